"""One torchrun rank of tests/engines/test_tp_extract.py's kill tests: `hookscope ARGS...` on every
rank, and on rank KILL_RANK alone a real SIGKILL at KILL_AT (a site of tests/kit/kill_driver.py);
torchrun then tears the other ranks down, as it would after a crash or an OOM kill.

    python tp_extract_worker.py KILL_RANK KILL_AT HOOKSCOPE_ARGS...
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "kit"))  # a torchrun child: not on pytest's path

import kill_driver  # noqa: E402

from hookscope.cli import main  # noqa: E402

if __name__ == "__main__":
    kill_rank, kill_at, *args = sys.argv[1:]
    if os.environ["RANK"] == kill_rank:
        kill_driver.arm(kill_at)
    sys.exit(main(args))
