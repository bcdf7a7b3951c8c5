"""Disaggregated topology: 1 capture rank + 2 trainer ranks (torchrun, gloo) on the tiny default.

Against the colocated 2-process run on the same data, global batch and seed: the same per-step
losses, including across a resume (the capture rank picks up the trainers' data position), with
FSDP2 and with DeepSpeed ZeRO-3, and across a stop signal that reaches the capture rank only; the
target is never loaded on trainer ranks; a crashed trainer stops the whole job.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash2.capture.transfer import capture_schedule
from dflash2.checkpoint import find_latest, read_train_state
from dflash2.config import load_run_config
from dflash2.errors import EXIT_STOPPED, EXIT_USER_ERROR
from dflash2.export import check_export
from dflash2.run import check_capture_ranks
from dflash2.target.head import target_num_parameters
from tests.run_helpers import (
    REPO,
    TIMEOUT_S,
    TINY_CONFIG,
    TRAIN,
    Process,
    check_ok,
    children,
    launch_train,
    metrics,
    run,
    tiny_subset,
    torchrun,
    wait_for_line,
)

CRASH_BOUND_S = 120  # a crashed rank must end the job well before any process-group timeout
BOUNDED_WAITS = {
    "DFLASH2_DIST_TIMEOUT_S": str(CRASH_BOUND_S),
    "DFLASH2_STARTUP_TIMEOUT_S": str(CRASH_BOUND_S),
}
FAILING_TRAINER = REPO / "tests" / "dist_scripts" / "train_failing_trainer.py"


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in metrics(run_dir)]


@pytest.fixture(scope="module")
def common(tiny_default, tmp_path_factory) -> list[str]:
    data = tiny_subset(tiny_default, tmp_path_factory.mktemp("data"), 32)
    return [
        f"model.target={tiny_default.target_dir}",
        f"data.train={data}",
        "data.max_length=96",
        "backend=fsdp",
        "objective.num_anchors=8",
        "train.micro_batch_size=2",  # x 2 trainer ranks: a global micro-batch of 4
        "train.global_batch_size=null",  # the accumulation steps of the overrides, on any number of ranks
        "train.max_steps=4",
        "train.warmup_steps=0",
        "train.lr=3e-3",
        "train.log_every=1",
        "train.progress_bar=false",
    ]


def test_schedule_serves_every_trainer_once_per_micro_batch_and_pads_the_rest():
    assert capture_schedule(1, 2) == [[0], [1]]
    assert capture_schedule(2, 2) == [[0, 1]]
    assert capture_schedule(2, 3) == [[0, 1], [2, None]]
    rounds = capture_schedule(3, 7)
    served = [t for row in rounds for t in row if t is not None]
    assert sorted(served) == list(range(7))
    assert all(row[t % 3] == t for row in rounds for t in row if t is not None)  # trainer t <- rank t % 3


def test_a_layout_without_trainer_ranks_is_refused(common):
    cfg = load_run_config(TINY_CONFIG, [*common, "output_dir=x", "topology=disaggregated", "capture_ranks=1"])
    with pytest.raises(ValueError, match=r"capture_ranks=1 must be in \[1, 0\] for 1 processes"):
        check_capture_ranks(cfg.capture_ranks, world_size=1)


def test_deepspeed_is_confined_to_a_role_only_on_the_verified_version(monkeypatch):
    import deepspeed

    from dflash2.distributed.deepspeed_groups import VERIFIED_VERSION, confine_deepspeed

    assert deepspeed.__version__ == VERIFIED_VERSION  # requirements.txt pins it
    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    with pytest.raises(ValueError, match=r"DeepSpeed 0.20.0 is installed.*install deepspeed==0.19.8 or use"):
        with confine_deepspeed(group=None):
            pass


def run_disaggregated_across_a_resume(
    common: list[str], run_dir: Path, backend: str, stop_log: Path | None = None
) -> tuple:
    """1 capture rank + 2 trainer ranks to step 2 (checkpoint), then a second launch to step 4 that
    resumes it: the capture rank must continue the trainers' data order. Returns both launches.
    With `stop_log`, a launch stopped by a signal to its capture rank (logged there) comes between."""
    args = [
        *common,
        f"output_dir={run_dir}",
        f"backend={backend}",
        "topology=disaggregated",
        "capture_ranks=1",
    ]
    first = check_ok(launch_train(3, [*args, "train.save_every=2", "train.stop_at_step=2"]))
    if stop_log is not None:
        stop_by_signalling_the_capture_rank(args, stop_log)
        assert "resumed from" in stop_log.read_text()
        saved = read_train_state(find_latest(run_dir)).step  # no step lost: saved is the last logged
        assert saved >= 2 and [m["step"] for m in metrics(run_dir)] == list(range(1, saved + 1))
    second = check_ok(launch_train(3, args))
    assert "resumed from" in second.stdout
    return first, second


def stop_by_signalling_the_capture_rank(args: list[str], log: Path) -> None:
    """A launch under launch/torchrun.py whose capture rank alone gets SIGUSR1 once it holds the
    target: it relays the request, the trainers stop after the same step with a checkpoint, then the
    capture rank, and the launcher exits with 75."""
    wrapper = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--standalone", "--nproc_per_node=3"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        launcher = subprocess.Popen(
            [*wrapper, str(TRAIN), "--config", str(TINY_CONFIG), *args], cwd=REPO, env=env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    workers: list[Process] = []
    try:
        wait_for_line(log, "capture rank 0: holds", launcher)
        workers = children(launcher.pid)
        capture_rank = next(w for w in workers if w.environ().get("LOCAL_RANK") == "0")  # global rank 0
        capture_rank.signal(signal.SIGUSR1)
        assert launcher.wait(timeout=TIMEOUT_S) == EXIT_STOPPED, log.read_text()[-4000:]
    finally:
        launcher.kill()
        for worker in workers:
            worker.signal(signal.SIGKILL)


@pytest.fixture(scope="module")
def colocated(common, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("colocated")
    check_ok(launch_train(2, [*common, f"output_dir={run_dir}", "train.export=false"]))
    return run_dir


@pytest.fixture(scope="module")
def fsdp_disaggregated(common, tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("disaggregated")
    stop_log = tmp_path_factory.mktemp("stopped") / "stopped.log"
    first, _ = run_disaggregated_across_a_resume(common, run_dir, "fsdp", stop_log)
    return run_dir, first.stdout


def test_disaggregated_matches_colocated_across_a_resume_and_trainers_hold_no_target(
    colocated, fsdp_disaggregated, tiny_default
):
    split, first_stdout = fsdp_disaggregated
    total = target_num_parameters(tiny_default.target_dir)
    assert re.findall(r"capture rank 0: holds (\d+)/(\d+) target parameters", first_stdout) == [
        (str(total),) * 2
    ]
    assert (
        re.findall(r"\] rank \d: holds (\d+)/(\d+) target parameters", first_stdout)
        == [("0", str(total))] * 2
    )
    # Same global batches and blocks, the same target forward per micro-batch: equal up to fp32 rounding.
    assert losses(split) == pytest.approx(losses(colocated), rel=1e-6)
    waits = [m["feature_wait_s"] for m in metrics(split)]
    assert len(waits) == 4 and all(w >= 0 for w in waits)
    assert check_export(split / "export") == []  # exported by the trainer ranks


def test_a_finished_run_launched_again_ends_at_once(fsdp_disaggregated, common, tmp_path):
    # resumed at its last step the capture rank sends nothing: every trainer must still get the end
    # marker (it waited for it until the collective timeout, then exited 1)
    run_dir = tmp_path / "run"
    shutil.copytree(fsdp_disaggregated[0], run_dir)
    args = [*common, f"output_dir={run_dir}", "topology=disaggregated", "capture_ranks=1"]
    start = time.monotonic()
    again = check_ok(launch_train(3, args, extra_env=BOUNDED_WAITS))
    assert time.monotonic() - start < CRASH_BOUND_S and "resumed from" in again.stdout
    assert losses(run_dir) == losses(fsdp_disaggregated[0])  # nothing trained again


def test_a_refused_resume_ends_every_rank_before_the_target_loads(fsdp_disaggregated, common, tmp_path):
    # the contract was checked on trainer ranks only: the capture rank (rank 0) loaded the target,
    # then held the job until the launcher killed it (300 s under launch/torchrun.py)
    run_dir = tmp_path / "run"
    shutil.copytree(fsdp_disaggregated[0], run_dir)
    args = [
        *common,
        f"output_dir={run_dir}",
        "topology=disaggregated",
        "capture_ranks=1",
        "objective.num_anchors=4",
    ]
    start = time.monotonic()
    refused = launch_train(3, args, extra_env=BOUNDED_WAITS)
    output = refused.stdout + refused.stderr  # plain torchrun exits 1 whatever its workers' codes
    # the capture rank (rank 0) ended with the user error too, in torchrun's table of failures (which
    # rank torchrun saw fail first is a race: the others exit once rank 0 has printed)
    assert re.search(rf"rank\s*: 0 \(local_rank: 0\)\s*exitcode\s*: {EXIT_USER_ERROR} ", output), output
    assert output.count("error: ") == 1 and "num_anchors: saved 8, new 4" in output
    assert "target parameters" not in output and time.monotonic() - start < CRASH_BOUND_S / 2


@pytest.mark.slow
def test_deepspeed_disaggregated_matches_fsdp_across_a_resume(fsdp_disaggregated, common, tmp_path):
    """backend=deepspeed: ZeRO-3 over the capture rank for the target and over the 2 trainer ranks
    for the draft, its world-wide collectives confined to each role (dflash2.distributed.deepspeed_groups)."""
    first, _ = run_disaggregated_across_a_resume(common, tmp_path, "deepspeed")
    assert len(re.findall(r"capture rank 0: holds (\d+)/\1 target parameters", first.stdout)) == 1
    # the same global batches, blocks and target forwards as FSDP2; gradients reduced by ZeRO-3
    # instead of FSDP2 (another summation order): 4e-8 relative observed in fp32
    assert losses(tmp_path) == pytest.approx(losses(fsdp_disaggregated[0]), rel=1e-6)
    assert check_export(tmp_path / "export") == []


def test_a_crashed_trainer_stops_the_whole_job(common, tmp_path):
    start = time.monotonic()
    overrides = [
        *common,
        f"output_dir={tmp_path}",
        "topology=disaggregated",
        "capture_ranks=1",
        "train.export=false",
    ]
    # global rank 2 (trainer 1) fails at its second micro-batch
    result = run(
        [*torchrun(3), str(FAILING_TRAINER), "--fail-at", "2:2", "--config", str(TINY_CONFIG), *overrides]
    )
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "injected failure" in result.stderr + result.stdout
    assert elapsed < CRASH_BOUND_S, f"the job took {elapsed:.0f} s to stop"


def test_a_trainer_that_stops_responding_after_its_first_step_is_found_in_the_steps_timeout(common, tmp_path):
    """One capture rank and one trainer: once the trainer has taken a step, the capture rank waits
    for it twice DFLASH2_DIST_TIMEOUT_S (a step and a checkpoint write), not the start-up's timeout,
    which it waited before."""
    overrides = [*common, f"output_dir={tmp_path}", "topology=disaggregated", "capture_ranks=1"]
    overrides += ["train.max_steps=40", "train.export=false"]
    waits = {"DFLASH2_DIST_TIMEOUT_S": "3", "DFLASH2_STARTUP_TIMEOUT_S": str(CRASH_BOUND_S)}
    start = time.monotonic()
    # global rank 1 (the trainer) stops responding at its third micro-batch, after its second step
    command = [*torchrun(2), str(FAILING_TRAINER), "--stall-at", "1:3", "--config", str(TINY_CONFIG)]
    result = run([*command, *overrides], extra_env=waits)
    elapsed = time.monotonic() - start
    assert "rank 1 stalls at micro-batch 3" in result.stdout, result.stdout + result.stderr
    said = r"rank 0: capture of micro-batch \d+ did not complete: .*\(collectives wait at most 6 s here, 2 x DFLASH2_DIST_TIMEOUT_S\)"
    assert result.returncode != 0 and re.search(said, result.stderr), result.stderr
    assert elapsed < CRASH_BOUND_S - 30, f"the stalled trainer was waited for {elapsed:.0f} s"


def test_a_run_whose_end_takes_longer_than_the_steps_timeout_ends_well(common, tmp_path):
    """The capture rank sends its last features before the trainers' last steps, final checkpoint
    and export, and waits for all of them: longer than the steps' timeout, which each one fits."""
    overrides = [*common, f"output_dir={tmp_path}", "topology=disaggregated", "capture_ranks=1"]
    waits = {"DFLASH2_DIST_TIMEOUT_S": "3", "DFLASH2_STARTUP_TIMEOUT_S": str(CRASH_BOUND_S)}
    command = [*torchrun(2), str(FAILING_TRAINER), "--slow-finish", "1:8", "--config", str(TINY_CONFIG)]
    # 16 steps: the capture rank, a few micro-batches ahead, learns of the first step before its last one
    check_ok(run([*command, *overrides, "train.max_steps=16"], extra_env=waits))
    assert len(losses(tmp_path)) == 16 and check_export(tmp_path / "export") == []


