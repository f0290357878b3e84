"""Lowering: the local program rewritten into the op sequence every backend runs."""
