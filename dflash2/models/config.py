"""Draft config handling: the architecture table; load, normalise, validate (contract section 3).

A draft config is a Hugging Face Qwen3 config dict plus the DFlash fields. Servers read the DFlash 2 fields
(``NESTED_ONLY_KEYS``) only from the nested ``dflash_config`` dict, and the shared fields
(``NESTED_FIRST_KEYS``) from ``dflash_config`` first, else from the top level. The canonical form written by
this project keeps every DFlash field nested, so both loaders read the same values.

Two views of a config exist on purpose:
- ``validate_draft_config`` reads a raw dict the way a server would, so a third party's export is judged by
  what will actually be served (a top-level ``conv_kernel_size`` is reported: servers ignore it).
- ``normalize_draft_config`` repairs the layout (moves top-level DFlash fields into ``dflash_config``, fills
  defaults) and ``check_draft_config`` normalises then validates.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from transformers import Qwen3Config

from dflash2.config import read_json_object
from dflash2.target.files import CONFIG_FILE

NESTED_ONLY_KEYS = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
)
NESTED_FIRST_KEYS = ("block_size", "target_layer_ids", "num_target_layers", "mask_token_id", "mask_token")
LAYER_TYPES = ("full_attention", "sliding_attention")
CONV_KEYS = ("conv_kernel_size", "conv_group_size")
SELECTOR_KEYS = ("selector_rank", "selector_top_k")
LOGIT_TRANSFORM_KEYS = ("output_multiplier", "final_logit_softcapping")


@dataclass(frozen=True)
class Architecture:
    """What a draft architecture has, by the name the servers select it with.

    conv: a grouped dynamic conv around every sublayer (`CONV_KEYS`); selector: the candidate
    selector (`SELECTOR_KEYS`); defaults: the DFlash fields normalisation fills when a config omits
    them (a DFlash 2 config always carries its logit transforms; a v1 config only when it writes them).
    """

    name: str
    conv: bool = False
    selector: bool = False
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def fields(self) -> tuple[str, ...]:
        """The dflash_config keys of the parts this architecture has."""
        return (CONV_KEYS if self.conv else ()) + (SELECTOR_KEYS if self.selector else ())


DFLASH = Architecture("DFlashDraftModel")
DFLASH2 = Architecture(
    "DFlash2DraftModel",
    conv=True,
    selector=True,
    defaults=MappingProxyType({"output_multiplier": 1.0, "final_logit_softcapping": None}),
)
ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in (DFLASH, DFLASH2)}
DEFAULT_ARCHITECTURE = DFLASH.name  # what a config naming no architecture is

# Backbone fields that decide tensor shapes: a loader falling back to its own default would build a
# different model, so they must be written explicitly.
REQUIRED_BACKBONE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)


# ---------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------


def load_config_dict(source: str | Path | dict) -> dict:
    """A deep copy of a config dict, or the dict in a config.json file (or a directory holding one)."""
    if isinstance(source, dict):
        return copy.deepcopy(source)
    path = Path(source)
    if path.is_dir():
        path = path / CONFIG_FILE
    if not path.is_file():
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        raise ValueError(
            f"config source {str(source)!r}{where}: no such file; pass a config.json or its directory"
        )
    return read_json_object(path, str(path))


def config_field(config: Any, name: str, default: Any = None) -> Any:
    """A field of a config dict or config object (`default` when absent)."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def draft_value(config: Any, name: str, default: Any = None) -> Any:
    """A DFlash field the way loaders read it: nested ``dflash_config`` first, else the top level."""
    nested = config_field(config, "dflash_config")
    nested = nested if isinstance(nested, dict) else {}  # another type is reported by validation
    if name in nested:
        return nested[name]
    return config_field(config, name, default)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers the servers pick when a config names none: spread over the target's depth."""
    if num_draft_layers < 1:
        raise ValueError(f"num_hidden_layers={num_draft_layers}: a draft needs at least one layer")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(
            f"num_target_layers={num_target_layers}: the default layer spread needs >= 4 target layers; "
            "set dflash_config.target_layer_ids explicitly"
        )
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _architecture(cfg: dict) -> str | None:
    architectures = cfg.get("architectures")
    if isinstance(architectures, list) and len(architectures) == 1:
        return architectures[0]
    return None


