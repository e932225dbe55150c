"""Errors a user can cause. Each message says what was wrong and what to do."""

from __future__ import annotations


class HookscopeError(Exception):
    """Base class of every error hookscope raises on purpose."""


class UnknownPointError(HookscopeError, KeyError):
    """A point name that the model does not have."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


class PointNotReachedError(HookscopeError):
    """A requested point never executed during the forward pass."""


class SelectionError(HookscopeError, ValueError):
    """A position / head / token-mask selection that does not fit the activation."""


class ModelLoadError(HookscopeError):
    """A model or tokenizer that could not be found or loaded."""


class StoreError(HookscopeError):
    """An activation store that is missing, corrupt, or does not match the command."""


class StaleIndexError(StoreError):
    """A saved top-k index (`hs.top`) built from another version of the store, or another SAE."""


class DataError(HookscopeError):
    """Input data that is missing, empty or malformed."""


class PointNotLoadedError(HookscopeError):
    """A point whose weights a `points=` load left on the meta device."""


class SAEError(HookscopeError):
    """An SAE directory or encoder file (`hs.top(..., sae=)`) that is missing, malformed or of an
    unsupported kind."""


class TensorParallelError(HookscopeError):
    """A tensor-parallel load or verb that cannot run as asked: no torchrun / process group, a `tp`
    that does not divide the heads or the processes, a family transformers has no plan for, a
    point kept sharded where the verb needs it whole."""


class EngineError(HookscopeError):
    """A serving engine (vLLM) or a request to one that hookscope cannot read exactly: an unsupported
    version, model class or setting, or a point its kernels never expose; the message names the fix."""


class EditFailed(EngineError):
    """An edit that raised inside a serving engine's forward (a value that does not fit the
    activation, found only when it ran): its requests ran on without their edits and the engine is
    still usable; the message names the edit, the point and the error."""


class EngineDied(EngineError):
    """A serving engine's core process ended during a call (a signal, the out-of-memory killer, a
    crash): the engine cannot be used again. `what` says which process ended and how; the message
    adds what to do next (make a new engine; an extraction resumes with the same command)."""

    def __init__(self, what: str, then: str):
        super().__init__(f"{what}; {then}")
        self.what = what
