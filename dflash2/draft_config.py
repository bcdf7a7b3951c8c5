"""Write a draft config for a target: `python -m dflash2.draft_config --target DIR --arch ARCH --out FILE`.

Every size the draft shares with the target is read from the target's config.json (its `text_config`
for a vision-language checkpoint): hidden size, vocabulary, number of target layers, and by default
the attention geometry, intermediate size, norm epsilon, RoPE theta, context length and dtype. The
DFlash fields get the shipped configs' defaults (block 8, conv kernel 2 / group 16, selector rank
min(256, H / 4) / top-k 16, the servers' default layer spread). The mask token is one the target's
replies never contain: `--mask-token`, else the tokenizer's own mask token, else its first added
special token that is not a stop, bos, pad or unk token and does not occur in the chat template.
The result passes `check_draft_config` against the target and its tokenizer, or nothing is written.
Field by field: docs/targets.md.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dflash2.config import has_tokenizer
from dflash2.data.render import stop_token_ids
from dflash2.errors import add_debug_flag, exit_process, run_main
from dflash2.models.config import (
    ARCHITECTURES,
    CONV_KEYS,
    DFLASH2,
    SELECTOR_KEYS,
    check_draft_config,
    default_target_layer_ids,
    load_config_dict,
    text_config_of,
)

MAX_SELECTOR_RANK = 256


@dataclass(frozen=True)
class DraftChoices:
    """What the command line chooses; None: derived from the target (see the module docstring)."""

    architecture: str = DFLASH2.name
    num_layers: int = 5
    block_size: int = 8
    target_layer_ids: list[int] | None = None
    sliding_window: int = 2048  # 0: every layer full attention
    conv_kernel_size: int | None = None  # DFlash 2: 2
    conv_group_size: int | None = None  # DFlash 2: 16
    selector_rank: int | None = None  # DFlash 2: min(256, hidden_size // 4)
    selector_top_k: int | None = None  # DFlash 2: 16
    mask_token: str | None = None
    mask_token_id: int | None = None  # instead of a token (needed for a target without a tokenizer)
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    rope_theta: float | None = None
    max_position_embeddings: int | None = None


def build_draft_config(target_dir: str | Path, choices: DraftChoices) -> tuple[dict, str]:
    """(the draft config, one line saying which mask token was chosen and why)."""
    target_dir = Path(target_dir)
    top = load_config_dict(target_dir)
    text = dict(text_config_of(top))
    text.setdefault("dtype", top.get("dtype") or top.get("torch_dtype"))
    tokenizer = tokenizer_if_any(target_dir)
    mask_token, mask_token_id, mask_note = choose_mask_token(target_dir, tokenizer, text, choices)
    cfg = backbone_fields(text, choices)
    cfg["dflash_config"] = dflash_fields(cfg, choices, mask_token, mask_token_id)
    normalized = check_draft_config(cfg, tokenizer=tokenizer, target_config=target_dir)
    return {**{key: normalized[key] for key in cfg}, **normalized}, mask_note  # in the order written here


def backbone_fields(text: dict, choices: DraftChoices) -> dict:
    hidden, num_layers = require(text, "hidden_size"), choices.num_layers
    heads = flag_or_target(choices.num_attention_heads, text, "num_attention_heads")
    target_rope = (text.get("rope_parameters") or {}).get("rope_theta", text.get("rope_theta"))
    rope_theta = flag_or(choices.rope_theta, target_rope)
    if rope_theta is None:
        raise ValueError("the target's config has no rope_theta; pass --rope-theta")
    for flag, value in (
        ("--rope-theta", choices.rope_theta),
        ("--max-position-embeddings", choices.max_position_embeddings),
    ):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} {value}: must be > 0")
    dtype = text.get("dtype") or text.get("torch_dtype") or "float32"
    if choices.sliding_window < 0:
        raise ValueError(
            f"--sliding-window {choices.sliding_window}: give a window of tokens, or 0 for full attention"
        )
    sliding = choices.sliding_window > 0
    cfg = {
        "architectures": [choices.architecture],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": flag_or_target(choices.intermediate_size, text, "intermediate_size"),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": flag_or(choices.num_key_value_heads, text.get("num_key_value_heads", heads)),
        "head_dim": flag_or(choices.head_dim, text.get("head_dim") or hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": text.get("rms_norm_eps", 1e-6),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta)},
        "rope_theta": float(rope_theta),
        "max_position_embeddings": flag_or_target(
            choices.max_position_embeddings, text, "max_position_embeddings"
        ),
        "vocab_size": require(text, "vocab_size"),
        "num_target_layers": require(text, "num_hidden_layers"),
        "layer_types": [("sliding_attention" if sliding else "full_attention")] * num_layers,
    }
    if sliding:
        cfg.update(sliding_window=choices.sliding_window, use_sliding_window=True)
    cfg.update(is_causal=False, tie_word_embeddings=False, torch_dtype=dtype, dtype=dtype)
    return cfg


def dflash_fields(cfg: dict, choices: DraftChoices, mask_token: str | None, mask_token_id: int) -> dict:
    hidden, num_target_layers = cfg["hidden_size"], cfg["num_target_layers"]
    layer_ids = choices.target_layer_ids
    if layer_ids is None:
        # the servers' spread, each layer once: on a shallow target it repeats ids, which a server
        # collects once each (5 draft layers over 6 target layers: [1, 2, 2, 2, 3] -> [1, 2, 3])
        layer_ids = sorted(set(default_target_layer_ids(num_target_layers, choices.num_layers)))
    arch = ARCHITECTURES[choices.architecture]
    fields: dict[str, Any] = {"block_size": choices.block_size}
    if arch.conv:
        group = flag_or(choices.conv_group_size, 16)
        if group < 1 or hidden % group:
            divisors = [d for d in range(1, 65) if hidden % d == 0]
            raise ValueError(
                f"--conv-group-size {group} does not divide the target's hidden size {hidden}; "
                f"pass --conv-group-size with one of its divisors, e.g. {divisors[-4:]}"
            )
        fields.update(conv_kernel_size=flag_or(choices.conv_kernel_size, 2), conv_group_size=group)
    if arch.selector:
        fields.update(
            selector_rank=flag_or(choices.selector_rank, min(MAX_SELECTOR_RANK, hidden // 4)),
            selector_top_k=flag_or(choices.selector_top_k, 16),
        )
    lacking = [name for name in CONV_KEYS + SELECTOR_KEYS if name not in arch.fields]
    given = [f"--{name.replace('_', '-')}" for name in lacking if getattr(choices, name) is not None]
    if given:
        raise ValueError(f"{arch.name} has no convolution or selector: drop {', '.join(given)}")
    if mask_token is not None:
        fields["mask_token"] = mask_token
    fields.update(mask_token_id=mask_token_id, num_target_layers=num_target_layers)
    fields["target_layer_ids"] = list(layer_ids)
    fields.update(arch.defaults)
    return fields


def flag_or(value: Any, default: Any) -> Any:
    """A flag's value when it was passed (0 included), else the default."""
    return default if value is None else value


