"""A window of a dataset's epoch: where its rows lie in the mapped shards, and gathering a batch
of them straight into its own tensor (store/dataset.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .recycler import Alloc

_SHIFT = 40  # a located row: part << _SHIFT | row (rows of a part < 2**40)


def located_rows(parts: Sequence[int], firsts: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
    """Where each row of shards placed at (part, first row) with `sizes` rows lies, packed."""
    if not sizes:
        return np.zeros(0, np.int64)
    return np.concatenate(
        [
            np.arange(f, f + n, dtype=np.int64) + (p << _SHIFT)
            for p, f, n in zip(parts, firsts, sizes, strict=True)
        ]
    )


class Layout:
    """Where a window's rows lie. `sources[j]` holds part j's tensor of each column (a part: shards
    mapped side by side at one stride, strided.py, or one shard). `located[r]` says where the
    window's row r is: `part << _SHIFT | row` when all columns have it at the same row (one column,
    or shards mapped one by one); else r itself, with its part in `parts[r]` and its row in each
    column in `rows[name][r]`. `hold` keeps the mappings alive."""

    def __init__(
        self,
        sources: list[dict[str, torch.Tensor]],
        dtypes: dict[str, torch.dtype],
        located: np.ndarray,
        parts: np.ndarray | None = None,
        rows: dict[str, np.ndarray] | None = None,
        hold: object = None,
    ):
        self.sources = sources
        self.dtypes = dtypes
        self.located = located
        self.parts = parts
        self.rows = rows
        self.hold = hold

    def decode(self, located: np.ndarray) -> tuple[np.ndarray | None, dict[str, np.ndarray]]:
        """(the part of each of `located`, None if there is one part; its row in each column)."""
        small = np.uint16 if len(self.sources) < 1 << 16 else np.int64  # numpy radix-sorts small ints
        if self.rows is None:
            if len(self.sources) == 1:
                return None, dict.fromkeys(self.dtypes, located)
            rows = located & ((1 << _SHIFT) - 1)
            return (located >> _SHIFT).astype(small), dict.fromkeys(self.dtypes, rows)
        assert self.parts is not None
        part = None if len(self.sources) == 1 else self.parts[located].astype(small)
        return part, {name: r[located] for name, r in self.rows.items()}


class MappedWindow:
    """A window's mapped columns and this rank's rows of it in their order: for each position, the
    part holding its row and the row there (worked out once a window, by the thread that maps it,
    so a batch only slices them)."""

    def __init__(
        self,
        layout: Layout,
        located: np.ndarray,
        ordered: bool,
        batches: tuple[int, int] | None,
        stacks: dict[str, list[str]] | None = None,
    ):
        """`located`: the window's rows for this rank, in order (see Layout); `ordered`: sequential;
        `stacks`: output key -> the columns gathered into it as one `[rows, columns, ...]` tensor."""
        self.sources = layout.sources
        self.dtypes = layout.dtypes
        self.hold = layout
        self.stacks = stacks or {}
        # stacks of one row kind (a CLT's mlp.in and mlp.out) share one layer-major buffer: the
        # columns of all of them, stack after stack
        kinds: dict[tuple, list[str]] = {}
        for key, names in self.stacks.items():
            kind = (self.dtypes[names[0]], tuple(self.sources[0][names[0]].shape[1:]))
            kinds.setdefault(kind, []).append(key)
        self.buffers = list(kinds.values())
        self.rows = len(located)
        self.part, rows = layout.decode(located)
        # grouped: each batch's positions come in few runs of one part (so gathering needs no sort)
        self.grouped = self.part is None or ordered
        if batches is not None and not self.grouped:
            assert self.part is not None
            # batch by batch (`batches` = (size, rows of a batch begun before the window)), the
            # positions sorted by part now, so that gathering a batch sorts nothing
            size, begun = batches
            parts = len(self.sources)
            batch = (np.arange(self.rows, dtype=np.int64) + begun) // size
            key = batch * parts + self.part
            if (self.rows - 1 + begun) // size * parts + parts <= 1 << 16:
                key = key.astype(np.uint16)  # numpy radix-sorts 16-bit keys, faster than wider ones
            grouped = np.argsort(key, kind="stable")
            self.part = self.part[grouped]
            rows = {name: r[grouped] for name, r in rows.items()}
            self.grouped = True  # a batch's positions as a set are unchanged, now in part order
        index: dict[int, torch.Tensor] = {}  # columns sharing one rows array share one index
        for r in rows.values():
            index.setdefault(id(r), torch.from_numpy(r))
        self.index = {name: index[id(r)] for name, r in rows.items()}

    def new_batch(self, n: int, empty: Alloc) -> Batch:
        """Memory for a batch of `n` rows of every output, which `fill` fills (from this window or, for a
        batch that straddles windows, from each). A stack is gathered into column-major memory
        ([columns, rows, ...]: a gather into a strided `[rows, columns, ...]` destination measured several
        times slower in torch) and handed out as its `[rows, columns, ...]` view; stacks of one row kind share
        one such buffer (so a batch keeps the memory of all of them while one is held)."""
        shapes = {k: v.shape[1:] for k, v in self.sources[0].items()}
        out = {}
        rows = {}
        whole = []
        for keys in self.buffers:
            names = [name for key in keys for name in self.stacks[key]]
            buffer = empty((len(names), n, *shapes[names[0]]), self.dtypes[names[0]])
            at = 0
            for key in keys:
                out[key] = buffer[at : at + len(self.stacks[key])].movedim(0, 1)
                at += len(self.stacks[key])
            rows.update({name: same_size_ints(buffer[j]) for j, name in enumerate(names)})
            whole.append((names, same_size_ints(buffer).flatten(0, 1)))
        for k in shapes:
            if k not in rows:
                out[k] = empty((n, *shapes[k]), self.dtypes[k])
                rows[k] = same_size_ints(out[k])
        return Batch(n, out, rows, whole)

    def gather(self, positions: slice, empty: Alloc) -> tuple[dict[str, torch.Tensor], np.ndarray | None]:
        """The rows at `positions` of the order in a batch of their own: (outputs, grouping), see `fill`."""
        batch = self.new_batch(len(range(*positions.indices(self.rows))), empty)
        return batch.out, self.fill(batch, positions, 0)

    def fill(self, batch: Batch, positions: slice, at: int) -> np.ndarray | None:
        """Gather the rows at `positions` of the order into rows `at`.. of `batch`, grouped by part:
        returns grouping, with batch row at + k = the row at position positions[grouping[k]] (grouping
        None: in order). Straight from the mapped shards, one copy per row: a whole batch from one part
        in one gather per run of a buffer's columns that are rows of one mapping (one pass of torch's
        threads, which wait for each other at every call: one for a whole CLT batch when the writer put
        its columns side by side); a batch's part from one window (it straddles windows), or a window of
        several parts, column by column into its contiguous slices."""
        n = len(range(*positions.indices(self.rows)))
        assert at + n <= batch.n, (at, n, batch.n)
        index = {k: v[positions] for k, v in self.index.items()}
        if self.part is None:  # one part
            sources = dict(self.sources[0])
            if at == 0 and n == batch.n:  # the whole batch: one gather per run of a buffer's columns
                for names, flat in batch.whole:
                    j = 0
                    while j < len(names):  # columns j..end-1 are rows of one mapping (mapper.py)
                        source, end = sources[names[j]], j + 1
                        while end < len(names) and sources[names[end]] is source:
                            end += 1
                        torch.index_select(
                            source,
                            0,
                            torch.cat([index[name] for name in names[j:end]]),
                            out=flat[j * n : end * n],
                        )
                        j = end
                    for name in names:
                        del sources[name]
            for k, source in sources.items():
                torch.index_select(source, 0, index[k].contiguous(), out=batch.rows[k][at : at + n])
            return None
        part = self.part[positions]
        # a stable sort of small integers is a radix sort in numpy: linear in the batch
        grouping = None if self.grouped else np.argsort(part, kind="stable")
        if grouping is not None:
            part = part[grouping]
            order = torch.from_numpy(grouping)
            index = {k: v[order] for k, v in index.items()}
        cuts = [0, *(np.flatnonzero(part[1:] != part[:-1]) + 1).tolist(), n]
        for a, b in zip(cuts, cuts[1:], strict=False):
            if b > a:
                for k, source in self.sources[int(part[a])].items():
                    # torch's gather, on its threads: faster than numpy's one-thread `take` from
                    # mapped shards into a numpy-allocated batch
                    into = batch.rows[k][at + a : at + b]
                    torch.index_select(source, 0, index[k][a:b].contiguous(), out=into)
        return grouping


class Batch:
    """A batch's memory: `out`, what is handed out (a tensor per output key, a stack a view of its
    buffer); `rows`, each column's `n` rows as integers of its element size (contiguous); `whole`, each
    buffer of stacks as (its columns, one `[columns * n, ...]` block)."""

    def __init__(
        self,
        n: int,
        out: dict[str, torch.Tensor],
        rows: dict[str, torch.Tensor],
        whole: list[tuple[list[str], torch.Tensor]],
    ):
        self.n = n
        self.out = out
        self.rows = rows
        self.whole = whole

    def first(self, rows: int) -> dict[str, torch.Tensor]:
        """The outputs, cut to their first `rows` rows when the batch was not filled."""
        return self.out if rows == self.n else {k: v[:rows] for k, v in self.out.items()}


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_size_ints(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as integers of its element size: whole rows of bytes to gather (any dtype,
    bfloat16 and bool included; no conversion, one gather kernel)."""
    return t.view(_SAME_SIZE_INT[t.element_size()])
