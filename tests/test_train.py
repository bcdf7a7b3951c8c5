"""The real entry point (launch/train.py) on the tiny default target, in real processes.

One process under plain python, two under torchrun (gloo) with ZeRO-3 and with FSDP2; a resumed
run against an uninterrupted one; a changed contract field refused.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from dflash2.export import check_export
from tests.run_helpers import check_ok, launch_train, metrics, short_tiny_run, tiny_subset


@pytest.fixture(scope="module")
def common(tiny_default) -> list[str]:
    return [
        f"model.target={tiny_default.target_dir}",
        f"data.train={tiny_default.train_jsonl}",
        "data.max_length=96",
        "objective.num_anchors=8",
        "train.progress_bar=false",
        "train.log_every=1",
        "train.save_every=0",
        "train.lr=3e-3",
        "train.weight_decay=0.01",  # two AdamW parameter groups under both backends, resumed exactly
        "train.warmup_steps=0",
        "train.max_steps=10",
        "train.global_batch_size=null",  # the accumulation steps of the overrides, on any number of ranks
    ]


@pytest.fixture(scope="module")
def one_process_run(common, tmp_path_factory) -> Path:
    """Plain `python launch/train.py`: one process, no MPI, global micro-batch of 4."""
    run_dir = tmp_path_factory.mktemp("one")
    check_ok(launch_train(1, [*common, f"output_dir={run_dir}", "backend=fsdp", "train.micro_batch_size=4"]))
    return run_dir


def test_one_process_run_learns_logs_and_exports(one_process_run):
    losses = [m["loss"] for m in metrics(one_process_run)]
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    for m in metrics(one_process_run):  # block_size 8
        for name in ("insample_accept_len", "insample_accept_len_selector"):
            assert 1 <= m[name] <= m["insample_accept_len_max"] <= 8, (name, m)
    assert check_export(one_process_run / "export") == []
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(one_process_run / "tb"))
    events.Reload()
    names = set(events.Tags()["scalars"])
    for name in [
        "loss",
        "base_loss",
        "selector_loss",
        "accuracy",
        "accuracy_pos_1",
        "accuracy_pos_7",
        "topk_coverage",
        "selector_accuracy",
        "est_accept_len",
        "est_accept_len_selector",
        "insample_accept_len",
        "insample_accept_len_selector",
        "insample_accept_len_max",
        "selector_weight_fraction",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "capture_fraction",
    ]:
        assert f"train/{name}" in names, name
    assert (one_process_run / "config.yaml").is_file()


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp"])
def test_two_process_run_shards_target_learns_and_matches_one_process(
    backend, common, one_process_run, tmp_path
):
    result = launch_train(
        2, [*common, f"output_dir={tmp_path}", f"backend={backend}", "train.micro_batch_size=2"]
    )
    check_ok(result)
    held = [tuple(map(int, m)) for m in re.findall(r"holds (\d+)/(\d+) target parameters", result.stdout)]
    assert len(held) == 2 and all(0 < local < total for local, total in held), held
    assert sum(local for local, _ in held) >= held[0][1]  # the shards cover the model
    two, one = metrics(tmp_path), metrics(one_process_run)
    # Same global batch, same blocks (anchors depend on the sample, not the rank): same first loss.
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-4)
    assert two[0]["num_supervised_tokens"] == one[0]["num_supervised_tokens"]
    losses = [m["loss"] for m in two]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3


def test_resume_is_exact_and_contract_changes_are_refused(common, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    args = [
        *common,
        "backend=deepspeed",
        "train.micro_batch_size=2",
        "train.max_steps=6",
        "train.save_every=3",
    ]
    check_ok(launch_train(2, [*args, f"output_dir={full}"]))
    check_ok(launch_train(2, [*args, f"output_dir={resumed}", "train.stop_at_step=3"]))
    assert not (resumed / "export").exists()
    check_ok(launch_train(2, [*args, f"output_dir={resumed}"]))
    a, b = metrics(full), metrics(resumed)
    assert [m["step"] for m in b] == [1, 2, 3, 4, 5, 6]
    assert [m["loss"] for m in a] == [m["loss"] for m in b]
    wa, wb = (
        load_file(full / "export" / "model.safetensors"),
        load_file(resumed / "export" / "model.safetensors"),
    )
    assert wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)

    changed = ["objective.num_anchors=9", "data.chat_template_kwargs={enable_thinking: false}"]
    refused = launch_train(1, [*args, f"output_dir={resumed}", *changed, "train.max_steps=7"])
    assert refused.returncode != 0
    output = refused.stderr + refused.stdout
    assert re.search(r"num_anchors.*8.*9", output), refused.stderr[-2000:]
    assert "chat_template_kwargs: saved {}, new {'enable_thinking': False}" in output, refused.stderr[-2000:]


def test_a_fresh_run_in_a_used_directory_sets_the_other_runs_checkpoints_aside(tiny_default, tmp_path):
    """train.resume=none where an earlier run left steps 4 and 6: the new run's first save moves them
    to checkpoints/set_aside/ (they were replaced and rotated by step number beside the new run's)."""
    overrides = ["backend=local", "train.save_every=2", "train.keep_last=2"]
    short_tiny_run(tiny_default, tmp_path, *overrides, steps=6)
    root = tmp_path / "run" / "checkpoints"
    before = {step: load_file(root / f"step_{step:08d}" / "draft.safetensors") for step in (4, 6)}
    result, _ = short_tiny_run(tiny_default, tmp_path, *overrides, "train.resume=none", "seed=1", steps=4)
    assert "set aside 2 checkpoint(s) of another run" in result.stdout
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000004"]
    assert (root / "latest").read_text().strip() == "step_00000004"
    for step in (4, 6):
        kept = load_file(root / "set_aside" / f"step_{step:08d}" / "draft.safetensors")
        assert all(kept[k].equal(before[step][k]) for k in kept)
    new = load_file(root / "step_00000004" / "draft.safetensors")
    assert not all(new[k].equal(before[4][k]) for k in new)  # seed 1: another run's weights


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_resume_on_another_number_of_ranks_continues_the_run(backend, common, one_process_run, tmp_path):
    """2 ranks to step 3, then 1 rank to step 5, then 2 ranks to step 6, with the global batch of
    the one-process run (4): train.global_batch_size=4 with micro-batches of 2 gives 1 accumulation
    step on 2 ranks and 2 on 1 rank. Each launch resumes the checkpoint of the other layout and the
    losses follow the uninterrupted one-process run. (Stopped at an odd step: DeepSpeed's micro-step
    count of 3 once put an accumulation boundary inside the first 2-micro-batch step.)"""
    args = [
        *common,
        f"output_dir={tmp_path}",
        f"backend={backend}",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "train.save_every=2",
        "train.export=false",
    ]
    check_ok(launch_train(2, [*args, "train.stop_at_step=3"]))
    to_one = check_ok(launch_train(1, [*args, "train.stop_at_step=5"]))
    assert "resuming a checkpoint of 2 ranks on 1" in to_one.stdout
    to_two = check_ok(launch_train(2, [*args, "train.stop_at_step=6"]))
    assert "resuming a checkpoint of 1 ranks on 2" in to_two.stdout
    resumed, uninterrupted = metrics(tmp_path), metrics(one_process_run)[:6]
    assert [m["step"] for m in resumed] == list(range(1, 7))
    for got, expected in zip(resumed, uninterrupted):
        assert got["num_supervised_tokens"] == expected["num_supervised_tokens"]  # the same samples
        # fp32, the same samples and blocks summed in another order: at most 2.1e-7 relative observed
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5), got["step"]


