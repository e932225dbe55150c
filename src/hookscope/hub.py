"""Can this machine reach the Hugging Face hub? Asked before a model or dataset is fetched by name,
so that an offline machine gets a clear error in seconds instead of a minute of retries.

Imports nothing of ours: loading/loader.py and the sources ask it.
"""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlsplit

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
PROBE_SECONDS = 3.0  # DNS plus one TCP connect; the hub answers in well under a second when it is there

OFFLINE_HELP = (
    "give a local directory instead (a path starting with ./ or /), or set HF_HUB_OFFLINE=1 to use "
    "only what is already in the Hugging Face cache (~/.cache/huggingface, or $HF_HOME)"
)


def offline_variable() -> str | None:
    """The first of HF_HUB_OFFLINE / HF_DATASETS_OFFLINE / TRANSFORMERS_OFFLINE set to a true value."""
    for name in OFFLINE_VARIABLES:
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return name
    return None


def unreachable_reason(timeout: float = PROBE_SECONDS) -> str | None:
    """Why the hub cannot be reached (an offline variable, no DNS, no route), or None when a TCP
    connection to it opens within `timeout` seconds. Behind a proxy the probe is skipped (None):
    only the HTTP client knows how to go through it."""
    variable = offline_variable()
    if variable is not None:
        return f"{variable}={os.environ[variable]} is set"
    if any(os.environ.get(v) for v in _PROXY_VARIABLES):
        return None
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(f"cannot connect to {host}:{port}: {e}")

    # DNS lookups ignore socket timeouts: run the probe in a thread and stop waiting for it
    thread = threading.Thread(target=probe, name="hookscope-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"no answer from {host}:{port} within {timeout:.0f} s"
