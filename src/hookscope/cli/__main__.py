"""`python -m hookscope.cli ...`: the same as the `hookscope` command."""

import sys

from . import main

sys.exit(main())