def architecture_of(config: Any) -> Architecture:
    """The architecture record of a draft config (dict or Qwen3Config); none named: the default."""
    names = config_field(config, "architectures") or [DEFAULT_ARCHITECTURE]
    if len(names) != 1:
        raise ValueError(f"architectures must name exactly one draft class, got {names}")
    if names[0] not in ARCHITECTURES:
        raise ValueError(
            f"unknown draft architecture {names[0]!r}; known: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[names[0]]


# ---------------------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------------------


def _nest_dflash_fields(cfg: dict) -> dict:
    """Move top-level DFlash fields into ``dflash_config``; equal copies merge, different ones raise."""
    nested = dict(cfg.pop("dflash_config", None) or {})
    for key in NESTED_ONLY_KEYS + NESTED_FIRST_KEYS:
        if key not in cfg:
            continue
        top = cfg.pop(key)
        if key in nested and nested[key] != top:
            raise ValueError(
                f"{key} is set twice with different values: dflash_config.{key}={nested[key]!r} and "
                f"top-level {key}={top!r}; keep one value (in dflash_config)"
            )
        nested[key] = top
    return nested


def _normalize_rope(cfg: dict) -> None:
    """Keep ``rope_parameters`` (transformers 5) and the legacy ``rope_theta`` both present and equal.
    A legacy ``rope_scaling`` dict (e.g. YaRN) becomes ``rope_parameters`` with the theta: left beside
    them, transformers would take it for the RoPE parameters and drop the theta (10000 instead)."""
    theta = cfg.get("rope_theta")
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict):
        folded = {key: value for key, value in scaling.items() if key != "type"}
        folded.setdefault("rope_type", scaling.get("type", "default"))
        if params is None:
            params = cfg["rope_parameters"] = folded
        elif {k: v for k, v in params.items() if k != "rope_theta"} != {
            k: v for k, v in folded.items() if k != "rope_theta"
        }:
            raise ValueError(
                f"rope_scaling={scaling!r} and rope_parameters={params!r} are both set and differ; keep "
                "rope_parameters (transformers 5's form: the RoPE type, its scaling fields and rope_theta)"
            )
        cfg.pop("rope_scaling")
    if params is None and theta is not None:
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    elif isinstance(params, dict) and "rope_theta" not in params and theta is not None:
        params["rope_theta"] = theta
    elif isinstance(params, dict) and "rope_theta" in params:
        if theta is not None and theta != params["rope_theta"]:
            raise ValueError(
                f"rope_theta={theta!r} differs from rope_parameters.rope_theta={params['rope_theta']!r}; "
                "keep one value"
            )
        cfg["rope_theta"] = params["rope_theta"]


def _qwen3_layer_types(cfg: dict, num_layers: int) -> list[str]:
    """The layer types transformers' Qwen3Config gives a config without `layer_types`: with
    `use_sliding_window`, sliding from layer `max_window_layers` on (its defaults: window 4096, 28)."""
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
    first_sliding = cfg.get("max_window_layers", 28)
    return [
        "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
        for i in range(num_layers)
    ]


def _check_sliding_semantics(cfg: dict) -> None:
    """Sliding layers listed in `layer_types` mean something else to the loaders when `is_causal` is
    unset (causal within the block) or `use_sliding_window` is not true (no window): filling either
    in would change the model that a config of another tool describes, so both must be written."""
    if "sliding_attention" not in (cfg.get("layer_types") or []):
        return
    if "is_causal" not in cfg:
        raise ValueError(
            "layer_types has sliding_attention layers and is_causal is not set: loaders then make those layers "
            "causal within the block, while a DFlash draft is trained with is_causal: false; write is_causal "
            "explicitly (false for a DFlash draft; a draft trained otherwise cannot follow the contract)"
        )
    if cfg.get("use_sliding_window") is not True:
        raise ValueError(
            f"layer_types has sliding_attention layers but use_sliding_window={cfg.get('use_sliding_window')!r}: "
            "loaders then apply no window to them; set use_sliding_window: true (and sliding_window), or make "
            "those layers full_attention, whichever the draft was trained with"
        )


