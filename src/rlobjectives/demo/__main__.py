"""``python -m rlobjectives.demo`` (and ``torchrun ... -m rlobjectives.demo``): see ``--help``."""

import sys

from .training import main

sys.exit(main())
