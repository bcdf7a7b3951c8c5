"""Memory plan: parameter counts against real instantiations, shard arithmetic, the activation
estimate against the tensors a real CPU step saves for backward, and the 27B recipes."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash2.config import load_run_config
from dflash2.errors import EXIT_DOES_NOT_FIT, EXIT_USER_ERROR, run_main
from dflash2.fixtures.tiny_default import TARGET_DIMS
from dflash2.models import TargetHead, build_draft
from dflash2.models.config import load_config_dict
from dflash2.objective import ObjectiveConfig, compute_objective
from dflash2.plan import (
    DTYPE_BYTES,
    GIB,
    StepShapes,
    count_params,
    draft_activation_bytes,
    load_target_config,
    main,
    meta_models,
    plan_run,
)
from tests.run_helpers import check_ok, launch_train, tiny_subset

TINY = "configs/tiny-dflash2.yaml"
TINY_DRAFT = "configs/draft/tiny-dflash2.json"
ZERO3_RECIPE = "configs/recipes/qwen3.6-27b-dflash2-8gpu-zero3.yaml"
DISAGG_RECIPE = "configs/recipes/qwen3.6-27b-dflash2-2gpu-disaggregated.yaml"
TARGET_27B = "configs/target/qwen3.6-27b.json"
# the tiny config's micro-batch of 8 on any number of ranks (its global batch of 8 fits one rank)
PER_RANK_BATCH = "train.global_batch_size=null"


def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def item(role, name: str) -> float:
    return next(i.num_bytes for i in role.items if i.name == name)


@pytest.fixture(scope="module")
def tiny_target_config() -> Qwen3Config:
    return Qwen3Config(**TARGET_DIMS)


def test_meta_counts_equal_real_models(tiny_target_config):
    cfg = load_run_config(TINY)
    draft_meta, target_meta = meta_models(cfg, tiny_target_config)
    torch.manual_seed(0)
    draft, target = build_draft(TINY_DRAFT), Qwen3ForCausalLM(tiny_target_config)
    draft_counts, target_counts = count_params(draft_meta), count_params(target_meta)
    assert draft_counts.total == numel(draft) and target_counts.total == numel(target)
    # sharding units: one per decoder layer (+ the DFlash 2 selector), the root holds the rest
    expected_blocks = sorted([numel(layer) for layer in draft.layers] + [numel(draft.candidate_selector)])
    assert sorted(draft_counts.blocks) == expected_blocks
    assert draft_counts.root == numel(draft.fc) + numel(draft.hidden_norm) + numel(draft.norm)
    assert target_counts.blocks == tuple(numel(layer) for layer in target.model.layers)
    assert target_counts.largest_module == tiny_target_config.vocab_size * tiny_target_config.hidden_size


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp"])
def test_colocated_shards_divide_over_world(tiny_target_config, backend):
    cfg = load_run_config(TINY, [f"backend={backend}", PER_RANK_BATCH])
    (role,) = plan_run(cfg, world_size=4, target_config=tiny_target_config).roles
    draft_total = numel(build_draft(TINY_DRAFT))
    target_total = numel(Qwen3ForCausalLM(tiny_target_config))
    assert role.role == "colocated" and role.num_ranks == 4
    assert item(role, "target shards") == pytest.approx(target_total * 4 / 4)  # fp32 run
    assert item(role, "draft parameters") == pytest.approx(draft_total * 4 / 4)
    assert item(role, "draft optimizer state") == pytest.approx(draft_total * 8 / 4)  # exp_avg + exp_avg_sq
    vocab, hidden = tiny_target_config.vocab_size, tiny_target_config.hidden_size
    assert item(role, "embedding + LM head copy") == 2 * vocab * hidden * 4  # whole, on every rank


def test_bf16_zero3_keeps_fp32_master_and_offload_moves_state_to_cpu(tiny_target_config):
    cfg = load_run_config(TINY, ["precision=bf16", "ds_config=ds_configs/zero3_offload.json", PER_RANK_BATCH])
    (role,) = plan_run(cfg, world_size=2, target_config=tiny_target_config).roles
    draft_total = numel(build_draft(TINY_DRAFT))
    assert item(role, "draft parameters") == pytest.approx(draft_total * 2 / 2)  # bf16 partition
    assert item(role, "draft optimizer state") == pytest.approx(draft_total * 12 / 2)  # master + 2 moments
    offloaded = {i.name for i in role.items if i.where == "cpu"}
    assert offloaded == {
        "target shards",
        "draft parameters",
        "draft gradients",  # DeepSpeed's flat gradient partitions follow the optimizer to the CPU
        "draft fp32 gradients (step)",
        "draft optimizer state",
    }


def test_disaggregated_target_only_on_capture_ranks(tiny_target_config):
    cfg = load_run_config(TINY, ["backend=fsdp", "topology=disaggregated", "capture_ranks=1", PER_RANK_BATCH])
    capture, trainer = plan_run(cfg, world_size=3, target_config=tiny_target_config).roles
    assert (capture.role, capture.num_ranks, trainer.role, trainer.num_ranks) == ("capture", 1, "trainer", 2)
    target_total = numel(Qwen3ForCausalLM(tiny_target_config))
    assert item(capture, "target shards") == pytest.approx(target_total * 4)  # the whole target, fp32
    assert item(trainer, "draft parameters") == pytest.approx(numel(build_draft(TINY_DRAFT)) * 4 / 2)
    assert not any(i.name.startswith("target") for i in trainer.items)
    assert not any(i.name.startswith("draft") for i in capture.items)
    with pytest.raises(ValueError, match="no trainer rank"):
        plan_run(cfg, world_size=1, target_config=tiny_target_config)


def measured_saved_bytes(draft, head, batch, objective) -> int:
    """Bytes of every distinct tensor storage autograd saves during a real objective forward
    (parameters, head buffers and the input features excluded: they are not activations)."""
    skip = {t.untyped_storage().data_ptr() for t in [*draft.parameters(), *head.buffers(), batch["features"]]}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compute_objective(draft, head, batch, objective, torch.Generator().manual_seed(0))
    return sum(saved.values())


@pytest.mark.parametrize(
    "precision,batch_size,num_anchors,seq_len,heads,window",
    [
        ("fp32", 1, 16, 256, (4, 2), 2048),
        ("fp32", 2, 64, 512, (8, 2), 2048),
        ("bf16", 1, 64, 1024, (4, 2), 2048),
        ("fp32", 2, 64, 1024, (4, 2), 128),  # window-bounded: each block scores 128 + 16 - 2 keys
        ("bf16", 1, 64, 1024, (8, 2), 256),
    ],
)
def test_activation_estimate_matches_a_real_step(precision, batch_size, num_anchors, seq_len, heads, window):
    config = json.load(open(TINY_DRAFT))
    config.update(num_attention_heads=heads[0], num_key_value_heads=heads[1], sliding_window=window)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    torch.manual_seed(0)
    draft = build_draft(config).to(dtype)
    hidden, vocab, block = config["hidden_size"], config["vocab_size"], config["dflash_config"]["block_size"]
    num_features = len(config["dflash_config"]["target_layer_ids"])
    head = TargetHead(torch.randn(vocab, hidden, dtype=dtype), 0.05 * torch.randn(vocab, hidden, dtype=dtype))
    batch = {
        "input_ids": torch.randint(4, vocab, (batch_size, seq_len)),
        "loss_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
        "features": torch.randn(batch_size, seq_len, num_features * hidden, dtype=dtype),
    }
    objective = ObjectiveConfig.for_draft(
        draft, mask_token_id=3, num_anchors=num_anchors, logits_chunk_rows=64
    )
    measured = measured_saved_bytes(draft, head, batch, objective)
    shapes = StepShapes(
        batch=batch_size, seq_len=seq_len, num_anchors=num_anchors, block_size=block, hidden=hidden,
        intermediate=config["intermediate_size"], num_heads=heads[0], num_kv_heads=heads[1],
        head_dim=config["head_dim"], num_features=num_features, teacher=False,
        selector_top_k=config["dflash_config"]["selector_top_k"],
        selector_rank=config["dflash_config"]["selector_rank"],
        sliding_windows=(window,) * config["num_hidden_layers"],
    )  # fmt: skip
    estimate = draft_activation_bytes(shapes, DTYPE_BYTES[precision])
    estimate.pop("backward (one layer)")  # transient gradients, not saved tensors
    assert 0.95 * measured <= sum(estimate.values()) <= 1.3 * measured


def test_a_teacher_adds_the_last_hidden_state_to_the_captured_features(tiny_target_config):
    # a KL weight (or labels: target) captures [b, S, (K+1)*H]: the planner counts the one more state
    def captured(*overrides):
        cfg = load_run_config(TINY, [PER_RANK_BATCH, *overrides])
        (role,) = plan_run(cfg, world_size=1, target_config=tiny_target_config).roles
        return item(role, "captured features")

    num_features = len(load_config_dict(TINY_DRAFT)["dflash_config"]["target_layer_ids"])
    plain = captured()
    assert captured("objective.kl_weight=1") == pytest.approx(plain * (num_features + 1) / num_features)
    assert captured("objective.labels=target") == captured("objective.kl_weight=1")


def test_27b_recipes_plan_on_meta():
    target_config = load_target_config(TARGET_27B)
    zero3 = plan_run(load_run_config(ZERO3_RECIPE), world_size=8, target_config=target_config)
    disagg = plan_run(load_run_config(DISAGG_RECIPE), world_size=2, target_config=target_config)
    assert any("1.924 B parameters" in line for line in zero3.header)  # the ~1.92 B draft
    assert any("26.896 B parameters" in line for line in zero3.header)
    (colocated,) = zero3.roles
    capture, trainer = disagg.roles
    for role in (colocated, capture, trainer):
        assert role.total() < 80 * GIB, role.role
    assert not zero3.warnings and not disagg.warnings
    # the capture GPU holds the whole bf16 target: 26.9 B x 2 bytes
    assert item(capture, "target shards") == pytest.approx(26_895_998_464 * 2)


def test_cli_prints_plan_and_warns_on_small_devices(capsys):
    args = [ZERO3_RECIPE, "--world-size", "8", "--target-config", TARGET_27B]
    assert main([*args, "--device-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "per colocated rank (8 ranks)" in out and "fits" in out and "WARNING" not in out
    main([*args, "--device-gb", "24", "train.micro_batch_size=2"])
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "WARNING: colocated ranks need" in out


def test_the_fit_hint_names_only_levers_that_can_move(capsys):
    args = [ZERO3_RECIPE, "--world-size", "8", "--target-config", TARGET_27B, "--device-gb", "24"]
    main(args)  # the recipe's micro-batch is 1 already
    out = capsys.readouterr().out
    assert "lower data.max_length, objective.num_anchors or objective.logits_chunk_rows, add ranks" in out
    main([*args, "train.micro_batch_size=2"])
    assert (
        "lower train.micro_batch_size, data.max_length, objective.num_anchors or" in capsys.readouterr().out
    )


def test_the_logits_chunk_with_the_teacher_is_what_distill_loss_allocates(monkeypatch):
    """distill_loss cuts a third of logits_chunk_rows a chunk (three fp32 [rows, V] buffers each):
    the rows it is handed are counted here, not assumed."""
    import dflash2.objective as objective_module

    target_config = load_target_config(TARGET_27B)
    cfg = load_run_config(ZERO3_RECIPE)
    assert cfg.objective.needs_teacher
    (role,) = plan_run(cfg, world_size=8, target_config=target_config).roles
    seen = []
    apply = objective_module._ChunkedDistill.apply
    monkeypatch.setattr(objective_module._ChunkedDistill, "apply", lambda *a: seen.append(a[8]) or apply(*a))
    head = TargetHead(torch.randn(50, 8), torch.randn(50, 8))
    terms = objective_module.LossTerms(0.0, 1.0, 0.0, 1.0, 1.0, None)
    rows = cfg.objective.logits_chunk_rows
    objective_module.distill_loss(
        torch.randn(4, 8), head, torch.zeros(4, dtype=torch.long), torch.ones(4), torch.randn(4, 8),
        torch.arange(4), terms, rows, 4,
    )  # fmt: skip
    (chunk,) = seen
    vocab = target_config.get_text_config().vocab_size
    assert item(role, "logits chunk") == chunk * vocab * (3 * 4 + 2 * 2)  # bf16 compute


def test_cli_exit_codes_gate_a_launch(capsys):
    """0: fits; 3 (EXIT_DOES_NOT_FIT): a role needs more than --device-gb; 2: a global batch the
    data-parallel ranks cannot split (30 sequences on 8 ranks), one message, before any model is built."""
    args = [ZERO3_RECIPE, "--world-size", "8", "--target-config", TARGET_27B]
    assert main([*args, "--device-gb", "80"]) == 0
    assert "global batch 32: micro-batch 1 x 4 accumulation steps x 8 ranks" in capsys.readouterr().out
    assert main([*args, "--device-gb", "24"]) == EXIT_DOES_NOT_FIT == 3
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert run_main(main, [*args, "train.global_batch_size=30"]) == EXIT_USER_ERROR
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("error:") == 1
    assert "train.global_batch_size=30 is not a multiple of micro_batch_size 1 x 8" in captured.err
    assert "(--world-size 8)" in captured.err
    # 2 nodes x 8 GPUs: the recipe's 32 sequences are 2 accumulation steps
    assert main([ZERO3_RECIPE, "--world-size", "16", "--target-config", TARGET_27B]) == 0
    assert "global batch 32: micro-batch 1 x 2 accumulation steps x 16 ranks" in capsys.readouterr().out


def test_checkpoint_size_is_what_a_checkpoint_holds_and_its_write_time_follows_the_bandwidth(
    capsys, tmp_path, tiny_default
):
    """The planned size against the files of a real one-rank checkpoint of the tiny draft (fp32 draft
    weights, plus the backend's fp32 weights and AdamW moments); the write time is size / bandwidth."""
    overrides = [f"model.target={tiny_default.target_dir}", f"data.train={tiny_subset(tiny_default, tmp_path, 16)}",
                 "backend=fsdp", "train.max_steps=1", "train.export=false", "train.progress_bar=false",
                 f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    check_ok(launch_train(1, overrides))
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000001"
    written = sum(f.stat().st_size for f in [checkpoint / "draft.safetensors", *checkpoint.glob("backend/*")])
    cfg = load_run_config(TINY, overrides)
    planned = plan_run(cfg, world_size=1, target_config=load_target_config(tiny_default.target_dir))
    assert planned.checkpoint_bytes <= written <= 1.02 * planned.checkpoint_bytes  # + headers, metadata
    recipe = plan_run(
        load_run_config(ZERO3_RECIPE), world_size=8, target_config=load_target_config(TARGET_27B)
    )
    assert main([ZERO3_RECIPE, "--target-config", TARGET_27B, "--write-gb-per-s", "2"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("checkpoint:"))
    size = recipe.checkpoint_bytes / 1e9  # 1.924 B parameters x 16 bytes
    assert (
        f"checkpoint: {size:.3g} GB" in line and f"about {math.ceil(size / 2)} s to write at 2 GB/s" in line
    )
