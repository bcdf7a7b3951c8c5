"""resolve_run: the facts every role of a run shares, read once from the files (no model is built)."""

from __future__ import annotations

import json
import warnings

import pytest
from transformers import AutoConfig, AutoTokenizer

from dflash2.checkpoint import TrainState, save_checkpoint
from dflash2.config import load_run_config
from dflash2.identity import data_identity, target_identity, tokenizer_identity
from dflash2.models import build_draft
from dflash2.models.config import load_config_dict
from dflash2.run_plan import build_contract, position_limit, resolve_run
from tests.run_helpers import REPO
from tests.test_checkpoint import FakeBackend

# The contracts the tiny runs wrote before the run plan existed (checkpoints/step_*/contract.json of
# `launch/train.py --config configs/tiny-dflash{,2}.yaml`), less the identities of their inputs.
COMMON = {
    "block_size": 8, "ce_weight": 1.0, "chat_template_kwargs": {}, "distill_temperature": 1.0,
    "global_batch_size": 8, "hidden_size": 128, "is_causal": False, "kl_weight": 0.0,
    "layer_types": ["sliding_attention", "sliding_attention"], "loss_gamma": 7.0, "mask_token_id": 3,
    "num_anchors": 16, "num_draft_layers": 2, "position_decay": 0.8, "position_weighting": "gamma",
    "seed": 0, "selector_loss_alpha": 1.0, "selector_mode": "insert", "sliding_window": 2048,
    "target_layer_ids": [1, 3, 4], "tv_weight": 0.0, "final_logit_softcapping": None,
    # joined the contract later (checkpoint.CONTRACT_FIELDS_UNRECORDED), at the values these runs train with
    "labels": "data", "loss_vocab_size": None, "supervised_tokens": "replies", "max_length": 256,
    "duplicates": "keep",
    # joined later with its key (checkpoint.CONTRACT_FIELDS_ADDED), at the value older runs behaved as
    "selector_grad": "backbone",
}  # fmt: skip
FROZEN = {
    "tiny-dflash.yaml": {
        **COMMON, "architecture": "DFlashDraftModel", "conv_group_size": None, "conv_kernel_size": None,
        "output_multiplier": None, "selector_rank": None, "selector_top_k": None,
    },
    "tiny-dflash2.yaml": {
        **COMMON, "architecture": "DFlash2DraftModel", "conv_group_size": 16, "conv_kernel_size": 2,
        "output_multiplier": 1.0, "selector_rank": 32, "selector_top_k": 8,
    },
}  # fmt: skip
IDENTITIES = ("target", "tokenizer", "dataset")


def tiny_config(tiny_default, name: str, run_dir, *more: str):
    paths = [f"model.target={tiny_default.target_dir}", f"data.train={tiny_default.train_jsonl}"]
    return load_run_config(REPO / "configs" / name, [*paths, f"output_dir={run_dir}", *more])


@pytest.mark.parametrize("name", sorted(FROZEN))
def test_the_plan_of_each_tiny_run(tiny_default, tmp_path, name):
    cfg = tiny_config(tiny_default, name, tmp_path / "run")
    plan = resolve_run(cfg)
    tokenizer = AutoTokenizer.from_pretrained(tiny_default.target_dir)
    assert plan.layer_ids == [1, 3, 4]
    assert plan.pad_token_id == tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
    assert plan.target_hidden_size == AutoConfig.from_pretrained(tiny_default.target_dir).hidden_size == 128
    assert plan.config.train.grad_accum_steps == 1 and plan.global_batch_size == 8
    assert {k: v for k, v in plan.contract.items() if k not in IDENTITIES} == FROZEN[name]
    assert [plan.contract[k] for k in IDENTITIES] == [
        target_identity(tiny_default.target_dir),
        tokenizer_identity(tiny_default.target_dir),
        data_identity(tiny_default.train_jsonl),
    ]
    # what the model built from the plan holds, and the contract of that model's config
    draft = build_draft(plan.draft_source)
    assert plan.spec == draft.spec
    assert plan.contract == build_contract(cfg, draft.config.to_dict(), data_parallel_size=1)
    raw = build_draft(load_config_dict(cfg.model.draft_config), target_config=plan.target_config)
    assert draft.config.to_dict() == raw.config.to_dict()  # the config a checkpoint's draft_config.json holds
    assert (plan.objective.block_size, plan.objective.mask_token_id) == (8, 3)
    assert plan.resume_from is None and plan.start == TrainState()


def test_the_batch_layout_follows_the_data_parallel_ranks(tiny_default, tmp_path):
    cfg = tiny_config(tiny_default, "tiny-dflash2.yaml", tmp_path / "run", "train.micro_batch_size=4")
    one, two = resolve_run(cfg, 1), resolve_run(cfg, 2)
    assert (one.config.train.grad_accum_steps, two.config.train.grad_accum_steps) == (2, 1)
    assert one.contract == two.contract  # the global batch, not its split, is what a checkpoint holds
    with pytest.raises(ValueError, match="train.global_batch_size=8 is not a multiple of micro_batch_size 8"):
        resolve_run(tiny_config(tiny_default, "tiny-dflash2.yaml", tmp_path / "run"), 2)


