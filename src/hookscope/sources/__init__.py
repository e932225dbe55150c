"""What extraction reads: one file per kind of source, each following `base.Source` (its settings
for the manifest and fingerprint, its batches, the rows of a batch). `source_for(cfg)` picks the
kind; a new kind is one new file here, added to `KINDS` (see base.py). The text readers are public
here too: `iter_documents` (documents.py), `pack` / `batches` (packing.py), `source_fingerprint`."""

from __future__ import annotations

from ..extract_config import ExtractConfig
from .base import Batches, Rows, Source
from .documents import BUILTIN_STDLIB, iter_documents
from .fingerprint import source_fingerprint
from .generated import GeneratedSource
from .images import ImageSource
from .packing import PackPolicy, batches, pack, pack_policy
from .text import DEFAULT_CONTEXT, TextSource

# asked in this order: images claim an image folder, generation claims --generate, text the rest
KINDS: tuple[type[Source], ...] = (ImageSource, GeneratedSource, TextSource)


def source_for(cfg: ExtractConfig) -> type[Source]:
    """The kind of source that reads `cfg.data`, its options checked (nothing loaded yet)."""
    kind = next(k for k in KINDS if k.claims(cfg))
    kind.check_config(cfg)
    return kind


__all__ = [
    "BUILTIN_STDLIB",
    "Batches",
    "DEFAULT_CONTEXT",
    "KINDS",
    "GeneratedSource",
    "ImageSource",
    "PackPolicy",
    "Rows",
    "Source",
    "TextSource",
    "batches",
    "iter_documents",
    "pack",
    "pack_policy",
    "source_fingerprint",
    "source_for",
]
