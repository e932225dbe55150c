"""hookscope: look inside PyTorch models.

    import hookscope as hs
    model, tok, arch = hs.load()                          # bundled all-MiniLM-L6-v2, offline
    hs.points(model)                                      # every hook point, by canonical name
    acts = hs.collect(model, ids, "blocks.3.resid_post")  # stops after block 3
    g = hs.grads(model, ids, "blocks.*.resid_post", loss_fn)
    with hs.edit(model, hs.ablate("blocks.2.attn.z", heads=[0])):
        out = model(ids)
"""

from .arch import Arch, PointSpec, arch_of
from .capture import Capture, PointInfo, capture, collect, grads, points
from .edit import ablate, edit, patch, steer
from .errors import (
    DataError,
    HookscopeError,
    ModelLoadError,
    PointNotReachedError,
    SelectionError,
    StoreError,
    UnknownPointError,
)
from .generate import Generation, generate
from .hooks import Hook, Hooks, add_hook, hooks
from .models import Loaded, load
from .profiling import ProfileReport, profile
from .store import open_store

__version__ = "0.1.0"

__all__ = [
    "Arch", "PointSpec", "arch_of", "Capture", "PointInfo", "capture", "collect", "grads", "points",
    "ablate", "edit", "patch", "steer", "Hook", "Hooks", "add_hook", "hooks", "Loaded", "load",
    "HookscopeError", "UnknownPointError", "PointNotReachedError", "SelectionError", "ModelLoadError",
    "StoreError", "DataError", "profile", "ProfileReport", "open_store",
]
__all__ += ["generate", "Generation"]
