"""Probe (issue 15): `with hs.capture(...)` around a full forward vs the plain forward, tiny GPT-2
(3 layers, d_model 64), 1 x 16 tokens; interleaved rounds, thread CPU time, median ratio."""

import time

import torch

import hookscope as hs
from hookscope.testing import build_tiny

torch.set_num_threads(1)
model = build_tiny("gpt2", n_layers=3, d_model=64, n_heads=4).eval()
ids = torch.randint(1, 100, (1, 16))
P = "blocks.1.resid_post"


def plain():
    with torch.inference_mode():
        return model(ids)


def cap():
    with hs.capture(model, P) as c:
        model(ids)
    return c[P]


def per(op, n=300):
    for _ in range(30):
        op()
    t = time.thread_time()
    for _ in range(n):
        op()
    return (time.thread_time() - t) / n * 1e6


rs = []
for _r in range(7):
    a = per(plain)
    b = per(cap)
    rs.append(b / a)
rs.sort()
print(f"plain {a:.0f} us capture {b:.0f} us  median ratio {rs[3]:.3f} all {[round(x, 3) for x in rs]}")
