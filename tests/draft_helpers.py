"""Small shared builders for model tests: tiny draft configs and random non-identity weights."""

from __future__ import annotations

import copy

import torch

from dflash2.models import TargetHead, build_draft

HIDDEN, VOCAB, NUM_TARGET_LAYERS = 64, 257, 6

_BASE = {
    "architectures": ["DFlash2DraftModel"],
    "model_type": "qwen3",
    "hidden_size": HIDDEN,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "vocab_size": VOCAB,
    "num_target_layers": NUM_TARGET_LAYERS,
    "tie_word_embeddings": False,
    "is_causal": False,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 6,
    "use_sliding_window": True,
    "dflash_config": {
        "block_size": 4,
        "target_layer_ids": [1, 3, 4],
        "mask_token_id": 256,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 4,
        "output_multiplier": 1.0,
        "final_logit_softcapping": None,
    },
}


def tiny_draft_config(
    architecture: str = "DFlash2DraftModel", config_overrides: dict | None = None, **dflash_overrides
) -> dict:
    """`config_overrides`: top-level keys (e.g. sliding_window, layer_types, is_causal);
    `dflash_overrides`: keys of dflash_config."""
    cfg = copy.deepcopy(_BASE)
    cfg.update(copy.deepcopy(config_overrides or {}))
    cfg["architectures"] = [architecture]
    if architecture == "DFlashDraftModel":
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            cfg["dflash_config"].pop(key)
    cfg["dflash_config"].update(dflash_overrides)
    return cfg


def randomize_(module: torch.nn.Module, seed: int = 0, scale: float = 0.2) -> torch.nn.Module:
    """Overwrite every parameter with random values (norms around 1), so identity inits and zero
    codebooks cannot hide a bug."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * scale
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return module


def random_draft(
    architecture: str = "DFlash2DraftModel", seed: int = 0, config_overrides: dict | None = None, **overrides
):
    return randomize_(
        build_draft(tiny_draft_config(architecture, config_overrides, **overrides)), seed
    ).eval()


def random_head(seed: int = 1) -> TargetHead:
    gen = torch.Generator().manual_seed(seed)
    return TargetHead(
        torch.randn(VOCAB, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen) * 0.3
    )


def random_features(seq_len: int, batch: int = 1, seed: int = 2, num_layers: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq_len, num_layers * HIDDEN, generator=gen)


def plain_greedy(target, prompt: list[int], num_tokens: int) -> list[int]:
    """Reference greedy decoding: a full forward over the whole sequence for every token (no cache,
    no state to roll back)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
