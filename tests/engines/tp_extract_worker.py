"""One rank of tests/engines/test_tp_extract.py's kill tests, a child of the fork server with
torchrun's environment (tests/kit/forkserver.py, `call_ranks`): `hookscope ARGS...` on every rank,
and on rank KILL_RANK alone a real SIGKILL at KILL_AT (a site of tests/kit/kill_driver.py); the
server then kills the other ranks, as torchrun tears them down after a crash or an OOM kill."""

from __future__ import annotations

import os
from typing import Any

import kill_driver


def run_rank(kill_rank: int, kill_at: str, args: list[str]) -> dict[str, Any]:
    armed = kill_at if os.environ["RANK"] == str(kill_rank) else "never"
    return kill_driver.run_cli(args, "KILL", armed)
