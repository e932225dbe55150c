"""What per-expert points cost on a small Mixtral shape (CPU).

Per-expert activations are recomputed from the experts' call (transformers fuses every expert
into 3-D weights; there is no module per expert to hook). This measures, in one process, the
median of several runs of:
  router   hs.collect of blocks.L.mlp.router.logits (stops inside block L, before its experts)
  mlp_out  hs.collect of blocks.L.mlp.out (block L's experts run once)
  experts  hs.collect of every blocks.L.mlp.experts.{E}.post (experts recomputed, then stop)
  forward  the full forward pass, no hooks

    .venv/bin/python bench/bench_families.py [--layers 4 --d-model 256 --experts 8 --seq 128 --batch 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--implementation", default="grouped_mm", help="experts kernel: grouped_mm | eager")
    args = p.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    import hookscope as hs

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "mixtral",
        vocab_size=1024,
        hidden_size=args.d_model,
        intermediate_size=2 * args.d_model,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
    )
    cfg._experts_implementation = args.implementation
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 1024, (args.batch, args.seq))
    layer = args.layers // 2
    cases = {
        "router": lambda: hs.collect(model, ids, f"blocks.{layer}.mlp.router.logits"),
        "mlp_out": lambda: hs.collect(model, ids, f"blocks.{layer}.mlp.out"),
        "experts": lambda: hs.collect(
            model, ids, [f"blocks.{layer}.mlp.experts.{e}.post" for e in range(args.experts)]
        ),
        "forward": lambda: model(ids, use_cache=False),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    with torch.inference_mode():
        for fn in cases.values():
            fn()  # warm up
        for _ in range(args.repeat):
            for name, fn in cases.items():  # interleaved, so load drifts hit every case alike
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(
        json.dumps(
            {
                "shape": vars(args),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "loadavg": open("/proc/loadavg").read().split()[:3]
                if os.path.exists("/proc/loadavg")
                else None,
                "median_ms": {k: round(v, 2) for k, v in med.items()},
                "experts_over_mlp_out": round(med["experts"] / med["mlp_out"], 3),
                "experts_over_forward": round(med["experts"] / med["forward"], 3),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
