"""dflash2: train DFlash and DFlash 2 speculative-decoding drafts, and export them for serving.

The public names below are loaded on first use (PEP 562), so `import dflash2` (or `import
dflash2.models`) pulls in nothing else of the package. README.md, section "Python API", shows them
at work.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {  # name -> the module that defines it
    "RunConfig": "dflash2.config",
    "load_run_config": "dflash2.config",
    "DraftSpec": "dflash2.models",
    "build_draft": "dflash2.models",
    "draft_spec": "dflash2.models",
    "load_draft": "dflash2.models",
    "TargetHead": "dflash2.models",
    "LocalBackend": "dflash2.distributed",
    "build_backend": "dflash2.distributed",
    "RunPlan": "dflash2.run_plan",
    "resolve_run": "dflash2.run_plan",
    "Setup": "dflash2.train",
    "build_setup": "dflash2.train",
    "train_step": "dflash2.train",
    "fit": "dflash2.train",
    "ObjectiveConfig": "dflash2.objective",
    "compute_objective": "dflash2.objective",
    "total_loss": "dflash2.objective",
    "export_draft": "dflash2.export",
    "check_export": "dflash2.export",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'dflash2' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
