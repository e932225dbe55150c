"""Block streaming: extraction when even the weights a capture needs do not fit (`max_memory`).

The run is layer-major over chunks of batches: for each block up to the last point, its weights are
read from the safetensors checkpoint (the next block's read ahead in a thread while this one
computes), every batch of the chunk goes through it, the points inside it are kept, and its weights
go back to `meta`. Resident weights: the ones outside the blocks (embeddings, norms) + at most two
blocks (one when two do not fit, or when the next one's read is a copy of cached bytes); on the CPU
an input embedding that can be is looked up row by row from its file instead (embedding_rows.py).
When the blocks all hold the same tensors and loading only renames them, the blocks are one or two
buffer sets allocated once and reused by every block (block_buffers.py), so the process does not
keep freed blocks in its allocator's heap; otherwise
(blocks that differ, weights transformers fuses or splits, a pickled checkpoint) each block is
loaded afresh by transformers' own loader.

How "block k alone" runs, for any Hugging Face family without per-family code: the model's own
forward, with blocks 0..k-1 swapped for stand-ins that return the hidden state block k-1 gave
(saved in the pass before), in the block's own output format, and a stop right after block k.
The model's code between blocks (RWKV's rescaling, GPT-2's nothing) runs as it always does, and
embeddings, rotary tables and masks are recomputed by the model's own code (cheap beside a block).
Feeding block k with the kwargs recorded at block 0 would skip that recomputation, but breaks on
families whose blocks get per-layer arguments (sliding-window masks, per-layer rotary tables).

A batch goes through each block with the same shapes and inputs as in one whole forward pass, so
on CPU the rows are bit for bit those of the in-memory run, whatever the chunk size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor, nn

from ..arch import Arch
from ..capture import Capture
from ..errors import HookscopeError
from ..stopping import Stop, no_cache
from .allocator import give_back_freed, returning_freed_memory
from .block_buffers import BlockBuffers, layout_of, slots_for
from .checkpoint import Checkpoint
from .embedding_rows import embedding_rows_for
from .loader import Loaded
from .stream_plan import StreamPlan, nbytes, plan_stream, resident_bytes
from .weight_files import checkpoint_files, resolve_source


class _Replay(nn.Module):
    """Stands in for a block before the one a pass runs: returns the hidden state the real block
    k-1 gave (whatever it is called with), in the block's own output format."""

    def __init__(self, hidden: Tensor, extras: int):
        super().__init__()
        self.hidden, self.extras = hidden, extras

    def forward(self, *args, **kwargs):
        return self.hidden if self.extras < 0 else (self.hidden, *([None] * self.extras))


