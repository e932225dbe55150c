"""How an extraction run allocates host memory (loading/allocator.py), checked two ways outside our
code: glibc's own count of the bytes it has mapped (`mallinfo2`), and the minor page faults the
kernel counts to allocate and fill a large tensor (a fresh mapping faults every page in; memory
reused from malloc's heap faults none). Small allocations made between the large ones (as a run
makes them) can send glibc to fresh memory once or twice before the heap settles, so the faults
checked are the steady state's: several allocations after a few."""

from __future__ import annotations

import ctypes
import os
import resource

import pytest
import torch
from helpers import corpus_fixture

from hookscope.extract import ExtractConfig, InMemory, extract
from hookscope.extract.streamed import Streamed
from hookscope.loading import allocator
from hookscope.loading.allocator import keeping_freed_memory, prefer_huge_pages

SIZE = 64 * 2**20  # above glibc's largest mmap threshold (32 MB): mapped afresh by default
# outside a run: larger than any free space the runs here leave in the heap (a few SIZE regions), so
# that glibc's default shows, each allocation a fresh mapping
BIG = 4 * SIZE
corpus = corpus_fixture(40)
glibc = pytest.mark.skipif(
    allocator._glibc() is None or allocator._user_tuned(), reason="needs glibc and no MALLOC_* variables"
)


def faults(size: int = SIZE) -> int:
    """Minor page faults to allocate, fill and free one tensor of `size` bytes, with small
    allocations after it (Python objects, a C buffer) as a run makes between batches."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(size, dtype=torch.uint8)
    t.fill_(1)
    del t
    small = [bytearray(1000) for _ in range(100)] + [torch.empty(300_000, dtype=torch.uint8)]
    del small
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def steady(size: int = SIZE, warm: int = 5, counted: int = 6) -> int:
    """The faults of `counted` allocations of `size` bytes after `warm` of them."""
    for _ in range(warm):
        faults(size)
    return sum(faults(size) for _ in range(counted))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def mapped_on_its_own(size: int = BIG) -> bool:
    """Whether glibc gives a `size`-byte tensor a mapping of its own (its default above the mmap
    threshold), by glibc's count of its mapped bytes while the tensor is alive. The tensor is made
    larger than all the heap's free bytes: a free chunk left below a live one (which trimming cannot
    return) would otherwise serve it from the heap, as glibc looks there before mapping."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    size = max(size, libc.mallinfo2().fordblks + SIZE)  # never touched: costs no memory
    before = libc.mallinfo2().hblkhd
    t = torch.empty(size, dtype=torch.uint8)
    during = libc.mallinfo2().hblkhd
    del t
    return during - before >= size


def one_mapping() -> int:
    """The faults of one fresh SIZE-byte mapping (4 KB pages, or 2 MB ones with PyTorch's huge
    pages), measured on a BIG one."""
    return min(faults(BIG) for _ in range(2)) // (BIG // SIZE)


@glibc
def test_within_a_run_freed_large_tensors_are_reused_not_mapped_again():
    mapped = one_mapping()
    assert mapped >= 16 and mapped_on_its_own()
    with keeping_freed_memory() as active:
        assert active
        assert not mapped_on_its_own()
        assert steady() <= 2 * mapped  # six allocations, at most two mappings' faults
        with keeping_freed_memory():  # a nested run
            pass
        assert steady() <= 2 * mapped and not mapped_on_its_own()  # the inner run's end changed nothing
    assert mapped_on_its_own()  # glibc's defaults again


@glibc
def test_a_user_s_malloc_settings_are_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    with keeping_freed_memory() as active:
        assert not active
        assert mapped_on_its_own()
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    with keeping_freed_memory(enabled=False) as active:
        assert not active


@glibc
def test_an_extraction_keeps_freed_memory_but_not_under_max_memory(tiny_dirs, corpus, tmp_path, monkeypatch):
    mapped = one_mapping()
    seen: dict[str, object] = {}

    def measured(cls, name, measure):
        real = cls.run

        def run(self, batches, **options):
            seen[name] = measure()  # inside the run, as its batches allocate
            yield from real(self, batches, **options)

        monkeypatch.setattr(cls, "run", run)

    measured(InMemory, "in memory", lambda: (mapped_on_its_own(), steady()))
    measured(Streamed, "streamed", mapped_on_its_own)
    for name, overrides in (("streamed", {"max_memory": "600KB"}), ("in memory", {})):
        extract(
            ExtractConfig(
                out=str(tmp_path / name),
                model=str(tiny_dirs["gpt2"]),
                points=["blocks.1.resid_post"],
                data=str(corpus),
                context=32,
                batch_size=4,
                max_tokens=256,
                progress=False,
                **overrides,
            )
        )
    assert seen["streamed"] is True
    on_its_own, faulted = seen["in memory"]
    assert not on_its_own and faulted <= 2 * mapped  # by default: 6 mappings' faults
    assert mapped_on_its_own()  # the run's end gave glibc's defaults back


