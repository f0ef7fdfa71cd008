"""``python -m aerie``: the same command line as the ``aerie`` console script."""

import sys

from aerie.cli import main

sys.exit(main())