class BlockStreamer:
    """Runs chunks of batches layer-major under a `StreamPlan`; see the module docstring.

    `run_chunk(inputs, keeps)` returns, per batch, {point: rows kept} as `Capture` keeps them
    (token mask `keeps[i]`, in `dtype`, on the CPU). `on_block(k, n)` is told each block as it
    starts (the progress bar). `peak_weight_bytes`: the most weight memory held at once, read-ahead
    included."""

    def __init__(
        self,
        model: nn.Module,
        arch: Arch,
        checkpoint: Callable[[], Checkpoint],
        plan: StreamPlan,
        *,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        on_block: Callable[[int, int], None] | None = None,
    ):
        # a checkpoint opened for each read and closed after it: the pages a memory map has read
        # stay in the process until it is closed, and would add up to the whole model
        self.model, self.arch, self.open_checkpoint, self.plan = model, arch, checkpoint, plan
        self.dtype, self.device, self.on_block = dtype, device, on_block
        self._loaded: set[int] = set()  # the blocks in the model now
        self._placement = {"": str(device)}
        self._reader: ThreadPoolExecutor | None = None
        self._ahead: tuple[int, Future] | None = None
        self._extras = -1  # the blocks' output format: -1 a tensor, else a tuple of 1 + extras
        self.peak_weight_bytes = 0
        self._final = max(plan.stage_of.values())
        self._allocator: contextlib.ExitStack | None = None  # entered by run_chunk, left by close
        resident = set(plan.resident) - self._embedding_by_rows()
        with returning_freed_memory():  # the loader's temporaries (a conversion's) too
            self._materialize(lambda name: name in resident)
            self.buffers = self._block_buffers()  # None: each block loaded afresh by transformers' loader

    def run_chunk(self, inputs: list[dict[str, Tensor]], keeps: list[Tensor]) -> list[dict[str, Tensor]]:
        self._return_freed_memory()
        acts: list[dict[str, Tensor]] = [{} for _ in inputs]
        hidden: list[Tensor | None] = [None] * len(inputs)
        stages = sorted(set(range(self.plan.last_block + 1)) | set(self.plan.stage_of.values()))
        for k in stages:
            if self.on_block is not None:
                self.on_block(k, self.arch.n_layers)
            in_block = k < self.arch.n_layers
            if in_block:
                self._load(k)
            points = [p for p, s in self.plan.stage_of.items() if s == k]
            for b, (batch, keep) in enumerate(zip(inputs, keeps, strict=True)):
                hidden[b] = self._pass(k, batch, keep, hidden[b], points, acts[b])
                give_back_freed()
            if in_block and self.plan.last_block > 0:  # one block only: it stays for the next chunk
                self._release(k)
                self._loaded.discard(k)
        return acts

    def close(self) -> None:
        """Stop the read-ahead thread and give the allocator back its settings (a later chunk
        starts both again)."""
        if self.buffers is not None:
            self.buffers.close()
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
        self._reader, self._ahead = None, None
        if self._allocator is not None:
            self._allocator.close()
        self._allocator = None

    def _return_freed_memory(self) -> None:
        """The freed tensors of a pass go back to the system, not into the heap (allocator.py): the
        process then holds what `max_memory` counts, not that plus what the passes freed."""
        if self._allocator is None:
            self._allocator = contextlib.ExitStack()
            self._allocator.enter_context(returning_freed_memory())

    def _materialize(self, wants: Callable[[str], bool]) -> None:
        with contextlib.closing(self.open_checkpoint()) as checkpoint:
            checkpoint.materialize(self.model, wants, self._placement)

    @staticmethod
    def _prefetch(checkpoint: Checkpoint, wants: Callable[[str], bool]) -> None:
        with contextlib.closing(checkpoint):
            checkpoint.prefetch(wants)

    def _embedding_by_rows(self) -> set[str]:
        """The input embedding's weight, left on `meta` and looked up row by row from its file
        (embedding_rows.py), when it is resident and can be: its name, else nothing."""
        with contextlib.closing(self.open_checkpoint()) as checkpoint:

            def locate(name: str):
                return (checkpoint.direct_reads([name]) or {}).get(name)

            found = embedding_rows_for(self.model, locate, self.device)
        if found is None or found[0] not in self.plan.resident:
            return set()
        found[1].install()
        return {found[0]}

    def _block_buffers(self) -> BlockBuffers | None:
        """Reused buffers for the blocks that run, when they all hold the same tensors (names,
        shapes, dtypes: their parameters, no stored buffer) and each can be read straight from the
        safetensors files (`Checkpoint.direct_reads`)."""
        paths = self.arch.block_paths[: self.plan.last_block + 1]
        layout = layout_of(self.model.get_submodule(paths[0]))
        for path in paths:
            block = self.model.get_submodule(path)
            if layout_of(block) != layout or set(block.state_dict()) != set(layout):
                return None
        reads = {}
        with contextlib.closing(self.open_checkpoint()) as checkpoint:
            for k, path in enumerate(paths):
                found = checkpoint.direct_reads(self.plan.blocks[k])
                if found is None:
                    return None
                reads[k] = {name[len(path) + 1 :]: read for name, read in found.items()}
        slots = slots_for(layout, reads, self.device, self.plan.read_ahead and self.plan.last_block > 0)
        return BlockBuffers(layout, reads, slots, self.device)

    def _release(self, k: int) -> None:
        if self.buffers is not None:
            self.buffers.detach(k, self.model.get_submodule(self.arch.block_paths[k]))
            return
        with contextlib.closing(self.open_checkpoint()) as checkpoint:
            checkpoint.release(self.model, [self.arch.block_paths[k]])

    def _wants(self, k: int) -> Callable[[str], bool]:
        prefix = self.arch.block_paths[k] + "."
        return lambda name: name.startswith(prefix)

    def _load(self, k: int) -> None:
        """Block k's weights into the model (from the read-ahead when it holds them), and the next
        block of the cycle 0..last read ahead."""
        if k in self._loaded:
            return  # still resident (a plan with one block)
        nxt = (k + 1) % (self.plan.last_block + 1)
        if self.buffers is not None:
            self.buffers.attach(k, self.model.get_submodule(self.arch.block_paths[k]))
            self._loaded.add(k)
            _rescale_fresh_block(self.model)
            held = resident_bytes(self.model)
            if nxt != k:
                self.buffers.read_ahead(nxt)  # while block k computes: the spare slot or the page cache
            if len(self.buffers.host) > 1:
                held += nbytes(self.model, self.plan.blocks[nxt])
            self.peak_weight_bytes = max(self.peak_weight_bytes, held)
            return
        if self._ahead is not None and self._ahead[0] == k:
            self._ahead[1].result()  # block k is in the page cache now
        self._ahead = None
        self._materialize(self._wants(k))
        self._loaded.add(k)
        _rescale_fresh_block(self.model)
        held = resident_bytes(self.model)
        if self.plan.read_ahead and self.plan.last_block > 0:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="hookscope-read")
            # opened here: reading the model's names beside a pass that swaps blocks is not safe
            self._ahead = (nxt, self._reader.submit(self._prefetch, self.open_checkpoint(), self._wants(nxt)))
            held += nbytes(self.model, self.plan.blocks[nxt])
        self.peak_weight_bytes = max(self.peak_weight_bytes, held)

    def _pass(
        self,
        k: int,
        batch: dict[str, Tensor],
        keep: Tensor,
        saved: Tensor | None,
        points: list[str],
        acts: dict[str, Tensor],
    ) -> Tensor | None:
        """One batch through block k (blocks before it replaying `saved`); keeps `points` into `acts`
        and returns block k's output, the next block's input (None after the last block)."""
        wants_output = k < self._final
        out: list[Tensor] = []
        with torch.inference_mode(), self._replaying(k, saved), contextlib.ExitStack() as stack:
            cap = (
                stack.enter_context(
                    Capture(
                        self.model,
                        points,
                        token_mask=keep,
                        dtype=self.dtype,
                        device="cpu",
                        stop=False if wants_output else None,
                    )
                )
                if points
                else None
            )
            if wants_output:
                block = self.model.get_submodule(self.arch.block_paths[k])
                stop = Stop()  # after block k: the rest of the model is not needed
                stack.callback(stop.after(block, self._keep_output(out)).remove)
                stop.run(self.model, batch, **no_cache(self.model))
                if not out:
                    raise HookscopeError(
                        f"block {k} ({self.arch.block_paths[k]}) never ran in the forward "
                        "pass: this model cannot be streamed; run without --max-memory"
                    )
            else:
                cap.run(batch)
            for point in points:
                acts[point] = cap[point]
        return out[0] if out else None

    def _keep_output(self, out: list[Tensor]) -> Callable[[Tensor | tuple], None]:
        def keep(output: Tensor | tuple) -> None:
            if isinstance(output, Tensor):
                self._extras = -1
                out.append(output)
            else:
                self._extras = len(output) - 1
                out.append(output[0])

        return keep

    @contextlib.contextmanager
    def _replaying(self, k: int, saved: Tensor | None) -> Iterator[None]:
        """Blocks 0..k-1 swapped for stand-ins returning `saved` while the pass runs."""
        swapped = []
        try:
            for j in range(min(k, self.arch.n_layers)):
                parent_path, _, child = self.arch.block_paths[j].rpartition(".")
                parent = self.model.get_submodule(parent_path)
                swapped.append((parent, child, parent._modules[child]))
                parent._modules[child] = _Replay(saved, self._extras)
            yield
        finally:
            for parent, child, block in swapped:
                parent._modules[child] = block


