"""Faults a run meets on a cluster, injected on purpose: stop signals (to the launcher, to one rank, to
a single process), a launcher killed with SIGKILL, a frozen rank. A stopped run must lose no step: it
checkpoints after the step it stopped at, and its continuation ends bitwise equal to an uninterrupted
run (both backends). The pieces these rely on (the stop request, the parent-death signal, the
launchers' exit codes, the collective timeout) are also tested alone, fast."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash2.checkpoint import find_latest, read_train_state
from dflash2.errors import EXIT_FAILED, EXIT_STOPPED, EXIT_USER_ERROR, ReportedError, job_exit_code
from dflash2.faults import TIMEOUT_ENV, StopRequest, collective_section, collective_timeout, stop_marker
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
    seeded_rng,
    tiny_subset,
    train_command,
    wait_for_step,
    wait_gone,
)

STEPS = 10
WRAPPER = REPO / "launch" / "torchrun.py"
FROZEN_TIMEOUT_S = 15  # the collective timeout of the frozen-rank launch


# ------------------------------------------------------------------ helpers


@pytest.fixture(scope="module")
def common(tiny_default, tmp_path_factory) -> list[str]:
    data = tiny_subset(tiny_default, tmp_path_factory.mktemp("data"), 64)
    return [
        f"model.target={tiny_default.target_dir}",
        f"data.train={data}",
        "data.max_length=96",
        "objective.num_anchors=8",
        "train.micro_batch_size=2",
        "train.global_batch_size=null",  # the accumulation steps of the overrides, on any number of ranks
        f"train.max_steps={STEPS}",
        "train.save_every=0",
        "train.export=false",
        "train.progress_bar=false",
        "train.log_every=1",
        "train.warmup_steps=0",
        "train.lr=3e-3",
    ]


def wrapped(nproc: int, args: list[str]) -> list[str]:
    """launch/torchrun.py instead of torchrun."""
    command = [sys.executable, str(WRAPPER), "--standalone", f"--nproc_per_node={nproc}"]
    return [*command, str(TRAIN), "--config", str(TINY_CONFIG), *args]


def saved_step(run_dir: Path) -> int:
    return read_train_state(find_latest(run_dir)).step


def logged_steps(run_dir: Path) -> list[int]:
    return [m["step"] for m in metrics(run_dir)]


def started_until_step(launched, command: list[str], log: Path, step: int, extra_env: dict | None = None):
    """Start `command` (a launcher) and wait until it has logged `step`: (launcher, its workers), the
    workers tracked so that the test's end kills whatever is left of them."""
    launcher = launched(command, log, extra_env)
    wait_for_step(log, step, launcher)
    workers = children(launcher.pid)
    launched.track(workers)
    return launcher, workers


def assert_stopped_without_loss(run_dir: Path, at_least: int) -> int:
    """The checkpoint is at the last step logged: every step trained was saved. The run's stop marker
    (what a SLURM batch shell requeues on) names that step and checkpoint."""
    step = saved_step(run_dir)
    assert step >= at_least and logged_steps(run_dir)[-1] == step, (step, logged_steps(run_dir))
    marker = json.loads(stop_marker(run_dir).read_text())
    assert marker["step"] == step and Path(marker["checkpoint"]).name == find_latest(run_dir).name, marker
    return step


def assert_bitwise_equal(run_dir: Path, reference: Path) -> None:
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))  # each step once, across the launches
    assert [m["loss"] for m in metrics(run_dir)] == [m["loss"] for m in metrics(reference)]
    got, expected = (load_file(find_latest(d) / "draft.safetensors") for d in (run_dir, reference))
    assert saved_step(run_dir) == saved_step(reference) == STEPS
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


# ------------------------------------------------------------------ real runs