def flag_or_target(value: Any, text: dict, key: str) -> Any:
    """A flag's value when it was passed, else the target's `key` (required only then: a flag
    stands in for a field the target's config lacks, e.g. a MoE target's dense intermediate_size)."""
    if value is not None:
        return value
    if text.get(key) is None:
        flag = "--" + key.replace("_", "-")
        raise ValueError(f"the target's config has no {key}; pass {flag}")
    return text[key]


def require(text: dict, key: str) -> Any:
    if text.get(key) is None:
        raise ValueError(f"the target's config has no {key}; is --target a causal LM checkpoint?")
    return text[key]


def tokenizer_if_any(target_dir: Path):
    """The target's tokenizer, or None for a directory that holds a config.json alone."""
    if not has_tokenizer(target_dir):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


def choose_mask_token(target_dir: Path, tokenizer, text: dict, choices: DraftChoices):
    """(token written into the config or None, its id, a one-line note)."""
    if choices.mask_token_id is not None and choices.mask_token is not None:
        raise ValueError("give --mask-token or --mask-token-id, not both")
    if choices.mask_token_id is not None and choices.mask_token_id < 0:
        raise ValueError(f"--mask-token-id {choices.mask_token_id}: give a token id >= 0")
    if choices.mask_token_id is not None:
        if tokenizer is not None:
            refuse_reserved(
                target_dir, tokenizer, choices.mask_token_id, f"--mask-token-id {choices.mask_token_id}"
            )
        # its token written too where the tokenizer has one: servers that look the mask up by token
        # (by default '<|MASK|>') then find this id
        token = _token_of(tokenizer, choices.mask_token_id)
        return token, choices.mask_token_id, f"mask token id {choices.mask_token_id} (--mask-token-id)"
    if tokenizer is None:
        raise ValueError(
            f"{target_dir} has no tokenizer: pass --mask-token-id (an id the target never emits), or "
            "point --target at the checkpoint with its tokenizer"
        )
    vocab = tokenizer.get_vocab()
    if choices.mask_token is not None:
        if choices.mask_token not in vocab:
            raise ValueError(
                f"--mask-token {choices.mask_token!r} is not a token of {target_dir}'s tokenizer"
            )
        refuse_reserved(
            target_dir, tokenizer, vocab[choices.mask_token], f"--mask-token {choices.mask_token!r}"
        )
        return (
            choices.mask_token,
            vocab[choices.mask_token],
            f"mask token {choices.mask_token!r} (--mask-token)",
        )
    own = getattr(tokenizer, "mask_token", None)
    if own is not None and own in vocab and usable_mask(target_dir, tokenizer, own, vocab[own]):
        return own, vocab[own], f"mask token {own!r} (id {vocab[own]}): the tokenizer's own mask token"
    for token_id, token in unused_special_tokens(target_dir, tokenizer, text):
        note = (
            f"mask token {token!r} (id {token_id}): the tokenizer's first added special token that is "
            "not a stop, bos, pad or unk token and not in the chat template"
        )
        return token, token_id, note
    raise ValueError(
        f"the tokenizer of {target_dir} has no mask token and no unused special token; pass "
        "--mask-token TOKEN (a token of its vocabulary that the target's replies never contain)"
    )


