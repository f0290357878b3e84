"""torch.distributed program emitter."""
