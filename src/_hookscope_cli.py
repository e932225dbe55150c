"""The `hookscope` command's entry point: `OMP_WAIT_POLICY=PASSIVE` set, then `hookscope.cli.main`.

torch's OpenMP runtime reads OMP_WAIT_POLICY once, when torch loads; unset, each idle thread of an
op's team spins ~300,000 times before it sleeps, on the cores the extraction's data and writer threads
need. A run of the command owns its process, so it asks for PASSIVE (idle threads sleep at once); a
value the user set is kept. This module lives outside the `hookscope` package on purpose: importing
anything inside it runs `hookscope/__init__.py`, which loads torch. A lazy `__init__` would change what
`import hookscope` does for every library user (and six verbs share a name with a submodule the
import system would rebind over them); a re-exec would load torch twice (bench/HISTORY.md,
Extraction, "A re-exec of the command"). Library users'
threading is untouched: only the command sets the variable.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from hookscope.cli import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
