"""A store as SAELens's cached-activations folder, and the names SAELens's configs need.

SAELens (6.x) trains from a `datasets` folder made by `save_to_disk`: one example per sequence,
a column named after the TransformerLens hook holding `Array2D((context_size, d_in))`, and
`token_ids` (`List(int32, length=context_size)`); its `ActivationsStore` checks the column's shape
against the config's `context_size` and `d_in`. This module writes exactly that, one Arrow file per
store shard, and records `model_name`, `hook_name`, `context_size`, `d_in` and `dtype` in
`hookscope_export.json` (`saelens_config(DIR)` reads them back for a SAELens config).

Sequences: a store keeps one row per token. When every sequence of the store kept all its tokens
(`drop_bos=False` at extraction), each example is one of the model's sequences. When special tokens
were dropped (the default), sequences are ragged, so consecutive rows are regrouped into examples of
`context_size` rows (the extraction context by default); SAELens flattens examples into tokens
and shuffles them anyway, so training sees the same rows. The few rows after the last whole
example are left out and counted in the metadata.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import StoreError
from .arrow import SIDECAR, arrow_column, arrow_dtype, feature, import_datasets, write_dataset
from .hf import describe, store_info
from .progress import rows_progress

if TYPE_CHECKING:  # the store room is below this one; a Store is passed in, never imported
    from ..store import Store

# canonical point suffix -> TransformerLens hook name suffix, where it is not just "hook_" + last part
# (attn.in / mlp.in: what the sublayer reads, after its norm: the bridge's attn.hook_in / mlp.hook_in;
# TransformerLens's hook_attn_in / hook_mlp_in are the stream before that norm: *.in_pre_norm)
_TL_SPELLING = {
    "attn.out": "hook_attn_out",
    "mlp.out": "hook_mlp_out",
    "attn.in": "attn.hook_in",
    "mlp.in": "mlp.hook_in",
    "attn.in_pre_norm": "hook_attn_in",
    "mlp.in_pre_norm": "hook_mlp_in",
    "attn.q_input": "hook_q_input",
    "attn.k_input": "hook_k_input",
    "attn.v_input": "hook_v_input",
}
_BLOCK = re.compile(r"^(blocks\.\d+)\.(.+)$")


def tl_hook_name(point: str) -> str:
    """The TransformerLens hook name of a canonical point name (`blocks.3.resid_post` ->
    `blocks.3.hook_resid_post`, `blocks.3.attn.z` -> `blocks.3.attn.hook_z`)."""
    if point.startswith("module:"):
        raise StoreError(
            f"{point!r} is a raw module path with no TransformerLens hook name; pass "
            "hook_name= (--hook-name) to name the SAELens column yourself"
        )
    if point == "ln_final":  # after the norm's weight: the bridge's spelling (HookedTransformer has none)
        return "ln_final.hook_out"
    block = _BLOCK.match(point)
    if block and block.group(2) in _TL_SPELLING:
        return f"{block.group(1)}.{_TL_SPELLING[block.group(2)]}"
    if point.rsplit(".", 1)[-1].startswith("hook_"):
        return point
    head, _, last = point.rpartition(".")
    return f"{head}.hook_{last}" if head else f"hook_{last}"


@dataclass(frozen=True)
class SaelensExport:
    """What was written, and what a SAELens config must say to read it."""

    path: str
    point: str  # the store's column
    hook_name: str  # the TransformerLens name: the column's name in the export and SAELens's hook_name
    model_name: str | None  # the store's model (a Hugging Face id or a local path)
    context_size: int
    d_in: int
    dtype: str  # the column's dtype in the export: float16 or float32 (bfloat16 is widened)
    sequences: str  # "whole": each example is one of the model's sequences; "regrouped": consecutive rows
    examples: int
    rows_exported: int
    rows_left_out: int  # rows after the last whole example

    def runner_kwargs(self) -> dict[str, Any]:
        """Arguments of SAELens's `LanguageModelSAERunnerConfig` that point it at this export."""
        return {
            "model_name": self.model_name,
            "hook_name": self.hook_name,
            "context_size": self.context_size,
            "dtype": self.dtype,
            "use_cached_activations": True,
            "cached_activations_path": self.path,
        }


def saelens_config(path: str | os.PathLike) -> SaelensExport:
    """Read back the metadata of a SAELens export folder."""
    sidecar = Path(path) / SIDECAR
    try:
        meta = json.loads(sidecar.read_text())["saelens"]
        return SaelensExport(**meta)
    except FileNotFoundError:
        raise StoreError(
            f"{path}: no {SIDECAR}; is this a folder made by hookscope export --format saelens?"
        ) from None
    except (KeyError, TypeError, ValueError) as e:
        raise StoreError(f"{sidecar}: not a SAELens export's metadata ({e})") from e


