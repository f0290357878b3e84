"""The layout search's internals: local moves, the ILP, the data-parallel pins."""
