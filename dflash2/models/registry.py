"""Architecture name -> draft class; a draft's spec and expected tensors; build a draft from a
config, load one from an export."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash2.models.config import (
    ARCHITECTURES,
    REQUIRED_BACKBONE_KEYS,
    architecture_of,
    check_draft_config,
    draft_value,
    load_config_dict,
    normalize_draft_config,
    to_qwen3_config,
    validate_draft_config,
)
from dflash2.models.draft import DFlash2DraftModel, DFlashDraftModel
from dflash2.models.spec import DraftSpec
from dflash2.target.files import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, load_weights, weight_files

DRAFT_REGISTRY: dict[str, type[DFlashDraftModel]] = {
    cls.architecture.name: cls for cls in (DFlashDraftModel, DFlash2DraftModel)
}
assert DRAFT_REGISTRY.keys() == ARCHITECTURES.keys(), "one draft class per architecture of models.config"


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
    return draft_class(architecture_of(cfg).name)(to_qwen3_config(cfg))


def draft_spec(config: str | Path | dict) -> DraftSpec:
    """The spec of a draft config (a config.json path, a directory, or a dict), as the draft built
    from it holds it (normalised, not validated)."""
    qwen3_config = to_qwen3_config(load_config_dict(config))
    return DraftSpec.from_config(qwen3_config, architecture_of(qwen3_config))


def expected_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor an export must hold, name -> shape (contract section 4, names without ``model.``):
    the state dict of the draft `cfg` builds, built on the meta device (no memory, no init).
    A ValueError names a field the shapes cannot be derived without."""
    cfg = normalize_draft_config(cfg)
    arch = architecture_of(cfg)
    for key, value in [(key, cfg.get(key)) for key in REQUIRED_BACKBONE_KEYS] + [
        (f"dflash_config.{key}", draft_value(cfg, key)) for key in arch.fields
    ]:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key}={value!r}: must be a positive int")
    layer_ids = draft_value(cfg, "target_layer_ids")
    if not isinstance(layer_ids, list) or not layer_ids:
        raise ValueError(f"dflash_config.target_layer_ids={layer_ids!r}: must be a non-empty list")
    with torch.device("meta"):
        draft = draft_class(arch.name)(to_qwen3_config(cfg))
    return {name: tuple(tensor.shape) for name, tensor in draft.state_dict().items()}


def check_export_config(export_dir: str | Path) -> None:
    """An export's config.json, read as the servers read it (not normalised into another model
    first): a ValueError naming every problem, before any weight loads."""
    export_dir = Path(export_dir)
    if export_dir.is_dir() and not (export_dir / CONFIG_FILE).is_file():
        inside = export_dir / "export"  # a training run's directory: its export is there
        hint = (
            f"; this looks like a training run: its export is {inside}"
            if (inside / CONFIG_FILE).is_file()
            else ""
        )
        raise ValueError(
            f"{export_dir}: no {CONFIG_FILE}, so not an export (a training checkpoint is exported with "
            f"`python -m dflash2.export <checkpoint> <out>`){hint}"
        )
    problems = validate_draft_config(load_config_dict(export_dir), source=export_dir / "config.json")
    if problems:  # read as it is, as the servers read it: not normalised into another model first
        raise ValueError(
            f"{export_dir}: the servers would not load this draft as trained: "
            + "; ".join(problems)
            + f" (`python -m dflash2.export {export_dir} <out>` rewrites the layout of its config.json)"
        )


def load_draft(export_dir: str | Path, dtype: torch.dtype | None = None) -> DFlashDraftModel:
    """Load an export (config.json + model.safetensors). Missing, unexpected or misshapen tensors
    are errors: the servers would silently drop or zero them."""
    export_dir = Path(export_dir)
    check_export_config(export_dir)
    draft = build_draft(export_dir)
    files = weight_files(export_dir)
    if not files:
        raise ValueError(
            f"{export_dir}: neither {SINGLE_FILE} nor {INDEX_FILE}; an export holds its weights there"
        )
    state = load_weights(files)
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