def export_saelens(
    store: Store,
    out: str | os.PathLike,
    point: str | None = None,
    *,
    hook_name: str | None = None,
    context_size: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> SaelensExport:
    """Write `point` (default: the store's only point) in SAELens's cached-activations layout.
    Needs the `datasets` package: `pip install 'hookscope[datasets]'`.

    Returns:
        SaelensExport: where it went and what a SAELens config must say (`runner_kwargs()`).

    Raises:
        StoreError: no `datasets` package, an empty store, a point it lacks (or several and none
            named), a context size the rows cannot fill, or `out` not empty without `overwrite=True`."""
    import_datasets()
    point = _the_point(store, point)
    if not store.num_shards:
        raise StoreError(f"{store.path}: the store holds no rows yet; nothing to export")
    hook_name = hook_name or tl_hook_name(point)
    col = store.points[point]
    d_in = math.prod(col.shape)  # per-head points flatten to n_heads * d_head, as SAELens does
    dtype = arrow_dtype(getattr(torch, col.dtype))
    whole = _whole_sequence_length(store)
    if context_size is None:
        context_size = whole or store.manifest.settings.get("context")
        if not isinstance(context_size, int):
            raise StoreError(
                f"{store.path}: the store's settings give no context size; pass context_size= "
                "(--context-size)"
            )
    if context_size < 1:
        raise StoreError(f"context_size={context_size} must be >= 1")
    sequences = "whole" if whole == context_size else "regrouped"
    examples = len(store) // context_size
    if examples == 0:
        raise StoreError(
            f"{store.path}: {len(store)} rows do not fill one example of {context_size} rows; "
            "pass a smaller context_size"
        )
    datasets = import_datasets()
    has_tokens = "token_ids" in store.meta
    features = {hook_name: datasets.Array2D(shape=(context_size, d_in), dtype=dtype)}
    if has_tokens:
        features["token_ids"] = feature((context_size,), "int32")
    plan = _examples_per_shard(store, context_size)
    result = SaelensExport(
        path=str(Path(out).resolve()),
        point=point,
        hook_name=hook_name,
        model_name=store.manifest.settings.get("model"),
        context_size=context_size,
        d_in=d_in,
        dtype=dtype,
        sequences=sequences,
        examples=examples,
        rows_exported=examples * context_size,
        rows_left_out=len(store) - examples * context_size,
    )
    sidecar = {
        "format": "hookscope-export",
        "layout": "saelens",
        "saelens": asdict(result),
        "store": store_info(store),
    }
    names = [point] + (["token_ids"] if has_tokens else [])

    def tables():
        carry: dict[str, torch.Tensor] | None = None  # rows of an example begun in the previous shard
        for i, n_examples in enumerate(plan):
            shard = store.load_shard(i, names)
            if carry is not None:
                shard = {k: torch.cat([carry[k], v]) for k, v in shard.items()}
            take = n_examples * context_size
            carry = {k: v[take:] for k, v in shard.items()}
            if not n_examples:
                continue
            acts = shard[point][:take].reshape(take, d_in)
            columns = {
                hook_name: arrow_column(acts.reshape(n_examples, context_size, d_in), features[hook_name])
            }
            if has_tokens:
                tokens = shard["token_ids"][:take].to(torch.int32).reshape(n_examples, context_size)
                columns["token_ids"] = arrow_column(tokens, features["token_ids"])
            yield columns

    with rows_progress(result.rows_exported, "export saelens", progress) as bar:
        write_dataset(
            out,
            features,
            tables(),
            sum(1 for n in plan if n),
            description=describe(store, f"SAELens cached activations of {hook_name}"),
            sidecar=sidecar,
            overwrite=overwrite,
            progress=None if bar is None else lambda n: bar(n * context_size),
        )
    return result


def _the_point(store: Store, point: str | None) -> str:
    points = list(store.points)
    if point is None:
        if len(points) != 1:
            raise StoreError(
                f"{store.path}: the store holds {len(points)} points {points}; name the one to "
                "export (--point)"
            )
        return points[0]
    if point not in store.points:
        raise StoreError(f"{store.path}: no point {point!r}; the store has {points}")
    members = store.manifest.settings.get("stacked", {}).get(point)
    if members:  # SAELens trains on one hook's activations, not several blocks' side by side
        raise StoreError(
            f"{store.path}: {point!r} is a stacked column (--stack) of {len(members)} blocks "
            f"({members[0]} ... {members[-1]}); SAELens trains on one hook: export from a store "
            "extracted without --stack, or read the stack with store.dataset for a crosscoder"
        )
    return point


def _whole_sequence_length(store: Store) -> int | None:
    """L when the store's rows are whole sequences of L tokens each, one after another; else None."""
    if "seq_ids" not in store.meta:
        return None
    seq = store.tensor("seq_ids")
    _, counts = torch.unique_consecutive(seq, return_counts=True)
    if len(counts) and bool((counts == counts[0]).all()) and len(torch.unique(seq)) == len(counts):
        length = int(counts[0])
        if length == store.manifest.settings.get("context", length):
            return length
    return None


def _examples_per_shard(store: Store, context_size: int) -> list[int]:
    """How many whole examples are completed in each shard when rows run on across shards."""
    out, done = [], 0
    for i in range(store.num_shards):
        end = store.first_row(i) + store.manifest.shards[i].rows
        out.append(end // context_size - done)
        done = end // context_size
    return out