def normalize_draft_config(cfg: dict) -> dict:
    """A new dict in canonical form: DFlash fields nested, defaults filled, nothing dropped.

    ``num_target_layers`` is kept at the top level too (it is also a backbone field, and the reference
    loader reads it there); it always equals the nested value.
    """
    out = copy.deepcopy(cfg)
    nested = _nest_dflash_fields(out)
    if "num_target_layers" in nested:
        out["num_target_layers"] = nested["num_target_layers"]
    out.setdefault("architectures", [DEFAULT_ARCHITECTURE])
    out.setdefault("model_type", "qwen3")
    _check_sliding_semantics(out)
    out.setdefault("is_causal", False)
    out.setdefault("tie_word_embeddings", False)
    num_layers = out.get("num_hidden_layers")
    if "layer_types" not in out and _is_int(num_layers):
        out["layer_types"] = _qwen3_layer_types(out, num_layers)
    if "sliding_attention" in (out.get("layer_types") or []):
        out["use_sliding_window"] = True
    num_target_layers = nested.get("num_target_layers")
    if "target_layer_ids" not in nested and _is_int(num_target_layers) and _is_int(num_layers):
        nested["target_layer_ids"] = default_target_layer_ids(num_target_layers, num_layers)
    arch = ARCHITECTURES.get(_architecture(out))
    for key, value in arch.defaults.items() if arch else ():
        nested.setdefault(key, value)
    _normalize_rope(out)
    out["dflash_config"] = nested
    return out


# ---------------------------------------------------------------------------------------------------------
# Validation (a raw dict, read the way servers read it)
# ---------------------------------------------------------------------------------------------------------


def _check_identity(cfg: dict, problems: list[str]) -> None:
    architectures = cfg.get("architectures")
    if _architecture(cfg) not in ARCHITECTURES:
        problems.append(
            f"architectures={architectures!r}: must be one of {[[name] for name in ARCHITECTURES]}; "
            "the architecture selects DFlash v1 or DFlash 2 in the servers"
        )
    if cfg.get("model_type") != "qwen3":
        problems.append(f"model_type={cfg.get('model_type')!r}: set model_type to 'qwen3'")
    nested = cfg.get("dflash_config")
    if nested is not None and not isinstance(nested, dict):
        problems.append(f"dflash_config={nested!r}: must be a JSON object holding the DFlash fields")


def _check_layout(cfg: dict, problems: list[str]) -> None:
    nested = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    for key in NESTED_ONLY_KEYS:
        if key in cfg:
            problems.append(
                f"top-level {key}={cfg[key]!r}: servers read {key} only inside dflash_config and ignore "
                f"it here; move it into dflash_config"
            )
    for key in NESTED_FIRST_KEYS:
        if key in cfg and key in nested and cfg[key] != nested[key]:
            problems.append(
                f"{key} conflict: dflash_config.{key}={nested[key]!r} but top-level {key}={cfg[key]!r}; "
                "keep one value (in dflash_config)"
            )


DFLASH_KEYS = NESTED_ONLY_KEYS + NESTED_FIRST_KEYS
# Fields whose absence a loader fills with a default (a different model, or no error where one was due)
DEFAULTED_KEYS = REQUIRED_BACKBONE_KEYS + (
    "architectures",
    "model_type",
    "dflash_config",
    "is_causal",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "rms_norm_eps",
    "attention_bias",
    "hidden_act",
    "tie_word_embeddings",
)


def _check_field_names(cfg: dict, problems: list[str]) -> None:
    """A loader ignores a field it does not know and uses its default for a missing one, so a
    misspelled field (target_layers_ids) would train and serve the default without a word. A key close
    to a field the config lacks is taken for a misspelling of it; other keys (another loader's own
    fields, notes) are kept. Read on the config as written: normalisation fills the defaults."""
    nested = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}

    def lacks(name: str) -> bool:
        return name not in nested and name not in cfg

    for where, keys, known in (
        ("dflash_config.", nested, DFLASH_KEYS),
        ("", cfg, DEFAULTED_KEYS + DFLASH_KEYS),
    ):
        for key in keys:
            if key in known or not isinstance(key, str):
                continue
            close = [name for name in difflib.get_close_matches(key, known, n=3, cutoff=0.8) if lacks(name)]
            if close:
                problems.append(
                    f"{where}{key}: not a field of a draft config, and {close[0]} is missing: did you mean "
                    f"{close[0]}? (a loader ignores the one and uses its default for the other)"
                )


