"""What the fault tests share: an extraction config, and the row-for-row comparison of a store that
lived through a fault with one that did not (the corpus and shard digests: tests/kit/helpers.py)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from helpers import shard_digests, write_corpus  # noqa: F401 - the fault tests import them from here

from hookscope.store import open_store


def extract_config(model_dir: Path, corpus: Path, out: Path, **overrides: Any) -> dict[str, Any]:
    """ExtractConfig fields for a run of about 50 batches, 2 per shard, on a tiny GPT-2."""
    base = dict(
        out=str(out),
        model=str(model_dir),
        points=["blocks.1.resid_post", "blocks.0.attn.z"],
        data=str(corpus),
        context=32,
        batch_size=4,
        dtype="bfloat16",
        shard_rows=200,
        progress=False,
    )
    return {**base, **overrides}


def load_model(path: str, tokenizer: bool = True) -> None:
    """Load a model once (for `ForkServer.warm`: its family's code is imported lazily)."""
    import hookscope as hs

    hs.load(path, tokenizer=tokenizer)


def row_keys(store) -> Counter:
    """Each row's origin, with multiplicity: (packed sequence, document, position in the document)
    for text; (image, token position) for images, which have no packed sequences."""
    names = [n for n in ("seq_ids", "doc_ids", "positions") if n in store.manifest.columns]
    return Counter(zip(*(store.tensor(n).tolist() for n in names), strict=True))


def compare_stores(got: Path, want: Path) -> dict[str, Any]:
    """Row-for-row comparison: rows lost / duplicated (by origin), whether every column holds the
    same bits, and whether shards and manifest are byte-identical. Both stores are verified."""
    a, b = open_store(got, verify=True), open_store(want, verify=True)
    ka, kb = row_keys(a), row_keys(b)
    same_values = len(a) == len(b) and all(
        torch.equal(_bits(a.tensor(name)), _bits(b.tensor(name))) for name in b.manifest.columns
    )
    return {
        "rows": len(a),
        "rows_lost": sum((kb - ka).values()),
        "rows_duplicated": sum((ka - kb).values()),
        "same_values": same_values,
        "same_files": shard_digests(got) == shard_digests(want)
        and a.manifest.to_json() == b.manifest.to_json(),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so NaNs compare equal and nothing is rounded."""
    return t.view(torch.int16) if t.element_size() == 2 else t


# -- reading a hostile store, in a fork-server child ----------------------------------------------


def probe_store(path: str, headroom: int = 1 << 30) -> dict[str, str]:
    """Read a (possibly hostile) store every way a user can, allowed `headroom` bytes of address
    space beyond what the process already has: a huge allocation fails instead of swapping.
    Each outcome is "ok" or "<exception type>: <message>"; `inspect` is "<exit code>: <stderr>"."""
    import resource

    vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, resource.RLIM_INFINITY))
    return {
        "reader": _outcome(_read_everything, path),
        "verify": _outcome(lambda p: open_store(p, verify=True), path),
        "inspect": _inspect(path),
    }


def _read_everything(path: str) -> None:
    store = open_store(path)
    point = next(iter(store.points))
    for split in (None, "train"):  # the datasets first: they plan an epoch from the manifest alone
        for _ in store.dataset(point, split=split, buffer_rows=64):
            pass
    for name in store.manifest.columns:
        store.tensor(name)


def _outcome(fn, *args) -> str:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the test decides which exceptions are acceptable
        return f"{type(e).__name__}: {e}"
    return "ok"


def _inspect(path: str) -> str:
    import contextlib
    import io

    from hookscope.cli import main

    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(["inspect", path])
    except Exception as e:  # noqa: BLE001
        return f"crash: {type(e).__name__}: {e}"
    return f"{code}: {err.getvalue().strip()}"


def damage(fs, root: str, fault: str) -> None:
    """Damage the store at `root` on filesystem `fs` (any fsspec one) the way `fault` says."""
    first, second = (f"{root}/shards/shard-r000-00000{i}.safetensors" for i in (0, 1))
    if fault == "truncated":
        fs.pipe_file(first, fs.cat_file(first)[:-100])
    elif fault == "two shards exchanged":
        a, b = fs.cat_file(first), fs.cat_file(second)
        fs.pipe_file(first, b)
        fs.pipe_file(second, a)
    elif fault == "manifest lies about a shard's size":
        manifest = json.loads(fs.cat_file(f"{root}/manifest.json"))
        manifest["shards"][0]["bytes"] -= 1  # the totals follow, so the manifest adds up
        manifest["bytes"] -= 1
        fs.pipe_file(f"{root}/manifest.json", json.dumps(manifest).encode())
    elif fault == "manifest lies about a shard's rows":
        manifest = json.loads(fs.cat_file(f"{root}/manifest.json"))
        manifest["shards"][0]["rows"] -= 1  # the totals follow, so the manifest adds up
        manifest["rows"] -= 1
        fs.pipe_file(f"{root}/manifest.json", json.dumps(manifest).encode())
    elif fault == "header says another dtype":
        data = fs.cat_file(first)  # the same length: JSON allows the space
        assert b'"BF16"' in data
        fs.pipe_file(first, data.replace(b'"BF16"', b'"I16" ', 1))
    else:
        raise AssertionError(fault)
