"""What page-locked host memory costs to make, on a CUDA machine: the out stage's ring (extract/ring.py)
pins one buffer per batch in flight while it grows, on the main thread or ahead of it.

    python bench/probe_pinning.py --out bench/out/gpu      # a few seconds; writes pinning.json

For each size (a one-point Llama-1B batch, 128 MiB; a GPT-2-small one, 64 MiB; every block of the
Llama shape, 2 GiB), fresh in this process: PyTorch's pinned allocator (`torch.empty(pin_memory=True)`,
cudaHostAlloc); the same call inside `registering_pinned_memory`, as an extraction on CUDA makes it
(PyTorch's allocator faulting memory in and registering it: `registered_by_torch_s`); and ordinary
memory faulted in (on huge pages) then registered with cudaHostRegister by hand, with the fault-in
alone beside it; then whether a non-blocking device-to-host copy into the registered
memory returns at once and lands the right bytes (a pinned copy would; a pageable one blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as extract sets it (loading.allocator.prefer_huge_pages)

SIZES = {
    "gpt2-small batch (64 MiB)": 2**26,
    "llama-1b batch (128 MiB)": 2**27,
    "llama-1b 16 points (2 GiB)": 2**31,
}


def seconds(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/out/gpu")
    args = p.parse_args()
    import torch

    from hookscope.loading.allocator import registering_pinned_memory

    assert torch.cuda.is_available(), "a CUDA device is needed"
    torch.cuda.init()
    cudart = torch.cuda.cudart()
    results: dict = {"torch": torch.__version__, "sizes": {}}
    kept = []  # held to the end: every allocation below is a fresh one
    for name, size in SIZES.items():
        row: dict = {}
        for _ in range(2):
            t, buf = seconds(lambda: torch.empty(size, dtype=torch.uint8, pin_memory=True))  # noqa: B023
            kept.append(buf)
            row.setdefault("cudaHostAlloc_s", []).append(t)
        with registering_pinned_memory() as on:
            row["registered_by_torch_on"] = on
            for _ in range(2):
                t, buf = seconds(lambda: torch.empty(size, dtype=torch.uint8, pin_memory=True))  # noqa: B023
                kept.append(buf)
                row.setdefault("registered_by_torch_s", []).append(t)
                row["registered_by_torch_is_pinned"] = buf.is_pinned()
        for _ in range(2):
            t_fault, buf = seconds(lambda: torch.empty(size, dtype=torch.uint8).zero_())  # noqa: B023
            t_reg, err = seconds(lambda: cudart.cudaHostRegister(buf.data_ptr(), size, 0))  # noqa: B023
            kept.append(buf)
            row.setdefault("fault_in_s", []).append(t_fault)
            row.setdefault("cudaHostRegister_s", []).append(t_reg)
            row["register_error"] = int(err)  # 0: cudaSuccess
        row["GB_per_s"] = {k: size / min(v) / 1e9 for k, v in row.items() if k.endswith("_s")}
        results["sizes"][name] = row
    # a non-blocking copy into registered memory: does it return at once, and land the right bytes?
    size = 2**27
    host = torch.empty(size, dtype=torch.uint8).zero_()
    cudart.cudaHostRegister(host.data_ptr(), size, 0)
    device = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        call_s, _ = seconds(lambda: host.copy_(device, non_blocking=True))
        event = torch.cuda.Event()
        event.record(side)
    wait_s, _ = seconds(event.synchronize)
    results["registered_copy"] = {
        "call_s": call_s,
        "wait_s": wait_s,
        "is_pinned": host.is_pinned(),
        "equal": bool(torch.equal(host, device.cpu())),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pinning.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
