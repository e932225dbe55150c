"""Extraction: any source (hookscope.sources) -> capture -> sharded store, through one loop
(loop.py) and one executor seam (`InMemory`; see its docstring for what an executor gets and
must do). `hookscope extract` and `hs.extract` both call `extract(ExtractConfig(...))`."""

from ..extract_config import DEFAULT_DATA, DEFAULT_POINT, ExtractConfig, validate_config
from .loop import InMemory, extract
from .outcome import ExtractInterrupted, ExtractSummary

__all__ = [
    "DEFAULT_DATA",
    "DEFAULT_POINT",
    "ExtractConfig",
    "ExtractInterrupted",
    "ExtractSummary",
    "InMemory",
    "extract",
    "validate_config",
]
