"""Run an extraction that SIGKILLs its own process at a chosen moment (tests only).

    python kill_driver.py CONFIG_JSON KILL_AT

or, in a child of the fork server, `run_extract(config, kill_at)`. KILL_AT names a site and the
event of that site to die at, counted from 1 over the whole run:

    replace:N:before|after           around the N-th os.replace (the first stamps the manifest at
                                     open; then, per shard, its rename and the manifest replace)
    rename:N:before|after            around the N-th shard rename (.tmp -> final name)
    manifest-replace:N:before|after  around the N-th manifest replace (1 is the stamp at open)
    save:N                           inside the N-th shard write, leaving a half-written .tmp file
    library-save:N                   inside safetensors' own write of the N-th shard, where no wrapper
                                     reaches: the process dies there (SIGXFSZ, as abrupt as SIGKILL),
                                     leaving whatever temporary file the library writes half-written
    manifest-write:N                 inside the N-th manifest save, leaving a half-written .tmp
    journal-write:N                  inside the N-th shard commit appended to a journal, leaving its
                                     line half-written (a torn last line: that shard not committed)
    fsync:N                          inside the N-th os.fsync (shard data, shard directory,
                                     manifest, store directory)
    batch:N                          as the N-th new batch is handed to the writer (the writer
                                     thread may be in the middle of a shard)
    forward:N                        at the N-th module call of a forward pass
    tokenize:N                       inside the N-th call to the tokenizer
    upload:N:before|after            around the N-th shard upload (a store at a URL; after it, the
                                     object exists but no manifest lists it yet)
    part:N:before|after              around the N-th part of a multipart upload (S3; either way the
                                     upload is left unfinished: no object, an open upload on S3)
    put:N:before|after               around the N-th PUT (a store at a URL; 1 is the manifest stamp)
    manifest-put:N:before|after      around the N-th PUT of a manifest object (1 is the stamp at open,
                                     then one per committed shard; the store card is not counted)
    never                            run to the end
    count                            run to the end, counting every site's events

A real SIGKILL: no finally blocks, no atexit, no flush, exactly as a crash or an OOM kill.

    python kill_driver.py cli SIGNAL KILL_AT HOOKSCOPE_ARGS...

runs `hookscope HOOKSCOPE_ARGS...` (the CLI's own main) and sends the process a real SIGNAL (INT,
TERM or KILL) at KILL_AT, from whichever thread reaches it; with INT or TERM the run goes on to
handle it as it would a Ctrl-C or a scheduler's stop (no half-written files are faked). In a child
of the fork server: `run_cli(args, signal_name, kill_at)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import signal
import sys
from collections import Counter
from typing import Any

import torch

from hookscope.extract import ExtractConfig, extract
from hookscope.sources import text as text_source
from hookscope.store import ShardWriter
from hookscope.store import fs as fs_module
from hookscope.store import upload as upload_module
from hookscope.store import writer as writer_module

SITES = (
    "replace",
    "rename",
    "manifest-replace",
    "save",
    "library-save",
    "manifest-write",
    "journal-write",
    "fsync",
    "batch",
    "forward",
    "tokenize",
    "upload",
    "part",
    "put",
    "manifest-put",
)


SIGNAL = signal.SIGKILL  # what die() sends; `cli` mode may choose SIGINT or SIGTERM


def die() -> None:
    os.kill(os.getpid(), SIGNAL)


class Plan:
    """Counts each site's events and dies at the chosen one."""

    def __init__(self, kill_at: str):
        kind, *rest = kill_at.split(":")
        if kind not in (*SITES, "never", "count"):
            raise SystemExit(f"bad KILL_AT {kill_at!r}")
        self.kind = kind
        self.n = int(rest[0]) if rest else 0
        self.when = rest[1] if len(rest) > 1 else None
        self.counts: Counter[str] = Counter()

    def event(self, site: str) -> bool:
        """Count one event of `site`; True if it is the one to die at."""
        self.counts[site] += 1
        return site == self.kind and self.counts[site] == self.n

    def at(self, due: bool, when: str) -> None:
        if due and self.when == when:
            die()


def die_at_file_size() -> None:
    """Make a write past the file-size limit end this process, with no core file (main thread only):
    Python ignores SIGXFSZ, whose default action kills. `die_in_next_write` then sets the limit."""
    import ctypes

    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    ctypes.CDLL(None).prctl(4, 0)  # PR_SET_DUMPABLE = 0: the kernel writes no core file