def _check_backbone(cfg: dict, problems: list[str]) -> None:
    for key in REQUIRED_BACKBONE_KEYS:
        value = cfg.get(key)
        if not _is_int(value) or value < 1:
            problems.append(f"{key}={value!r}: must be a positive int written in config.json")
    heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if _is_int(heads) and _is_int(kv_heads) and kv_heads > 0 and heads % kv_heads:
        problems.append(
            f"num_attention_heads={heads} is not divisible by num_key_value_heads={kv_heads}; "
            "choose num_key_value_heads dividing num_attention_heads"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg['hidden_act']!r}: the servers support only 'silu'")
    if cfg.get("tie_word_embeddings", False) is not False:
        problems.append(
            f"tie_word_embeddings={cfg['tie_word_embeddings']!r}: a draft has no embedding of its own; set false"
        )
    if "quantization_config" in cfg:
        problems.append("quantization_config is present: export unquantized weights and remove it")
    if cfg.get("input_embedding_scale", 1.0) != 1.0:
        problems.append(
            f"input_embedding_scale={cfg['input_embedding_scale']!r}: SGLang does not read it; remove it "
            "(the draft must be trained with unscaled target embeddings)"
        )
    if cfg.get("is_causal") is not False:
        problems.append(
            f"is_causal={cfg.get('is_causal')!r}: write is_causal: false explicitly (loaders disagree on "
            "the default)"
        )
    dtypes = {cfg[key] for key in ("torch_dtype", "dtype") if cfg.get(key) is not None}
    if len(dtypes) > 1:
        problems.append(
            f"torch_dtype={cfg['torch_dtype']!r} differs from dtype={cfg['dtype']!r}; both must name the "
            "dtype of the saved tensors"
        )


def _check_layers(cfg: dict, problems: list[str]) -> None:
    layer_types = cfg.get("layer_types")
    num_layers = cfg.get("num_hidden_layers")
    if not isinstance(layer_types, list):
        problems.append(
            f"layer_types={layer_types!r}: write one entry per draft layer, e.g. 'full_attention'"
        )
        return
    if _is_int(num_layers) and len(layer_types) != num_layers:
        problems.append(
            f"layer_types has {len(layer_types)} entries but num_hidden_layers={num_layers}; write one per layer"
        )
    unknown = [t for t in layer_types if t not in LAYER_TYPES]
    if unknown:
        problems.append(f"layer_types contains {unknown!r}: each entry must be one of {list(LAYER_TYPES)}")
    if "sliding_attention" not in layer_types:
        return
    window = cfg.get("sliding_window")
    if not _is_int(window) or window < 1:
        problems.append(f"sliding_window={window!r}: sliding_attention layers need a positive sliding_window")
    if cfg.get("use_sliding_window") is not True:
        problems.append(
            f"use_sliding_window={cfg.get('use_sliding_window')!r}: sliding_attention layers need "
            "use_sliding_window: true (transformers' Qwen3Config drops sliding_window without it)"
        )


def _check_pair(nested: dict, first: str, second: str, problems: list[str]) -> tuple[int, int]:
    """Both > 0 or both 0/absent, as the servers require. Returns the two values (0 when unusable)."""
    values = []
    for key in (first, second):
        value = nested.get(key, 0)
        if value is None:
            value = 0
        if not _is_int(value) or value < 0:
            problems.append(f"dflash_config.{key}={value!r}: must be an int >= 0")
            value = 0
        values.append(value)
    if bool(values[0]) != bool(values[1]):
        problems.append(
            f"dflash_config.{first}={values[0]!r} but {second}={values[1]!r}: set both > 0 or both 0/absent"
        )
    return values[0], values[1]


