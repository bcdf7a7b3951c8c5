"""DraftSpec: the typed description of a draft, parsed once from its config and kept on the model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash2.models import DraftSpec, build_draft, draft_spec
from dflash2.models.config import ARCHITECTURES, DEFAULT_ARCHITECTURE, load_config_dict, to_qwen3_config
from dflash2.models.registry import DRAFT_REGISTRY
from dflash2.models.spec import ConvSpec, LogitTransform, SelectorSpec
from dflash2.objective import ObjectiveConfig, summarize_metrics, total_loss
from tests.draft_helpers import random_draft, random_head, tiny_draft_config

SLIDING = "sliding_attention"


def spec(
    architecture, num_layers, hidden, layer_ids, mask_id, conv=None, selector=None, transform=None, **kw
):
    fields = dict(block_size=8, layer_types=(SLIDING,) * num_layers, is_causal=False, sliding_window=2048)
    fields.update(kw)
    return DraftSpec(
        architecture=architecture,
        mask_token_id=mask_id,
        target_layer_ids=tuple(layer_ids),
        num_layers=num_layers,
        hidden_size=hidden,
        conv=conv,
        selector=selector,
        logit_transform=transform,
        **fields,
    )


IDENTITY = LogitTransform(1.0, None)
# Written by hand from the config files.
SHIPPED = {
    "configs/draft/tiny-dflash.json": spec("DFlashDraftModel", 2, 128, [1, 3, 4], 3),
    "configs/draft/tiny-dflash2.json": spec(
        "DFlash2DraftModel", 2, 128, [1, 3, 4], 3, ConvSpec(2, 16), SelectorSpec(32, 8), IDENTITY
    ),
    "configs/draft/smollm2-dflash.json": spec("DFlashDraftModel", 3, 576, [1, 14, 27], 3),
    "configs/draft/smollm2-dflash2.json": spec(
        "DFlash2DraftModel", 3, 576, [1, 14, 27], 3, ConvSpec(2, 16), SelectorSpec(144, 16), IDENTITY
    ),
    "configs/qwen3.6-27b-dflash2.json": spec(
        "DFlash2DraftModel",
        5,
        5120,
        [5, 19, 33, 47, 61],
        248070,
        ConvSpec(2, 16),
        SelectorSpec(256, 16),
        IDENTITY,
    ),
}


@pytest.mark.parametrize("path", sorted(SHIPPED))
def test_spec_of_shipped_configs(path):
    assert draft_spec(path) == SHIPPED[path]
    assert DraftSpec.from_config(load_config_dict(path)) == SHIPPED[path]  # the raw dict reads alike


def test_spec_of_test_helper_configs():
    helper = dict(block_size=4, layer_types=(SLIDING, "full_attention"), sliding_window=6)
    v2 = spec(
        "DFlash2DraftModel", 2, 64, [1, 3, 4], 256, ConvSpec(2, 16), SelectorSpec(8, 4), IDENTITY, **helper
    )
    assert draft_spec(tiny_draft_config()) == v2
    # a v1 config that writes the transforms keeps them (the helper's v1 config writes the identity)
    assert draft_spec(tiny_draft_config("DFlashDraftModel")) == dataclasses.replace(
        v2, architecture="DFlashDraftModel", conv=None, selector=None
    )
    softcapped = draft_spec(tiny_draft_config(output_multiplier=1.3, final_logit_softcapping=8.0))
    assert softcapped.logit_transform == LogitTransform(1.3, 8.0)
    # no layer ids: the servers' spread over the target's depth (6 layers, 2 draft layers -> 1, 3)
    cfg = tiny_draft_config()
    del cfg["dflash_config"]["target_layer_ids"]
    assert draft_spec(cfg).target_layer_ids == (1, 3)


def test_the_model_keeps_the_spec_it_was_built_from():
    cfg = tiny_draft_config()
    draft = build_draft(cfg)
    assert draft.spec == draft_spec(cfg)
    assert (draft.block_size, draft.mask_token_id, draft.target_layer_ids) == (4, 256, [1, 3, 4])
    with pytest.raises(dataclasses.FrozenInstanceError):
        draft.spec.block_size = 8
    with pytest.raises(AttributeError):
        draft.block_size = 8
    # parsed once: editing the config object afterwards does not change the draft
    draft.config.dflash_config["block_size"] = 16
    assert draft.block_size == 4


def test_one_draft_class_per_architecture():
    assert list(DRAFT_REGISTRY) == list(ARCHITECTURES)
    for name, cls in DRAFT_REGISTRY.items():
        assert cls.architecture is ARCHITECTURES[name]
    assert DEFAULT_ARCHITECTURE in ARCHITECTURES
    cfg = tiny_draft_config("DFlashDraftModel")
    del cfg["architectures"]
    assert draft_spec(cfg).architecture == DEFAULT_ARCHITECTURE


# The draft part of the resume contract that train.build_contract wrote before the spec existed
# (configs' draft_config.to_dict()), frozen: a spec field change must not move a shipped contract.
def contract(
    architecture, layers, hidden, layer_ids, mask_id, conv=(None, None), selector=(None, None), mult=None
):
    return {
        "architecture": architecture,
        "num_draft_layers": layers,
        "hidden_size": hidden,
        "target_layer_ids": layer_ids,
        "block_size": 8,
        "mask_token_id": mask_id,
        "conv_kernel_size": conv[0],
        "conv_group_size": conv[1],
        "selector_rank": selector[0],
        "selector_top_k": selector[1],
        "output_multiplier": mult,
        "final_logit_softcapping": None,
        "sliding_window": 2048,
        "layer_types": [SLIDING] * layers,
        "is_causal": False,
    }


FROZEN_CONTRACTS = {
    "configs/draft/tiny-dflash.json": contract("DFlashDraftModel", 2, 128, [1, 3, 4], 3),
    "configs/draft/tiny-dflash2.json": contract(
        "DFlash2DraftModel", 2, 128, [1, 3, 4], 3, (2, 16), (32, 8), 1.0
    ),
    "configs/draft/smollm2-dflash.json": contract("DFlashDraftModel", 3, 576, [1, 14, 27], 3),
    "configs/draft/smollm2-dflash2.json": contract(
        "DFlash2DraftModel", 3, 576, [1, 14, 27], 3, (2, 16), (144, 16), 1.0
    ),
    "configs/qwen3.6-27b-dflash2.json": contract(
        "DFlash2DraftModel", 5, 5120, [5, 19, 33, 47, 61], 248070, (2, 16), (256, 16), 1.0
    ),
}


@pytest.mark.parametrize("path", sorted(FROZEN_CONTRACTS))
def test_contract_fields_equal_the_frozen_contracts(path):
    normalized = to_qwen3_config(load_config_dict(path)).to_dict()  # what a run hands the contract
    fields = DraftSpec.from_config(normalized).contract_fields()
    assert fields == FROZEN_CONTRACTS[path]
    assert list(fields) == list(FROZEN_CONTRACTS[path])  # the same order, hence the same bytes


def test_v1_logit_transforms_apply_as_before():
    """A v1 config that writes a transform is trained and decoded with it (as before the spec); one
    that writes none uses the logits as they are."""
    head = random_head()
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    draft = random_draft("DFlashDraftModel", seed=1, output_multiplier=1.3, final_logit_softcapping=8.0)
    logits = head.logits(hidden)
    want = 8.0 * torch.tanh(logits * 1.3 / 8.0)
    torch.testing.assert_close(draft.compute_logits(hidden, head), want, rtol=0, atol=0)
    cfg = ObjectiveConfig.for_draft(draft)
    assert (cfg.output_multiplier, cfg.softcap, cfg.top_k) == (1.3, 8.0, cfg.coverage_top_k)

    plain = tiny_draft_config("DFlashDraftModel")
    for key in ("output_multiplier", "final_logit_softcapping"):
        del plain["dflash_config"][key]
    draft = build_draft(plain)
    assert draft.spec.logit_transform is None
    assert draft.compute_logits(hidden, head) is not None
    assert draft.transform_logits(logits) is logits
    assert draft.spec.contract_fields()["output_multiplier"] is None
    cfg = ObjectiveConfig.for_spec(draft.spec, num_anchors=3)
    assert (cfg.output_multiplier, cfg.softcap, cfg.num_anchors) == (1.0, None, 3)


def test_total_loss_keeps_the_bits_of_the_logged_loss():
    """`loss` is base / w + alpha * selector / w, in that float order (changing it moves its last bits)."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        base, sel, w = (
            torch.rand(3, generator=gen, dtype=torch.float64) * torch.tensor([50.0, 30.0, 9.0])
        ).tolist()
        w += 1.0
        alpha = 0.7
        want = base / w
        want += alpha * sel / w
        assert total_loss(base, sel, alpha, w) == want
        assert total_loss(base, None, alpha, w) == base / w
    base_sum, sel_sum = torch.tensor(3.25, requires_grad=True), torch.tensor(1.5, requires_grad=True)
    assert total_loss(base_sum, None, 0.5) is base_sum
    assert float(total_loss(base_sum, sel_sum, 0.5).detach()) == 3.25 + 0.5 * 1.5


def test_summarize_passes_the_configs_alpha():
    sums = {
        "weight_sum": torch.tensor(7.0),
        "slot_count": torch.tensor([4.0, 3.0]),
        "slot_correct": torch.tensor([2.0, 1.0]),
        "slot_topk_hit": torch.tensor([3.0, 2.0]),
        "num_anchors": torch.tensor(4.0),
        "base_loss_sum": torch.tensor(9.1),
        "accept_len_sum": torch.tensor(6.0),
        "accept_len_max_sum": torch.tensor(9.0),
        "selector_loss_sum": torch.tensor(2.3),
        "selector_weight_sum": torch.tensor(5.0),
        "slot_selector_correct": torch.tensor([1.0, 1.0]),
        "accept_len_selector_sum": torch.tensor(5.0),
    }
    cfg = ObjectiveConfig.for_spec(draft_spec(tiny_draft_config()), selector_loss_alpha=0.3)
    assert cfg.summarize(sums) == summarize_metrics(sums, 0.3)
    assert cfg.summarize(sums) != summarize_metrics(sums, 0.5)
