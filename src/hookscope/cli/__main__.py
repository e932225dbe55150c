"""`python -m hookscope.cli ...`: the same as the `hookscope` command, except that OMP_WAIT_POLICY stays
as the user left it: the package, torch with it, is loaded before this file runs (src/_hookscope_cli.py)."""

import sys

from . import main

sys.exit(main())