def _check_v2_fields(cfg: dict, nested: dict, problems: list[str]) -> None:
    arch = ARCHITECTURES.get(_architecture(cfg))
    hidden_size, vocab_size = cfg.get("hidden_size"), cfg.get("vocab_size")
    kernel_size, group_size = _check_pair(nested, *CONV_KEYS, problems)
    rank, top_k = _check_pair(nested, *SELECTOR_KEYS, problems)
    if arch is not None:
        _check_parts(arch, kernel_size, group_size, rank, problems)
    if group_size and _is_int(hidden_size) and hidden_size % group_size:
        problems.append(
            f"dflash_config.conv_group_size={group_size} does not divide hidden_size={hidden_size}; "
            "pick a divisor of hidden_size"
        )
    if top_k and top_k & (top_k - 1):
        problems.append(f"dflash_config.selector_top_k={top_k}: must be a power of two (e.g. 8 or 16)")
    if top_k and _is_int(vocab_size) and top_k > vocab_size:
        problems.append(f"dflash_config.selector_top_k={top_k} exceeds vocab_size={vocab_size}; lower it")
    block_size = draft_value(cfg, "block_size")
    if kernel_size and _is_int(block_size) and kernel_size > block_size:
        problems.append(
            f"dflash_config.conv_kernel_size={kernel_size} exceeds block_size={block_size}; "
            "need 1 <= conv_kernel_size <= block_size"
        )
    multiplier = nested.get("output_multiplier", 1.0)
    if not _is_number(multiplier) or multiplier <= 0:
        problems.append(f"dflash_config.output_multiplier={multiplier!r}: must be a number > 0 (1.0 = off)")
    softcap = nested.get("final_logit_softcapping")
    if softcap is not None and (not _is_number(softcap) or softcap <= 0):
        problems.append(
            f"dflash_config.final_logit_softcapping={softcap!r}: must be null (off) or a number > 0"
        )


def _check_parts(
    arch: Architecture, kernel_size: int, group_size: int, rank: int, problems: list[str]
) -> None:
    """The conv and selector fields against what the architecture has: set when it has them, absent when not."""
    if arch.conv and not (kernel_size > 0 and group_size > 0):
        problems.append(
            f"dflash_config.conv_kernel_size={kernel_size!r}, conv_group_size={group_size!r}: "
            f"{arch.name} needs both > 0 (e.g. 2 and 16)"
        )
    if arch.selector and rank <= 0:
        problems.append(
            f"dflash_config.selector_rank={rank!r}: {arch.name} needs selector_rank > 0 (and selector_top_k > 0)"
        )
    if (kernel_size and not arch.conv) or (rank and not arch.selector):
        complete = [name for name, other in ARCHITECTURES.items() if other.conv and other.selector]
        problems.append(
            f"architectures=[{arch.name!r}] with conv_kernel_size={kernel_size}, selector_rank={rank}: "
            f"v1 ignores conv and selector; set architectures to {complete} or remove them"
        )


def _check_block_and_layers(cfg: dict, problems: list[str]) -> None:
    block_size = draft_value(cfg, "block_size")
    if not _is_int(block_size) or block_size < 2:
        problems.append(f"dflash_config.block_size={block_size!r}: must be an int >= 2")
    num_target_layers = draft_value(cfg, "num_target_layers")
    if not _is_int(num_target_layers) or num_target_layers < 1:
        problems.append(
            f"num_target_layers={num_target_layers!r}: must be the target's num_hidden_layers (a positive int)"
        )
        num_target_layers = None
    layer_ids = draft_value(cfg, "target_layer_ids")
    if not isinstance(layer_ids, list) or not layer_ids:
        problems.append(
            f"dflash_config.target_layer_ids={layer_ids!r}: write the non-empty list of target layer ids the "
            "draft was trained with (servers otherwise guess a default spread)"
        )
        return
    for index, layer_id in enumerate(layer_ids):
        if not _is_int(layer_id):
            problems.append(f"dflash_config.target_layer_ids[{index}]={layer_id!r}: must be an int")
        elif num_target_layers is not None and not 0 <= layer_id < num_target_layers:
            problems.append(
                f"dflash_config.target_layer_ids[{index}]={layer_id}: out of range [0, {num_target_layers}) "
                f"(num_target_layers={num_target_layers}); use ids of existing target layers"
            )
    if all(_is_int(i) for i in layer_ids) and any(a >= b for a, b in zip(layer_ids, layer_ids[1:])):
        problems.append(
            f"dflash_config.target_layer_ids={layer_ids}: must be strictly increasing (SGLang collects the "
            f"target's layers in order, once each): write {sorted(set(layer_ids))} and train with it"
        )


