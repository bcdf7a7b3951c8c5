"""Both backends in real processes (2 ranks under torchrun, 1 rank under plain python) against
independent references: an unsharded Hugging Face forward and a single-process PyTorch training loop."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash2.checkpoint import find_latest
from dflash2.distributed.ds_config import resolve_ds_config
from dflash2.distributed.env import _fill_launch_env, build_backend
from tests.dist_scripts.tiny import StandInDraft, micro_batch, save_tiny_target, weighted_loss_sum
from tests.dist_scripts.train_tiny import MICRO_BATCH_SIZE, TARGET_LAYER_IDS, target_inputs

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "dist_scripts" / "train_tiny.py"
LAUNCH_TIMEOUT_S = 300  # one launch runs every case of a module in 15-60 s here (see run_helpers)
STEPS = 4
SAVE_AT = 2
# LR of each optimizer step for lr=1e-2, warmup 1, cosine over 4 steps to 0.1 * lr (computed by hand)
EXPECTED_LRS = [1e-2, 1e-2, 0.775e-2, 0.325e-2]


def launch(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        command = [sys.executable, str(SCRIPT), *args]
    else:
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
        ]
        command = [*torchrun, str(SCRIPT), *args]
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )


def check_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"launch failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("target")
    save_tiny_target(str(path))
    return path


@pytest.fixture(scope="module")
def load_targets(tiny_default, tmp_path_factory) -> list[Path]:
    """Targets the 2-rank FSDP2 run loads both sharded and whole: the tiny default, and a tiny
    Qwen3 with tied embeddings."""
    tied = tmp_path_factory.mktemp("tied_target")
    save_tiny_target(str(tied), tied=True)
    return [tiny_default.target_dir, tied]


@pytest.fixture(scope="module")
def ds_configs(tmp_path_factory) -> dict[str, Path]:
    """The shipped ZeRO-3 configs, with every parameter partitioned (the tiny model is below the
    default persistence threshold, which would keep it whole on each rank)."""
    paths = {}
    for name in ("zero3", "zero3_offload"):
        config = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        paths[name] = tmp_path_factory.mktemp("ds") / f"{name}.json"
        paths[name].write_text(json.dumps(config))
    return paths


# (backend, ranks) -> (draft precision, DeepSpeed config): 2 ranks in fp32 for tight comparisons,
# 1 rank in bf16 (and with ZeRO-Offload for DeepSpeed) to cover the production settings
SETUPS = {
    ("fsdp", 2): ("fp32", None),
    ("deepspeed", 2): ("fp32", "zero3"),
    ("fsdp", 1): ("bf16", None),
    ("deepspeed", 1): ("bf16", "zero3_offload"),
}


@pytest.fixture(scope="module")
def runs(target_dir, ds_configs, load_targets, tmp_path_factory):
    """runs(backend, nproc): one training launch (checks + 4 steps, checkpoint at step 2) and, on 2
    ranks, a resumed launch from that checkpoint; each launched once per module."""
    cache = {}

    def get(backend: str, nproc: int) -> dict:
        if (backend, nproc) not in cache:
            precision, ds_config = SETUPS[backend, nproc]
            ds_config_path = ds_configs[ds_config] if ds_config else None
            compare = load_targets if (backend, nproc) == ("fsdp", 2) else []
            cache[backend, nproc] = launch_pair(
                backend, nproc, precision, target_dir, ds_config_path, tmp_path_factory, compare
            )
        return cache[backend, nproc]

    return get


TORCH_ABORT = "terminate called without an active exception"


def launch_pair(
    backend: str,
    nproc: int,
    precision: str,
    target_dir: Path,
    ds_config: Path | None,
    tmp_path_factory,
    compare_load: list[Path],
) -> dict:
    base = tmp_path_factory.mktemp(f"{backend}{nproc}")
    common = ["--backend", backend, "--target-dir", str(target_dir), "--run-dir", str(base / "run")]
    common += ["--precision", precision] + (["--ds-config", str(ds_config)] if ds_config else [])
    first_args = ["--out", str(base / "first"), "--steps", str(STEPS), "--save-at", str(SAVE_AT)]
    first = launch(nproc, [*common, *first_args, "--compare-load", *map(str, compare_load)])
    if first.returncode != 0 and TORCH_ABORT in first.stderr:
        # A worker aborted inside torch's C++ runtime (seen in 2 of 5 full suite runs on one day,
        # never alone, cause not found): said here, then launched once more from nothing. A second
        # abort fails the test.
        warnings.warn(
            f"{backend} x {nproc}: a worker aborted ({TORCH_ABORT!r}); launching again", stacklevel=2
        )
        shutil.rmtree(base / "first", ignore_errors=True)
        shutil.rmtree(base / "run", ignore_errors=True)
        first = launch(nproc, [*common, *first_args, "--compare-load", *map(str, compare_load)])
    check_ok(first)
    resumed = None
    if nproc == 2:
        resume_args = ["--out", str(base / "resumed"), "--steps", str(STEPS), "--resume", "--skip-target"]
        resumed = launch(nproc, [*common, *resume_args, "--crash-in-final-save"])
    return {"backend": backend, "nproc": nproc, "precision": precision, "base": base, "resumed": resumed}


ALL_RUNS = list(SETUPS)
TWO_RANK_RUNS = [("fsdp", 2), ("deepspeed", 2)]


@pytest.mark.parametrize("backend,nproc", ALL_RUNS)
def test_target_is_sharded(runs, backend, nproc):
    run = runs(backend, nproc)
    sizes = [
        json.loads((run["base"] / "first" / f"target_numel_rank{r}.json").read_text())
        for r in range(run["nproc"])
    ]
    total = sizes[0]["total"]
    assert total > 100_000  # the tiny Qwen3: embedding + 2 layers + LM head
    for size in sizes:
        # each rank holds its 1/nproc share (ZeRO-3 pads each tensor to a multiple of the world size)
        assert size["local"] <= total // run["nproc"] + 64
    assert sum(size["local"] for size in sizes) >= total


@pytest.mark.parametrize("backend,nproc", ALL_RUNS)
def test_target_features_and_head_match_unsharded_model(runs, backend, nproc, target_dir):
    run = runs(backend, nproc)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    # the output of the last decoder layer, not its final-normed version that hidden_states[L] holds
    reference.get_decoder().config.tie_last_hidden_states = False
    input_ids, attention_mask = target_inputs()
    with torch.no_grad():
        hidden = reference(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[i + 1] for i in TARGET_LAYER_IDS], dim=-1)
    for rank in range(run["nproc"]):
        got = load_file(str(run["base"] / "first" / f"target_rank{rank}.safetensors"))
        assert got["features"].shape == expected.shape  # [b, S, K*H]
        # fp32, same kernels: only reduction-order differences from the sharded all-gathers
        torch.testing.assert_close(got["features"], expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(got["embed"], reference.get_input_embeddings().weight)
        assert torch.equal(got["lm_head"], reference.get_output_embeddings().weight)


def test_sharded_fsdp_load_equals_the_full_load(runs):
    """FSDP2 builds the target on meta and reads each rank's shards; against a plain from_pretrained
    in the same process: identical features, non-persistent buffers (rotary inv_freq) and LM head,
    and tied embeddings stay one tensor."""
    run = runs("fsdp", 2)
    # the tiny default in fp32, the tied target in fp32, the tiny default read from fp32 into bf16
    for index, expect_tied in enumerate([False, True, False]):
        for rank in range(2):
            got = load_file(str(run["base"] / "first" / f"load{index}_rank{rank}.safetensors"))
            sharded = {k.split(".", 1)[1]: v for k, v in got.items() if k.startswith("backend.")}
            full = {k.split(".", 1)[1]: v for k, v in got.items() if k.startswith("full.")}
            assert sharded.keys() == full.keys() and any(k.startswith("buffer.") for k in full)
            for key in full:
                assert torch.equal(sharded[key], full[key]), (index, rank, key)
            tied = json.loads((run["base"] / "first" / f"load{index}_tied_rank{rank}.json").read_text())
            assert tied == {"backend": expect_tied, "full": expect_tied}


def reference_training(initial: dict[str, torch.Tensor], seeds_per_rank: list[list[int]]):
    """Single-process AdamW on the global batch (all ranks' micro-batches), loss / global weight sum."""
    model = StandInDraft()
    model.load_state_dict(initial)
    # weight decay on the linear layers' weights only, never on biases
    named = dict(model.named_parameters())
    groups = [
        {"params": [p for n, p in named.items() if n.endswith(".weight")], "weight_decay": 0.01},
        {"params": [p for n, p in named.items() if n.endswith(".bias")], "weight_decay": 0.0},
    ]
    assert sum(len(g["params"]) for g in groups) == len(named)
    optimizer = torch.optim.AdamW(groups, lr=EXPECTED_LRS[0], betas=(0.9, 0.95))
    grad_norms = []
    for step in range(STEPS):
        batches = [
            micro_batch(seeds[step], micro, rank, MICRO_BATCH_SIZE)
            for rank, seeds in enumerate(seeds_per_rank)
            for micro in range(2)
        ]
        loss_sum = sum(weighted_loss_sum(model(x), labels, weights) for x, labels, weights in batches)
        (loss_sum / sum(weights.sum() for _, _, weights in batches)).backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        for group in optimizer.param_groups:
            group["lr"] = EXPECTED_LRS[step]
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict(), grad_norms


@pytest.mark.parametrize("backend,nproc", ALL_RUNS)
def test_training_matches_single_process_reference(runs, backend, nproc):
    run = runs(backend, nproc)
    out = run["base"] / "first"
    seeds = [json.loads((out / f"seeds_rank{r}.json").read_text()) for r in range(run["nproc"])]
    expected, expected_norms = reference_training(load_file(str(out / "initial.safetensors")), seeds)
    got = load_file(str(out / "final.safetensors"))
    assert set(got) == set(expected)  # the draft's own names, no wrapper prefixes
    # fp32: gradients summed in another order than the reference (~3e-8 observed);
    # bf16 compute against the fp32 reference: ~2e-2 observed after 4 steps at lr 1e-2
    atol, norm_rtol = (1e-6, 1e-5) if run["precision"] == "fp32" else (5e-2, 1e-2)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=atol, rtol=1e-5, msg=name)
    stats = json.loads((out / "stats.json").read_text())
    assert [s["lr"] for s in stats] == pytest.approx(EXPECTED_LRS, rel=1e-12)
    assert [s["grad_norm"] for s in stats] == pytest.approx(expected_norms, rel=norm_rtol)


