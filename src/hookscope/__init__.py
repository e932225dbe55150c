"""hookscope: look inside PyTorch models.

    import hookscope as hs
    model, tok, arch = hs.load()                          # bundled all-MiniLM-L6-v2, offline
    hs.points(model)                                      # every hook point, by canonical name
    acts = hs.collect(model, ids, "blocks.3.resid_post")  # stops after block 3
    g = hs.grads(model, ids, "blocks.*.resid_post", loss_fn)
    with hs.edit(model, hs.ablate("blocks.2.attn.z", heads=[0])):
        out = model(ids)
    hs.compile_model(model, "blocks")                     # or hs.load(..., compile_policy="blocks")

This file is the public surface: the verbs, every type they hand back, and the errors, each
imported here and listed in `__all__`, one name per concept. The extension API lives in its
submodules and is documented there: the family tables (`hookscope.arch`: `arch_of`, `PointSpec`;
`Arch`, a model's table, is public since `hs.load` hands it back), each edit's class
(`hookscope.edit`, `hookscope.experts`: every edit verb returns an `Edit`), the selection a capture
or an edit applies (`hookscope.selection.Selection`: the verbs take its options by keyword), raw
hooks (`hookscope.hooks`: `Hook`, `add_hook`) and the compile layer's counters and caches
(`hookscope.compiling`). Rooms and their one-way imports: docs/architecture.md.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from .arch import Arch
from .capture import Capture, PointDict, PointInfo
from .compiling import compile_model
from .edit import Edit, Edits, ablate, patch, steer

# registers its table change (arch.TABLE_CHANGES): a tensor-parallel model's sharded points gathered;
# extension API: `from hookscope.engines import tensor_parallel` (layout, sharded)
from .engines import tensor_parallel as _tensor_parallel  # noqa: F401
from .errors import (
    DataError,
    EditFailed,
    EngineDied,
    EngineError,
    HookscopeError,
    ModelLoadError,
    PointNotLoadedError,
    PointNotReachedError,
    SAEError,
    SelectionError,
    StaleIndexError,
    StoreError,
    TensorParallelError,
    UnknownPointError,
)
from .experts import ablate_expert, force_route
from .export import SaelensExport, export_hf, export_saelens
from .extract import ExtractConfig, ExtractInterrupted, ExtractSummary, extract
from .generate import Generation
from .hooks import Hooks, hooks
from .loading import Loaded, load
from .profiling import ProfileReport, profile
from .store import ActivationDataset, Column, DatasetOptions, Manifest, PointStats, Store, open_store
from .top import TopResult, top
from .verbs import capture, collect, edit, generate, grads, points

try:
    __version__ = _version("hookscope")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    # models and their points
    "load",
    "Loaded",
    "Arch",
    "points",
    "PointInfo",
    # hooks (a `with hooks(model) as h` block; raw `Hook` / `add_hook` are in hookscope.hooks)
    "hooks",
    "Hooks",
    # capture (collect stops early; a `with capture(...)` block runs the whole model)
    "collect",
    "capture",
    "Capture",
    "grads",
    "PointDict",
    # generation (captures and edits aligned to token positions)
    "generate",
    "Generation",
    # edits
    "edit",
    "Edits",
    "Edit",
    "ablate",
    "patch",
    "steer",
    # extraction to a store, and the store read back
    "extract",
    "ExtractConfig",
    "ExtractSummary",
    "ExtractInterrupted",
    "open_store",
    "Store",
    "ActivationDataset",
    "DatasetOptions",
    "Manifest",
    "Column",
    "PointStats",
    # a store's top-activating contexts, and a store as other trainers' inputs
    "top",
    "TopResult",
    "export_saelens",
    "SaelensExport",
    "export_hf",
    # profiling and the compile policy
    "profile",
    "ProfileReport",
    "compile_model",
    # errors
    "HookscopeError",
    "UnknownPointError",
    "PointNotReachedError",
    "PointNotLoadedError",
    "SelectionError",
    "ModelLoadError",
    "StoreError",
    "StaleIndexError",
    "DataError",
    "EngineError",
    "EngineDied",
    "EditFailed",
    "SAEError",
    "TensorParallelError",
    # mixture-of-experts routing edits
    "ablate_expert",
    "force_route",
    "__version__",
]
