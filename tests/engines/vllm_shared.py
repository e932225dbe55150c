"""The vLLM engines and the `vllm serve` server that several test files share (tests/engines/conftest.py
makes them fixtures): each is started once for the run of consecutive files that use it, not once
per file, and at most one of them is up at a time (engines beside each other would each hold a KV
cache of VLLM_CPU_KVCACHE_SPACE).

A new file gets an engine here only if its checkpoint and settings are the same as a shared one's;
an engine of its own it starts in a module-scoped fixture, as test_vllm_names.py does.
"""

from __future__ import annotations

import hashlib
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from vllm_models import engine, save, shut, through_the_serializer
from vllm_server import port_taken, start, stop

# A thing started, and how to stop it.
Started = tuple[Any, Callable[[], None]]


class OneAtATime:
    """The shared engine or server now up, by name: asking for another stops this one first."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.thing: Any = None
        self._stop: Callable[[], None] | None = None

    def get(self, name: str, start_it: Callable[[], Started]) -> Any:
        if name != self.name:
            self.release()
            self.thing, self._stop = start_it()
            self.name = name
        return self.thing

    def release(self, name: str | None = None) -> None:
        """Stop what is up (only if it is `name`, where given); the next `get` starts it afresh."""
        if self._stop is None or name not in (None, self.name):
            return
        stop_it, self._stop, self.name, self.thing = self._stop, None, None, None
        stop_it()


# ---- the in-process llama the edit and steering tests share ----


def start_edit_llama(root: Path) -> Started:
    """Llama in this process, 64 tokens per forward (a 90-token prompt prefills over several
    forwards, beside the decode steps of short ones), 8 requests at once, prefix caching off (edits
    refuse it); its RPC through vLLM's serializer as in the default layout (edits, steering vectors
    and selections cross it). test_vllm_steer.py, test_vllm_generate.py, test_vllm_edit_block.py."""
    directory = save("llama", root / "llama", seed=1)
    llm = engine(
        directory,
        in_process=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        enable_prefix_caching=False,
    )
    through_the_serializer(llm)
    return types.SimpleNamespace(directory=directory, llm=llm), lambda: shut(llm)


# ---- the llama in vLLM's default layout the capture tests share ----


def start_default_layout_llama(root: Path) -> Started:
    """Llama with its engine core and worker in their own processes (vLLM's default layout: the
    selections' descriptions, the edit blocks and the rows' handoff cross its RPC), 64 tokens per
    forward (a 200-token prompt takes 4, each shared with other requests' chunks), 8 requests at
    once, prefix caching off (edit blocks refuse it; test_vllm_names.py captures under it).
    test_vllm_requests.py, test_vllm_selections.py, test_vllm_edit_block.py's first test."""
    from vllm import envs
    from vllm.v1.engine.core_client import MPClient

    # an engine core run in this process before (an in-process engine's) froze vLLM's settings,
    # VLLM_ENABLE_V1_MULTIPROCESSING among them: read them afresh
    envs.disable_envs_cache()
    directory = save("llama", root / "llama", seed=1)
    llm = engine(
        directory,
        enable_chunked_prefill=True,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        enable_prefix_caching=False,
    )
    assert isinstance(llm.llm_engine.engine_core, MPClient), "the engine core runs in this process"
    return types.SimpleNamespace(directory=directory, llm=llm), lambda: shut(llm)


def hooks_left(llm) -> list[int]:
    """The hooks on the worker's modules now, per worker: none between tests on a shared engine."""
    return llm.collective_rpc("hookscope_hook_count")


# ---- the `vllm serve` server test_vllm_serve.py and test_vllm_serve_store.py share ----

# Named edits, test_vllm_serve.py's: name -> (point, seed of its values): two points whose values
# differ (blocks.1.resid_pre would equal blocks.0.resid_post), so a vector added at the wrong one shows
VECTORS = {"joy": ("blocks.0.resid_post", 5), "calm": ("blocks.1.resid_post", 6)}
# name -> (point, heads it zeroes): in the same file, its metadata "ablate:<point>"
ABLATIONS = {"no_head_1": ("blocks.0.attn.z", [1])}
# The store: the points it keeps, and the rows already in it when the server starts (key, rows), as a
# server stopped before left them. The shared server's keeps the generated tokens' rows too (the
# default, test_vllm_serve_store.py); test_vllm_serve_prompts.py's own, the prompts' rows only
STORE_POINTS = ["blocks.0.mlp.out", "blocks.1.resid_post", "blocks.1.attn.z"]
EARLIER = ("earlier", 5)
# Requests sent at once to a server with a store, test_vllm_serve_store.py's and
# test_vllm_serve_prompts.py's: name -> (prompt, vllm_xargs), two asking for a capture (one by the id
# vLLM gives it, one under its own capture_id), one not; prompts of different lengths, so that rows
# filed under the wrong request show
CAPTURE_REQUESTS = {
    "by_id": ([5, 17, 33, 64, 9, 40, 70, 12, 101, 3], {"hookscope.capture": 1}),
    "mine": (
        [8, 2, 77, 31, 5, 19, 44, 90, 6, 13, 58, 21, 3, 99, 7, 11, 64],
        {"hookscope.capture": 1, "hookscope.capture_id": "mine"},
    ),
    "plain": ([4, 28, 61, 9, 15, 33, 2], {}),
}


def vector(name: str) -> torch.Tensor:
    return torch.randn(256, generator=torch.Generator().manual_seed(VECTORS[name][1]))


def key_of(key: str) -> int:
    """The doc_ids value of `key`'s rows, computed here as docs/served.md gives it."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def vllm_config(directory, *, prefix_caching=False, shutdown_timeout=30):
    """The VllmConfig fields the plugin reads at start, for this checkpoint as `vllm serve` loads it."""
    from transformers import AutoConfig

    from hookscope.engines.vllm import EXTENSION, serve

    return types.SimpleNamespace(
        shutdown_timeout=shutdown_timeout,
        model_config=types.SimpleNamespace(
            model=str(directory),
            hf_config=AutoConfig.from_pretrained(directory),
            dtype=torch.float32,
            enforce_eager=True,
            logits_processors=[serve.CHECK],
        ),
        cache_config=types.SimpleNamespace(enable_prefix_caching=prefix_caching),
        parallel_config=types.SimpleNamespace(
            worker_extension_cls=EXTENSION, tensor_parallel_size=1, pipeline_parallel_size=1
        ),
    )


def start_store(directory, out, generated: bool = True) -> None:
    """A store of the server's settings (`generated`: the generated tokens' rows too) holding one
    earlier batch of prompt rows, as a server stopped before left it."""
    import hookscope as hs
    from hookscope.engines.vllm import capture_store, serve

    options = serve.StoreOptions(str(out), STORE_POINTS, generated=generated)
    _, names, _, settings, _, _ = serve.store_call(vllm_config(directory), options)
    key, n = EARLIER
    rows = {name: torch.full((n, 4, 64) if name.endswith("attn.z") else (n, 256), 7.0) for name in names}
    with hs.store.ShardWriter(out, settings) as writer:
        writer.write(0, rows, capture_store.columns(list(range(n)), n, key, 0))


def write_vectors(path: Path) -> None:
    from safetensors.torch import save_file

    from hookscope.engines.vllm import serve

    save_file(
        {
            **{name: vector(name) for name in VECTORS},
            **{name: torch.tensor(heads) for name, (_, heads) in ABLATIONS.items()},
        },
        path,
        metadata={
            **{name: point for name, (point, _) in VECTORS.items()},
            **{name: serve.ABLATE + point for name, (point, _) in ABLATIONS.items()},
        },
    )


def start_llama_server(root: Path, generated: bool = True) -> Started:
    """`vllm serve` of a llama with the named vectors and ablation (VECTORS, ABLATIONS) and a store
    of STORE_POINTS that already holds EARLIER's rows, its shards of 1000 rows (every row the server
    writes is committed when it stops), the generated tokens' rows too unless `generated` is False
    (test_vllm_serve_prompts.py's own server). Only requests that ask for a capture write to the
    store. `proc`, its API server: test_vllm_serve_store.py stops it with SIGTERM, then releases it."""
    import vllm_slow_steps

    from hookscope.engines.vllm import serve

    directory = save("llama", root / "llama", seed=3)
    vectors, out, log = root / "vectors.safetensors", root / "acts", root / "server.log"
    write_vectors(vectors)
    start_store(directory, out, generated=generated)
    flags = serve.serve_flags(vectors, store=out, points=STORE_POINTS, shard_rows=1000, generated=generated)
    # the drained request's slow steps (test_vllm_serve_store.py)
    flags.insert(flags.index(serve.CHECK) + 1, vllm_slow_steps.FLAG)
    proc, url, port = start(directory, flags, log)

    def stop_it() -> None:
        stop(proc)
        assert not port_taken(port), f"port {port} still taken after the server stopped"

    server = types.SimpleNamespace(
        url=url, model=str(directory), directory=directory, out=out, log=log, proc=proc
    )
    return server, stop_it
