"""`python -m hookscope.cli ...`: the same as the `hookscope` command, except that OMP_WAIT_POLICY stays
as the user left it: the package, torch with it, is loaded before this file runs (src/_hookscope_cli.py)."""

import sys

from . import main

if __name__ == "__main__":  # not when vLLM's spawned workers import it again
    sys.exit(main())
