"""Architecture name -> draft class; build a draft from a config, load one from an export."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash2.models.config import check_draft_config, load_config_dict, to_qwen3_config
from dflash2.models.draft import DFlash2DraftModel, DFlashDraftModel
from dflash2.target.files import SINGLE_FILE

DRAFT_REGISTRY: dict[str, type[DFlashDraftModel]] = {
    "DFlashDraftModel": DFlashDraftModel,
    "DFlash2DraftModel": DFlash2DraftModel,
}


def draft_class(architecture: str) -> type[DFlashDraftModel]:
    if architecture not in DRAFT_REGISTRY:
        raise ValueError(
            f"unknown draft architecture {architecture!r}; known: {', '.join(sorted(DRAFT_REGISTRY))}"
        )
    return DRAFT_REGISTRY[architecture]


def build_draft(
    config: str | Path | dict, *, target_config=None, tokenizer=None, source: str | Path | None = None
) -> DFlashDraftModel:
    """Build a freshly initialised draft from a config.json path, a directory, or an HF-form dict.

    The config is normalised (DFlash fields nested in `dflash_config`) and validated first —
    against the target's config and tokenizer when given — with every problem in one ValueError.
    """
    source = source or (None if isinstance(config, dict) else config)
    cfg = check_draft_config(
        load_config_dict(config), target_config=target_config, tokenizer=tokenizer, source=source
    )
    architectures = cfg.get("architectures") or ["DFlashDraftModel"]
    if len(architectures) != 1:
        raise ValueError(f"architectures must name exactly one draft class, got {architectures}")
    return draft_class(architectures[0])(to_qwen3_config(cfg))


def load_draft(export_dir: str | Path, dtype: torch.dtype | None = None) -> DFlashDraftModel:
    """Load an export (config.json + model.safetensors). Missing, unexpected or misshapen tensors
    are errors: the servers would silently drop or zero them."""
    export_dir = Path(export_dir)
    draft = build_draft(export_dir)
    state = load_file(str(export_dir / SINGLE_FILE))
    state = {k.removeprefix("model."): v for k, v in state.items()}
    expected = draft.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{export_dir}: missing tensors {missing}; unexpected tensors {unexpected}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"{export_dir}: tensor {name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(expected[name].shape)}"
            )
    draft.load_state_dict(state)
    if dtype is not None:
        draft = draft.to(dtype)
    return draft.eval()