def _rescale_fresh_block(model: nn.Module) -> None:
    """RWKV divides its blocks' output weights by 2**(k // rescale_every) in place on its first eval
    forward (`_rescale_layers`, once, flagged by `layers_are_rescaled`), and halves the stream every
    `rescale_every` blocks. A streamed block is read afresh from the checkpoint after that first
    forward, so it is rescaled here, by the model's own method, as it arrives: the other blocks are on
    meta then (a streamer holds one block in the model at a time), where the division does nothing."""
    for module in model.modules():
        if (
            not module.training
            and callable(getattr(module, "_rescale_layers", None))
            and hasattr(module, "layers_are_rescaled")
        ):
            module.layers_are_rescaled = False
            module._rescale_layers()


def streamer_for(
    loaded: Loaded,
    points: list[str],
    max_memory: int,
    *,
    batch_size: int,
    context: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    revision: str | None = None,
    on_block: Callable[[int, int], None] | None = None,
) -> BlockStreamer:
    """The executor for a model loaded with `device="meta"` (its weights are read from its own
    directory, or its snapshot in the Hugging Face cache)."""
    plan = plan_stream(
        loaded.model,
        loaded.arch,
        points,
        max_memory,
        batch_size=batch_size,
        context=context,
        store_itemsize=dtype.itemsize,
    )
    source, local = resolve_source(loaded.name)
    files = checkpoint_files(source, revision=revision, local_files_only=local)
    weights_dtype = next(iter(loaded.model.parameters())).dtype
    return BlockStreamer(
        loaded.model,
        loaded.arch,
        lambda: Checkpoint(loaded.model, files, weights_dtype),
        plan,
        dtype=dtype,
        device=device,
        on_block=on_block,
    )