@pytest.mark.slow
def test_fsdp_launcher_death_frozen_rank_and_forwarded_usr1_lose_no_step(common, launched, tmp_path):
    """FSDP2, two ranks. (1) torchrun alone gets SIGKILL or SIGUSR1 (which it does not handle) and
    dies: its workers, in sessions of their own, stop by themselves within seconds, with a checkpoint.
    (2) A rank is frozen (SIGSTOP): the job ends within the collective timeout + 30 s with a message
    naming the rank and the operation; the steps since the checkpoint are lost. (3) SIGUSR1 reaches
    launch/torchrun.py, which forwards it, and SIGTERM every worker at the same time (as srun signals
    every process of a step): one request, exit 75. (4) The run then ends bitwise equal to an
    uninterrupted one, each step logged once."""
    rng = seeded_rng()
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    args = [*common, "backend=fsdp", f"output_dir={run_dir}"]
    check_ok(launch_train(2, [*common, "backend=fsdp", f"output_dir={reference}"]))

    log = tmp_path / "killed.log"
    launcher, workers = started_until_step(launched, train_command(2, args), log, rng.randint(1, 3))
    assert len(workers) == 2, workers
    death = rng.choice([signal.SIGKILL, signal.SIGUSR1])
    launcher.send_signal(death)
    assert launcher.wait() == -death  # torchrun died of it
    took = wait_gone(workers, timeout=60)
    assert took < 30, f"the workers outlived their launcher ({death.name}) by {took:.0f} s"
    assert "stopped on a SIGTERM (the launcher died) after step" in log.read_text()
    stopped = assert_stopped_without_loss(run_dir, at_least=1)

    log = tmp_path / "frozen.log"
    frozen_env = {TIMEOUT_ENV: str(FROZEN_TIMEOUT_S)}
    job, workers = started_until_step(
        launched, train_command(2, args), log, stopped + rng.randint(1, 2), frozen_env
    )
    workers[rng.randrange(2)].signal(signal.SIGSTOP)
    start = time.monotonic()
    job.wait(timeout=FROZEN_TIMEOUT_S + 60)
    wait_gone(workers, timeout=30)
    took = time.monotonic() - start
    assert took < FROZEN_TIMEOUT_S + 30, f"the job took {took:.0f} s to end"
    output = log.read_text()
    assert re.search(
        r"error: rank \d: (training step \d+|the stop vote before step \d+) did not complete", output
    )
    assert not re.search(r'File "[^"]*(dflash2|launch)/', output)  # no traceback from a worker
    assert saved_step(run_dir) == stopped  # what was trained since is lost, and trained again below

    log = tmp_path / "usr1.log"
    launcher, workers = started_until_step(launched, wrapped(2, args), log, stopped + rng.randint(1, 2))
    launcher.send_signal(signal.SIGUSR1)
    for worker in workers:
        worker.signal(signal.SIGTERM)
    assert launcher.wait(timeout=TIMEOUT_S) == EXIT_STOPPED, log.read_text()[-4000:]
    assert "aborting" not in log.read_text()  # the forwarded repeat was the same request
    assert_stopped_without_loss(run_dir, at_least=stopped + 1)

    check_ok(launch_train(2, args))
    assert_bitwise_equal(run_dir, reference)


@pytest.mark.slow
def test_deepspeed_ranks_agree_to_stop_when_one_rank_gets_the_signal(common, launched, tmp_path):
    """ZeRO-3, two ranks under launch/torchrun.py: SIGUSR1 reaches one rank only (SLURM's `--signal`
    may reach some processes only); both stop after the same step, with one checkpoint, and the
    launcher exits 75. The run then ends bitwise equal to an uninterrupted one."""
    rng = seeded_rng()
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    args = [*common, "backend=deepspeed", f"output_dir={run_dir}"]
    check_ok(launch_train(2, [*common, "backend=deepspeed", f"output_dir={reference}"]))

    log = tmp_path / "usr1.log"
    launcher, workers = started_until_step(launched, wrapped(2, args), log, rng.randint(1, 4))
    workers[rng.randrange(2)].signal(signal.SIGUSR1)
    assert launcher.wait(timeout=TIMEOUT_S) == EXIT_STOPPED, log.read_text()[-4000:]
    assert_stopped_without_loss(run_dir, at_least=1)

    check_ok(launch_train(2, args))
    assert_bitwise_equal(run_dir, reference)


