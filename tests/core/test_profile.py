"""hs.profile on tiny models: rows, shares, trace, picture, HTML, backward labels, hook cost,
cleanup. References are independent of our event parsing: the trace file as written by the
profiler, output sizes seen by a plain register_forward_hook, the PNG decoder, sleep durations."""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict

import pytest
import torch

import hookscope as hs
from hookscope.arch import arch_of
from hookscope.cli import main
from hookscope.errors import HookscopeError
from hookscope.hooks import hook_count
from hookscope.profiling.events import relative_spread
from hookscope.profiling.labels import BlockLabels, profiler_enabled
from hookscope.testing import build_tiny

pytestmark = pytest.mark.slow  # real passes under torch.profiler, traces written and parsed: 40 s

N_BLOCKS = 4


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    # wide enough that the blocks, not the embedding / head / Python glue, dominate a step
    return build_tiny("gpt2", d_model=256, n_layers=N_BLOCKS, n_heads=4, vocab_size=64)


@pytest.fixture(scope="module")
def inputs():
    torch.manual_seed(0)
    # long enough that the blocks dominate the step, as in a real model (fixed costs stay small)
    return {"input_ids": torch.randint(0, 64, (8, 128)), "use_cache": False}


@pytest.fixture(scope="module")
def small():
    """The same blocks, narrow and on a short input: for the tests of where labels and hooks go,
    which do not need the blocks to dominate a step."""
    torch.manual_seed(0)
    model = build_tiny("gpt2", d_model=64, n_layers=N_BLOCKS, n_heads=4, vocab_size=64)
    return model, {"input_ids": torch.randint(0, 64, (2, 16)), "use_cache": False}


