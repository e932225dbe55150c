"""The kill sweep: an extraction SIGKILLed at seeded points spread over a run, then the same command
again, must give exactly the store an uninterrupted run gives: the same shards byte for byte, no row
lost, none duplicated (counted by each row's origin).

A handful of points run by default; `pytest --full` runs the whole sweep (>= 20 points, every kill
site of tests/kit/kill_driver.py, plus SIGKILLs from outside at random times and a second crash during
the resume). The runs are children of a fork server, so a point costs one extraction, not one
Python start-up.
Every point runs for every source (tests/kit/source_kit.py: text, text + generated continuation,
images), but for the sites a source does not have (images have no tokenizer).
"""

from __future__ import annotations

import math
import random
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
from fault_log import record
from faultkit import compare_stores
from forkserver import ForkServer
from source_kit import SOURCES, PerSource, make_case

from hookscope.store import open_store

SEED = 2026
RUN = "kill_driver:run_extract"
# site -> (what the table calls it, points in the full sweep); the first point of the sites in
# DEFAULT runs without --full
SITES = {
    "save": ("inside a shard write (half-written .tmp left)", 4),
    "rename": ("around a shard's rename into place", 4),
    "manifest-replace": ("around the manifest replace", 4),
    "manifest-write": ("inside the manifest write (half-written .tmp left)", 3),
    "journal-write": ("inside a shard's commit record (its journal line half-written)", 3),
    "fsync": ("inside an fsync (shard, manifest or directory)", 3),
    "batch": ("as a batch is queued (the writer thread mid-shard)", 3),
    "forward": ("in the middle of a forward pass", 3),
    "tokenize": ("inside the tokenizer", 2),
    "timed": ("from outside, at a random moment", 4),
    # the process dies of SIGXFSZ there: a file-size limit set just before the write
    "library-save": ("inside safetensors' own shard write (its temporary file left)", 2),
}
DEFAULT = (
    "save",
    "rename",
    "manifest-replace",
    "manifest-write",
    "journal-write",
    "fsync",
    "batch",
    "forward",
    "library-save",
)
# the sites every source runs by default: where the sources differ (the batches they make, the
# forward); the writer's sites are one code path whatever made the rows: text runs them by default,
# the other sources with --full
EVERY_SOURCE = ("batch", "forward")
# a crash, then a second crash early in the resume, then the resume that finishes
TWICE = [("batch", "save:1"), ("fsync", "rename:1:after"), ("forward", "manifest-write:2")]


@dataclass(frozen=True)
class Kill:
    site: str
    fraction: float  # how far into the run: the event ceil(fraction * count) of the site
    when: str | None = None  # before / after, for renames and replaces

    def kill_at(self, counts: dict[str, int]) -> str:
        n = max(1, math.ceil(self.fraction * counts[self.site]))
        return f"{self.site}:{n}" + (f":{self.when}" if self.when else "")

    def __str__(self) -> str:
        return f"{self.site}@{self.fraction:.2f}" + (f":{self.when}" if self.when else "")


def _plan() -> list:
    rng = random.Random(SEED)
    points = []
    for site, (_, n) in SITES.items():
        for i in range(n):
            when = rng.choice(["before", "after"]) if site in ("rename", "manifest-replace") else None
            fraction = rng.uniform(0.05, 0.9) if site == "timed" else rng.random()
            marks = () if i == 0 and site in DEFAULT else (pytest.mark.full,)
            kill = Kill(site, round(fraction, 4), when)
            points.append(pytest.param((kill,), id=str(kill), marks=marks))
    for site, again in TWICE:
        kill = Kill(site, round(rng.random(), 4))
        points.append(pytest.param((kill, again), id=f"{kill}+{again}", marks=pytest.mark.full))
    return points


def _for_every_source(points: list) -> list:
    """Each point for each source that has its sites; a writer's site for a source besides text
    with --full."""
    return [
        pytest.param(source, *p.values, id=f"{source}-{p.id}", marks=_marks(source, p))
        for source in SOURCES
        for p in points
        if not (source == "images" and any("tokenize" in str(k) for k in p.values[0]))
    ]


def _marks(source: str, point) -> tuple:
    first = point.values[0][0]
    if source != "text" and first.site not in EVERY_SOURCE:
        return (pytest.mark.full,)
    return point.marks


POINTS = _plan()


@dataclass
class Reference:
    config: dict
    out: Path
    counts: dict[str, int]
    seconds: float


@pytest.fixture(scope="module")
def server(tiny_dirs) -> ForkServer:
    server = ForkServer.shared()
    server.warm("faultkit:load_model", path=str(tiny_dirs["gpt2"]))
    return server


