"""`python -m fivefold ...`: the same command line as the `fivefold` script."""

import sys

from fivefold.cli import main

sys.exit(main())