@pytest.mark.parametrize("backend,nproc", TWO_RANK_RUNS)
def test_resume_is_bit_identical_and_contract_is_checked(runs, backend, nproc):
    run = runs(backend, nproc)
    resumed = run["resumed"]
    # the resumed launch dies (on purpose) inside its final save, after writing its outputs
    assert resumed.returncode != 0
    first = load_file(str(run["base"] / "first" / "final.safetensors"))
    again = load_file(str(run["base"] / "resumed" / "final.safetensors"))
    for name in first:
        assert torch.equal(first[name], again[name]), name
    # same data order: the resumed run drew the seeds of steps 2 and 3 again from the restored RNGs
    for rank in range(2):
        first_seeds = json.loads((run["base"] / "first" / f"seeds_rank{rank}.json").read_text())
        resumed_seeds = json.loads((run["base"] / "resumed" / f"seeds_rank{rank}.json").read_text())
        assert resumed_seeds == first_seeds[SAVE_AT:]
    message = (run["base"] / "resumed" / "contract_error_rank0.txt").read_text()
    assert "block_size: saved 4, new 8" in message
    assert "num_anchors: saved <absent>, new 3" in message


@pytest.mark.parametrize("backend,nproc", TWO_RANK_RUNS)
def test_crash_before_rename_keeps_previous_checkpoint(runs, backend, nproc):
    run = runs(backend, nproc)
    root = run["base"] / "run" / "checkpoints"
    half_written = root / f".tmp-step_{STEPS:08d}"
    assert (half_written / "draft.safetensors").is_file()  # everything but the rename was done
    assert not (root / f"step_{STEPS:08d}").exists()
    assert find_latest(run["base"] / "run") == root / f"step_{SAVE_AT:08d}"
    saved = load_file(str(root / f"step_{SAVE_AT:08d}" / "draft.safetensors"))
    assert set(saved) == set(load_file(str(run["base"] / "first" / "final.safetensors")))


