"""A Python with torch and hookscope already imported that forks one child per request (tests only).

Starting Python with torch and transformers takes seconds on this machine; forking a process that
has already imported them takes milliseconds. A child is a real, separate process: it can be
SIGKILLed in the middle of a write, run under a memory limit, or enter its own mount namespace,
and nothing it does reaches the test process except the JSON it returns.

    server = ForkServer.shared()                 # one per test session, started on first use
    server.warm("faultkit:load_model", path=model_dir)   # import the model's code before forking
    reply = server.call("kill_driver:run_extract", config=cfg, kill_at="save:2")
    reply.status    # 0, 1 (an exception: see reply.log), -9 (SIGKILL), ...
    reply.result    # what the function returned (JSON), when it returned
    replies = server.call_ranks(2, "kill_driver:run_cli", args=...)   # two ranks, as torchrun starts them

    python forkserver.py                         # the server: one JSON request per stdin line
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


@dataclass
class Reply:
    status: int  # the child's exit code, or -signal when a signal ended it
    seconds: float
    timed_out: bool  # killed by the server after `timeout` seconds: the child hung
    result: Any
    log: str  # the child's stdout and stderr


class ForkServer:
    """The client: a handle on one server process."""

    _shared: ForkServer | None = None

    @classmethod
    def shared(cls) -> ForkServer:
        if cls._shared is None or cls._shared.proc.poll() is not None:
            cls._shared = cls()
            atexit.register(cls._shared.close)
        return cls._shared

    def __init__(self):
        # the client's folders of tests/ (the kit, the calling test's room): a child may run a
        # function of the test module that called it (`test_faults_env:tiny_tmpfs`)
        tests = [p for p in sys.path if p and Path(p).resolve().is_relative_to(HERE.resolve().parent)]
        path = os.pathsep.join([*dict.fromkeys(tests), *filter(None, [os.environ.get("PYTHONPATH")])])
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=HERE,
        )
        self.tmp = Path(tempfile.mkdtemp(prefix="forkserver-"))
        self.calls = 0
        ready = self.proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"fork server did not start (said {ready!r})")

    def call(
        self, function: str, *, kill_after: float | None = None, timeout: float = 120.0, **kwargs: Any
    ) -> Reply:
        """Run `module:function(**kwargs)` in a fresh child. `kill_after`: SIGKILL it after that
        many seconds if it is still running. A child running past `timeout` is killed as hung."""
        self.calls += 1
        result, log = self.tmp / f"{self.calls}.json", self.tmp / f"{self.calls}.log"
        request = {
            "function": function,
            "kwargs": kwargs,
            "kill_after": kill_after,
            "timeout": timeout,
            "result": str(result),
            "log": str(log),
        }
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the fork server died")
        reply = json.loads(line)
        value = json.loads(result.read_text()) if result.exists() else None
        return Reply(
            reply["status"],
            reply["seconds"],
            reply["timed_out"],
            value,
            log.read_text(errors="replace") if log.exists() else "",
        )

    def call_ranks(
        self, world_size: int, function: str, *, timeout: float = 300.0, **kwargs: Any
    ) -> list[Reply]:
        """Run `module:function(**kwargs)` in `world_size` children at once, each with the
        environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and a free
        MASTER_PORT); as torchrun does, the first that fails gets the others killed. One reply per
        rank, in rank order."""
        self.calls += 1
        files = [
            (self.tmp / f"{self.calls}.{r}.json", self.tmp / f"{self.calls}.{r}.log")
            for r in range(world_size)
        ]
        request = {
            "function": function,
            "kwargs": kwargs,
            "ranks": world_size,
            "timeout": timeout,
            "files": [[str(result), str(log)] for result, log in files],
        }
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the fork server died")
        replies = []
        for reply, (result, log) in zip(json.loads(line), files, strict=True):
            value = json.loads(result.read_text()) if result.exists() else None
            text = log.read_text(errors="replace") if log.exists() else ""
            replies.append(Reply(reply["status"], reply["seconds"], reply["timed_out"], value, text))
        return replies

    def warm(self, function: str, **kwargs: Any) -> None:
        """Run `module:function(**kwargs)` in the server itself, once: to import lazily loaded
        modules (a model family's code, its tokenizer) before children fork. It must not start
        threads, which a fork would not copy."""
        self.proc.stdin.write(json.dumps({"warm": function, "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline() or "null")
        if reply != "warm":
            raise RuntimeError(f"warming the fork server with {function} failed: {reply}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        shutil.rmtree(self.tmp, ignore_errors=True)


# -- the server -----------------------------------------------------------------------------------


def _child(request: dict) -> None:
    """In the forked child: run the function, write its JSON result, exit without cleanup."""
    code = 1
    try:
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        module, _, name = request["function"].partition(":")
        value = getattr(importlib.import_module(module), name)(**request["kwargs"])
        Path(request["result"]).write_text(json.dumps(value))
        code = 0
    except BaseException:  # noqa: BLE001 - whatever it was, report it in the log and the exit code
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, kill_after: float | None, timeout: float) -> tuple[int, float, bool]:
    start = time.monotonic()
    timed_out = killed_by_timer = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        elapsed = time.monotonic() - start
        if kill_after is not None and elapsed >= kill_after and not killed_by_timer:
            os.kill(pid, signal.SIGKILL)
            killed_by_timer = True
        if elapsed >= timeout and not timed_out:
            os.kill(pid, signal.SIGKILL)
            timed_out = True
        time.sleep(0.002)
    return os.waitstatus_to_exitcode(status), time.monotonic() - start, timed_out


def _ranks(request: dict) -> list[dict]:
    """Fork one child per rank with torchrun's environment; wait for all of them, killing the rest
    once one fails or the time is up. Each rank's {status, seconds, timed_out}, in rank order."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    world = request["ranks"]
    start = time.monotonic()
    pids = []
    for rank, (result, log) in enumerate(request["files"]):
        pid = os.fork()
        if pid == 0:
            ranks = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}
            os.environ.update(
                {k: str(v) for k, v in ranks.items()}, MASTER_ADDR="127.0.0.1", MASTER_PORT=port
            )
            _child({**request, "result": result, "log": log})
        pids.append(pid)
    ended: dict[int, tuple[int, float]] = {}
    timed_out = False
    while len(ended) < world:
        for rank, pid in enumerate(pids):
            if rank not in ended:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    ended[rank] = (os.waitstatus_to_exitcode(status), time.monotonic() - start)
        failed = any(code != 0 for code, _ in ended.values())
        timed_out = timed_out or time.monotonic() - start >= request["timeout"]
        if failed or timed_out:
            for rank, pid in enumerate(pids):
                if rank not in ended:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        time.sleep(0.002)
    return [{"status": ended[r][0], "seconds": ended[r][1], "timed_out": timed_out} for r in range(world)]


def _warm(request: dict) -> str:
    try:
        module, _, name = request["warm"].partition(":")
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the replies
            getattr(importlib.import_module(module), name)(**request["kwargs"])
    except Exception:  # noqa: BLE001 - reported to the client
        return traceback.format_exc()
    return "warm"


def serve() -> None:
    import torch

    import hookscope.cli  # noqa: F401 - imported once here, so that children start warm
    import hookscope.extract  # noqa: F401

    torch.set_num_threads(1)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if "warm" in request:
            print(json.dumps(_warm(request)), flush=True)
            continue
        if "ranks" in request:
            print(json.dumps(_ranks(request)), flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            _child(request)
        status, seconds, timed_out = _wait(pid, request["kill_after"], request["timeout"])
        reply = {"status": status, "seconds": seconds, "timed_out": timed_out}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    serve()
