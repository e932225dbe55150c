"""Where a step reads a tensor's value on the host: on a GPU, each such read waits for every kernel
queued before it (a host sync), and a forward that has one per batch cannot run ahead of the device.

    with HostReads() as reads:          # on this thread only
        model(**inputs)
    print(reads.calls)                  # ["aten.is_nonzero.default at masking_utils.py:292 ...", ...]

Reads are seen where torch dispatches them (`.item()`, `bool(t)`, `int(t)`, `nonzero` without a
size, a boolean index, `torch.equal`, `unique`, `masked_select`) and, for the copies to the host
that a CPU tensor makes without any dispatch (`.tolist()`, `.numpy()`, `.cpu()`), at torch's
function level. `device_only=True` keeps the reads of non-CPU tensors only (on a GPU: exactly the
syncs); on the CPU, where every tensor is on the host, `host` names the storages (`data_ptr` of
`untyped_storage()`) that stay on the host in a GPU run too, and reads touching only those are left
out. A `.to(device)` is not counted: on the CPU the host and the device have one name.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_aten = torch.ops.aten
# operations that read a tensor's values on the host
READS = {
    _aten._local_scalar_dense.default,
    _aten.item.default,
    _aten.is_nonzero.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.equal.default,
    _aten._unique2.default,
    _aten.unique_consecutive.default,
}
INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default}  # with a bool index
COPIES = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}  # a device tensor's copy to the host
_OWN_FRAMES = ("record", "__torch_dispatch__", "__torch_function__")


class HostReads:
    """Records each read (see the module docstring) made on this thread inside the block, with
    the three innermost Python frames outside torch, in `calls`."""

    def __init__(self, host: Iterable[int] = (), device_only: bool = False):
        self.host, self.device_only = set(host), device_only
        self.calls: list[str] = []
        self._modes = [_Functions(), _Dispatch()]
        for mode in self._modes:
            mode.reads = self

    def __enter__(self) -> HostReads:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def record(self, what: str, args: tuple, kwargs: dict) -> None:
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if self.device_only and all(t.device.type == "cpu" for t in tensors):
            return
        if {t.untyped_storage().data_ptr() for t in tensors} <= self.host:
            return
        where = [
            f for f in traceback.extract_stack() if "/torch/" not in f.filename and f.name not in _OWN_FRAMES
        ][-3:]
        self.calls.append(
            f"{what} at "
            + " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.line}" for f in reversed(where))
        )


class _Dispatch(TorchDispatchMode):
    reads: HostReads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS or (
            func in INDEXING
            and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_leaves(args[1]))
        ):
            self.reads.record(str(func), args, kwargs)
        return func(*args, **kwargs)


class _Functions(TorchFunctionMode):
    reads: HostReads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in COPIES:
            self.reads.record(f"Tensor.{func.__name__}", args, kwargs)
        return func(*args, **kwargs)