def test_a_plan_resumes_from_the_latest_complete_checkpoint(tiny_default, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_config(tiny_default, "tiny-dflash2.yaml", run_dir)
    contract = resolve_run(cfg).contract
    for step, state in (
        (2, {"step": 2, "epoch": 0, "step_in_epoch": 2}),
        (5, {"step": 5, "epoch": 1, "step_in_epoch": 1}),
    ):
        save_checkpoint(
            FakeBackend(), run_dir, step, draft_config={}, contract=contract, train_state=state, keep_last=3
        )
    plan = resolve_run(cfg)
    assert plan.resume_from == run_dir / "checkpoints" / "step_00000005"
    assert plan.start == TrainState(step=5, epoch=1, step_in_epoch=1)
    chosen = resolve_run(
        tiny_config(
            tiny_default,
            "tiny-dflash2.yaml",
            run_dir,
            f"train.resume={run_dir / 'checkpoints' / 'step_00000002'}",
        )
    )
    assert chosen.start == TrainState(step=2, epoch=0, step_in_epoch=2)
    assert (
        resolve_run(tiny_config(tiny_default, "tiny-dflash2.yaml", run_dir, "train.resume=none")).resume_from
        is None
    )


def test_a_coverage_top_k_above_the_vocabulary_is_refused_before_a_step(tiny_default, tmp_path):
    """torch.topk would fail mid-step with 'selected index k out of range' (the tiny vocabulary: 1024)."""
    assert resolve_run(
        tiny_config(tiny_default, "tiny-dflash.yaml", tmp_path / "run", "objective.coverage_top_k=1024")
    )
    cfg = tiny_config(tiny_default, "tiny-dflash.yaml", tmp_path / "run", "objective.coverage_top_k=1025")
    with pytest.raises(ValueError, match=r"coverage_top_k=1025 is above the target's vocabulary \(1024\)"):
        resolve_run(cfg)


def test_a_max_length_past_the_positions_of_the_target_or_the_draft_is_refused(tiny_default, tmp_path):
    """The tiny target and its drafts are made for 2048 positions: a longer data.max_length would feed the
    target positions it never saw and train the draft past its config's RoPE table."""
    assert resolve_run(
        tiny_config(tiny_default, "tiny-dflash2.yaml", tmp_path / "run", "data.max_length=2048")
    )
    cfg = tiny_config(tiny_default, "tiny-dflash2.yaml", tmp_path / "run", "data.max_length=2049")
    with pytest.raises(
        ValueError,
        match=r"data.max_length=2049 is above the 2048 positions the target is made for \(.*config.json: max_position_embeddings=2048\)",
    ):
        resolve_run(cfg)
    draft = load_config_dict(REPO / "configs/draft/tiny-dflash2.json") | {"max_position_embeddings": 1024}
    (tmp_path / "draft.json").write_text(json.dumps(draft))
    cfg = tiny_config(
        tiny_default,
        "tiny-dflash2.yaml",
        tmp_path / "run",
        "data.max_length=1500",
        f"model.draft_config={tmp_path / 'draft.json'}",
    )
    with pytest.raises(
        ValueError,
        match=r"above the 1024 positions the draft is made for \(.*draft.json: max_position_embeddings=1024\); set data.max_length <= 1024",
    ):
        resolve_run(cfg)


def test_the_positions_of_a_yarn_target_are_its_factor_times_the_original_length():
    """Qwen3's model card adds YaRN (factor 4 over 32768) and keeps max_position_embeddings 40960: the
    model is made for 131072 positions. Llama 3.1 writes its extended length itself."""
    from transformers import LlamaConfig, Qwen3Config

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers notes the factor that max_position_embeddings implies
        qwen = Qwen3Config(max_position_embeddings=40960, rope_scaling=yarn)
    assert position_limit(qwen) == (131072, "yarn RoPE scaling, factor 4 over 32768 positions")
    assert position_limit(Qwen3Config(max_position_embeddings=40960)) == (
        40960,
        "max_position_embeddings=40960",
    )
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    llama3 |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    llama = LlamaConfig(max_position_embeddings=131072, rope_scaling=llama3)
    assert position_limit(llama) == (131072, "max_position_embeddings=131072")
    # RoPE parameters per layer type (sliding and full attention): the scaled type's reach counts
    from transformers import Gemma3TextConfig

    per_type = {"full_attention": {**yarn, "rope_theta": 1e6}, "sliding_attention": {"rope_type": "default"}}
    gemma = Gemma3TextConfig(max_position_embeddings=32768, rope_parameters=per_type)
    assert position_limit(gemma) == (
        131072,
        "yarn RoPE scaling (full_attention layers), factor 4 over 32768 positions",
    )
    # Gemma 3 as published: linear factor 8 on its full-attention layers, max_position_embeddings
    # already the scaled length (no original length named)
    linear = {
        "full_attention": {"rope_type": "linear", "factor": 8.0},
        "sliding_attention": {"rope_type": "default"},
    }
    gemma = Gemma3TextConfig(max_position_embeddings=131072, rope_parameters=linear)
    assert position_limit(gemma) == (131072, "max_position_embeddings=131072")
