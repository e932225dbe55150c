"""Reused weight buffers for block streaming: the process's memory stays flat across blocks.

Allocating each streamed block's tensors afresh leaves the freed ones in the C allocator's heap
(glibc keeps mid-sized freed chunks, and a read-ahead thread's in an arena of its own), so a run
capped at the weights of two blocks was measured holding most of the model. Here every block
whose tensors have the same names, shapes and dtypes shares one or two buffer sets ("slots"),
allocated once: a block's parameters are pointed at a slot while it runs and back at `meta` after.
A block's tensors are read from the safetensors files straight into the slot (`pread` into its
bytes; a dtype conversion goes through one 1 MiB staging buffer), so no whole-tensor temporary
and no memory map's pages are left behind. On CUDA the slots are pinned host memory, copied into
one set of device buffers, reused too.

The next block is read ahead in a thread while this one computes: into the spare slot when there
are two, else only into the page cache (`page_in`: the kernel's memory, not the process's), to
be copied into the one slot when it starts. `slots_for` picks: two where a read is work worth
overlapping (a conversion; a copy to a GPU, which needs pinned slots), one where it is a copy of
cached bytes (short against a chunk's passes through the block: bench/HISTORY.md, Memory, "A block
read from the page cache").
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor, nn

from .safetensors_reads import TensorRead, page_in, read_into

_ALIGN = 64  # bytes: each tensor's start in a slot (any dtype's view needs its own size)
_STAGING_BYTES = 2**20  # resident while converting, one per slot: kept small


Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]  # parameter name in the block -> shape, dtype


def layout_of(block: nn.Module) -> Layout:
    return {name: (tuple(p.shape), p.dtype) for name, p in block.named_parameters()}


def slots_for(
    layout: Layout, reads: dict[int, dict[str, TensorRead]], device: torch.device | str, read_ahead: bool
) -> int:
    """How many slots: two when the next block is read ahead and reading it is more than a copy of
    cached bytes (a dtype conversion, or a GPU run's pinned copy); else one."""
    if not read_ahead:
        return 1
    return 2 if torch.device(device).type != "cpu" or converts(layout, reads) else 1


def converts(layout: Layout, reads: dict[int, dict[str, TensorRead]]) -> bool:
    """Whether any tensor is stored in another dtype than the block's (a read converts it)."""
    return any(read.stored != layout[name][1] for block in reads.values() for name, read in block.items())


def _carve(layout: Layout, device: torch.device | str, pin: bool) -> tuple[Tensor, dict[str, Tensor]]:
    """One allocation holding every tensor of `layout`, and the tensors as views of it."""
    offsets, total = {}, 0
    for name, (shape, dtype) in layout.items():
        offsets[name] = total
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        total += -(-nbytes // _ALIGN) * _ALIGN
    whole = torch.empty(max(total, 1), dtype=torch.uint8, device=device, pin_memory=pin)
    views = {}
    for name, (shape, dtype) in layout.items():
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        views[name] = whole[offsets[name] : offsets[name] + nbytes].view(dtype).view(shape)
    return whole, views


class BlockBuffers:
    """`count` slots (2: one computing, one read ahead) for blocks of one `layout`; `reads[k]` says
    where block k's tensors lie. `attach(k, module)` puts block k's weights in `module` (read now,
    or waited for when read ahead); `detach` puts its `meta` parameters back; `read_ahead(k)` reads
    block k into the spare slot in a thread, or with one slot pages its bytes in."""

    def __init__(
        self,
        layout: Layout,
        reads: dict[int, dict[str, TensorRead]],
        count: int,
        device: torch.device | str = "cpu",
    ):
        device = torch.device(device)
        on_host = device.type == "cpu"
        pin = device.type == "cuda"
        self.layout, self.reads = layout, reads
        self.host = [_carve(layout, "cpu", pin) for _ in range(count)]
        # on a device: one set of device buffers, each block copied in from its host slot
        self.device = None if on_host else _carve(layout, device, False)
        # a read that converts goes through staging; one that does not reads straight into the slot
        staging = _STAGING_BYTES if converts(layout, reads) else 0
        self._staging = [torch.empty(staging, dtype=torch.uint8) for _ in range(count)]
        self._holds: list[int | None] = [None] * count  # the block each slot holds or is reading
        self._pending: dict[int, Future] = {}  # slot -> its read ahead
        self._paging: Future | None = None  # one slot: the next block's bytes paged in
        self._copied: list[object | None] = [None] * count  # CUDA: the event after a slot's copy out
        self._attached: dict[int, tuple[int, dict[str, nn.Parameter]]] = {}  # block -> (slot, meta params)
        self._reader: ThreadPoolExecutor | None = None

    def attach(self, k: int, module: nn.Module) -> None:
        slot = self._slot_holding(k)
        if slot is None:
            slot = self._free_slot()
            self.read(slot, k)
        views = self.host[slot][1]
        if self.device is not None:  # one copy (the sets share a layout), after the last block's work
            self.device[0].copy_(self.host[slot][0], non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device[0].device))
            self._copied[slot] = event
            views = self.device[1]
        metas = {}
        for name, tensor in views.items():
            owner, _, leaf = name.rpartition(".")
            holder = module.get_submodule(owner) if owner else module
            meta = holder._parameters[leaf]
            metas[name] = meta
            holder._parameters[leaf] = nn.Parameter(tensor, requires_grad=meta.requires_grad)
        self._attached[k] = (slot, metas)

    def detach(self, k: int, module: nn.Module) -> None:
        slot, metas = self._attached.pop(k)
        for name, meta in metas.items():
            owner, _, leaf = name.rpartition(".")
            (module.get_submodule(owner) if owner else module)._parameters[leaf] = meta
        self._holds[slot] = None

    def read_ahead(self, k: int) -> None:
        if self._slot_holding(k, wait=False) is not None:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="hookscope-read")
        if len(self.host) == 1:  # no spare slot: the page cache holds the next block
            if self._paging is None or self._paging.done():
                self._paging = self._reader.submit(self._page_in, k)
            return
        slot = self._free_slot()
        self._holds[slot] = k
        self._pending[slot] = self._reader.submit(self.read, slot, k)

    def _page_in(self, k: int) -> None:
        for read in self.reads[k].values():
            page_in(read)

    def close(self) -> None:
        """Stop the read-ahead thread; what it was reading is forgotten."""
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
        self._reader, self._paging = None, None
        for slot in list(self._pending):
            del self._pending[slot]
            if all(s != slot for s, _ in self._attached.values()):
                self._holds[slot] = None

    def read(self, slot: int, k: int) -> None:
        """Block k's tensors from the files into `slot`."""
        event = self._copied[slot]
        if event is not None:
            event.synchronize()  # the slot's last copy to the device is done
        views = self.host[slot][1]
        for name, read in self.reads[k].items():
            read_into(read, views[name], self._staging[slot])
        self._holds[slot] = k

    def _slot_holding(self, k: int, wait: bool = True) -> int | None:
        for slot, held in enumerate(self._holds):
            if held == k:
                if wait and slot in self._pending:
                    try:
                        self._pending.pop(slot).result()
                    except BaseException:
                        self._holds[slot] = None  # half read: never taken for block k
                        raise
                return slot
        return None

    def _free_slot(self) -> int:
        attached = {slot for slot, _ in self._attached.values()}
        free = [s for s in range(len(self.host)) if s not in attached]
        idle = [s for s in free if s not in self._pending]
        slot = idle[0] if idle else free[0]
        if slot in self._pending:  # read ahead for a block not asked for after all
            self._pending.pop(slot).result()
        self._holds[slot] = None
        return slot


def data_ranges(buffers: BlockBuffers) -> list[tuple[int, int]]:
    """The address ranges of every slot (and the device set), for a check that weights live there."""
    wholes = [whole for whole, _ in buffers.host] + ([buffers.device[0]] if buffers.device else [])
    return [(w.data_ptr(), w.data_ptr() + w.numel()) for w in wholes]
