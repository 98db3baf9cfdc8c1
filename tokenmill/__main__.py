"""`python -m tokenmill serve ...`: the same command line as the `tokenmill` script."""

import sys

from tokenmill.cli import main

sys.exit(main())
