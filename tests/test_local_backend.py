"""LocalBackend (one process, no process group) against FSDP2 on one gloo rank: the same run of the
tiny config through launch/train.py, step for step; a LocalBackend checkpoint resumes exactly; and
`backend=local` in a launched run trains as the Python API does, refusing what it cannot run; bf16
against FSDP2's mixed precision."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash2.config import load_run_config
from dflash2.errors import EXIT_USER_ERROR
from dflash2.plan import load_target_config, plan_run
from dflash2.schedule import lr_factor
from tests.run_helpers import REPO, TINY_CONFIG, TRAIN, check_ok, launch_train, metrics, run

SCRIPT = REPO / "tests" / "dist_scripts" / "train_local.py"
STEPS = 3
COMPARED = ("loss", "base_loss", "selector_loss", "grad_norm", "lr", "accuracy", "insample_accept_len")


@pytest.fixture(scope="module")
def common(tiny_default) -> list[str]:
    return [
        f"model.target={tiny_default.target_dir}",
        f"data.train={tiny_default.train_jsonl}",
        "data.max_length=96",
        "objective.num_anchors=8",
        "train.progress_bar=false",
        "train.log_every=1",
        "train.lr=3e-3",
        "train.weight_decay=0.01",  # both AdamW parameter groups
        "train.warmup_steps=0",
        f"train.max_steps={STEPS}",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",  # 2 accumulation steps in one process
        "train.export=false",
    ]


def train_local(overrides: list[str]):
    return check_ok(run([sys.executable, str(SCRIPT), str(TINY_CONFIG), *overrides]))


def final_weights(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step_{step:08d}" / "draft.safetensors")


@pytest.fixture(scope="module")
def local_run(common, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("local")
    train_local([*common, f"output_dir={run_dir}", "train.save_every=2"])
    return run_dir


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """Every step's metrics and the final weights of `run_dir` equal the reference run's, bit for bit."""
    ours, theirs = metrics(run_dir), metrics(reference)
    assert [m["step"] for m in ours] == list(range(1, STEPS + 1))
    for mine, other in zip(ours, theirs, strict=True):
        assert {k: mine[k] for k in COMPARED} == {k: other[k] for k in COMPARED}, mine["step"]
    weights, expected = final_weights(run_dir), final_weights(reference)
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], expected[name]) for name in expected)


def test_local_backend_matches_fsdp2_on_one_rank(local_run, common, tmp_path):
    check_ok(launch_train(1, [*common, f"output_dir={tmp_path}", "backend=fsdp", "train.save_every=2"]))
    local, fsdp = metrics(local_run), metrics(tmp_path)
    assert [m["step"] for m in local] == [m["step"] for m in fsdp] == list(range(1, STEPS + 1))
    for ours, theirs in zip(local, fsdp, strict=True):
        for key in COMPARED:
            assert math.isclose(ours[key], theirs[key], rel_tol=1e-6, abs_tol=1e-12), (ours["step"], key)
    ours, theirs = final_weights(local_run), final_weights(tmp_path)
    assert ours.keys() == theirs.keys()
    # Adam's update divides by the gradient's root mean square, so element by element a weight whose
    # gradient is tiny differs more: compared per tensor, relative to its norm (up to 1.06e-6 seen on
    # an AVX2 CPU, whose fp32 kernels sum in another order than AVX-512's; a wrong update is >= 1e-3)
    errors = {name: float((ours[name] - theirs[name]).norm() / theirs[name].norm()) for name in ours}
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda item: -item[1])[:3]
    assert (local_run / "checkpoints" / f"step_{STEPS:08d}" / "backend" / "backend.json").is_file()


def test_a_local_backend_checkpoint_resumes_exactly(local_run, common, tmp_path):
    train_local([*common, f"output_dir={tmp_path}", "train.save_every=2", "train.stop_at_step=2"])
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2]
    train_local([*common, f"output_dir={tmp_path}", "train.save_every=2"])  # resume=auto: from step 2
    assert_same_run(tmp_path, local_run)


def test_a_resume_follows_the_new_schedule_from_its_first_step_and_names_what_it_keeps(common, tmp_path):
    """lr and weight_decay come back with the optimizer (the run says so when the config changes
    them); warmup_steps, schedule, min_lr_ratio and max_steps shape the LR from the first resumed step."""
    train_local(
        [*common, f"output_dir={tmp_path}", "train.save_every=2", "train.stop_at_step=2", "train.max_steps=4"]
    )
    changed = ["train.max_steps=4", "train.lr=3e-2", "train.weight_decay=0.1", "train.warmup_steps=3"]
    out = train_local([*common, f"output_dir={tmp_path}", *changed]).stdout
    assert "train.lr=0.03 is not applied: a resumed run keeps its checkpoint's 0.003" in out, out
    assert "train.weight_decay=0.1 is not applied: a resumed run keeps its checkpoint's 0.01" in out, out
    logged = {m["step"]: m["lr"] for m in metrics(tmp_path)}
    new_schedule = [lr_factor(step, warmup_steps=3, total_steps=4, min_lr_ratio=0.1) for step in (2, 3)]
    assert [logged[3], logged[4]] == pytest.approx([3e-3 * factor for factor in new_schedule], rel=1e-6)


def test_a_launched_local_run_stopped_and_resumed_equals_the_python_api_run(local_run, common, tmp_path):
    # launch/train.py with backend=local: stopped after step 2 (a checkpoint), then the same command
    # resumes it; step for step and weight for weight what the Python API's uninterrupted run gave
    overrides = [*common, f"output_dir={tmp_path}", "backend=local", "train.save_every=2"]
    check_ok(launch_train(1, [*overrides, "train.stop_at_step=2"]))
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2]
    check_ok(launch_train(1, overrides))
    assert_same_run(tmp_path, local_run)


def test_bf16_computes_as_fsdp2_bf16_on_one_rank_keeps_fp32_masters_and_resumes_exactly(common, tmp_path):
    """bf16 compute on fp32 master weights, against FSDP2's MixedPrecisionPolicy(bf16, reduce fp32)
    on one rank: the same first step (its loss is one bf16 forward of the same weights; fp32's
    differs in the third decimal), and a checkpoint of fp32 masters that a resume continues exactly."""
    bf16 = [*common, "precision=bf16", "train.save_every=2"]
    local, fsdp = tmp_path / "local", tmp_path / "fsdp"
    train_local([*bf16, f"output_dir={local}"])
    check_ok(launch_train(1, [*bf16, f"output_dir={fsdp}", "backend=fsdp"]))
    first, reference = metrics(local)[0], metrics(fsdp)[0]
    assert first["loss"] == reference["loss"]
    # the gradients: equal up to the fp32 order of the norm's sums (fp32 compute: 2.7e-4 apart)
    assert math.isclose(first["grad_norm"], reference["grad_norm"], rel_tol=2e-5)
    # later steps drift apart by bf16 roundings of slightly different masters; bf16 against fp32 is
    # the larger gap (seen: losses at step 3 11.5595 / 11.5688 FSDP2 / 11.5453 fp32)
    assert math.isclose(metrics(local)[-1]["loss"], metrics(fsdp)[-1]["loss"], rel_tol=5e-3)
    masters = final_weights(local)
    assert all(t.dtype == torch.float32 for t in masters.values())
    trained = masters["layers.0.mlp.down_proj.weight"]
    assert not torch.equal(trained, trained.bfloat16().float()), "the checkpoint holds bf16-rounded weights"
    resumed = tmp_path / "resumed"
    train_local([*bf16, f"output_dir={resumed}", "train.stop_at_step=2"])
    train_local([*bf16, f"output_dir={resumed}"])
    assert [m["step"] for m in metrics(resumed)] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in metrics(resumed)] == [m["loss"] for m in metrics(local)]
    assert all(torch.equal(final_weights(resumed)[name], masters[name]) for name in masters)


def test_backend_local_refuses_more_processes_and_the_disaggregated_topology(common, tmp_path):
    # launch/torchrun.py: torchrun whose exit code is the workers' (2: a user error)
    launcher = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--standalone", "--nproc_per_node=2"]
    result = run(
        [
            *launcher,
            str(TRAIN),
            "--config",
            str(TINY_CONFIG),
            *common,
            f"output_dir={tmp_path}",
            "backend=local",
        ]
    )
    refusal = "error: backend=local trains in one process, but this launch started 2 (WORLD_SIZE): use backend=deepspeed or backend=fsdp, or launch one process"
    assert result.returncode == EXIT_USER_ERROR and refusal in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("error:") == 1 and "Traceback" not in result.stderr  # one rank says it
    assert not (tmp_path / "checkpoints").exists()
    disaggregated = ["topology=disaggregated", "capture_ranks=1"]
    with pytest.raises(ValueError, match="backend=local runs in one process; topology=disagg"):
        load_run_config(TINY_CONFIG, [*common, f"output_dir={tmp_path}", "backend=local", *disaggregated])
    cfg = load_run_config(TINY_CONFIG, [*common, f"output_dir={tmp_path}", "backend=local"])
    target_config = load_target_config(cfg.model.target)
    with pytest.raises(
        ValueError, match="backend=local runs in one process, not 8: plan it with --world-size 1"
    ):
        plan_run(cfg, world_size=8, target_config=target_config)
    lines = {
        item.name: item.note
        for item in plan_run(cfg, world_size=1, target_config=target_config).roles[0].items
    }
    assert lines["draft gathered"] == "nothing: every parameter is held whole"


def test_bf16_load_state_dict_reaches_the_fp32_masters(common, tmp_path):
    """Weights loaded into a bf16 Setup's draft (a warm start from the Python API) are what trains:
    the masters take the values as given, the working copies their bf16 rounding (before, the load
    went to the copies only, and the next step copied the untouched masters back over them)."""
    import dflash2

    cfg = load_run_config(TINY_CONFIG, [*common, f"output_dir={tmp_path}", "precision=bf16"])
    plan = dflash2.resolve_run(cfg)
    setup = dflash2.build_setup(plan, dflash2.LocalBackend.from_run_config(plan.config))
    loaded = {name: torch.randn_like(t) for name, t in setup.draft.state_dict().items()}
    setup.draft.load_state_dict(loaded)
    state = setup.backend.full_draft_state_dict()
    assert all(torch.equal(state[name], loaded[name]) for name in loaded)
    weight = setup.draft.get_parameter("layers.0.mlp.down_proj.weight")
    assert weight.dtype == torch.bfloat16 and torch.equal(
        weight, loaded["layers.0.mlp.down_proj.weight"].bfloat16()
    )
