"""The tensors of an export (contract section 4), written out by hand, against the shapes the
registry derives by building the draft on the meta device."""

from __future__ import annotations

import re

import pytest

from dflash2.models.config import draft_value, load_config_dict, normalize_draft_config
from dflash2.models.registry import expected_tensor_shapes
from tests.draft_helpers import tiny_draft_config

CONFIGS = [
    "configs/draft/tiny-dflash.json",
    "configs/draft/tiny-dflash2.json",
    "configs/draft/smollm2-dflash.json",
    "configs/draft/smollm2-dflash2.json",
    "configs/qwen3.6-27b-dflash2.json",
]


def contract_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor an export must hold, name -> shape (contract section 4, names without ``model.``)."""
    cfg = normalize_draft_config(cfg)
    hidden = cfg["hidden_size"]
    intermediate = cfg["intermediate_size"]
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    num_features = len(draft_value(cfg, "target_layer_ids"))
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, num_features * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    is_v2 = cfg["architectures"] == ["DFlash2DraftModel"]
    for i in range(cfg["num_hidden_layers"]):
        prefix = f"layers.{i}."
        layer = {
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (heads * head_dim, hidden),
            "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            "self_attn.o_proj.weight": (hidden, heads * head_dim),
            "self_attn.q_norm.weight": (head_dim,),
            "self_attn.k_norm.weight": (head_dim,),
            "mlp.gate_proj.weight": (intermediate, hidden),
            "mlp.up_proj.weight": (intermediate, hidden),
            "mlp.down_proj.weight": (hidden, intermediate),
        }
        if cfg.get("attention_bias"):
            layer["self_attn.q_proj.bias"] = (heads * head_dim,)
            layer["self_attn.k_proj.bias"] = (kv_heads * head_dim,)
            layer["self_attn.v_proj.bias"] = (kv_heads * head_dim,)
            layer["self_attn.o_proj.bias"] = (hidden,)
        if is_v2:
            kernel_size = draft_value(cfg, "conv_kernel_size")
            num_groups = hidden // draft_value(cfg, "conv_group_size")
            for conv in ("attention_conv", "mlp_conv"):
                layer[f"{conv}.base_kernel"] = (2, kernel_size, hidden)
                layer[f"{conv}.kernel_projection.weight"] = (2 * kernel_size * num_groups, hidden)
        shapes.update({prefix + name: shape for name, shape in layer.items()})
    if is_v2:
        rank, vocab = draft_value(cfg, "selector_rank"), cfg["vocab_size"]
        shapes["candidate_selector.predecessor_codebook"] = (vocab, rank)
        shapes["candidate_selector.successor_codebook"] = (vocab, rank)
        shapes["candidate_selector.hidden_projection.weight"] = (rank, hidden)
    return shapes


@pytest.mark.parametrize("path", CONFIGS)
@pytest.mark.parametrize("attention_bias", [False, True])
def test_meta_built_shapes_match_the_contract_table(path, attention_bias):
    cfg = load_config_dict(path)
    cfg["attention_bias"] = attention_bias
    assert expected_tensor_shapes(cfg) == contract_shapes(cfg)


@pytest.mark.parametrize("architecture", ["DFlashDraftModel", "DFlash2DraftModel"])
def test_meta_built_shapes_of_a_small_config(architecture):
    cfg = tiny_draft_config(architecture, num_target_layers=6, target_layer_ids=[0, 5])
    assert expected_tensor_shapes(cfg) == contract_shapes(cfg)


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda cfg: cfg.update(hidden_size=0), "hidden_size=0"),
        (lambda cfg: cfg.pop("head_dim"), "head_dim=None"),
        (lambda cfg: cfg["dflash_config"].update(selector_rank=0), "dflash_config.selector_rank=0"),
        (lambda cfg: cfg["dflash_config"].update(conv_kernel_size="2"), "dflash_config.conv_kernel_size='2'"),
        (lambda cfg: cfg["dflash_config"].update(target_layer_ids=[]), "dflash_config.target_layer_ids=[]"),
    ],
)
def test_shapes_of_a_broken_config_name_the_field(edit, field):
    cfg = tiny_draft_config()
    edit(cfg)
    with pytest.raises(ValueError, match="^" + re.escape(field)):
        expected_tensor_shapes(cfg)