def test_a_checkpoint_write_the_capture_rank_waits_for_with_a_step_ends_well(common, tmp_path):
    """A capture rank's send waits for the trainer's step and a checkpoint written after it, which
    may take up to the steps' timeout each: a write longer than that timeout alone (a single trainer
    has no peer to time out) is still waited for, and the run goes on."""
    overrides = [*common, f"output_dir={tmp_path}", "topology=disaggregated", "capture_ranks=1"]
    overrides += ["train.max_steps=16", "train.save_every=8", "train.export=false"]
    waits = {"DFLASH2_DIST_TIMEOUT_S": "3", "DFLASH2_STARTUP_TIMEOUT_S": str(CRASH_BOUND_S)}
    command = [*torchrun(2), str(FAILING_TRAINER), "--slow-save", "1:4.5", "--config", str(TINY_CONFIG)]
    check_ok(run([*command, *overrides], extra_env=waits))
    assert len(losses(tmp_path)) == 16


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed", "fsdp"])
def test_two_capture_ranks_share_the_target_and_match_colocated(colocated, common, tmp_path, backend):
    """2 capture ranks (ZeRO-3 or FSDP2 shards the target between them, each serves one trainer per
    round) feeding 2 trainer ranks: the same losses as the colocated 2-rank run."""
    args = [*common, f"output_dir={tmp_path}", f"backend={backend}", "topology=disaggregated"]
    run = check_ok(launch_train(4, [*args, "capture_ranks=2"]))
    held = re.findall(r"capture rank (\d): holds (\d+)/(\d+) target parameters", run.stdout)
    assert sorted(rank for rank, _, _ in held) == ["0", "1"]
    assert all(2 * int(mine) == int(total) for _, mine, total in held)  # half of the target each
    assert re.findall(r"\] rank \d: holds (\d+)/\d+ target parameters", run.stdout) == ["0", "0"]
    # (ZeRO-3 reduces the gradients in another order than FSDP2: equal up to fp32 rounding)
    assert losses(tmp_path) == pytest.approx(losses(colocated), rel=1e-6)
    assert check_export(tmp_path / "export") == []


