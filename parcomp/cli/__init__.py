"""The ``parcomp`` command: argument parsing (main) and one module per command."""
from .main import main  # noqa: F401 - the console script of installs made before parcomp/cli/
