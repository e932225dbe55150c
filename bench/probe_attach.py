"""Probe (issue 15): attach + remove one hook, hookscope vs a raw register_forward_hook, interleaved
rounds in one process, thread CPU time (robust to a shared machine's load), median ratio.
Run with PYTHONPATH=<old checkout>/src to time an older hookscope the same way."""

import statistics
import time

import torch

import hookscope as hs
from hookscope.testing import build_tiny

torch.set_num_threads(1)
model = build_tiny("gpt2", n_layers=6, d_model=64, n_heads=4).eval()


def fn(*a, **k):
    return None


blk = model.transformer.h[5]


def raw():
    blk.register_forward_hook(fn).remove()


def hsop():
    with hs.hooks(model) as h:
        h.forward("blocks.5.resid_post", fn)


def per(op, n=3000):
    t = time.thread_time()
    for _ in range(n):
        op()
    return (time.thread_time() - t) / n * 1e6


for _ in range(2000):
    raw()
    hsop()
rs, hs_, rw = [], [], []
for _r in range(25):
    a = per(raw)
    b = per(hsop)
    rs.append(b / a)
    hs_.append(b)
    rw.append(a)
print(
    f"raw {statistics.median(rw):.2f} us  hookscope {statistics.median(hs_):.2f} us  "
    f"median ratio {statistics.median(rs):.2f}"
)
