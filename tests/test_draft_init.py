"""model.init_from_target: the draft starts from the target's own layers.

References: the target model itself (transformers' modules, loaded with from_pretrained). A draft
layer initialised from target layer t must compute, module by module, what layer t computes on the
same input (norms, MLP, attention projections); the final norm is the target's; fc adds exactly
the identity on the deepest captured layer's slice. Targets whose layers are not the draft's kind
are refused with the fix, and a run prints the one-line summary and trains.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash2.draft_config import DraftChoices, build_draft_config
from dflash2.models import build_draft
from dflash2.target.draft_init import init_from_target
from tests.run_helpers import short_tiny_run
from tests.target_families import save_family

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def targets(tiny_default, tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-init")
    names = ("qwen3", "llama", "qwen3_moe", "qwen3_5_vlm", "gpt_oss")
    return {name: save_family(name, root / name, tiny_default.target_dir) for name in names}


def draft_for(target_dir, num_layers: int, seed: int = 0, **choices):
    cfg, _ = build_draft_config(target_dir, DraftChoices(num_layers=num_layers, block_size=4, **choices))
    torch.manual_seed(seed)
    return build_draft(cfg)


def assert_layers_compute_the_targets(draft, target_dir, layer_ids):
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    hidden = draft.config.hidden_size
    x = torch.randn(2, 5, hidden, generator=torch.Generator().manual_seed(1)) * 2
    with torch.no_grad():
        for mine, t in zip(draft.layers, layer_ids):
            theirs = target.model.layers[t]
            for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
                torch.testing.assert_close(getattr(mine, name)(x), getattr(theirs, name)(x))
            for name in ("q_proj", "k_proj", "v_proj"):
                torch.testing.assert_close(
                    getattr(mine.self_attn, name)(x), getattr(theirs.self_attn, name)(x)
                )
            y = torch.randn(2, 5, mine.self_attn.o_proj.in_features)
            torch.testing.assert_close(mine.self_attn.o_proj(y), theirs.self_attn.o_proj(y))
            if hasattr(theirs.self_attn, "q_norm"):
                z = torch.randn(2, 5, 3, mine.self_attn.head_dim)
                torch.testing.assert_close(mine.self_attn.q_norm(z), theirs.self_attn.q_norm(z))
                torch.testing.assert_close(mine.self_attn.k_norm(z), theirs.self_attn.k_norm(z))
        torch.testing.assert_close(draft.norm(x), target.model.norm(x))
        first = target.model.layers[layer_ids[0]].input_layernorm
        torch.testing.assert_close(draft.hidden_norm(x), first(x))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_each_draft_layer_computes_what_its_target_layer_computes(targets, family):
    target_dir = targets[family]
    draft = draft_for(target_dir, num_layers=2)
    fresh = draft_for(target_dir, num_layers=2)  # the same seed: what init_from_target started from
    summary = init_from_target(draft, target_dir, AutoConfig.from_pretrained(target_dir))
    num_target_layers = AutoConfig.from_pretrained(target_dir).num_hidden_layers
    last_two = [num_target_layers - 2, num_target_layers - 1]
    assert_layers_compute_the_targets(draft, target_dir, last_two)
    assert summary.startswith(
        f"draft initialised from the target: layers {last_two[0]} -> 0, {last_two[1]} -> 1"
    )

    # fc: the random init plus the identity on the deepest captured layer's slice, nothing else
    ids, hidden = draft.target_layer_ids, draft.config.hidden_size
    deepest = ids.index(max(ids))
    expected = fresh.fc.weight.detach().clone()
    expected[:, deepest * hidden : (deepest + 1) * hidden] += torch.eye(hidden)
    torch.testing.assert_close(draft.fc.weight.detach(), expected, rtol=0, atol=1e-6)
    # the DFlash 2 parts the target has no counterpart for keep their initialisation (the identity)
    for mine, theirs in zip(draft.layers, fresh.layers):
        torch.testing.assert_close(mine.attention_conv.base_kernel, theirs.attention_conv.base_kernel)
    assert "kept their initialisation: attention_conv, mlp_conv" in summary
    if family == "llama":  # Llama attention has no q/k norms: the draft's stay at one
        assert "self_attn.k_norm, self_attn.q_norm" in summary
        assert torch.equal(
            draft.layers[0].self_attn.q_norm.weight, torch.ones(draft.layers[0].self_attn.head_dim)
        )


def test_chosen_target_layers_and_the_smollm2_target(smollm2):
    draft = draft_for(smollm2.target_dir, num_layers=1)
    summary = init_from_target(
        draft, smollm2.target_dir, AutoConfig.from_pretrained(smollm2.target_dir), [20]
    )
    assert_layers_compute_the_targets(draft, smollm2.target_dir, [20])
    assert "layers 20 -> 0," in summary


def test_a_scaled_norm_of_another_convention_is_carried_by_its_effect():
    """A (1 + w) norm (Qwen3.5's) becomes the draft's plain-weight norm computing the same; a
    LayerNorm (mean-centred) is refused."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    from dflash2.target.draft_init import _norm_scale

    weight = torch.randn(16) * 0.3
    theirs = Qwen3_5RMSNorm(16, eps=1e-6)
    theirs.weight.data.copy_(weight)
    mine = Qwen3RMSNorm(16, eps=1e-6)
    mine.weight.data.copy_(_norm_scale(theirs, weight, mine, "norm.weight"))
    x = torch.randn(3, 16)
    torch.testing.assert_close(mine(x), theirs(x))
    torch.testing.assert_close(mine.weight.data, 1 + weight)
    with pytest.raises(ValueError, match="not an RMS norm with a scale; set model.init_from_target: false"):
        _norm_scale(torch.nn.LayerNorm(16), torch.ones(16), mine, "norm.weight")


@pytest.mark.parametrize(
    ("family", "names"),
    [
        ("qwen3_moe", "mlp.experts"),  # experts, not one MLP
        ("qwen3_5_vlm", "self_attn.q_proj.weight"),  # a gated attention: q_proj carries the gate
        ("gpt_oss", "self_attn"),  # attention sinks, biases, experts
    ],
)
def test_targets_whose_layers_are_not_the_drafts_kind_are_refused(targets, family, names):
    target_dir = targets[family]
    draft = draft_for(target_dir, num_layers=1)
    before = {name: p.detach().clone() for name, p in draft.named_parameters()}
    with pytest.raises(ValueError, match=f"{names}.*set model.init_from_target: false") as error:
        init_from_target(draft, target_dir, AutoConfig.from_pretrained(target_dir))
    assert "has no counterpart in the draft's layers" in str(error.value)
    assert all(torch.equal(p, before[name]) for name, p in draft.named_parameters())  # nothing was copied


def test_wrong_layer_ids_are_refused(targets):
    target_dir = targets["llama"]
    draft = draft_for(target_dir, num_layers=2)
    config = AutoConfig.from_pretrained(target_dir)
    for ids in ([5], [1, 6]):
        with pytest.raises(ValueError, match=r"must name 2 target layer\(s\) .* each in 0\.\.5"):
            init_from_target(draft, target_dir, config, ids)


def test_a_draft_deeper_than_the_target_names_the_setting_to_give(targets):
    target_dir = targets["llama"]  # 6 layers
    # (the default spread of 7 draft layers over 6 target layers repeats ids, which servers cannot feed)
    draft = draft_for(target_dir, num_layers=7, target_layer_ids=[1, 3, 4])
    with pytest.raises(
        ValueError, match="the draft has 7 layers, the target 6: give model.init_target_layers 7"
    ):
        init_from_target(draft, target_dir, AutoConfig.from_pretrained(target_dir))
    summary = init_from_target(
        draft, target_dir, AutoConfig.from_pretrained(target_dir), [0, 1, 2, 3, 4, 5, 5]
    )
    assert "5 -> 6" in summary  # repeats are allowed


def test_a_draft_under_another_rope_than_the_target_is_named(targets):
    target_dir = targets["llama"]
    cfg, _ = build_draft_config(target_dir, DraftChoices(num_layers=1, block_size=4))
    assert "RoPE" not in init_from_target(
        build_draft(cfg), target_dir, AutoConfig.from_pretrained(target_dir)
    )
    theta = cfg["rope_parameters"]["rope_theta"] * 100
    cfg["rope_parameters"]["rope_theta"] = cfg["rope_theta"] = theta
    summary = init_from_target(build_draft(cfg), target_dir, AutoConfig.from_pretrained(target_dir))
    assert summary.startswith("draft initialised from the target: layers ")
    assert f"; note: the draft's RoPE (rope_type default, rope_theta {theta}) is not the target's" in summary


def test_layers_without_the_switch_are_a_config_conflict():
    from dflash2.config import ModelConfig

    with pytest.raises(
        ValueError, match="model.init_target_layers is set but model.init_from_target is false"
    ):
        ModelConfig(draft_config="d.json", target="t", init_target_layers=[3])


def test_a_run_initialised_from_the_target_trains(tiny_default, tmp_path):
    result, steps = short_tiny_run(
        tiny_default, tmp_path, "model.init_from_target=true", num_lines=16, steps=6
    )
    assert "[dflash2] draft initialised from the target: layers " in result.stdout
    assert all(math.isfinite(m["loss"]) for m in steps)
    assert sum(m["loss"] for m in steps[-2:]) < sum(m["loss"] for m in steps[:2])
