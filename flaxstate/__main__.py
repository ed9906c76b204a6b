"""`python -m flaxstate`: the command line."""

import sys

from flaxstate.cli import main

sys.exit(main())
