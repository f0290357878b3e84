"""``python -m parcomp.cli``: the ``parcomp`` command."""
import sys

from .main import main

sys.exit(main())
