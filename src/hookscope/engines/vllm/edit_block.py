"""`hs.edit` on a vLLM engine: edits on every request the engine runs while a `with` block is open.

    with hs.edit(llm, hs.steer("blocks.1.resid_post", v), hs.ablate("blocks.0.attn.z", heads=[1])):
        hs.generate(llm, prompts, max_new_tokens=8)   # steered and ablated
        llm.generate(prompts, params)                 # the engine's own calls too

The block's edits are described as plain data (edits.py) and registered in every worker under the
block's id, on the workers' one edit path (`RequestEdits.open_block`): every token (prefill and
decode) of every request, whether hookscope tagged it or not. Leaving the block, also on an error,
removes them from every worker.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Sequence
from typing import Any

from ...errors import EngineError
from . import check_engine, liveness, refuse_prefix_caching
from .edits import check_for_every_request, describe
from .worker import raise_refusals


class EditBlock:
    """A `with` block that applies `edits` to every request the engine runs inside it: what
    `hs.edit(llm, *edits)` returns. Checked when it is made, before any worker is called."""

    def __init__(self, engine, edits: Sequence[Any]):
        self.architecture, arch = check_engine(engine)
        refuse_prefix_caching(engine.llm_engine.vllm_config, "hs.edit")
        self.engine, self.edits = engine, tuple(edits)
        self.described = [describe(edit, arch) for edit in self.edits]
        for edit in self.edits:
            check_for_every_request(edit)
        self.block: str | None = None

    def __enter__(self) -> EditBlock:
        if self.block is not None:
            raise EngineError("this hs.edit block is open already: make another with hs.edit(llm, ...)")
        self.block = uuid.uuid4().hex
        liveness.watch(self.engine)  # a dead engine core ends the calls instead of leaving them waiting
        try:
            raise_refusals(
                self.engine.collective_rpc(
                    "hookscope_open_edits", args=(self.architecture, self.block, self.described)
                )
            )
        except BaseException:  # a rank that refused, or an interrupt: no rank keeps the block
            self._close(quiet=True)
            raise
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self._close(quiet=kind is not None)

    def _close(self, quiet: bool) -> None:
        """The block's edits removed from every worker; `quiet`: an error of the block's body is
        already on its way, and one here would hide it."""
        block, self.block = self.block, None
        if block is None or liveness.dead(self.engine):  # (a dead engine holds no edits)
            return
        with contextlib.suppress(Exception) if quiet else contextlib.nullcontext():
            # the block's edits that raised in a forward (their requests ran on unedited): EditFailed
            raise_refusals(self.engine.collective_rpc("hookscope_close_edits", args=(block,)))
