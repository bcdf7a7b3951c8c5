"""`DraftSpec`: the typed, frozen description of a draft, parsed once from its Hugging Face config.

A draft config reaches the code as a raw dict (what servers read, checked by
`models.config.validate_draft_config`) and as the `Qwen3Config` a model is built from. What the
draft *is* (its architecture's parts, block size, mask id, target layers, attention pattern, logit
transforms) is read from either one here, once, and nowhere else; the model keeps it as `draft.spec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash2.models.config import (
    CONV_KEYS,
    LOGIT_TRANSFORM_KEYS,
    SELECTOR_KEYS,
    Architecture,
    architecture_of,
    config_field,
    default_target_layer_ids,
    draft_value,
)

_MISSING = object()


@dataclass(frozen=True)
class ConvSpec:
    """The grouped dynamic conv around every sublayer (DFlash 2)."""

    kernel_size: int
    group_size: int


@dataclass(frozen=True)
class SelectorSpec:
    """The candidate selector: codebook rank and candidates per slot (DFlash 2)."""

    rank: int
    top_k: int


@dataclass(frozen=True)
class LogitTransform:
    """Unary logit transforms (contract section 2.2): multiply, then softcap (None: no cap)."""

    multiplier: float = 1.0
    softcap: float | None = None

    @classmethod
    def from_values(cls, multiplier: Any, softcap: Any) -> LogitTransform:
        """As the servers read them: a missing or null multiplier is 1, a missing, null or
        non-positive final_logit_softcapping means no cap."""
        cap = float(softcap) if softcap is not None and float(softcap) > 0 else None
        return cls(float(multiplier or 1.0), cap)


@dataclass(frozen=True)
class DraftSpec:
    """What a draft is. `conv`, `selector`: None when the architecture has none. `logit_transform`:
    None when the config writes no transform and its architecture fills none (a v1 config without
    `output_multiplier` and `final_logit_softcapping`): the logits are used as they are."""

    architecture: str
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_layers: int
    hidden_size: int
    layer_types: tuple[str, ...]
    is_causal: bool | None
    sliding_window: int | None  # as Qwen3Config keeps it (None without use_sliding_window)
    conv: ConvSpec | None
    selector: SelectorSpec | None
    logit_transform: LogitTransform | None

    @classmethod
    def from_config(cls, config: Any, architecture: Architecture | None = None) -> DraftSpec:
        """The spec of a draft config (dict or Qwen3Config). Fields are read as loaders read them
        (nested `dflash_config` first); nothing is validated (callers validate the raw dict).
        `architecture`: the record to read with (default: the one the config names)."""
        arch = architecture or architecture_of(config)
        num_layers = int(config_field(config, "num_hidden_layers"))
        layer_ids = draft_value(config, "target_layer_ids")
        if layer_ids is None:  # the servers' default spread
            layer_ids = default_target_layer_ids(int(draft_value(config, "num_target_layers")), num_layers)
        return cls(
            architecture=arch.name,
            block_size=int(draft_value(config, "block_size")),
            mask_token_id=int(draft_value(config, "mask_token_id")),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            num_layers=num_layers,
            hidden_size=int(config_field(config, "hidden_size")),
            layer_types=tuple(config_field(config, "layer_types") or ()),
            is_causal=config_field(config, "is_causal"),
            sliding_window=config_field(config, "sliding_window"),
            conv=ConvSpec(*_ints(config, CONV_KEYS)) if arch.conv else None,
            selector=SelectorSpec(*_ints(config, SELECTOR_KEYS)) if arch.selector else None,
            logit_transform=_logit_transform(config, arch),
        )

    def contract_fields(self) -> dict[str, Any]:
        """The draft's part of the resume contract (training.md section 6): a checkpoint trained
        with other values is refused. A new spec field that decides what is trained enters here."""
        conv, selector, transform = self.conv, self.selector, self.logit_transform
        return {
            "architecture": self.architecture,
            "num_draft_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "target_layer_ids": list(self.target_layer_ids),
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "conv_kernel_size": conv.kernel_size if conv else None,
            "conv_group_size": conv.group_size if conv else None,
            "selector_rank": selector.rank if selector else None,
            "selector_top_k": selector.top_k if selector else None,
            "output_multiplier": transform.multiplier if transform else None,
            "final_logit_softcapping": transform.softcap if transform else None,
            # the attention pattern: which layers slide, how far, and whether a block sees its later slots
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
            "is_causal": self.is_causal,
        }


def _ints(config: Any, keys: tuple[str, ...]) -> list[int]:
    return [int(draft_value(config, key)) for key in keys]


def _logit_transform(config: Any, arch: Architecture) -> LogitTransform | None:
    values = [draft_value(config, key, arch.defaults.get(key, _MISSING)) for key in LOGIT_TRANSFORM_KEYS]
    if all(value is _MISSING for value in values):
        return None
    return LogitTransform.from_values(*(None if value is _MISSING else value for value in values))
