"""Captures and edits while a model generates, aligned to token positions.

    gen = hs.generate(model, inputs, points="blocks.1.resid_post", max_new_tokens=8)
    gen.sequences                       # [batch, T]: the prompt (left-padded) and the new tokens
    gen["blocks.1.resid_post"]          # [batch, T, d]: entry [b, p] was computed for sequences[b, p]
    gen.mask                            # [batch, T]: False on padding and after a row's EOS

With the KV cache on, `generate` runs the model once on the whole prompt and then once per new
token on that token alone, so a point's hook sees chunks of positions; `steps.py` knows which
positions a pass covers, and `keep.py` files each chunk at those positions, keeping only what
the `positions=` selection can still need (`Selection.at(offset)` reads positions as counted
from the sequence's start). `generate` never runs the model on the token it samples last; the
backend's `complete` runs it, up to the deepest captured point (`StepCapture.run_last`).

Heads, dtype and device selections are those of `hs.capture`, which does the hooking (so the
compile policy and early-copy rules are the capture's own); positions are sequence positions
(0 is the first prompt column, -1 the last generated one) with `hs.collect`'s shapes: an int or
"last" drops the position dim, a slice or list keeps it, a [batch] tensor picks one per row.

Edits (`hs.steer`, `hs.ablate`, `hs.patch`) apply to the prompt, the generated tokens or both
(`edit_on=`); an edit's own `positions=` are sequence positions too (`Edit.step`), and a patch's
source is read at the positions the current step covers.

Per generated token hs.generate adds what a hand-written hook would: a captured point's copy into
a buffer allocated once for the whole sequence (every position kept, on the model's device), a
steer's one add; no read of a tensor's value on the host (on a GPU, a wait for the device), no cast,
no allocation, no per-pass hook unless an edit's decision varies by position
(tests/generate/test_generate_per_token.py pins this).

Rooms: `driver.py` (checks, then one generate with everything attached), `steps.py` (following
the passes), `keep.py` (captured positions), `edits.py` (edits per step), `result.py`
(`Generation`), one backend per kind of model (`hf.py`, `lens.py` for TransformerLens 3,
`bridge.py` for the TransformerLens 4 bridge; see `backend.py`). `hookscope extract --generate N`
turns a `Generation` into store rows in `sources/generated.py`.
"""

from .driver import generate
from .edits import EDIT_ON
from .result import Generation

__all__ = ["EDIT_ON", "Generation", "generate"]
