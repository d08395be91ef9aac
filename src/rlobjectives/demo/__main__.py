"""``python -m rlobjectives.demo`` (and ``torchrun ... -m rlobjectives.demo``): see ``--help``."""

import sys

from .command_line import main

sys.exit(main())