@pytest.fixture(scope="module")
def references(tiny_dirs, server, tmp_path_factory) -> dict[str, Reference]:
    """Each source's uninterrupted run, counting every kill site's events (to place the kills);
    made when a test first asks for it."""

    def make(source: str) -> Reference:
        root = tmp_path_factory.mktemp(f"sweep-{source}")
        # about 40 batches, 2 per shard
        shape = {"batch_size": 4, "shard_rows": 130} if source == "images" else {"shard_rows": 200}
        case = make_case(
            source,
            tiny_dirs,
            root,
            docs=60,
            images=160,
            dtype="bfloat16",
            points=["blocks.1.resid_post", "blocks.0.attn.z"],
            **shape,
        )
        config = case.config(root / "ref")
        reply = server.call(RUN, config=config, kill_at="count")
        assert reply.status == 0, reply.log[-3000:]
        counts = reply.result["counts"]
        assert counts["save"] == counts["rename"] == open_store(root / "ref").num_shards >= 20
        return Reference(config, root / "ref", counts, reply.seconds)

    return PerSource(make)


def test_the_sweep_covers_every_site_and_the_run():
    kills = [p.values[0][0] for p in POINTS]
    default = [p.values[0][0] for p in POINTS if not p.marks]
    assert len(kills) >= 20 and {k.site for k in kills} == set(SITES)  # shard writes, manifest replaces...
    assert sorted(k.site for k in default) == sorted(DEFAULT)
    fractions = sorted(k.fraction for k in kills if k.site != "timed")
    assert fractions[0] < 0.2 and fractions[-1] > 0.8  # early and late in the run
    by_source = _for_every_source(POINTS)
    for source in SOURCES:  # by default: text every site of DEFAULT, the others where they differ
        here = [p.values[1][0].site for p in by_source if p.values[0] == source and not p.marks]
        assert sorted(here) == sorted(DEFAULT if source == "text" else EVERY_SOURCE), source
    assert {p.values[0] for p in by_source} == set(SOURCES)  # every point for every source...
    assert len(by_source) == len(POINTS) * len(SOURCES) - sum(  # ...but images' tokenizer sites
        "tokenize" in str(p.values[0][0]) for p in POINTS
    )


@pytest.mark.parametrize(("source", "kills"), _for_every_source(POINTS))
@pytest.mark.slow
def test_sigkill_then_resume_equals_an_uninterrupted_run(source, kills, references, server, tmp_path):
    reference = references[source]
    out = tmp_path / "store"
    config = {**reference.config, "out": str(out)}
    landed = 0
    for kill in kills:  # a Kill, or a fixed kill point (a string) in the resume
        timed = isinstance(kill, Kill) and kill.site == "timed"
        if timed:
            reply = server.call(RUN, config=config, kill_after=kill.fraction * reference.seconds)
        else:
            at = kill if isinstance(kill, str) else kill.kill_at(reference.counts)
            reply = server.call(RUN, config=config, kill_at=at)
        # it died where it was told to (a timed kill may come after the run has finished)
        died = -signal.SIGXFSZ if isinstance(kill, Kill) and kill.site == "library-save" else -signal.SIGKILL
        assert reply.status in ((died, 0) if timed else (died,)), reply.log[-3000:]
        landed += reply.status == died
        if (out / "manifest.json").exists():  # at any moment of a crash the store is consistent
            open_store(out, verify=True)
    committed = open_store(out).manifest.done_batches() if (out / "manifest.json").exists() else set()

    resumed = server.call(RUN, config=config)
    assert resumed.status == 0, resumed.log[-3000:]
    diff = compare_stores(out, reference.out)
    first = kills[0]
    fault = "twice: again early in the resume" if len(kills) > 1 else SITES[first.site][0]
    fault += "" if source == "text" else f" ({source})"
    ok = (
        diff["rows_lost"] == diff["rows_duplicated"] == 0
        and diff["same_values"]
        and diff["same_files"]
        and resumed.result["summary"]["batches_skipped"] == len(committed)
    )
    if landed:  # a timed kill can come after the end: then nothing was tried
        record(
            "kill",
            fault,
            survived=int(ok),
            rows_checked=diff["rows"],
            rows_lost=diff["rows_lost"],
            rows_duplicated=diff["rows_duplicated"],
        )
    assert resumed.result["summary"]["batches_skipped"] == len(committed)  # exactly the committed batches
    assert diff == {**diff, "rows_lost": 0, "rows_duplicated": 0, "same_values": True, "same_files": True}
