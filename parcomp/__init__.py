"""parcomp: a compiler for parallel model execution."""
__version__ = "0.1.0"