def dflash2_parameter_names(num_layers: int) -> tuple[set[str], set[str]]:
    """(decayed, not decayed) names of a DFlash 2 draft with attention biases, written out by hand."""
    decayed, kept = {"fc.weight", "candidate_selector.hidden_projection.weight"}, set()
    kept |= {"hidden_norm.weight", "norm.weight"}
    kept |= {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"}
    for i in range(num_layers):
        layer = f"layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            decayed.add(f"{layer}self_attn.{proj}.weight")
            kept.add(f"{layer}self_attn.{proj}.bias")
        decayed |= {f"{layer}mlp.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")}
        for conv in ("attention_conv", "mlp_conv"):
            decayed.add(f"{layer}{conv}.kernel_projection.weight")
            kept.add(f"{layer}{conv}.base_kernel")
        kept |= {f"{layer}{norm}.weight" for norm in ("input_layernorm", "post_attention_layernorm")}
        kept |= {f"{layer}self_attn.{norm}.weight" for norm in ("q_norm", "k_norm")}
    return decayed, kept


def test_weight_decay_skips_norms_biases_base_kernels_and_codebooks():
    from dflash2.config import OptimConfig
    from dflash2.models import build_draft
    from dflash2.optim import build_optimizer
    from tests.draft_helpers import randomize_, tiny_draft_config

    config = tiny_draft_config()
    config["attention_bias"] = True
    draft = randomize_(build_draft(config))
    optimizer, _ = build_optimizer(draft, OptimConfig(lr=0.1, weight_decay=0.5, warmup_steps=0))
    names = {id(p): n for n, p in draft.named_parameters()}
    groups = {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in optimizer.param_groups}
    decayed, kept = dflash2_parameter_names(config["num_hidden_layers"])
    assert groups == {0.5: decayed, 0.0: kept}
    assert decayed | kept == set(names.values())

    # a step with zero gradients is pure decoupled decay: decayed weights shrink by lr * wd, others stay
    before = {n: p.detach().clone() for n, p in draft.named_parameters()}
    for p in draft.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, param in draft.named_parameters():
        factor = 1 - 0.1 * 0.5 if name in decayed else 1.0
        torch.testing.assert_close(param.detach(), before[name] * factor, rtol=0, atol=1e-7, msg=name)


