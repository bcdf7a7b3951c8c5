"""The Python API called the way a notebook calls it: twice in one process, with a wrong argument,
out of order. Each misuse is one ValueError naming the fix, raised before anything changes, and a
call leaves no state behind that changes the next one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dflash2
from dflash2.data.loader import step_batches
from dflash2.faults import STOP_MARKER, stop_request
from dflash2.objective import compute_objective
from dflash2.run import run
from dflash2.timing import StepTimer
from dflash2.train import flushing_subnormals

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "tiny-dflash2.yaml"


@pytest.fixture
def overrides(tiny_default, tmp_path) -> list[str]:
    return [
        f"model.target={tiny_default.target_dir}",
        f"data.train={tiny_default.train_jsonl}",
        "data.max_length=64",
        "objective.num_anchors=4",
        "train.micro_batch_size=2",
        "train.global_batch_size=null",
        "train.max_steps=2",
        "train.warmup_steps=0",
        "train.export=false",
        "train.progress_bar=false",
        "train.log_every=1",
    ]


def setup_of(overrides: list[str], out: Path, *more: str) -> dflash2.Setup:
    cfg = dflash2.load_run_config(TINY_CONFIG, [*overrides, f"output_dir={out}", *more])
    plan = dflash2.resolve_run(cfg)
    return dflash2.build_setup(plan, dflash2.LocalBackend.from_run_config(plan.config))


def test_a_stopped_fit_leaves_no_stop_behind_and_a_setup_is_fitted_once(overrides, tmp_path, capsys):
    torch.set_flush_denormal(True)  # the caller's own setting, which fit must give back
    try:
        stopped = setup_of(overrides, tmp_path / "stopped")
        stop_request.signal_name = "SIGINT"  # as its handler records a Ctrl-C (launch/train.py)
        dflash2.fit(stopped)
        assert stop_request.stopped and stop_request.signal_name is None  # served, not left pending
        assert flushing_subnormals()
        clean = setup_of(overrides, tmp_path / "clean")
        summary = dflash2.fit(clean)
    finally:
        torch.set_flush_denormal(False)
    assert summary["loss"] > 0 and not stop_request.stopped
    assert not (tmp_path / "clean" / STOP_MARKER).exists()  # before: a finished run marked stopped
    assert "[dflash2] done: step 2" in capsys.readouterr().out
    with pytest.raises(ValueError, match="fitted already.*resolve_run and dflash2.build_setup again"):
        dflash2.fit(clean)
    again = setup_of(overrides, tmp_path / "clean")  # resume=auto: nothing left to train
    assert dflash2.fit(again) == {}
    past = setup_of(
        overrides, tmp_path / "clean", "train.max_steps=1"
    )  # before: "done: step 2", nothing else
    assert dflash2.fit(past) == {}
    assert "the checkpoint is at step 2, past train.max_steps=1: no step to train" in capsys.readouterr().out


def test_fit_refuses_a_setup_that_train_step_advanced(overrides, tmp_path):
    """fit would count its steps from the resume point: the checkpoint of its step 2 would hold the
    optimizer of step 4, and the schedule would start over."""
    setup = setup_of(overrides, tmp_path / "run")
    timer = StepTimer(setup.backend.device)
    timer.start_step()
    dflash2.train_step(setup, next(step_batches(len(setup.dataset), 2, 1, setup.cfg.seed, 0, 1)), timer)
    with pytest.raises(
        ValueError, match="took steps with train_step.*resolve_run and dflash2.build_setup again"
    ):
        dflash2.fit(setup)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_train_step_refuses_an_unstarted_timer_before_any_update(overrides, tmp_path):
    setup = setup_of(overrides, tmp_path / "run")
    before = {k: v.clone() for k, v in setup.backend.full_draft_state_dict().items()}
    step = next(step_batches(len(setup.dataset), 2, 1, setup.cfg.seed, 0, 1))
    with pytest.raises(ValueError, match=r"timer.start_step\(\)"):
        dflash2.train_step(setup, step, StepTimer(setup.backend.device))
    after = setup.backend.full_draft_state_dict()
    assert all(after[k].equal(v) for k, v in before.items())  # before: updated, then AssertionError
    # a step of another accumulation: refused before its backward (it was refused after, and every
    # later step then failed with "step() after 3 backward calls")
    timer = StepTimer(setup.backend.device)
    for wrong in (next(step_batches(len(setup.dataset), 2, 2, setup.cfg.seed, 0, 1)), None):
        timer.start_step()
        with pytest.raises(ValueError, match=r"one optimizer step of 1 micro-batches, got .*step_batches"):
            dflash2.train_step(setup, wrong, timer)
    assert all(setup.backend.full_draft_state_dict()[k].equal(v) for k, v in before.items())
    timer.start_step()
    dflash2.train_step(setup, step, timer)  # the Setup still trains
    assert any(not setup.backend.full_draft_state_dict()[k].equal(v) for k, v in before.items())
    # one backend per Setup: a second build_setup on it left fit stepping the other draft
    with pytest.raises(ValueError, match="this backend trains a draft already.*a backend for each Setup"):
        dflash2.build_setup(setup.plan, setup.backend)


def test_a_backend_of_another_batch_layout_is_refused(overrides, tmp_path):
    cfg = dflash2.load_run_config(
        TINY_CONFIG, [*overrides, f"output_dir={tmp_path}", "train.global_batch_size=4"]
    )
    plan = dflash2.resolve_run(cfg)
    assert plan.config.train.grad_accum_steps == 2
    with pytest.raises(ValueError, match=r"micro-batch 1 x 1 .* the plan is 2 x 2.*from_run_config"):
        dflash2.build_setup(plan, dflash2.LocalBackend())
    # a plan resolved for 2 data-parallel ranks, a backend of one: the message says so
    plan = dflash2.resolve_run(cfg, 2)
    with pytest.raises(
        ValueError, match=r"on 1 data-parallel rank\(s\), the plan is 2 x 1.*resolve_run\(cfg, 1\)"
    ):
        dflash2.build_setup(plan, dflash2.LocalBackend.from_run_config(plan.config))
    for ranks in (0, -1):
        with pytest.raises(ValueError, match=f"data-parallel ranks must be an int >= 1, got {ranks}"):
            dflash2.resolve_run(cfg, ranks)


def test_wrong_arguments_and_paths_are_named_before_anything_loads(overrides, tiny_default, tmp_path):
    with pytest.raises(ValueError, match="give a list of key=value strings"):
        dflash2.load_run_config(TINY_CONFIG, "train.max_steps=4")
    with pytest.raises(ValueError, match="takes a RunConfig.*load_run_config"):
        dflash2.resolve_run(str(TINY_CONFIG))
    cfg = dflash2.load_run_config(TINY_CONFIG, [*overrides, f"output_dir={tmp_path}"])
    with pytest.raises(ValueError, match="from_run_config takes a RunConfig"):
        dflash2.LocalBackend.from_run_config(str(TINY_CONFIG))
    backend = dflash2.LocalBackend.from_run_config(cfg)
    with pytest.raises(
        ValueError, match=r"plan must be a RunPlan \(dflash2.resolve_run\(cfg\)\), not RunConfig"
    ):
        dflash2.build_setup(cfg, backend)
    with pytest.raises(
        ValueError, match=r"setup must be a Setup \(dflash2.build_setup\(plan, backend\)\), not RunPlan"
    ):
        dflash2.fit(dflash2.resolve_run(cfg))
    missing = tmp_path / "nope.jsonl"
    cfg = dflash2.load_run_config(
        TINY_CONFIG, [*overrides, f"output_dir={tmp_path}", f"data.train={missing}"]
    )
    with pytest.raises(ValueError, match="data.train=.*does not exist"):
        dflash2.resolve_run(cfg)
    cfg = dflash2.load_run_config(
        TINY_CONFIG, [*overrides, f"output_dir={tmp_path}", "model.target=no/such/dir"]
    )
    with pytest.raises(ValueError, match=r"model.target='no/such/dir' \(relative to .*\) does not exist"):
        dflash2.resolve_run(cfg)  # before: the hub's "Repo id must be in the form ..."
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cfg = dflash2.load_run_config(TINY_CONFIG, [*overrides, f"output_dir={a_file}"])
    with pytest.raises(ValueError, match="output_dir=.*a-file' is a file: give a directory"):
        dflash2.resolve_run(cfg)  # before: NotADirectoryError once the target and the draft had loaded

    from dflash2.evaluate import evaluate, evaluate_drafts

    export = tmp_path / "export"
    export.mkdir()
    args = (tiny_default.target_dir, tiny_default.heldout_jsonl)
    with pytest.raises(ValueError, match="give a list of export directories"):
        evaluate_drafts(str(export), *args)
    with pytest.raises(ValueError, match="--target=.*does not exist"):
        evaluate(export, tmp_path / "no-target", tiny_default.heldout_jsonl)
    with pytest.raises(ValueError, match="precision 'fp16': give one of fp32, bf16"):
        evaluate(export, *args, precision="fp16")
    checkpoint = tmp_path / "step_00000002"
    checkpoint.mkdir()
    for name in ("draft_config.json", "draft.safetensors"):
        (checkpoint / name).write_text("{}")
    with pytest.raises(ValueError, match="is a training checkpoint, not an export.*dflash2.export"):
        evaluate(checkpoint, *args)
    with pytest.raises(ValueError, match="evaluate takes one export directory, got list.*evaluate_drafts"):
        evaluate([export], *args)  # before: a TypeError from pathlib
    with pytest.raises(ValueError, match="no config.json, so not an export.*python -m dflash2.export"):
        dflash2.load_draft(checkpoint)  # before: "no such file; pass a config.json or its directory"


def test_an_objective_that_needs_the_teacher_names_the_missing_tensor(overrides, tmp_path):
    setup = setup_of(overrides, tmp_path / "run", "objective.labels=target")
    ids = torch.tensor([setup.dataset[0]["input_ids"][:32]])
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "attention_mask": torch.ones_like(ids)}
    batch["features"] = torch.zeros(1, ids.shape[1], len(setup.layer_ids) * setup.head.hidden_size)
    with pytest.raises(ValueError, match=r"batch\['target_last_hidden'\].*split_last_hidden"):
        compute_objective(setup.draft, setup.head, batch, setup.objective, torch.Generator().manual_seed(0))


def test_a_failed_one_process_run_leaves_no_process_group_or_launcher_variables(overrides, tmp_path):
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    assert not any(name in os.environ for name in names) and not dist.is_initialized()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"not": "a conversation"}\n')
    cfg = dflash2.load_run_config(TINY_CONFIG, [*overrides, f"output_dir={tmp_path}", f"data.train={bad}"])
    with pytest.raises(ValueError):
        run(cfg)
    assert not dist.is_initialized()  # before: the group stayed, and RANK=0 ... reached every child
    assert [name for name in names if name in os.environ] == []


def logged_steps(run_dir: Path) -> list[int]:
    import json

    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_launch_that_stops_before_its_first_save_leaves_logs_and_checkpoints_in_step(
    overrides, tmp_path, capsys
):
    """Resumed from step 4 of a run that went on to step 6, and stopped before its first step: the
    logs keep steps 1-4, and the checkpoints agree (step 6 set aside at the same moment). Before, the
    next resume=auto continued from step 6 with steps 5-6 gone from both logs."""
    run = tmp_path / "run"
    more = ["train.max_steps=6", "train.save_every=2", "train.log_every=4"]
    dflash2.fit(setup_of(overrides, run, *more))
    assert "step 6/6" in capsys.readouterr().out
    resumed = setup_of(overrides, run, *more, f"train.resume={run / 'checkpoints' / 'step_00000004'}")
    dflash2.fit(resumed, stop_vote=lambda: True)
    assert logged_steps(run) == [1, 2, 3, 4]
    again = setup_of(overrides, run, *more, "train.max_steps=8", "train.stop_at_step=7")
    assert again.plan.start.step == 4  # before: 6
    dflash2.fit(again)
    assert logged_steps(run) == [1, 2, 3, 4, 5, 6, 7]
    assert "step 7/8" in capsys.readouterr().out  # the launch's last step, though log_every is 4


def test_a_fresh_run_stopped_before_its_first_step_says_it_has_no_checkpoint(overrides, tmp_path, capsys):
    import json

    dflash2.fit(setup_of(overrides, tmp_path / "run"), stop_vote=lambda: True)
    out = capsys.readouterr().out
    assert "after step 0 of 2: no checkpoint yet; run the same command again to start" in out, out
    marker = json.loads((tmp_path / "run" / STOP_MARKER).read_text())
    assert marker["signal"] == "another rank's stop request"  # before: "no signal"
    dflash2.fit(setup_of(overrides, tmp_path / "run"))  # the same command, run to its end
    assert not (tmp_path / "run" / STOP_MARKER).exists()  # before: the earlier stop's marker stayed


def test_a_diverged_step_is_logged_and_stops_the_run_naming_it(overrides, tmp_path, monkeypatch):
    import json

    import dflash2.train as train

    compute = train.compute_objective

    def nan_at_step_2(*args, **kwargs):
        out = compute(*args, **kwargs)
        if nan_at_step_2.calls == 1:
            out.loss_sum = out.loss_sum * float("nan")
            out.metrics["base_loss_sum"] = out.metrics["base_loss_sum"] * float("nan")
        nan_at_step_2.calls += 1
        return out

    nan_at_step_2.calls = 0
    monkeypatch.setattr(train, "compute_objective", nan_at_step_2)
    setup = setup_of(overrides, tmp_path / "run", "train.max_steps=4", "train.micro_batch_size=4")
    with pytest.raises(
        dflash2.errors.ReportedError,
        match="training diverged at step 2: loss nan, base_loss nan, grad_norm nan.*"
        "start again with a lower train.lr",  # no checkpoint yet
    ):
        dflash2.fit(setup)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[-1], parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert record["step"] == 2 and record["loss"] is None  # before: no line, or a bare NaN
    assert not (tmp_path / "run" / "checkpoints").exists()