@pytest.mark.slow
def test_one_process_stops_on_sigint_refuses_a_resume_early_and_resumes_from_any_directory(
    common, launched, tmp_path
):
    """Plain `python launch/train.py`: SIGINT stops it with a checkpoint (exit 75). A resume that
    breaks the contract is refused before the target loads, with exit 2 and one message, and leaves
    config.yaml alone. train.resume accepts a checkpoint copied under any name: the step comes from
    its state, and the run finishes, checkpoint and export included."""
    run_dir = tmp_path / "run"
    args = [*common, "backend=fsdp", f"output_dir={run_dir}"]
    log = tmp_path / "sigint.log"
    process = launched(train_command(1, args), log)
    wait_for_step(log, seeded_rng().randint(1, 4), process)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=TIMEOUT_S) == EXIT_STOPPED, log.read_text()[-4000:]
    stopped = assert_stopped_without_loss(run_dir, at_least=1)
    assert f"stopped on a SIGINT after step {stopped} of {STEPS}" in log.read_text()
    assert json.loads(stop_marker(run_dir).read_text())["signal"] == "SIGINT"
    config = (run_dir / "config.yaml").read_text()

    refused = launch_train(1, [*args, "objective.num_anchors=9"])
    assert refused.returncode == EXIT_USER_ERROR
    assert re.search(r"num_anchors: saved 8, new 9", refused.stderr)
    assert refused.stderr.count("error:") == 1 and "Traceback" not in refused.stderr
    assert "target parameters" not in refused.stdout  # refused before the target was loaded
    assert "[dflash2] data" not in refused.stdout  # and before the data was tokenised
    assert (run_dir / "config.yaml").read_text() == config

    copy = tmp_path / "kept-for-later"
    shutil.copytree(find_latest(run_dir), copy)
    elsewhere = tmp_path / "elsewhere"
    resume = [*common, "backend=fsdp", f"output_dir={elsewhere}", f"train.resume={copy}", "train.export=true"]
    resumed = check_ok(launch_train(1, resume))
    assert f"resumed from {copy} at step {stopped}" in resumed.stdout
    assert logged_steps(elsewhere) == list(range(stopped + 1, STEPS + 1))
    assert saved_step(elsewhere) == STEPS and (elsewhere / "export" / "model.safetensors").is_file()


# ------------------------------------------------------------------ the pieces, fast


STOP_REQUEST_SCRIPT = """
import os, signal, time
from dflash2.faults import stop_request
stop_request.install()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.3)
os.kill(os.getpid(), signal.SIGUSR1)  # within the window: the same request, forwarded by a launcher
time.sleep(0.3)
print("still running, asked by", stop_request.signal_name, flush=True)
time.sleep(2.0)
os.kill(os.getpid(), signal.SIGINT)  # later: a second request aborts at once
time.sleep(10)
print("not aborted", flush=True)
"""