def reserved_ids(target_dir: Path, tokenizer) -> set[int]:
    """The stop ids (as regeneration, evaluation and the server stop), bos, pad and unk."""
    from transformers import AutoConfig, GenerationConfig

    generation = None
    if (target_dir / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(target_dir)
    target = SimpleNamespace(config=AutoConfig.from_pretrained(target_dir), generation_config=generation)
    ids = {tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    return set(stop_token_ids(tokenizer, target)) | (ids - {None})


def _token_of(tokenizer, token_id: int) -> str | None:
    """The token string of `token_id`, or None without a tokenizer or past its vocabulary."""
    if tokenizer is None or token_id >= len(tokenizer):
        return None
    return tokenizer.convert_ids_to_tokens(token_id)


def refuse_reserved(target_dir: Path, tokenizer, token_id: int, given: str) -> None:
    if token_id in reserved_ids(target_dir, tokenizer):
        raise ValueError(
            f"{given} is a stop, bos, pad or unk token of the target (id {token_id}); pass a token its "
            "replies never contain"
        )


def usable_mask(target_dir: Path, tokenizer, token: str, token_id: int) -> bool:
    """A token that is not reserved (stop / bos / pad / unk) and that the chat template never renders."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    return token_id not in reserved_ids(target_dir, tokenizer) and token not in template


def unused_special_tokens(target_dir: Path, tokenizer, text: dict) -> list[tuple[int, str]]:
    """Added special tokens, by id, that are not reserved (stop / bos / pad / unk) and not in the chat
    template (so the template never renders them into a reply)."""
    reserved = reserved_ids(target_dir, tokenizer)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    return [
        (token_id, added.content)
        for token_id, added in sorted(tokenizer.added_tokens_decoder.items())
        if added.special
        and token_id not in reserved
        and token_id < text["vocab_size"]
        and added.content not in template
    ]


def parse_layer_ids(value: str) -> list[int]:
    try:
        return [int(part) for part in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected comma-separated ints, e.g. 1,15,28") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash2.draft_config", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="target checkpoint directory (config.json + tokenizer)")
    p.add_argument("--arch", required=True, choices=list(ARCHITECTURES), dest="architecture")
    p.add_argument("--out", required=True, help="the draft config.json to write")
    p.add_argument("--num-layers", type=int, default=5, help="draft decoder layers (default 5)")
    p.add_argument("--block-size", type=int, default=8, help="default 8")
    p.add_argument(
        "--target-layer-ids", type=parse_layer_ids, help="e.g. 1,15,28 (default: the servers' spread)"
    )
    p.add_argument("--sliding-window", type=int, default=2048, help="default 2048; 0: full attention")
    for flag, default in (("conv-kernel-size", "2"), ("conv-group-size", "16"), ("selector-top-k", "16")):
        p.add_argument(f"--{flag}", type=int, help=f"DFlash 2 only (default {default})")
    p.add_argument("--selector-rank", type=int, help="DFlash 2 only (default min(256, hidden_size / 4))")
    p.add_argument("--mask-token", help="a token the target's replies never contain (default: chosen)")
    p.add_argument(
        "--mask-token-id", type=int, help="an id instead of a token (a target without a tokenizer)"
    )
    for flag in ("num-attention-heads", "num-key-value-heads", "head-dim", "intermediate-size"):
        p.add_argument(f"--{flag}", type=int, help="default: the target's")
    p.add_argument("--rope-theta", type=float, help="default: the target's")
    p.add_argument("--max-position-embeddings", type=int, help="default: the target's")
    add_debug_flag(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = vars(parse_args(argv))
    target, out = Path(args.pop("target")), Path(args.pop("out"))
    args.pop("debug")
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory: give the file to write, e.g. {out / 'draft.json'}")
    cfg, mask_note = build_draft_config(target, DraftChoices(**args))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(cfg, indent=2) + "\n")
    print(f"{cfg['architectures'][0]} config for {target} -> {out}")
    print(mask_note)
    return 0


if __name__ == "__main__":
    exit_process(run_main(main))
