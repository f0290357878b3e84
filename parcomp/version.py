"""The package's version (a leaf module: program.py's header reads it without importing the API)."""
__version__ = "0.1.0"
