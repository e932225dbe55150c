"""Run an extraction that SIGKILLs its own process at a chosen moment (tests only).

    python kill_driver.py CONFIG_JSON KILL_AT

KILL_AT is "replace:N:before|after" (around the N-th os.replace: shard renames and manifest
replaces alternate), "save:N" (after half of the N-th shard file is written), or "never".
A real SIGKILL: no finally blocks, no atexit, no flush, exactly as a crash or an OOM kill.
"""

import json
import os
import signal
import sys

from hookscope.extract import ExtractConfig, extract
from hookscope.store import writer as writer_module


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(kill_at: str) -> None:
    kind, _, rest = kill_at.partition(":")
    if kind == "never":
        return
    count = {"n": 0}
    if kind == "replace":
        n, when = rest.split(":")
        real_replace = os.replace

        def replace(src, dst):
            count["n"] += 1
            if count["n"] == int(n) and when == "before":
                die()
            real_replace(src, dst)
            if count["n"] == int(n) and when == "after":
                die()

        os.replace = replace
    elif kind == "save":
        real_save = writer_module.save_file

        def save_file(tensors, path, *args, **kwargs):
            count["n"] += 1
            real_save(tensors, path, *args, **kwargs)
            if count["n"] == int(rest):
                with open(path, "r+b") as f:  # leave a half-written file behind, as a crash would
                    f.truncate(os.path.getsize(path) // 2)
                die()

        writer_module.save_file = save_file
    else:
        raise SystemExit(f"bad KILL_AT {kill_at!r}")


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    arm(sys.argv[2])
    print(extract(ExtractConfig(**config)))