def test_the_first_stop_signal_asks_repeats_are_one_request_and_a_later_one_aborts():
    result = subprocess.run(
        [sys.executable, "-c", STOP_REQUEST_SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == -signal.SIGINT, result.stderr
    assert "still running, asked by SIGTERM" in result.stdout and "not aborted" not in result.stdout
    assert "SIGTERM: stopping after this optimizer step" in result.stderr
    assert "second signal (SIGINT): aborting" in result.stderr


class VotingBackend:
    """all_reduce_sum over this rank and `others` (the other ranks' votes)."""

    device = torch.device("cpu")

    def __init__(self, others: list[float]) -> None:
        self.others = others

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + sum(self.others)


def test_every_rank_stops_when_any_rank_was_asked():
    request = StopRequest()
    assert not request.agreed(VotingBackend([0.0, 0.0]))
    assert request.agreed(VotingBackend([0.0, 1.0]))  # another rank got the signal
    assert request.agreed(VotingBackend([0.0]), requested=True)
    request.signal_name = "SIGUSR1"
    assert request.agreed(VotingBackend([0.0]))


def test_another_rank_says_it_was_signalled_when_it_acts_on_it(monkeypatch, capfd):
    """Rank 0 says at once that a signal asked it to stop; another rank says so at its next vote. A
    rank that ends before voting (rank 0 stopped on a user error and the launcher signalled the rest)
    adds no line under rank 0's message."""
    monkeypatch.setenv("RANK", "1")
    request = StopRequest()
    request._handle(signal.SIGTERM, None)
    assert request.signal_name == "SIGTERM" and capfd.readouterr().err == ""
    assert request.agreed(VotingBackend([0.0]))
    said = capfd.readouterr().err
    assert said.startswith("[dflash2] rank 1: SIGTERM: stopping after this optimizer step"), said
    assert said.count("\n") == 1
    assert request.agreed(VotingBackend([0.0])) and capfd.readouterr().err == ""  # said once
    request._handle(signal.SIGTERM, None)  # a repeat within the window: nothing more to say
    request.served()  # the stop was acted on (the end of fit): a later fit does not stop on it
    assert not request.agreed(VotingBackend([0.0])) and capfd.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    first = StopRequest()
    first._handle(signal.SIGINT, None)
    assert capfd.readouterr().err.startswith("[dflash2] rank 0: SIGINT: stopping after this optimizer step")


LAUNCHED_WORKER = """
import os, sys, time
from dflash2.faults import exit_with_launcher, stop_request
exit_with_launcher()
stop_request.install()
print(os.getpid(), flush=True)
while stop_request.signal_name is None:
    time.sleep(0.05)
print(stop_request.describe(), flush=True)
"""


def test_a_held_process_is_signalled_while_it_lives_and_never_after():
    """The tests signal workers through pidfds (tests.run_helpers.Process): once the process has
    ended and been reaped, its id is free for any later process or thread, and the handle reaches
    nothing."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    held = Process(child.pid)
    assert held.alive()
    held.signal(signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL
    assert not held.alive()
    held.signal(signal.SIGKILL)  # reaped: the handle reaches nothing, whoever has the id now


def test_a_worker_is_told_to_stop_when_its_launcher_dies(launched, tmp_path):
    out, script = tmp_path / "worker.out", tmp_path / "worker.py"
    script.write_text(LAUNCHED_WORKER)
    # the launcher: a shell that starts the worker (with RANK set, as launchers do) and waits for it
    launcher = launched(
        ["bash", "-c", f"RANK=0 '{sys.executable}' '{script}' > '{out}' & wait"], tmp_path / "log"
    )
    deadline = time.monotonic() + 60
    while not (out.exists() and out.read_text().strip()):
        assert time.monotonic() < deadline and launcher.poll() is None, (tmp_path / "log").read_text()
        time.sleep(0.05)
    worker = Process(int(out.read_text().split()[0]))  # alive: it waits for its launcher's death
    launched.track([worker])
    launcher.kill()
    launcher.wait()
    wait_gone([worker], timeout=10)
    assert out.read_text().splitlines()[1] == "SIGTERM (the launcher died)"


def test_a_failed_collective_ends_the_workers_of_its_job_and_nothing_else(launched, tmp_path):
    """A worker whose collective failed SIGKILLs its sibling workers (a frozen one would ignore
    SIGTERM), but not another child of the same parent that is no worker of the job."""
    sleeper = "import time; time.sleep(60)"
    ender = "from dflash2.faults import end_sibling_workers, exit_with_launcher; exit_with_launcher(); end_sibling_workers()"
    job = "RANK={rank} WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999"
    py = f"'{sys.executable}'"
    script = (
        f"{py} -c '{sleeper}' & echo $! > {tmp_path}/other; "  # not a worker: no RANK
        f"{job.format(rank=1)} {py} -c '{sleeper}' & echo $! > {tmp_path}/sibling; "
        f"sleep 1; {job.format(rank=0)} {py} -c '{ender}'; wait"
    )
    launched(["bash", "-c", script], tmp_path / "log")
    deadline = time.monotonic() + 60
    while not all(
        (tmp_path / name).exists() and (tmp_path / name).read_text().strip() for name in ("other", "sibling")
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    other = Process(int((tmp_path / "other").read_text()))  # alive: it sleeps 60 s
    launched.track([other])
    with suppress(ProcessLookupError):  # else the worker has ended it already
        sibling = Process(int((tmp_path / "sibling").read_text()))
        launched.track([sibling])
        wait_gone([sibling], timeout=30)
    assert other.alive()


def test_a_process_that_sets_rank_itself_ends_no_sibling_and_keeps_running_without_its_parent(
    launched, tmp_path
):
    """RANK set in the process (a plain run's one-process world, an in-process test) does not make it
    a launched worker: its parent's death does not signal it, and a failed collective ends no other
    child of its parent (pytest-xdist's other worker, say), even with the parent taken for a launcher."""
    sleeper = "import time; time.sleep(60)"
    ender = (
        "import os; os.environ.update(RANK='0', WORLD_SIZE='2', MASTER_ADDR='127.0.0.1', MASTER_PORT='29999'); "
        "from dflash2 import faults; faults.exit_with_launcher(); print('watching', faults._launcher_pid); "
        "faults._launcher_pid = os.getppid(); faults.end_sibling_workers(); print('ended', flush=True)"
    )
    py = f"'{sys.executable}'"
    script = (
        f"{py} -c '{sleeper}' & echo $! > {tmp_path}/other; sleep 1; env -u RANK {py} -c \"{ender}\"; wait"
    )
    launched(["bash", "-c", script], tmp_path / "log")
    deadline = time.monotonic() + 60
    while "ended" not in (tmp_path / "log").read_text():
        assert time.monotonic() < deadline, (tmp_path / "log").read_text()
        time.sleep(0.05)
    assert "watching None" in (tmp_path / "log").read_text().splitlines()
    other = Process(int((tmp_path / "other").read_text()))
    launched.track([other])
    assert other.alive()


def test_launcher_exit_code_is_the_workers():
    assert job_exit_code([0, 0]) == 0  # every worker finished (a signal that came as they ended)
    assert job_exit_code([EXIT_STOPPED, EXIT_STOPPED]) == EXIT_STOPPED
    assert job_exit_code([EXIT_STOPPED, -signal.SIGTERM]) == EXIT_STOPPED  # ended while exiting
    assert job_exit_code([EXIT_USER_ERROR, EXIT_USER_ERROR]) == EXIT_USER_ERROR
    assert job_exit_code([EXIT_USER_ERROR, -signal.SIGTERM]) == EXIT_USER_ERROR
    assert job_exit_code([EXIT_STOPPED, EXIT_FAILED]) == EXIT_FAILED
    assert job_exit_code([EXIT_USER_ERROR, EXIT_FAILED]) == EXIT_FAILED
    assert job_exit_code([-signal.SIGKILL]) == EXIT_FAILED


def test_a_timed_out_collective_names_the_rank_and_the_operation(monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, "15")
    monkeypatch.setenv("DFLASH2_STARTUP_TIMEOUT_S", "40")
    gloo = "[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 15000ms for recv"
    from datetime import timedelta

    steps = (timedelta(seconds=15), TIMEOUT_ENV)
    monkeypatch.setattr("dflash2.faults._steps_wait", steps)  # after the first step (enter_steps)
    with pytest.raises(
        ReportedError,
        match=r"rank 0: training step 7 did not complete: .*Timed out.*15 s here, DFLASH2_DIST_TIMEOUT_S\)",
    ):
        with collective_section("training step 7"):
            raise RuntimeError(gloo)
    monkeypatch.setattr("dflash2.faults._steps_wait", None)  # before it: the start-up's timeout
    with pytest.raises(
        ReportedError,
        match=r"rank 0: loading the target did not complete: .*40 s here, DFLASH2_STARTUP_TIMEOUT_S\)",
    ):
        with collective_section("loading the target"):
            raise RuntimeError(gloo)
    with pytest.raises(RuntimeError, match="^not a collective$"):  # any other error passes unchanged
        with collective_section("training step 7"):
            raise RuntimeError("not a collective")


def test_collective_timeout_setting(monkeypatch):
    from dflash2.faults import STARTUP_TIMEOUT_ENV, startup_timeout

    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    monkeypatch.delenv(STARTUP_TIMEOUT_ENV, raising=False)
    assert collective_timeout().total_seconds() == 600
    assert startup_timeout().total_seconds() == 1800
    monkeypatch.setenv(TIMEOUT_ENV, "12.5")
    assert collective_timeout().total_seconds() == 12.5
    assert startup_timeout().total_seconds() == 1800  # never shorter than its default...
    monkeypatch.setenv(TIMEOUT_ENV, "3600")
    assert startup_timeout().total_seconds() == 3600  # ... nor than the steps' (a job set for both)
    monkeypatch.setenv(STARTUP_TIMEOUT_ENV, "20")
    assert startup_timeout().total_seconds() == 20  # unless given
    for bad in ("0", "-3", "ten"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=f"{TIMEOUT_ENV}='{bad}': give the collective timeout"):
            collective_timeout()
        monkeypatch.setenv(TIMEOUT_ENV, "600")
        monkeypatch.setenv(STARTUP_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=f"{STARTUP_TIMEOUT_ENV}='{bad}': give the start-up collective"):
            startup_timeout()


PHASES_SCRIPT = """
import os, sys, time
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist
from dflash2.capture.transfer import FeatureReceiver
from dflash2.distributed import init_distributed
from dflash2.errors import exit_process, run_main
from dflash2.faults import collective_section, enter_steps, startup_timeout
def main(argv):
    init_distributed("fsdp")
    pair = dist.new_group([0, 1], timeout=startup_timeout())  # a group made during start-up
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(4)  # loading the target, longer than the steps' timeout
    with collective_section("start-up"):
        dist.barrier()
    enter_steps()
    print(f"rank {{rank}} took its first step", flush=True)
    if rank == 1:
        time.sleep(60)  # stalled
    with collective_section("training step 2"):
        if {mode!r} == "collective":
            dist.barrier(group=pair)
        else:  # a disaggregated trainer waiting for the features of its next micro-batch
            FeatureReceiver(1, pair, 1, torch.device("cpu")).batch([0], 1)
exit_process(run_main(main))
"""


@pytest.mark.parametrize("mode", ["collective", "features"])
def test_start_up_waits_its_own_timeout_and_the_steps_theirs(tmp_path, mode):
    """A rank that loads the target for longer than the steps' collective timeout is waited for (the
    start-up timeout); once the first step is done, a stalled rank ends the job after the steps'
    timeout, in a group made at start-up, in a collective or a receive of features (a gloo receive
    keeps its group's first timeout unless given one), the message naming it."""
    script = tmp_path / "phases.py"
    script.write_text(PHASES_SCRIPT.format(repo=str(REPO), mode=mode))
    launcher = [sys.executable, str(REPO / "launch" / "torchrun.py"), "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, TIMEOUT_ENV: "2", "DFLASH2_STARTUP_TIMEOUT_S": "60"}
    start = time.monotonic()
    result = subprocess.run(
        [*launcher, str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    took = time.monotonic() - start
    assert result.returncode == EXIT_FAILED, result.stderr
    assert "rank 0 took its first step" in result.stdout and "rank 1 took its first step" in result.stdout
    assert "start-up did not complete" not in result.stderr
    said = r"rank 0: training step 2 did not complete: .*\(collectives wait at most 2 s here, DFLASH2_DIST_TIMEOUT_S\)"
    assert re.search(said, result.stderr), result.stderr
    assert took < 45, f"the stalled rank was waited for {took:.0f} s"


TIMEOUTS_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist
from dflash2.distributed import init_distributed
from dflash2.faults import current_timeout, enter_end, enter_startup, enter_steps
init_distributed("fsdp")  # a one-process world
other = dist.new_group([0])  # made without a timeout: torch's default
def waits():
    return [str(g._get_backend(torch.device("cpu")).options._timeout) for g in (dist.group.WORLD, other)]
print("start", waits(), current_timeout()[1])
enter_steps()
print("steps", waits(), current_timeout()[1])
enter_startup()  # the next run of this process (build_setup)
print("again", waits(), current_timeout()[1])
enter_steps(steps_per_wait=2)  # a capture rank, once the trainers have started
print("capture", waits(), current_timeout()[1])
enter_end()  # its last features sent: the longer of the start-up's and its own
print("end", waits(), current_timeout()[1])
import os
os.environ["DFLASH2_STARTUP_TIMEOUT_S"] = "30"
enter_startup(); enter_steps(steps_per_wait=2); enter_end()
print("end, shorter start-up", waits(), current_timeout()[1])
"""


def test_a_run_starts_again_on_the_start_up_timeout(tmp_path):
    """The first step lowers every group of the process, also one made without a timeout; the next
    run in the process (a notebook) waits the start-up timeout again until its own first step."""
    script = tmp_path / "timeouts.py"
    script.write_text(TIMEOUTS_SCRIPT.format(repo=str(REPO)))
    env = {**os.environ, TIMEOUT_ENV: "20", "DFLASH2_STARTUP_TIMEOUT_S": "70"}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "start ['0:01:10', '0:30:00'] DFLASH2_STARTUP_TIMEOUT_S", lines
    assert lines[1] == "steps ['0:00:20', '0:00:20'] DFLASH2_DIST_TIMEOUT_S", lines
    assert lines[2] == "again ['0:01:10', '0:01:10'] DFLASH2_STARTUP_TIMEOUT_S", lines
    assert lines[3] == "capture ['0:00:40', '0:00:40'] 2 x DFLASH2_DIST_TIMEOUT_S", lines
    assert lines[4] == "end ['0:01:10', '0:01:10'] DFLASH2_STARTUP_TIMEOUT_S", lines
    assert lines[5] == "end, shorter start-up ['0:00:40', '0:00:40'] 2 x DFLASH2_DIST_TIMEOUT_S", lines


def test_metrics_are_trimmed_to_the_resumed_step(tmp_path):
    from dflash2.train_log import trim_metrics

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": step, "loss": 1.0 / step}) for step in range(1, 6)]
    path.write_text("\n".join(lines) + '\n{"step": 6, "lo')  # torn by a crash mid-write
    trim_metrics(path, 3)
    assert path.read_text() == "\n".join(lines[:3]) + "\n"
    trim_metrics(path, 0)  # a run started over
    assert path.read_text() == ""


def test_a_killed_builds_lock_refuses_a_deepspeed_start_instead_of_hanging(common, tmp_path):
    """DeepSpeed waits forever on the lock file of an op build that was killed part-way: the run
    refuses to start instead (exit 2, one message naming the file); a fresh lock is a build in progress."""
    from dflash2.distributed.env import BUILD_LOCK_STALE_S, stale_build_locks

    extensions = tmp_path / "extensions"
    stale, fresh = extensions / "py311_cpu" / "deepspeed_shm_comm" / "lock", extensions / "other" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    old = time.time() - BUILD_LOCK_STALE_S - 60
    os.utime(stale, (old, old))
    assert stale_build_locks(extensions) == [stale]

    run = launch_train(
        1,
        [*common, "backend=deepspeed", f"output_dir={tmp_path / 'run'}"],
        extra_env={"TORCH_EXTENSIONS_DIR": str(extensions)},
        timeout=120,
    )
    assert run.returncode == EXIT_USER_ERROR, run.stdout[-2000:] + run.stderr[-3000:]
    assert f"error: {stale}: a build lock older than 15 min" in run.stderr
    assert "delete it and start again" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "run").exists()  # the output_dir it made for its lock is gone with it


def test_a_run_on_an_output_dir_another_run_holds_stops_at_start_naming_it(common, tmp_path):
    """Two jobs on one output directory (array tasks sharing a config): the second stops before it
    loads anything, one message on one rank naming the holder, and writes nothing; once the holder is
    gone (the lock goes with its process), the run starts and names itself in the file."""
    lock = tmp_path / ".run.lock"
    lock.write_text("process 4242 on node7, SLURM job 99, since 2026-12-07 10:00:00\n")
    held = os.open(lock, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # as a running job's rank 0 holds it (the kernel's flock)
    try:
        result = run(wrapped(2, [*common, f"output_dir={tmp_path}", "backend=fsdp"]))
    finally:
        os.close(held)
    assert result.returncode == EXIT_USER_ERROR, result.stderr[-3000:]
    message = (
        f"error: output_dir {tmp_path} is in use by another run (process 4242 on node7, SLURM job 99, "
        "since 2026-12-07 10:00:00): two runs on one directory would overwrite"
    )
    assert message in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("error:") == 1 and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [".run.lock"]  # nothing written
    check_ok(launch_train(1, [*common, f"output_dir={tmp_path}", "train.max_steps=1"]))
    assert logged_steps(tmp_path) == [1]
    assert lock.read_text().startswith("process ") and "node7" not in lock.read_text()
    free = os.open(lock, os.O_RDONLY)
    fcntl.flock(free, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the run ended (raises if not)
    os.close(free)


def test_a_released_lock_removes_the_directory_it_made_and_nothing_else(tmp_path):
    """A user error before the run's first file leaves no output_dir holding only .run.lock; a directory
    that existed, or that holds more than the lock, stays (lock file and all)."""
    from dflash2.faults import RUN_LOCK, lock_run_dir, release_run_dir

    made = tmp_path / "new" / "run"
    release_run_dir(lock_run_dir(made), made, created=True)
    assert not made.exists() and (tmp_path / "new").is_dir()  # the output_dir alone, not its parents
    release_run_dir(lock_run_dir(made), made, created=False)  # a directory of the user's own
    assert sorted(p.name for p in made.iterdir()) == [RUN_LOCK]
    fd = lock_run_dir(tmp_path / "written")
    (tmp_path / "written" / "config.yaml").write_text("seed: 0\n")
    release_run_dir(fd, tmp_path / "written", created=True)
    assert sorted(p.name for p in (tmp_path / "written").iterdir()) == [RUN_LOCK, "config.yaml"]
    fd = lock_run_dir(made)  # released each time: taken again at once
    os.close(fd)


def test_a_run_that_opened_the_lock_file_a_released_run_removes_locks_the_new_one(tmp_path, monkeypatch):
    """Run B opens .run.lock just before run A (which made the directory, then met a user error)
    removes it: B's flock then succeeds on the unlinked file, so B must open the path again, or a
    third run would lock a new file and share the directory with B."""
    from dflash2 import faults

    out = tmp_path / "run"
    held_by_a = faults.lock_run_dir(out)
    flock = fcntl.flock
    released = []

    def release_then_flock(fd, operation):  # A lets go in the window between B's open and B's flock
        if not released:
            released.append(faults.release_run_dir(held_by_a, out, created=True))
            assert not out.exists()
        return flock(fd, operation)

    monkeypatch.setattr(faults.fcntl, "flock", release_then_flock)
    held_by_b = faults.lock_run_dir(out)
    monkeypatch.setattr(faults.fcntl, "flock", flock)
    assert released and os.fstat(held_by_b).st_nlink == 1
    assert os.fstat(held_by_b).st_ino == os.stat(out / faults.RUN_LOCK).st_ino
    with pytest.raises(ValueError, match="is in use by another run"):
        faults.lock_run_dir(out)  # a third run: refused
    os.close(held_by_b)


def test_a_requeued_slurm_job_waits_for_its_own_earlier_runs_lock_and_no_other(tmp_path, monkeypatch):
    """A network file system may keep a dead node's lock for its lease: a job requeued under the same
    SLURM job id waits for it (and says so at the end of its wait); the lock of another job is refused
    at once."""
    from dflash2.faults import RUN_LOCK, lock_run_dir

    lock = tmp_path / RUN_LOCK
    lock.write_text("process 4242 on node7, SLURM job 77, since 2026-12-07 10:00:00\n")
    held = os.open(lock, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    release = threading.Timer(2.0, os.close, [held])
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "78")
        start = time.monotonic()
        with pytest.raises(
            ValueError, match=r"is in use by another run \(process 4242 on node7, SLURM job 77,"
        ):
            lock_run_dir(tmp_path, requeue_wait_s=30)
        assert time.monotonic() - start < 1
        monkeypatch.setenv("SLURM_JOB_ID", "77")
        with pytest.raises(
            ValueError, match=r"still locked by this SLURM job's earlier run .* after 1 s: if its "
        ):
            lock_run_dir(tmp_path, requeue_wait_s=1)
        release.start()
        fd = lock_run_dir(tmp_path, requeue_wait_s=30)
        assert fd is not None and time.monotonic() - start >= 2  # taken once the holder let go
        assert (
            lock.read_text().startswith(f"process {os.getpid()} on ")
            and ", SLURM job 77, since" in lock.read_text()
        )
        os.close(fd)
    finally:
        release.cancel()
        release.join()