def test_extract_asks_for_huge_pages_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    prefer_huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")  # a user's opt-out stays
    prefer_huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"


# PyTorch's allocator settings, read back with its own getter (the string it last parsed)
settings_api = pytest.mark.skipif(
    not hasattr(torch._C, "_accelerator_getAllocatorSettings"),
    reason="this torch cannot read its allocator settings back",
)


def parsed_settings() -> dict[str, str]:
    text = torch._C._accelerator_getAllocatorSettings()
    return dict(item.split(":", 1) for item in text.split(",") if item)  # the last of a key wins


@pytest.fixture
def allocator_settings():
    """The test's settings put in place (in the process) and the process's put back after it."""
    before = torch._C._accelerator_getAllocatorSettings()
    yield torch._C._accelerator_setAllocatorSettings
    torch._C._accelerator_setAllocatorSettings(before or "pinned_use_cuda_host_register:False")


@settings_api
def test_pinned_memory_is_registered_inside_and_the_user_s_settings_come_back(
    allocator_settings, monkeypatch
):
    monkeypatch.setenv(allocator.REGISTER_ENV, "1")  # asked for (off by default)
    monkeypatch.setattr(allocator.os, "cpu_count", lambda: 6)
    allocator_settings("max_split_size_mb:512,garbage_collection_threshold:0.6")
    with allocator.registering_pinned_memory() as on:
        inside = parsed_settings()
        with allocator.registering_pinned_memory() as nested:  # a second run meanwhile
            pass
        still = parsed_settings()
    after = parsed_settings()
    assert on and nested
    assert inside["pinned_use_cuda_host_register"] == "True"
    assert inside["pinned_num_register_threads"] == "4"  # of 6 CPUs: PyTorch takes powers of two
    # PyTorch resets max_split_size and the collection threshold at every change: both kept
    for settings in (inside, still, after):
        assert settings["max_split_size_mb"] == "512" and settings["garbage_collection_threshold"] == "0.6"
    assert still["pinned_use_cuda_host_register"] == "True"  # the first run's still going
    assert after["pinned_use_cuda_host_register"] == "False" and after["pinned_num_register_threads"] == "1"


@settings_api
@pytest.mark.parametrize(
    "user", ["pinned_use_cuda_host_register:False", "pinned_use_cuda_host_register:True"]
)
def test_a_user_s_choice_of_pinning_is_left_alone(allocator_settings, monkeypatch, user):
    monkeypatch.setenv(allocator.REGISTER_ENV, "1")  # asked for, yet the user's own setting wins
    allocator_settings(user)
    with allocator.registering_pinned_memory() as on:
        assert not on and torch._C._accelerator_getAllocatorSettings() == user
    assert torch._C._accelerator_getAllocatorSettings() == user


@settings_api
def test_pinned_memory_is_left_alone_when_not_asked(allocator_settings, monkeypatch):
    allocator_settings("max_split_size_mb:256")
    with allocator.registering_pinned_memory(enabled=False) as on:  # a run on the CPU
        assert not on and torch._C._accelerator_getAllocatorSettings() == "max_split_size_mb:256"
    for asked in (None, "0"):  # off by default, until an extraction on a GPU has measured it
        if asked is None:
            monkeypatch.delenv(allocator.REGISTER_ENV, raising=False)
        else:
            monkeypatch.setenv(allocator.REGISTER_ENV, asked)
        with allocator.registering_pinned_memory() as on:
            assert not on and torch._C._accelerator_getAllocatorSettings() == "max_split_size_mb:256"


@settings_api
def test_a_cpu_extraction_leaves_the_allocator_settings_alone(
    allocator_settings, tiny_dirs, corpus, tmp_path, monkeypatch
):
    changes = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", changes.append)
    extract(
        ExtractConfig(
            out=str(tmp_path / "s"),
            model=str(tiny_dirs["gpt2"]),
            points=["blocks.1.resid_post"],
            data=str(corpus),
            context=32,
            batch_size=4,
            max_tokens=128,
            progress=False,
        )
    )
    assert changes == []
