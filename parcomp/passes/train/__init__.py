"""Rewrites of the training step that autodiff calls: accumulation, mixed precision, loss scaling."""
