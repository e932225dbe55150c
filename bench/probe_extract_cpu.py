"""Where an extraction's CPU time goes, per thread, on the CPU (issue 34): run `extract()` of the
bench_pipeline.py case (free forward, `embed` or 12 points through identity blocks, store in
/dev/shm) and report each thread's user and system seconds (/proc/self/task/*/stat), the process's
minor page faults, and a sample of every thread's Python stack every few ms (the innermost
hookscope frame and the line it runs, by thread): which of our functions the CPU time is in.

    python bench/probe_extract_cpu.py --points 1 --tokens 1048576
    python bench/probe_extract_cpu.py --points 12 --tokens 131072
    python bench/probe_extract_cpu.py --smoke

Threads that Python did not start (torch's intra-op pool) are summed as "other"; their work is
counted against the Python frame that called into torch.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pipeline  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def thread_stats() -> dict[int, tuple[str, float, float]]:
    """Native thread id -> (state, user, system CPU seconds)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (fields[0], int(fields[11]) / TICK, int(fields[12]) / TICK)
    return out


def minor_faults() -> int:
    return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[7])


class Sampler:
    """Every `every` seconds, each running Python thread's innermost hookscope frame
    (file:function:line), counted; each thread's native id -> name, and the last CPU times seen
    of every thread (those that end before the run does included)."""

    def __init__(self, every: float):
        self.every, self.counts = every, collections.Counter()
        self.names: dict[int, str] = {}
        self.first = {tid: (user, system) for tid, (_, user, system) in thread_stats().items()}
        self.last: dict[int, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="probe-sampler", daemon=True)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.every):
            threads = {t.ident: t for t in threading.enumerate()}
            states = thread_stats()
            for tid, (_, user, system) in states.items():
                self.last[tid] = (user, system)
            for ident, frame in sys._current_frames().items():
                t = threads.get(ident)
                if ident == me or t is None or t.native_id is None:
                    continue
                name = self.names[t.native_id] = _kind(t.name)
                if states.get(t.native_id, ("S",))[0] == "R":  # running, not waiting
                    self.counts[(name, _where(frame))] += 1
        for tid, (_, user, system) in thread_stats().items():
            self.last[tid] = (user, system)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _kind(name: str) -> str:
    return name.rstrip("0123456789_").removesuffix("_")


def _where(frame) -> str:
    """The innermost frame in hookscope's source, with the outermost torch/other call under it."""
    f, below = frame, None
    while f is not None:
        path = f.f_code.co_filename
        if "/hookscope/" in path and "/bench/" not in path:
            at = f"{Path(path).stem}.{f.f_code.co_name}:{f.f_lineno}"
            return at if below is None else f"{at} -> {below}"
        below = f.f_code.co_name
        f = f.f_back
    return f"(outside hookscope) {frame.f_code.co_name}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", type=int, default=1)
    p.add_argument("--tokens", type=int, default=2**20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--every", type=float, default=0.005, help="seconds between stack samples")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    context, batch = (128, 4) if args.smoke else (1024, 32)
    if args.smoke:
        args.tokens = 4096
    import torch
    import transformers

    from hookscope.extract import ExtractConfig, extract

    torch.set_num_threads(2)
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="hookscope-probe-cpu-") as tmp:
        work = Path(tmp)
        words = args.tokens * 11 // 10 + 4096
        bench_pipeline.prepare(
            work, docs=max(4, words // 2048), words_per_doc=min(2048, words), points=args.points
        )
        if args.points > 1:
            bench_pipeline.identity_blocks()
        points = ["embed"] + [f"blocks.{i}.resid_post" for i in range(args.points - 1)]
        store = Path(tempfile.mkdtemp(prefix="hookscope-probe-store-", dir=bench_pipeline.MEMORY_DIR))
        cfg = ExtractConfig(
            out=str(store / "s"),
            model=str(work / "model"),
            points=points,
            data=str(work / "corpus.jsonl"),
            context=context,
            batch_size=batch,
            dtype="bfloat16",
            max_tokens=args.tokens,
            progress=False,
        )
        faults = minor_faults()
        cpu, wall = time.process_time(), time.perf_counter()
        with Sampler(args.every) as sampler:
            summary = extract(cfg)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        faults = minor_faults() - faults
        import shutil

        shutil.rmtree(store, ignore_errors=True)
    rows = summary.new_rows
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"{args.points} point(s), {rows:,} rows in {wall:.2f} s ({rows / wall:,.0f} rows/s); "
        f"CPU {cpu:.2f} s = {cpu / rows * 1e6:.2f} us/row; minor faults {faults:,} "
        f"({faults / rows * 1e3:.1f} per 1k rows); load {load}"
    )
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for tid, (user, system) in sampler.last.items():
        u0, s0 = sampler.first.get(tid, (0.0, 0.0))
        kind = sampler.names.get(tid, "other (torch pool, tokenizer...)")
        by_kind[kind][0] += user - u0
        by_kind[kind][1] += system - s0
    for kind, (user, system) in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        per_row = (user + system) / rows * 1e6
        print(f"  {kind:36s} user {user:6.2f} s  sys {system:6.2f} s  = {per_row:5.2f} us/row")
    total = sum(sampler.counts.values())
    print(f"stack samples of running threads every {args.every * 1e3:.0f} ms ({total:,}), top {args.top}:")
    for (kind, where), n in sampler.counts.most_common(args.top):
        print(f"  {n / total:6.1%}  {kind:24s} {where}")
    print(summary)


if __name__ == "__main__":
    main()