@pytest.fixture(scope="module")
def forward_run(model, inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("forward")
    # 5 steps: one step slowed by other work on a shared machine moves the average little
    report = hs.profile(model, inputs, steps=5, warmup=1)
    return report, report.write(out)


@pytest.fixture(scope="module")
def backward_run(model, inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("backward")
    report = hs.profile(model, inputs, backward=True, steps=3, warmup=1)
    return report, report.write(out)


def trace_events(path) -> list[dict]:
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]


def durations_by_name(events: list[dict]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for e in events:
        out[e["name"]] += float(e["dur"])
    return out


BLOCKS = [f"blocks.{i}" for i in range(N_BLOCKS)]


def test_one_row_per_block_in_order(forward_run, model):
    report, _ = forward_run
    assert len(arch_of(model).block_paths) == model.config.n_layer == N_BLOCKS
    assert [r.name for r in report.rows] == BLOCKS
    assert all(r.kind == "block" and r.calls == 1 for r in report.rows)
    assert all(0 < r.self_s <= r.total_s for r in report.rows)


def test_block_times_match_trace_and_cover_the_step(forward_run):
    report, files = forward_run
    durations = durations_by_name(trace_events(files["trace"]))  # microseconds, summed over steps
    for row in report.rows:
        assert row.total_s == pytest.approx(durations[f"hs::{row.name}"] / report.steps * 1e-6, rel=0.01)
    assert report.profiled_step_s == pytest.approx(durations["hs::step"] / report.steps * 1e-6, rel=0.01)
    covered = sum(durations[f"hs::{b}"] for b in BLOCKS) / durations["hs::step"]
    assert covered >= 0.9
    assert report.blocks_share == pytest.approx(covered, rel=0.01)
    assert sum(r.share for r in report.rows) == pytest.approx(report.blocks_share)


def test_block_memory_is_its_output_under_inference(forward_run, model, inputs):
    # without a KV cache and without autograd, a block keeps exactly its output tensor
    report, _ = forward_run
    sizes = {}
    handles = [
        model.get_submodule(path).register_forward_hook(
            lambda m, a, out, i=i: sizes.__setitem__(f"blocks.{i}", out.numel() * out.element_size())
        )
        for i, path in enumerate(arch_of(model).block_paths)
    ]
    try:
        with torch.inference_mode():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    assert {r.name: r.cpu_mem_bytes for r in report.rows} == sizes


def test_trace_is_json_naming_every_block(forward_run):
    _, files = forward_run
    names = {e["name"] for e in trace_events(files["trace"])}
    assert {f"hs::{b}" for b in BLOCKS} | {"hs::step"} <= names


def test_picture_is_a_png_that_decodes(forward_run):
    import matplotlib.image

    _, files = forward_run
    data = files["plot"].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(files["plot"])
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image.std() > 0  # not a blank canvas


def test_html_embeds_the_picture_and_names_every_block(forward_run):
    _, files = forward_run
    page = files["html"].read_text()
    assert files["picture"].read_text() in page  # the SVG picture, inline
    assert all(f"<td>{b}</td>" in page for b in BLOCKS)
    assert 'src="http' not in page  # self-contained


def test_table_file_is_the_summary(forward_run):
    report, files = forward_run
    text = files["table"].read_text()
    assert text == report.summary() + "\n"
    assert all(f"\n{b} " in text for b in BLOCKS)
    assert "CUDA only" in text  # says what the CPU memory column is and where a timeline exists


def test_backward_labels_each_block(backward_run):
    report, files = backward_run
    backward_rows = [r for r in report.rows if r.kind == "block backward"]
    assert [r.name for r in backward_rows] == BLOCKS[::-1]  # in the order backward runs them
    assert all(r.calls == 1 and r.total_s > 0 for r in backward_rows)
    events = trace_events(files["trace"])
    spans = {e["name"]: e for e in events if e["name"].endswith(".backward")}
    assert set(spans) == {f"hs::{b}.backward" for b in BLOCKS}
    # each backward range holds autograd backward nodes, on its own thread
    autograd = [e for e in events if "Backward" in e["name"] and not e["name"].startswith("hs::")]
    for name, span in spans.items():
        start, end = float(span["ts"]), float(span["ts"]) + float(span["dur"])
        inside = [e for e in autograd if e["tid"] == span["tid"] and start <= float(e["ts"]) < end]
        assert inside, f"{name} holds no backward work"
    durations = durations_by_name(events)
    covered = sum(durations[f"hs::{b}"] + durations[f"hs::{b}.backward"] for b in BLOCKS)
    assert covered / durations["hs::step"] >= 0.9


def test_each_block_range_holds_that_blocks_own_work(small, tmp_path):
    model, inputs = small

    # markers from plain torch hooks: block i's MLP runs (forward hook) and its weight gradient
    # arrives (tensor hook on the parameter); each must fall inside block i's own ranges
    def mark(name: str) -> None:
        with torch.autograd.profiler.record_function(name):
            pass

    handles = []
    for i, path in enumerate(arch_of(model).block_paths):
        fc = model.get_submodule(f"{path}.mlp.c_fc")
        handles.append(fc.register_forward_hook(lambda m, a, o, i=i: mark(f"test.forward.{i}")))
        handles.append(fc.weight.register_hook(lambda g, i=i: mark(f"test.backward.{i}")))
    try:
        files = hs.profile(model, inputs, backward=True, steps=1, warmup=0).write(tmp_path)
    finally:
        for h in handles:
            h.remove()
    spans = {
        e["name"]: (float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in trace_events(files["trace"])
    }
    for i in range(N_BLOCKS):
        pairs = ((f"test.forward.{i}", f"hs::blocks.{i}"), (f"test.backward.{i}", f"hs::blocks.{i}.backward"))
        for marker, label in pairs:
            start, end = spans[label]
            assert start <= spans[marker][0] and spans[marker][1] <= end, f"{marker} outside {label}"


def test_backward_ranges_nest_and_do_not_overlap(backward_run):
    # Perfetto drops or mangles slices that straddle each other on one thread
    _, files = backward_run
    by_thread: dict = defaultdict(list)
    for e in trace_events(files["trace"]):
        if e.get("cat") in ("cpu_op", "user_annotation"):
            start = float(e["ts"])
            by_thread[e["tid"]].append((start, start + float(e["dur"]), e["name"]))
    for spans in by_thread.values():
        stack: list = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= start + 1e-3:
                stack.pop()
            assert not stack or end <= stack[-1][1] + 1e-3, f"{name} straddles {stack[-1][2]}"
            stack.append((start, end, name))


def test_backward_leaves_user_gradients_alone(small):
    model, inputs = small
    params = list(model.parameters())
    mark = torch.full_like(params[0], 7.0)
    params[0].grad = mark.clone()
    try:
        hs.profile(model, inputs, backward=True, steps=1, warmup=0)
        assert torch.equal(params[0].grad, mark)
        assert all(p.grad is None for p in params[1:])
    finally:
        params[0].grad = None


def test_hook_overhead_grows_with_a_slow_hook():
    small = build_tiny("gpt2")  # steps of a few ms: a 2 ms hook is a large share
    ids = torch.randint(0, 512, (2, 16))

    def noop(act, hook):
        return None

    def slow(act, hook):  # 100 ms: far above what a shared, loaded machine (load 10) adds to a step
        time.sleep(0.1)

    cheap = hs.profile(small, ids, steps=10, warmup=1, hooks=[("blocks.1.mlp.out", noop)])
    costly = hs.profile(small, ids, steps=10, warmup=1, hooks=lambda h: h.forward("blocks.1.mlp.out", slow))
    assert math.isfinite(cheap.hook_overhead) and math.isfinite(costly.hook_overhead)
    assert costly.hook_overhead > cheap.hook_overhead
    assert costly.step_time_s - costly.step_time_without_hooks_s > 0.06  # the sleep shows up
    (row,) = [r for r in costly.rows if r.kind == "hook"]
    assert row.name == "blocks.1.mlp.out" and row.calls == 1 and row.total_s >= 0.1
    assert "hooks cost" in costly.summary()
    plain = hs.profile(small, ids, steps=1, warmup=0)
    assert plain.hook_overhead is None


def test_gradient_hooks_get_backward_rows():
    small = build_tiny("gpt2")
    seen = []
    report = hs.profile(
        small,
        torch.randint(0, 512, (2, 16)),
        backward=True,
        steps=2,
        warmup=0,
        hooks=lambda h: h.grad("blocks.1.resid_mid", lambda g, hook: seen.append(g.shape)),
    )
    assert seen and all(s == (2, 16, 64) for s in seen)
    kinds = {(r.name, r.kind) for r in report.rows if r.kind.startswith("hook")}
    assert ("blocks.1.resid_mid", "hook backward") in kinds


def test_no_hooks_left_behind_even_when_the_forward_raises(small):
    model, inputs = small
    before = hook_count(model)
    hs.profile(model, inputs, steps=1, warmup=0, hooks=[("blocks.2.mlp.out", lambda a, h: None)])
    assert hook_count(model) == before

    def fail_while_profiling(act, hook):
        if profiler_enabled():  # only once the labels are on
            raise RuntimeError("boom")

    for backward in (False, True):
        with pytest.raises(RuntimeError, match="boom"):
            hs.profile(
                model,
                inputs,
                backward=backward,
                steps=1,
                warmup=0,
                hooks=[("blocks.2.resid_post", fail_while_profiling)],
            )
        assert hook_count(model) == before
        assert not profiler_enabled()


def test_labels_are_removed_on_exit_and_do_not_change_outputs(small):
    model, inputs = small
    before = hook_count(model)
    with torch.inference_mode():
        reference = model(**inputs).logits
        with BlockLabels(model, arch_of(model), backward=True):
            assert hook_count(model) == before + 2 * N_BLOCKS
            labelled = model(**inputs).logits
    assert hook_count(model) == before
    assert torch.equal(labelled, reference)


def test_bad_arguments_say_what_to_do(model, inputs):
    with pytest.raises(HookscopeError, match="steps must be >= 1"):
        hs.profile(model, inputs, steps=0)
    with pytest.raises(HookscopeError, match="list of \\(point, fn\\) pairs"):
        hs.profile(model, inputs, hooks=["blocks.0.resid_post"])
    frozen = build_tiny("gpt2").requires_grad_(False)
    with pytest.raises(HookscopeError, match="requires grad"):
        hs.profile(frozen, torch.randint(0, 512, (1, 8)), backward=True, steps=1, warmup=0)


# -- the base install, files, spread --------------------------------------------------------------


def _svg_texts(svg: str) -> list[str]:
    from xml.etree import ElementTree

    root = ElementTree.fromstring(svg)  # well-formed XML, or this raises
    return [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text")]


@pytest.fixture
def no_matplotlib(monkeypatch):
    """As on the README's base install: `import matplotlib...` raises ImportError."""
    import sys

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: the import fails


def test_the_picture_needs_no_matplotlib(forward_run, no_matplotlib, tmp_path):
    report, _ = forward_run
    with pytest.raises(ImportError):
        import matplotlib.figure  # noqa: F401
    files = report.write(tmp_path / "prof")
    assert set(files) == {"table", "trace", "picture", "html"}  # no PNG without matplotlib, nothing else lost
    svg = files["picture"].read_text()
    texts = _svg_texts(svg)
    assert all(b in texts for b in BLOCKS)  # a bar label per block
    for row in report.block_rows():  # each bar's figure is the row's time
        assert any(t.startswith(f"{row.total_s * 1e3:.2f} ms") for t in texts)
    assert svg in files["html"].read_text()


def test_cli_profile_on_the_base_install_prints_then_writes(tiny_dirs, no_matplotlib, tmp_path, capsys):
    out = tmp_path / "prof"
    assert (
        main(
            [
                "profile",
                str(tiny_dirs["gpt2"]),
                "--batch",
                "1",
                "--seq",
                "8",
                "--steps",
                "2",
                "--warmup",
                "0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert text.index("hookscope profile:") < text.index(f"files in {out}:")
    assert "time_per_block.svg" in text and "report.html" in text and "time_per_block.png" not in text
    assert sorted(p.name for p in out.iterdir()) == [
        "report.html",
        "table.txt",
        "time_per_block.svg",
        "trace.json",
    ]


def test_an_unwritable_out_is_a_clear_error_before_any_work(tiny_dirs, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert (
        main(
            [
                "profile",
                str(tiny_dirs["gpt2"]),
                "--batch",
                "1",
                "--seq",
                "8",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--out",
                str(blocker / "prof"),
            ]
        )
        == 2
    )
    captured = capsys.readouterr()
    assert captured.err.startswith(f"hookscope: error: cannot write the profile into {blocker / 'prof'}")
    assert "Traceback" not in captured.err and captured.out == ""  # refused before profiling


def test_a_failed_write_keeps_the_printed_summary(tiny_dirs, tmp_path, capsys, monkeypatch):
    from hookscope.profiling import report as report_module

    def disk_full(profiler, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report_module, "write_trace", disk_full)
    assert (
        main(
            [
                "profile",
                str(tiny_dirs["gpt2"]),
                "--batch",
                "1",
                "--seq",
                "8",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--out",
                str(tmp_path / "prof"),
            ]
        )
        == 2
    )
    captured = capsys.readouterr()
    assert "hookscope profile:" in captured.out and "blocks.2" in captured.out  # shown before the files
    assert "cannot write the profile into" in captured.err and "No space left on device" in captured.err


def test_relative_spread():
    assert relative_spread([2.0]) is None
    assert relative_spread([2.0, 2.0, 2.0]) == 0.0
    assert relative_spread([1.0, 2.0, 3.0]) == 1.0  # (3 - 1) / 2
    assert relative_spread([1.0, 3.0]) == 1.0  # (3 - 1) / median 2


def test_uneven_steps_show_a_spread_per_row_and_a_warning():
    small = build_tiny("gpt2")  # steps of a few ms: a 200 ms sleep in every other call dominates at load 10
    ids = torch.randint(0, 512, (2, 16))
    calls = []

    def sometimes_slow(act, hook):  # a busy machine, made repeatable
        calls.append(1)
        if len(calls) % 2:
            time.sleep(0.2)

    report = hs.profile(
        small, ids, steps=4, warmup=0, hooks=lambda h: h.forward("blocks.0.resid_post", sometimes_slow)
    )
    assert len(report.step_times_s) == 4 and len(report.step_times_without_hooks_s) == 4
    assert report.step_time_s == min(report.step_times_s)
    assert max(report.step_times_s) - min(report.step_times_s) > 0.1
    rows = {(r.name, r.kind): r for r in report.rows}
    assert rows["blocks.0", "block"].spread > 1.0  # 200 ms in some profiled steps, ~0 in others
    assert rows["blocks.0.resid_post", "hook"].spread > 1.0
    summary = report.summary()
    assert "warning: the 4 timed steps took" in summary and "spread" in summary.split("\n")[1]
    header = next(line for line in summary.split("\n") if line.startswith("point "))
    assert "spread" in header.split()  # a column of the table
    steady = hs.profile(small, ids, steps=1, warmup=0)
    assert steady.step_spread is None and all(r.spread is None for r in steady.rows)