@pytest.mark.slow
def test_a_disaggregated_run_resumes_on_fewer_trainer_ranks(fsdp_disaggregated, common, tmp_path):
    """Elastic resume in the disaggregated topology: 1 capture + 2 trainers to step 2, then 1 capture +
    1 trainer (2 accumulation steps for the same global batch): the uninterrupted run's losses."""
    args = [*common, f"output_dir={tmp_path}", "topology=disaggregated", "capture_ranks=1"]
    check_ok(launch_train(3, [*args, "train.save_every=2", "train.stop_at_step=2"]))
    resumed = check_ok(launch_train(2, [*args, "train.global_batch_size=4"]))
    assert "resumed from" in resumed.stdout
    assert "micro-batch 2 x 2 accumulation steps x 1 ranks" in resumed.stdout
    assert losses(tmp_path) == pytest.approx(losses(fsdp_disaggregated[0]), rel=1e-6)


def test_the_wire_carries_the_last_hidden_state_for_kl_and_tv(common, tmp_path):
    """With KL and TV weights the capture rank sends the target's last hidden state with the features:
    the trainers' per-step terms equal the colocated 2-rank run's."""
    distill = [
        "objective.kl_weight=0.5",
        "objective.tv_weight=0.5",
        "train.max_steps=2",
        "train.export=false",
    ]
    colocated_dir, split = tmp_path / "colocated", tmp_path / "disaggregated"
    check_ok(launch_train(2, [*common, *distill, f"output_dir={colocated_dir}"]))
    args = [*common, *distill, f"output_dir={split}", "topology=disaggregated", "capture_ranks=1"]
    check_ok(launch_train(3, args))
    for want, got in zip(metrics(colocated_dir), metrics(split), strict=True):
        for name in ("loss", "ce_loss", "kl_loss", "tv_loss", "insample_accept_len_sampled"):
            assert got[name] == pytest.approx(want[name], rel=1e-6), name
    assert metrics(split)[0]["kl_loss"] > 0