@pytest.mark.slow
def test_a_shipped_config_stopped_on_two_ranks_resumes_on_one_with_no_override(tiny_default, tmp_path):
    """configs/tiny-dflash2.yaml fixes its global batch (8 sequences per step): a 2-rank FSDP2 run
    (micro-batch 4) stopped at step 6 resumes on 1 rank (2 accumulation steps) with the same command
    and finishes with the losses of the uninterrupted 2-rank run. Without the fixed global batch the
    resume is refused, naming the override that resumes."""
    args = [
        f"model.target={tiny_default.target_dir}", f"data.train={tiny_subset(tiny_default, tmp_path, 64)}",
        "data.max_length=96", "objective.num_anchors=8", "backend=fsdp", "train.micro_batch_size=4",
        "train.max_steps=8", "train.save_every=0", "train.export=false", "train.progress_bar=false",
        "train.log_every=1", "train.warmup_steps=0",
    ]  # fmt: skip
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    check_ok(launch_train(2, [*args, f"output_dir={reference}"]))
    check_ok(launch_train(2, [*args, f"output_dir={run_dir}", "train.stop_at_step=6"]))
    refused = launch_train(1, [*args, f"output_dir={run_dir}", "train.global_batch_size=null"])
    assert refused.returncode == 2 and "global_batch_size: saved 8, new 4" in refused.stderr, refused.stderr
    assert "To resume, add these overrides: train.global_batch_size=8" in refused.stderr
    resumed = check_ok(launch_train(1, [*args, f"output_dir={run_dir}"]))
    assert "resuming a checkpoint of 2 ranks on 1" in resumed.stdout
    assert "global batch 8 samples per step: micro-batch 4 x 2 accumulation steps x 1 ranks" in resumed.stdout
    got, expected = metrics(run_dir), metrics(reference)
    assert [m["step"] for m in got] == list(range(1, 9))
    assert [m["loss"] for m in got[:6]] == [m["loss"] for m in expected[:6]]  # the same 2-rank steps
    for after, uninterrupted in zip(got[6:], expected[6:]):
        assert after["num_supervised_tokens"] == uninterrupted["num_supervised_tokens"]  # the same samples
        # fp32, the same samples summed in another order (one rank, two micro-batches)
        assert after["loss"] == pytest.approx(uninterrupted["loss"], rel=1e-5), after["step"]


def test_subnormals_are_flushed_on_a_cpu_inside_the_block_and_restored_after():
    import torch

    from dflash2.train import subnormals_flushed

    subnormal = torch.tensor([1e-40], dtype=torch.float32)  # below fp32's smallest normal, 1.18e-38
    assert (subnormal * 1).item() > 0
    with subnormals_flushed(torch.device("cpu")):
        assert (subnormal * 1).item() == 0
        assert (torch.tensor([1e-30]) * 1).item() > 0  # a normal float is untouched
    assert (subnormal * 1).item() > 0
    with pytest.raises(RuntimeError, match="inside"), subnormals_flushed(torch.device("cpu")):
        raise RuntimeError("inside")
    assert (subnormal * 1).item() > 0, "the flag stayed on after an error"
    with subnormals_flushed(torch.device("cuda")):  # not a CPU: left as it is (no GPU touched)
        assert (subnormal * 1).item() > 0