def test_ds_config_batch_sizes_are_written_and_conflicts_named():
    base = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    resolved = resolve_ds_config(base, micro_batch_size=3, grad_accum_steps=2, dp_world_size=4)
    assert resolved["train_micro_batch_size_per_gpu"] == 3
    assert resolved["gradient_accumulation_steps"] == 2
    assert resolved["train_batch_size"] == 24
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu=8.*gives 3"):
        resolve_ds_config(
            {**base, "train_micro_batch_size_per_gpu": 8},
            micro_batch_size=3,
            grad_accum_steps=2,
            dp_world_size=4,
        )
    with pytest.raises(ValueError, match="optimizer"):
        resolve_ds_config(
            {**base, "optimizer": {"type": "Adam"}}, micro_batch_size=3, grad_accum_steps=2, dp_world_size=1
        )
    offload = json.loads((REPO / "ds_configs" / "zero3_offload.json").read_text())
    assert offload["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert offload["zero_optimization"]["stage"] == base["zero_optimization"]["stage"] == 3


def test_launch_environment_for_plain_python_and_the_deepspeed_launcher(monkeypatch):
    from dflash2.distributed import env

    monkeypatch.setattr(env, "_set_for_one_process", [])  # what this test's one-process world records
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", *env.TASK_COUNT_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    # one of 16 tasks of `srun -n 16 python launch/train.py` (no torch launcher): refused, not a
    # one-process world of its own (it was: 16 runs on one device and one output directory)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "16")
    with pytest.raises(ValueError, match="one of 16 tasks started without torchrun.*launch/slurm"):
        _fill_launch_env()
    assert "RANK" not in os.environ
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # `srun python ...`: one task is a one-process world
    _fill_launch_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("0", "1", "0")
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and int(os.environ["MASTER_PORT"]) > 0

    # the deepspeed launcher sets RANK/WORLD_SIZE/MASTER_* and may pass the local rank only as argv
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(sys, "argv", ["train.py", "--local_rank=1", "--config", "x.yaml"])
    _fill_launch_env()
    assert os.environ["LOCAL_RANK"] == "1" and os.environ["RANK"] == "3"


def test_build_backend_rejects_mismatched_config_paths():
    with pytest.raises(ValueError, match="only used by backend 'deepspeed'"):
        build_backend("fsdp", "ds_configs/zero3.json", 1, 1)
    with pytest.raises(ValueError, match="needs a ds_config"):
        build_backend("deepspeed", None, 1, 1)
    with pytest.raises(ValueError, match="backend must be one of"):
        build_backend("ddp", None, 1, 1)


SELECTOR_DTYPES_SCRIPT = """
import sys, torch
sys.path.insert(0, {repo!r})
from dflash2.config import OptimConfig
from dflash2.distributed.env import build_backend, init_distributed
from dflash2.models import build_draft
from dflash2.models.config import load_config_dict

init_distributed("fsdp")
backend = build_backend("fsdp", None, 1, 1)
draft = build_draft(load_config_dict("configs/draft/tiny-dflash2.json"))
model = backend.setup_draft(draft, OptimConfig(), "bf16")
selector = backend.unwrap(model).candidate_selector
k = selector.top_k
projected = []
selector.hidden_projection.register_forward_hook(lambda m, args, out: projected.append(out.dtype))
scores = selector(
    torch.randn(2, draft.config.hidden_size, dtype=torch.bfloat16),
    torch.randn(2, k, dtype=torch.float32) * 30,
    torch.randint(0, 100, (2, k)),
    torch.randint(0, 100, (2, k)),
)
print(scores.dtype, projected[0])
"""


def test_fsdp2_bf16_keeps_the_selectors_fp32_unary_logits(tmp_path):
    # the objective sums fp32 unary logits with the pair scores (as DeepSpeed's bare selector and one
    # process do); FSDP2's input cast would round them to bf16 in the selector's unit alone
    # the selector's scores in fp32; its own product still computes in bf16 (the unit's parameters)
    printed = run_one_process_script(tmp_path, SELECTOR_DTYPES_SCRIPT)
    assert printed.split() == ["torch.float32", "torch.bfloat16"], printed


DS_COMM_SCRIPT = """
import sys
import warnings
sys.path.insert(0, {repo!r})
from dflash2.config import OptimConfig
from dflash2.distributed.env import build_backend, init_distributed
from dflash2.models import build_draft
from dflash2.models.config import load_config_dict

init_distributed("deepspeed")
backend = build_backend("deepspeed", "ds_configs/zero3.json", 1, 1)
engine = backend.setup_draft(build_draft(load_config_dict("configs/draft/tiny-dflash2.json")), OptimConfig(), "bf16")
print(engine.communication_data_type, engine.optimizer.grad_partitions_flat_buffer.dtype)
"""


def test_deepspeed_bf16_reduces_and_accumulates_gradients_in_fp32(tmp_path):
    # as FSDP2's reduce_dtype: without communication_data_type, ZeRO-3 reduces bf16 buckets, and
    # without data_types.grad_accum_dtype it sums the micro-batches of a step in a bf16 buffer
    printed = run_one_process_script(tmp_path, DS_COMM_SCRIPT)
    assert printed.split()[-2:] == ["torch.float32", "torch.float32"], printed


def run_one_process_script(tmp_path: Path, source: str) -> str:
    """`source` (formatted with the repository's path) run as a plain one-process python script; its stdout."""
    script = tmp_path / "script.py"
    script.write_text(source.format(repo=str(REPO)))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
