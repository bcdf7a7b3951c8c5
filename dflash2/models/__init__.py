"""Draft models as pure math: DFlash v1, DFlash 2, the candidate selector, the spec, the registry."""

from dflash2.models.draft import DFlash2DraftModel, DFlashDraftModel
from dflash2.models.registry import (
    DRAFT_REGISTRY,
    build_draft,
    draft_class,
    draft_spec,
    expected_tensor_shapes,
    load_draft,
)
from dflash2.models.spec import DraftSpec
from dflash2.target.head import TargetHead

__all__ = [
    "DRAFT_REGISTRY",
    "DFlash2DraftModel",
    "DFlashDraftModel",
    "DraftSpec",
    "TargetHead",
    "build_draft",
    "draft_class",
    "draft_spec",
    "expected_tensor_shapes",
    "load_draft",
]