def _check_mask_token(cfg: dict, tokenizer: Any, problems: list[str], source: Any = None) -> None:
    before = len(problems)
    _check_mask_token_id(cfg, tokenizer, problems)
    if tokenizer is not None and len(problems) > before:  # a draft/tokenizer mismatch: name both
        files = (
            f" (draft {_config_file(source, 'config given as a dict')}, "
            f"tokenizer {getattr(tokenizer, 'name_or_path', None) or 'given as an object'})"
        )
        problems[before:] = [problem + files for problem in problems[before:]]


def _check_mask_token_id(cfg: dict, tokenizer: Any, problems: list[str]) -> None:
    mask_token_id = draft_value(cfg, "mask_token_id")
    vocab_size = cfg.get("vocab_size")
    if not _is_int(mask_token_id):
        problems.append(f"dflash_config.mask_token_id={mask_token_id!r}: must be an int token id")
        return
    if _is_int(vocab_size) and not 0 <= mask_token_id < vocab_size:
        problems.append(
            f"dflash_config.mask_token_id={mask_token_id}: out of range [0, {vocab_size}) (vocab_size); "
            "use an id of the target's vocabulary"
        )
    if tokenizer is None:
        return
    if not hasattr(tokenizer, "get_vocab"):
        raise ValueError(
            f"tokenizer: give a Hugging Face tokenizer (AutoTokenizer.from_pretrained(dir)), not "
            f"{type(tokenizer).__name__}"
        )
    mask_token = draft_value(cfg, "mask_token")
    vocab = tokenizer.get_vocab()
    if mask_token is not None:
        if mask_token not in vocab:
            problems.append(
                f"dflash_config.mask_token={mask_token!r} is not a token of the tokenizer; fix it"
            )
        elif vocab[mask_token] != mask_token_id:
            problems.append(
                f"dflash_config.mask_token_id={mask_token_id} but the tokenizer maps mask_token "
                f"{mask_token!r} to {vocab[mask_token]}; make them agree"
            )
        return
    tokenizer_mask = getattr(tokenizer, "mask_token", None)
    if tokenizer_mask is not None and tokenizer_mask in vocab and vocab[tokenizer_mask] != mask_token_id:
        problems.append(
            f"dflash_config.mask_token_id={mask_token_id} but the tokenizer's mask token {tokenizer_mask!r} "
            f"has id {vocab[tokenizer_mask]}; make them agree or set dflash_config.mask_token"
        )


def text_config_of(target_config: Any) -> Any:
    """The text decoder's config of a target config (dict, PretrainedConfig or path): its `text_config`
    for a multimodal checkpoint, else the config itself."""
    if isinstance(target_config, (str, Path)):
        target_config = load_config_dict(target_config)
    text = config_field(target_config, "text_config")
    return text if text is not None else target_config


def _config_file(config: Any, unknown: str) -> str:
    """The file a config came from: a path (a directory means its config.json), the directory a
    transformers config was read from, else `unknown`."""
    where = getattr(config, "name_or_path", None) if not isinstance(config, (str, Path)) else config
    if not where:
        return unknown
    return str(Path(where) / CONFIG_FILE) if Path(where).is_dir() else str(where)


# Fields of a target's config that scale or cap its logits or its input embeddings. The draft
# borrows the bare embedding and LM head weights (dflash2.target.head), so a target that sets one of
# them would be distilled and embedded wrongly: refused, with the value that is harmless.
_TARGET_SCALINGS = {
    "final_logit_softcapping": None,  # Gemma 2
    "logit_scale": 1.0,  # Cohere (its default 0.0625 scales the logits)
    "logits_scaling": 1.0,  # Granite
    "embedding_multiplier": 1.0,  # Granite
    "scale_emb": 1.0,  # MiniCPM
}
_SCALED_EMBEDDING_TYPES = ("gemma",)  # Gemma multiplies its input embeddings by sqrt(hidden_size)


def _check_target_family(target: Any, files: str, problems: list[str]) -> None:
    model_type = str(config_field(target, "model_type") or "")
    if model_type.startswith(_SCALED_EMBEDDING_TYPES):
        problems.append(
            f"the target's model_type {model_type!r} scales its input embeddings, which the draft borrows "
            f"unscaled{files}; such targets are not supported (docs/targets.md lists the families that are)"
        )
    for name, harmless in _TARGET_SCALINGS.items():
        value = config_field(target, name)
        if value is not None and value != harmless and not (harmless is None and value == 0):
            problems.append(
                f"the target sets {name}={value!r}, which the draft's borrowed embedding and LM head would "
                f"not apply{files}; such targets are not supported (docs/targets.md lists the families that are)"
            )


