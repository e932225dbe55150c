"""How an extraction run allocates host memory (extract/host_memory.py), checked by what the kernel
counts: the minor page faults the process takes to allocate and fill a large tensor. A fresh
mapping faults every page in; memory reused from malloc's heap faults none."""

from __future__ import annotations

import os
import resource

import pytest
import torch
from helpers import corpus_fixture

from hookscope.extract import ExtractConfig, InMemory, extract, host_memory
from hookscope.extract.host_memory import prefer_huge_pages, reused_heap
from hookscope.extract.streamed import Streamed

SIZE = 64 * 2**20  # above glibc's largest mmap threshold (32 MB): mapped afresh by default
corpus = corpus_fixture(40)
glibc = pytest.mark.skipif(host_memory._glibc() is None, reason="needs glibc and no MALLOC_* variables")


def faults() -> int:
    """Minor page faults to allocate, fill and free one SIZE-byte tensor."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(SIZE, dtype=torch.uint8)
    t.fill_(1)
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@glibc
def test_within_a_run_a_freed_large_tensor_is_reused_not_mapped_again():
    faults()
    mapped = faults()
    assert mapped >= 16  # every page (4 KB or 2 MB) faulted in again: the default, a fresh mmap
    with reused_heap() as active:
        assert active
        faults()  # the heap grows once
        assert faults() <= mapped // 4
        with reused_heap():  # a nested run
            pass
        assert faults() <= mapped // 4  # the inner run's end left the outer one's settings
    assert faults() >= mapped // 2  # glibc's defaults again: mapped afresh


@glibc
def test_a_user_s_malloc_settings_are_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    with reused_heap() as active:
        assert not active
        faults()
        assert faults() >= 16
    with reused_heap(enabled=False) as active:
        assert not active


@glibc
def test_an_extraction_reuses_the_heap_but_not_under_max_memory(tiny_dirs, corpus, tmp_path, monkeypatch):
    seen: dict[str, int] = {}

    def measured(cls, name):
        real = cls.run

        def run(self, batches):
            faults()
            seen[name] = faults()
            yield from real(self, batches)

        monkeypatch.setattr(cls, "run", run)

    measured(InMemory, "in memory")
    measured(Streamed, "streamed")
    for name, overrides in (("in memory", {}), ("streamed", {"max_memory": "600KB"})):
        extract(ExtractConfig(out=str(tmp_path / name), model=str(tiny_dirs["gpt2"]),
                              points=["blocks.1.resid_post"], data=str(corpus), context=32, batch_size=4,
                              max_tokens=256, progress=False, **overrides))
    assert seen["in memory"] <= 8
    assert seen["streamed"] >= 16
    assert faults() >= 16  # the run's end gave the defaults back


def test_extract_asks_for_huge_pages_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    prefer_huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")  # a user's opt-out stays
    prefer_huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
