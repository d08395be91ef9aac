"""``python -m rlobjectives``: the command line (see :mod:`rlobjectives.cli`)."""

import sys

from .cli import main

sys.exit(main())