def _check_target(cfg: dict, target_config: Any, problems: list[str], source: Any = None) -> None:
    target = text_config_of(target_config)
    files = (
        f" (draft {_config_file(source, 'config given as a dict')}, "
        f"target {_config_file(target_config, 'config given as a dict')})"
    )
    before = len(problems)
    for key in ("hidden_size", "vocab_size"):
        if cfg.get(key) != config_field(target, key):
            problems.append(
                f"{key}={cfg.get(key)!r} but the target's {key} is {config_field(target, key)!r}{files}; "
                "they must be equal"
            )
    num_target_layers = draft_value(cfg, "num_target_layers")
    if num_target_layers != config_field(target, "num_hidden_layers"):
        problems.append(
            f"num_target_layers={num_target_layers!r} but the target has num_hidden_layers="
            f"{config_field(target, 'num_hidden_layers')!r}{files}; set num_target_layers to it"
        )
    if len(problems) > before:  # a draft config made for another target
        target_dir = Path(_config_file(target_config, "<target dir>"))
        target_dir = target_dir.parent if target_dir.name == CONFIG_FILE else target_dir
        problems.append(
            "a draft config made for this target: python -m dflash2.draft_config --target "
            f"{target_dir} --arch {_architecture(cfg) if _architecture(cfg) in ARCHITECTURES else DEFAULT_ARCHITECTURE} "
            "--out <draft.json>"
        )
    _check_target_family(target, files, problems)


def validate_draft_config(
    cfg: dict, *, tokenizer: Any = None, target_config: Any = None, source: str | Path | None = None
) -> list[str]:
    """Every contract section 3 problem of a raw config dict, one message each (empty list: valid).

    tokenizer: a Hugging Face tokenizer (or its directory), to check the mask token; target_config: the target's config
    (dict, PretrainedConfig or path), to check hidden size, vocabulary and depth; source: the file
    `cfg` was read from, named with the target's in a draft/target mismatch.
    """
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    problems: list[str] = []
    _check_identity(cfg, problems)
    _check_layout(cfg, problems)
    _check_field_names(cfg, problems)
    _check_backbone(cfg, problems)
    _check_layers(cfg, problems)
    nested = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    _check_v2_fields(cfg, nested, problems)
    _check_block_and_layers(cfg, problems)
    _check_mask_token(cfg, tokenizer, problems, source)
    if target_config is not None:
        _check_target(cfg, target_config, problems, source)
    return problems


def check_draft_config(cfg: dict, **kwargs: Any) -> dict:
    """Normalise, validate, and return the normalised config; raise one ValueError listing every problem."""
    misspelled: list[str] = []
    _check_field_names(cfg, misspelled)  # before normalisation fills the default a misspelling leaves
    try:
        normalized = normalize_draft_config(cfg)
    except ValueError:
        if misspelled:
            raise ValueError("invalid draft config:\n  " + "\n  ".join(misspelled)) from None
        raise
    problems = list(dict.fromkeys(misspelled + validate_draft_config(normalized, **kwargs)))
    if problems:
        raise ValueError("invalid draft config:\n  " + "\n  ".join(problems))
    return normalized


# ---------------------------------------------------------------------------------------------------------
# Qwen3Config
# ---------------------------------------------------------------------------------------------------------


def to_qwen3_config(cfg: dict) -> Qwen3Config:
    """A transformers Qwen3Config from a draft config (normalised first; not validated).

    ``dflash_config`` and ``num_target_layers`` become attributes, so ``draft_value(config, name)`` reads
    every DFlash field; the legacy ``rope_theta`` stays readable next to ``rope_parameters``.
    """
    normalized = normalize_draft_config(cfg)
    kwargs = {key: value for key, value in normalized.items() if key != "rope_theta"}
    config = Qwen3Config(**kwargs)
    if "rope_theta" in normalized:
        config.rope_theta = normalized["rope_theta"]
    return config