def die_in_next_write(limit: int) -> None:
    """Any thread: the next write that takes a file past `limit` bytes kills the process mid-write."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _tear_last_line(path: str) -> None:
    with open(path, "rb") as f:
        data = f.read()
    start = data.rfind(b"\n", 0, len(data) - 1) + 1  # where the last line begins
    os.truncate(path, start + (len(data) - start) // 2)


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def arm(kill_at: str) -> Plan:
    """Wrap every site of this process with `plan`'s counters (and its kill)."""
    plan = Plan(kill_at)
    if plan.kind == "never":
        return plan
    real_replace, real_fsync, real_save = os.replace, os.fsync, writer_module.save_columns
    real_write, real_pack = ShardWriter.write, text_source.pack_batches

    def replace(src, dst):
        due = [plan.event("replace")]
        due.append(plan.event("manifest-replace" if str(dst).endswith(".json") else "rename"))
        plan.at(any(due), "before")
        real_replace(src, dst)
        plan.at(any(due), "after")

    def fsync(fd):
        path = _fd_path(fd)
        if path.endswith(".json.tmp") and plan.event("manifest-write") and SIGNAL == signal.SIGKILL:
            os.truncate(path, os.path.getsize(path) // 2)  # the rest of the JSON never reached the disk
            die()
        if path.endswith(".journal") and plan.event("journal-write") and SIGNAL == signal.SIGKILL:
            _tear_last_line(path)  # the line's end never reached the disk
            die()
        if plan.event("fsync"):
            die()
        real_fsync(fd)

    if plan.kind == "library-save":
        die_at_file_size()

    def save_columns(columns, path, *args, **kwargs):
        if plan.event("library-save"):  # half of the tensors' bytes, well past the header
            die_in_next_write(sum(p.nbytes for parts in columns.values() for p in parts) // 2)
        out = real_save(columns, path, *args, **kwargs)
        if plan.event("save"):
            if SIGNAL == signal.SIGKILL:  # leave a half-written file behind, as a crash would
                with open(path, "r+b") as f:
                    f.truncate(os.path.getsize(path) // 2)
            die()
        return out

    def write(self, *args, **kwargs):
        if plan.event("batch"):
            die()
        return real_write(self, *args, **kwargs)

    def pack(documents, tokenizer, *args, **kwargs):
        return real_pack(documents, _CountingTokenizer(tokenizer, plan), *args, **kwargs)

    def forward(module, args):
        if plan.event("forward"):
            die()

    real_upload, real_put = fs_module.RemoteFS.put_file, fs_module.RemoteFS.put

    def upload(self, *args, **kwargs):
        due = plan.event("upload")
        plan.at(due, "before")
        real_upload(self, *args, **kwargs)
        plan.at(due, "after")

    def put(self, rel, *args, **kwargs):
        due = [plan.event("put")]
        if rel.startswith("manifest"):
            due.append(plan.event("manifest-put"))
        plan.at(any(due), "before")
        real_put(self, rel, *args, **kwargs)
        plan.at(any(due), "after")

    real_part = upload_module.put_part

    def part(*args, **kwargs):
        due = plan.event("part")
        plan.at(due, "before")
        etag = real_part(*args, **kwargs)
        plan.at(due, "after")
        return etag

    fs_module.RemoteFS.put_file, fs_module.RemoteFS.put, upload_module.put_part = upload, put, part
    os.replace, os.fsync, writer_module.save_columns = replace, fsync, save_columns
    ShardWriter.write, text_source.pack_batches = write, pack
    torch.nn.modules.module.register_module_forward_pre_hook(forward)
    return plan


class _CountingTokenizer:
    """The tokenizer, with a kill site inside its __call__ (after the work, before it returns)."""

    def __init__(self, tokenizer: Any, plan: Plan):
        self._tokenizer, self._plan = tokenizer, plan

    def __call__(self, *args, **kwargs):
        out = self._tokenizer(*args, **kwargs)
        if self._plan.event("tokenize"):
            die()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def run_extract(config: dict[str, Any], kill_at: str = "never") -> dict[str, Any]:
    """The fork server's entry: extract with `kill_at` armed; the summary and each site's count."""
    plan = arm(kill_at)
    summary = extract(ExtractConfig(**config))
    return {"summary": dataclasses.asdict(summary), "counts": dict(plan.counts)}


def run_cli(
    args: list[str], signal_name: str, kill_at: str, environ: dict[str, str] | None = None
) -> dict[str, Any]:
    """The fork server's entry for `cli` mode: `hookscope args...` sent a real SIG`signal_name` at
    `kill_at`, with `environ` added to the environment (the server's was fixed when it started);
    the code its main returns (what the process exits with) and what it wrote to sys.stderr.
    SIGINT gets Python's own handler back: a child of a shell's background job inherits it
    ignored, and a terminal's Ctrl-C finds the default."""
    global SIGNAL
    from hookscope.cli import main

    os.environ.update(environ or {})
    SIGNAL = signal.Signals["SIG" + signal_name]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    arm(kill_at)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    return {"code": code, "stderr": err.getvalue()}


if __name__ == "__main__" and sys.argv[1] == "cli":
    from hookscope.cli import main

    SIGNAL = signal.Signals["SIG" + sys.argv[2]]
    arm(sys.argv[3])
    sys.exit(main(sys.argv[4:]))
elif __name__ == "__main__":
    config = json.loads(sys.argv[1])
    arm(sys.argv[2])
    print(extract(ExtractConfig(**config)))
