"""Launch scripts: syntax, the SLURM environment derivation against recorded SLURM environments,
the sbatch requeue path (SIGUSR1 passed on to the step, scontrol requeue when it exits 75), a
two-node run simulated on this machine with two torchrun agents meeting over the static rendezvous,
and, with SLURM installed, a real job stopped by USR1, requeued and resumed without losing a step."""

from __future__ import annotations

import errno
import json
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from dflash2.config import load_run_config
from dflash2.errors import EXIT_STOPPED, EXIT_USER_ERROR
from dflash2.faults import STOP_MARKER
from dflash2.plan import plan_run
from tests.run_helpers import Process, check_ok, launch_train, metrics, tiny_subset

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
SCRIPTS = sorted(
    [*REPO.glob("launch/*.sh"), *REPO.glob("launch/slurm/*.sh"), *REPO.glob("launch/slurm/*.sbatch")]
)
SLURM_CASES = sorted(FIXTURES.glob("slurm_env_*.json"))
DERIVED = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NNODES",
    "NODE_RANK",
    "GPUS_PER_NODE",
    "WORLD_SIZE",
    "RESTART_COUNT",
)


def write_stub(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def stub_scontrol(
    directory: Path,
    nodelist: str,
    hostnames: list[str],
    log: Path,
    job_state: str = "RUNNING",
    end_time: int | None = None,
) -> None:
    """scontrol that answers `show hostnames <nodelist>` with the recorded hosts and `show job` with
    `job_state` (its third line, as SLURM writes it, before 200 KB of other fields: more than a
    pipe holds, so a reader that stops at the match ends scontrol with SIGPIPE) and, given
    `end_time` (seconds since the epoch), an `EndTime` in local time as SLURM writes it; logs
    `requeue <id>`."""
    times = (
        f"printf '   StartTime=2026-01-01T00:00:00 EndTime=%s Deadline=N/A\\n' \"$(date -d @{end_time} +%Y-%m-%dT%H:%M:%S)\"\n"
        if end_time is not None
        else ""
    )
    write_stub(
        directory,
        "scontrol",
        f"""echo "$*" >> {log}
if [[ "$1 $2" == "show hostnames" && "$3" == "{nodelist}" ]]; then printf '%s\\n' {" ".join(hostnames)}; exit 0; fi
if [[ "$1 $2" == "show job" ]]; then
  printf 'JobId=%s JobName=x\n   UserId=u(1) GroupId=g(1)\n   JobState={job_state} Reason=None\n' "$3"
  {times}  for i in $(seq 2000); do echo "   Comment=$(printf '%090d' "$i")"; done
  exit 0
fi
if [[ "$1" == requeue ]]; then exit 0; fi
echo "scontrol stub: unexpected arguments: $*" >&2; exit 1
""",
    )


def slurm_environment(case: dict, stub_dir: Path) -> dict[str, str]:
    return {"PATH": f"{stub_dir}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), **case["env"]}


def derive(env: dict[str, str]) -> subprocess.CompletedProcess:
    show = " ".join(f'{name}="${name}"' for name in DERIVED)
    command = f"source launch/slurm/slurm_env.sh && printf '%s\\n' {show}"
    return subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_sbatch_files_request_requeue_and_a_warning_signal():
    for name in ("zero3", "fsdp", "disaggregated"):
        text = (REPO / "launch" / "slurm" / f"{name}.sbatch").read_text()
        assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@300" in text, name
        assert "#SBATCH --mem=0" in text and "#SBATCH --exclusive" in text, name


@pytest.mark.parametrize("case_file", SLURM_CASES, ids=lambda p: p.stem)
def test_env_derivation_from_recorded_slurm_environments(case_file, tmp_path):
    case = json.loads(case_file.read_text())
    stub_scontrol(tmp_path, case["env"]["SLURM_JOB_NODELIST"], case["scontrol_hostnames"], tmp_path / "log")
    result = derive(slurm_environment(case, tmp_path))
    assert result.returncode == 0, result.stderr
    derived = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert derived == case["expected"]


def test_env_derivation_names_what_is_missing(tmp_path):
    case = json.loads((FIXTURES / "slurm_env_2x8.json").read_text())
    stub_scontrol(tmp_path, case["env"]["SLURM_JOB_NODELIST"], case["scontrol_hostnames"], tmp_path / "log")
    env = slurm_environment(case, tmp_path)
    no_job = derive({k: v for k, v in env.items() if k != "SLURM_JOB_ID"})
    assert no_job.returncode != 0 and "SLURM_JOB_ID is unset" in no_job.stderr
    no_gpus = derive({k: v for k, v in env.items() if not k.startswith("SLURM_GPUS")})
    assert no_gpus.returncode != 0 and "GPUS_PER_NODE" in no_gpus.stderr
    explicit = derive(
        {k: v for k, v in env.items() if not k.startswith("SLURM_GPUS")} | {"GPUS_PER_NODE": "4"}
    )
    assert "WORLD_SIZE=8" in explicit.stdout.splitlines()


def start_sbatch(
    tmp_path: Path,
    tiny_default,
    overrides: list[str],
    *,
    exit_on_signal: int = EXIT_STOPPED,
    writes_marker: bool = True,
    alone: str = "sleep 60 & step=$!; wait",
    case: str = "slurm_env_1node.json",
    extra_env: dict | None = None,
    job_state: str = "RUNNING",
    marker_json: str = '{"step": 5}',
    path_first: Path | None = None,
    end_in: int | None = None,
) -> tuple[subprocess.Popen, Path, Path]:
    """Run launch/slurm/fsdp.sbatch as SLURM would (batch shell, a recorded environment) with stub
    srun / scontrol, on the tiny default with output_dir tmp_path/run. The srun stub records its
    arguments, then runs `alone` like a running step; SIGUSR1 or SIGTERM (which the batch shell must
    pass on) ends it as the workers would after their checkpoint: the run's stop marker (when
    `writes_marker`), then exit `exit_on_signal`."""
    recorded = json.loads((FIXTURES / case).read_text())
    nodelist, hosts = recorded["env"]["SLURM_JOB_NODELIST"], recorded["scontrol_hostnames"]
    end_time = None if end_in is None else int(time.time()) + end_in
    stub_scontrol(tmp_path, nodelist, hosts, tmp_path / "scontrol.log", job_state, end_time)
    srun_log, run_dir = tmp_path / "srun.log", tmp_path / "run"
    marker = f"echo '{marker_json}' > {run_dir / STOP_MARKER}; " if writes_marker else ""
    on_signal = f"echo $1 >> {tmp_path / 'signals.log'}; {marker}kill $step; exit {exit_on_signal}"
    write_stub(
        tmp_path,
        "srun",
        f"stop() {{ {on_signal}; }}\ntrap 'stop USR1' USR1\ntrap 'stop TERM' TERM\necho $$ > {tmp_path / 'srun.pid'}\n"
        f'printf "%s\\n" "$@" > {srun_log}.tmp; mv {srun_log}.tmp {srun_log}\n{alone}\n',
    )
    # scancel --signal=TERM <job>: every process of the job's steps, here the stub step
    write_stub(
        tmp_path,
        "scancel",
        f'echo "$*" >> {tmp_path / "scancel.log"}\n[[ "$1 $2" == "--signal=TERM 77" ]] && kill -TERM $(cat {tmp_path / "srun.pid"})\n',
    )
    env = slurm_environment(recorded, tmp_path) | {"DFLASH2_ROOT": str(REPO), "PYTHON": sys.executable}
    if path_first is not None:
        env["PATH"] = f"{path_first}:{env['PATH']}"
    paths = [
        f"model.target={tiny_default.target_dir}",
        f"data.train={tiny_default.train_jsonl}",
        f"output_dir={run_dir}",
    ]
    command = ["bash", "launch/slurm/fsdp.sbatch", "configs/tiny-dflash2.yaml", *paths, *overrides]
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=env | (extra_env or {}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return process, srun_log, tmp_path / "scontrol.log"


def wait_for_srun(process: subprocess.Popen, srun_log: Path) -> None:
    deadline = time.monotonic() + 60
    while not srun_log.exists():
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, "srun was never called"
        time.sleep(0.2)


def requeued(scontrol_log: Path, job_id: str = "77") -> bool:
    return f"requeue {job_id}" in scontrol_log.read_text().splitlines()


# the recorded 1-node job has 4 GPUs: the tiny config's global batch of 8 is a micro-batch of 2 there
FOUR_GPUS = ["train.micro_batch_size=2"]


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=lambda s: s.name)
def test_sbatch_passes_the_stop_on_and_requeues_from_the_runs_marker(tiny_default, tmp_path, sig):
    """USR1 (--signal=B:USR1@<lead>) or TERM (scancel --signal=TERM --batch) reaches the batch shell: it
    passes it on to the step, and requeues because the run wrote its stop marker, although the step's exit status is
    one that srun made up (137: --kill-on-bad-exit ended a task)."""
    process, srun_log, scontrol_log = start_sbatch(tmp_path, tiny_default, FOUR_GPUS, exit_on_signal=137)
    wait_for_srun(process, srun_log)
    process.send_signal(sig)
    output, _ = process.communicate(timeout=30)
    assert process.returncode == 0, output
    # TERM goes to the step's processes through scancel, never to srun (srun kills its step on TERM)
    assert (tmp_path / "scancel.log").exists() == (sig == signal.SIGTERM)
    assert (
        tmp_path / "signals.log"
    ).read_text() == f"{sig.name.removeprefix('SIG')}\n"  # the step got it, once
    assert requeued(scontrol_log)
    assert 'the run stopped with a checkpoint ({"step": 5}); requeueing, it resumes there' in output
    assert "global batch 8: micro-batch 2 x 1 accumulation steps x 4 ranks\n" in output
    # a cluster's start-up: one rank may read a 27B target while the others wait
    assert "collectives wait at most 1800 s until a rank's first step (DFLASH2_STARTUP_TIMEOUT_S" in output
    assert "600 s from then on (DFLASH2_DIST_TIMEOUT_S)" in output
    # the batch shell's lines are also in the run directory
    assert "requeueing" in (tmp_path / "run" / "slurm" / "batch-77.log").read_text()
    srun_args = srun_log.read_text().splitlines()
    # --cpus-per-task passed explicitly (srun does not inherit it from sbatch since Slurm 22.05), and
    # the step's output per node under the run directory, per job and restart
    assert srun_args[:6] == [
        "--export=ALL",
        "--kill-on-bad-exit=1",
        "--nodes=1",
        "--ntasks-per-node=1",
        "--cpus-per-task=32",
        f"--output={tmp_path / 'run' / 'slurm' / '77.0' / 'node%n.out'}",
    ]
    assert srun_args[-3:] == [f"output_dir={tmp_path / 'run'}", *FOUR_GPUS, "backend=fsdp"]


def test_sbatch_requeues_on_the_marker_alone_and_never_after_a_failure(tiny_default, tmp_path):
    for name in ("a", "b", "c", "d"):
        (tmp_path / name).mkdir()
    # stopped by a signal that did not come through the batch shell (scancel --signal to the step):
    # the marker alone decides
    stopped, _, scontrol_log = start_sbatch(
        tmp_path / "a",
        tiny_default,
        FOUR_GPUS,
        alone=f"echo '{{\"step\": 3}}' > {tmp_path / 'a' / 'run' / STOP_MARKER}",
    )
    assert stopped.communicate(timeout=60) and stopped.returncode == 0
    assert requeued(scontrol_log)
    # the run failed while stopping (no marker): the job fails, it is not requeued over and over,
    # even with exit status 75
    failed, srun_log, scontrol_log = start_sbatch(
        tmp_path / "b", tiny_default, FOUR_GPUS, exit_on_signal=EXIT_STOPPED, writes_marker=False
    )
    wait_for_srun(failed, srun_log)
    failed.send_signal(signal.SIGUSR1)
    output, _ = failed.communicate(timeout=30)
    assert failed.returncode == EXIT_STOPPED and "no stop marker: not requeued" in output, output
    assert not any(line.startswith("requeue") for line in scontrol_log.read_text().splitlines())
    # a marker left by an earlier start does not requeue this one
    (tmp_path / "c" / "run").mkdir()
    (tmp_path / "c" / "run" / STOP_MARKER).write_text('{"step": 2}\n')
    done, _, scontrol_log = start_sbatch(tmp_path / "c", tiny_default, FOUR_GPUS, alone="exit 0")
    assert done.communicate(timeout=60) and done.returncode == 0
    assert not requeued(scontrol_log)
    # a job SLURM reports cancelled (a plain scancel) is not requeued, though the run checkpointed
    cancelled, srun_log, scontrol_log = start_sbatch(
        tmp_path / "d", tiny_default, FOUR_GPUS, job_state="CANCELLED"
    )
    wait_for_srun(cancelled, srun_log)
    cancelled.send_signal(signal.SIGTERM)
    output, _ = cancelled.communicate(timeout=30)
    assert cancelled.returncode == 0 and "the job was cancelled: not requeued" in output, output
    assert not requeued(scontrol_log)


def test_the_stops_deadline_follows_the_time_left_before_the_time_limit(tmp_path):
    """A minute before the job's EndTime, so that a longer --signal lead gives the stop more time (a
    fixed 240 s requeued a 900 s lead's stop mid-checkpoint); half the time left under two minutes;
    240 s for a USR1 more than an hour before the time limit (sent by hand) or when SLURM reports no
    EndTime."""
    case = json.loads((FIXTURES / "slurm_env_1node.json").read_text())
    nodelist, hosts = case["env"]["SLURM_JOB_NODELIST"], case["scontrol_hostnames"]
    deadlines = {}
    for left in (900, 100, 7200, None):
        end_time = None if left is None else int(time.time()) + left
        stub_scontrol(tmp_path, nodelist, hosts, tmp_path / "log", end_time=end_time)
        said = subprocess.run(
            ["bash", "-c", "source launch/slurm/launch.sh && _dflash2_stop_deadline"],
            cwd=REPO, env=slurm_environment(case, tmp_path), capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert said.returncode == 0, said.stderr
        deadlines[left] = int(said.stdout)
    assert 835 <= deadlines[900] <= 840 and 47 <= deadlines[100] <= 50
    assert deadlines[7200] == deadlines[None] == 240  # a USR1 hours before the time limit: sent by hand


def test_sbatch_resolves_python_and_takes_the_device_gb_from_the_environment(tiny_default, tmp_path):
    """PYTHON=<a command name> reaches the nodes as an absolute path (their launcher looks for a file);
    DFLASH2_DEVICE_GB reaches the pre-flight's memory plan, and --device-gb among the arguments (which
    go to launch/train.py too, which has no such flag) is one message; the launcher waits for its
    workers as long as the longest stop deadline, an hour."""
    (tmp_path / "bin").mkdir()
    write_stub(tmp_path / "bin", "py-for-test", f'exec {sys.executable} "$@"\n')
    seen = tmp_path / "seen"
    process, srun_log, _ = start_sbatch(
        tmp_path,
        tiny_default,
        FOUR_GPUS,
        alone=f'echo "$PYTHON $TORCH_ELASTIC_SHUTDOWN_TIMEOUT" > {seen}; exit 0',
        extra_env={"PYTHON": "py-for-test", "DFLASH2_DEVICE_GB": "0.5"},
        path_first=tmp_path / "bin",
    )
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0 and "of 0.5 GiB (--device-gb)" in output, output
    python, shutdown_timeout = seen.read_text().split()
    assert python == str(tmp_path / "bin" / "py-for-test") and shutdown_timeout == "3600"
    (tmp_path / "flag").mkdir()
    refused, srun_log, _ = start_sbatch(tmp_path / "flag", tiny_default, [*FOUR_GPUS, "--device-gb", "80"])
    output, _ = refused.communicate(timeout=60)
    assert refused.returncode == EXIT_USER_ERROR and not srun_log.exists(), output
    assert "set DFLASH2_DEVICE_GB=<GiB> in the job's environment" in output and "Traceback" not in output


def test_sbatch_requeues_a_running_job_whose_stop_outlives_the_deadline(tiny_default, tmp_path):
    """A stop still writing its checkpoint DFLASH2_STOP_DEADLINE_S after SIGUSR1 (a slow file system):
    the batch shell requeues the running job, which resumes from its latest complete checkpoint, where
    the time limit would have ended it as TIMEOUT, which SLURM never requeues."""
    process, srun_log, scontrol_log = start_sbatch(
        tmp_path,
        tiny_default,
        FOUR_GPUS,
        alone="trap 'echo USR1 >> " + str(tmp_path / "signals.log") + "' USR1; sleep 6 & wait; wait",
        extra_env={"DFLASH2_STOP_DEADLINE_S": "1"},
    )
    wait_for_srun(process, srun_log)
    process.send_signal(signal.SIGUSR1)
    output, _ = process.communicate(timeout=60)
    assert requeued(scontrol_log), output
    assert "the stop did not finish within 1 s of SIGUSR1" in output, output


def test_sbatch_does_not_requeue_a_run_the_time_limit_stopped_before_its_first_step(tiny_default, tmp_path):
    """A start-up longer than the job's time before SIGUSR1 stops the run at its resume step: a requeued
    job would stop there again, over and over. A SIGTERM (preemption) before the first step requeues."""
    never_trained = '{"step": 5, "trained": 0, "checkpoint": null, "signal": "SIGUSR1"}'
    for sig, name in ((signal.SIGUSR1, "usr1"), (signal.SIGTERM, "term")):
        (tmp_path / name).mkdir()
        process, srun_log, scontrol_log = start_sbatch(
            tmp_path / name, tiny_default, FOUR_GPUS, marker_json=never_trained
        )
        wait_for_srun(process, srun_log)
        process.send_signal(sig)
        output, _ = process.communicate(timeout=30)
        if sig == signal.SIGUSR1:
            assert process.returncode == 1 and "before its first step" in output, output
            assert "Give the job a longer --time" in output and not requeued(scontrol_log)
        else:
            assert process.returncode == 0 and requeued(scontrol_log), output


def test_sbatch_survives_a_signal_during_the_preflight_and_acts_on_it(tiny_default, tmp_path):
    """USR1 or TERM while the pre-flight runs (the heavy imports) no longer kills the batch shell (the
    default action of USR1): USR1 (the time limit is near) starts nothing and is not requeued, TERM
    (preemption) requeues without starting."""
    slow = tmp_path / "slow-python"
    flag = tmp_path / "in-preflight"
    slow.write_text(
        f'#!/bin/bash\n[[ $1 == */preflight.py ]] && touch {flag} && sleep 3\nexec {sys.executable} "$@"\n'
    )
    slow.chmod(0o755)
    for sig, name in ((signal.SIGUSR1, "usr1"), (signal.SIGTERM, "term")):
        (tmp_path / name).mkdir()
        process, srun_log, scontrol_log = start_sbatch(
            tmp_path / name, tiny_default, FOUR_GPUS, extra_env={"PYTHON": str(slow)}
        )
        deadline = time.monotonic() + 30
        while not flag.exists():
            assert time.monotonic() < deadline and process.poll() is None, process.communicate()[0]
            time.sleep(0.05)
        flag.unlink()
        process.send_signal(sig)
        output, _ = process.communicate(timeout=60)
        assert not srun_log.exists(), output
        if sig == signal.SIGUSR1:
            assert process.returncode == 1 and "came before the run started: not started" in output, output
            assert not requeued(scontrol_log)
        else:
            assert process.returncode == 0 and requeued(scontrol_log), output


def test_sbatch_preflight_refuses_what_the_trainer_would_with_one_message(tiny_default, tmp_path):
    """The pre-flight runs the trainer's checks before srun: exit 2, one message, no traceback."""
    cases = {
        "resume": (["train.resume=none"], "train.resume='none': a requeued SLURM job resumes only with train.resume=auto"),
        "typo": (["train.max_step=5"], "train.max_step: Extra inputs are not permitted; did you mean train.max_steps?"),
        "target": (["model.target=/nowhere/target"], "model.target='/nowhere/target' does not exist"),
        "batch": (["train.micro_batch_size=2", "train.global_batch_size=12"],
                  "train.global_batch_size=12 is not a multiple of micro_batch_size 2 x 4 data-parallel ranks = 8"),
    }  # fmt: skip
    for name, (overrides, message) in cases.items():
        (tmp_path / name).mkdir()
        process, srun_log, _ = start_sbatch(tmp_path / name, tiny_default, overrides)
        output, _ = process.communicate(timeout=60)
        assert process.returncode == EXIT_USER_ERROR and not srun_log.exists(), (name, output)
        assert output.count("error:") == 1 and message in output and "Traceback" not in output, output
    assert "(this job has 4 GPUs)" in output


def test_the_preflight_prints_the_memory_plan_and_warns_when_it_is_over(tiny_default, tmp_path):
    """The planner's peak per GPU (dflash2.plan.plan_run on the same config) in the job's log; over the
    GPU's memory, a warning with the planner's fixes, and the job goes on (an estimate refuses nothing)."""
    overrides = [
        f"model.target={tiny_default.target_dir}",
        f"data.train={tiny_default.train_jsonl}",
        f"output_dir={tmp_path / 'run'}",
        "train.micro_batch_size=2",
    ]
    config = "configs/tiny-dflash2.yaml"
    preflight = [sys.executable, "launch/slurm/preflight.py", "--world-size", "4", "--device-gb", "0.5"]
    result = subprocess.run(
        [*preflight, config, *overrides], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout == f"{tmp_path / 'run'}\n", result.stderr
    expected = plan_run(
        load_run_config(REPO / config, overrides), world_size=4, target_config=tiny_default.target_dir
    )
    need = expected.roles[0].total() / 2**30
    assert need > 0.5  # the tiny run needs more than the 0.5 GiB given: a warning
    assert f"memory plan per GPU: colocated ranks {need:.1f} GiB, of 0.5 GiB (--device-gb)" in result.stderr
    assert (
        f"breakdown: python -m dflash2.plan {config} {' '.join(overrides)} --world-size 4 --device-gb 0.5"
        in result.stderr
    )
    warning = f"warning: the run may run out of GPU memory: colocated ranks need {need:.1f} GiB > 0.5 GiB per device: lower train.micro_batch_size"
    assert warning in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_the_preflight_says_its_notes_on_stderr_and_prints_the_output_dir_alone(
    tiny_default, tmp_path, monkeypatch, capsys
):
    """The batch shell reads the output_dir from the pre-flight's stdout: a note there (a file system
    that refuses locks) made the run's log directory and stop marker paths with the note in them, so
    a stopped job was never requeued."""
    import dflash2.faults as faults

    def refuse(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(faults, "fcntl", SimpleNamespace(flock=refuse, LOCK_EX=0, LOCK_NB=0))
    preflight = runpy.run_path(str(REPO / "launch/slurm/preflight.py"), run_name="preflight")
    overrides = [
        f"model.target={tiny_default.target_dir}",
        f"data.train={tiny_default.train_jsonl}",
        f"output_dir={tmp_path / 'run'}",
    ]
    argv = ["--world-size", "1", "--device-gb", "80", "configs/tiny-dflash2.yaml", *overrides]
    assert preflight["main"](argv) == 0
    said = capsys.readouterr()
    assert said.out == f"{tmp_path / 'run'}\n"
    assert f"note: the file system of {tmp_path / 'run'} refuses locks (No locks available)" in said.err


def test_the_preflight_reads_the_gpus_memory_and_a_gpu_it_cannot_read_stops_nothing(monkeypatch):
    preflight = runpy.run_path(str(REPO / "launch/slurm/preflight.py"), run_name="preflight")
    device_memory = preflight["device_memory"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * 2**30, int(79.18 * 2**30)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert device_memory(None) == (79.1, "this node's GPU 0, NVIDIA H100 80GB HBM3")  # as printed
    assert device_memory(40.0) == (40.0, "--device-gb")

    def busy(device):
        raise RuntimeError("CUDA error: all CUDA-capable devices are busy or unavailable")

    monkeypatch.setattr(torch.cuda, "mem_get_info", busy)
    gib, source = device_memory(None)
    assert gib == preflight["DEVICE_GB"] and source.startswith(
        "GPU 0 not readable here (RuntimeError: CUDA error"
    )


def test_sbatch_derives_accumulation_from_the_global_batch_on_two_nodes(tiny_default, tmp_path):
    """Node 0's batch shell of the recorded 2 x 8-GPU job: srun starts one task on each of the 2 nodes;
    the global batch of 32 is 2 accumulation steps there. An exported GPUS_PER_NODE does not override
    the allocation, and the rendezvous port is one that was free on this node (not the job id's)."""
    process, srun_log, _ = start_sbatch(
        tmp_path,
        tiny_default,
        ["train.micro_batch_size=1", "train.global_batch_size=32"],
        case="slurm_env_2x8.json",
        extra_env={"GPUS_PER_NODE": "4", "SLURM_NODEID": "0", "SLURM_PROCID": "0"},
    )
    wait_for_srun(process, srun_log)
    process.send_signal(signal.SIGUSR1)  # ends the stub step as a requeue does
    output = process.communicate(timeout=30)[0]
    assert "global batch 32: micro-batch 1 x 2 accumulation steps x 16 ranks\n" in output
    # the planner's estimate in the job's log (no GPU here: against its default 79 GiB), nothing over it
    assert re.search(
        r"\[dflash2\] memory plan per GPU: colocated ranks \d+\.\d GiB, of 79 GiB \(no GPU", output
    )
    assert "may run out of GPU memory" not in output
    assert "GPUS_PER_NODE=4 ignored: the allocation has 8 GPUs per node" in output
    port = re.search(r"2 nodes x 8 GPUs, 32 CPUs per node, rendezvous gpu-017:(\d+)", output)
    assert port and port.group(1) != "27203", output
    assert srun_log.read_text().splitlines()[2:5] == [
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=32",
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_nodes_simulated_with_two_torchrun_agents(tiny_default, tmp_path):
    """Two agents (`torchrun --nnodes 2 --nproc_per_node 1 --node_rank {0,1} --master_addr ...`,
    started by launch/multinode_torchrun.sh) run the real launch/train.py as one 2-rank world, rank 0
    on node 0."""
    run_dir = tmp_path / "run"
    port = free_port()
    args = [
        "--config", "configs/tiny-dflash2.yaml",
        f"model.target={tiny_default.target_dir}", f"data.train={tiny_subset(tiny_default, tmp_path, 64)}",
        "backend=fsdp", "train.max_steps=3", "train.save_every=0", "train.export=false",
        "train.micro_batch_size=4", "train.progress_bar=false", f"output_dir={run_dir}",
    ]  # fmt: skip
    agents = []
    for node_rank in (0, 1):
        env = os.environ | {
            "NNODES": "2", "NODE_RANK": str(node_rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "GPUS_PER_NODE": "1", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        agents.append(
            subprocess.Popen(
                ["launch/multinode_torchrun.sh", *args],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
        )
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output[-4000:]
    assert "[dflash2] done: step 3" in outputs[0] and "[dflash2] done" not in outputs[1]  # rank 0: node 0
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == checkpoint.name
    assert json.loads((checkpoint / "contract.json").read_text())["global_batch_size"] == 8  # 2 ranks x 4
    assert {p.name for p in (checkpoint / "backend").glob("rank*.safetensors")} == {
        "rank00000.safetensors",
        "rank00001.safetensors",
    }


# ------------------------------------------------------------------ a real two-node SLURM cluster
# Debian's Slurm (22.05, bookworm) runs several slurmd on one host: each node gets its own NodeName,
# Port, spool directory and pid file (%n), and `slurmd -N <name>` starts it. So the job below has two
# real SLURM nodes on this machine, one torchrun agent each, meeting over the static rendezvous.

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
NODES = ("dflash2n1", "dflash2n2")


def slurm_conf(root: Path, host: str, ctld_port: int, node_ports: list[int]) -> str:
    """Two CPU nodes on this host, one placeholder GPU each (gres backed by /dev/null) so that SLURM
    itself sets SLURM_GPUS_ON_NODE; proctrack/linuxproc and task/none need no cgroups."""
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={os.cpu_count()} "
        "RealMemory=2000 Gres=gpu:1 State=UNKNOWN"
        for name, port in zip(NODES, node_ports)
    )
    return f"""ClusterName=dflash2test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock,cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldPort={ctld_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
GresTypes=gpu
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def wait_for(predicate, timeout: float, what: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture
def slurm_cluster(tmp_path_factory):
    """munged + slurmctld + two slurmd on this machine, configured under a temporary directory.
    Needs the Debian packages slurmd, slurmctld, slurm-client and munge, and root."""
    import shutil

    missing = [name for name in SLURM_BINARIES if shutil.which(name) is None]
    if missing or os.geteuid() != 0:
        pytest.skip(
            f"a real SLURM needs root and {', '.join(missing) or 'nothing else'} (apt-get install slurmd slurmctld slurm-client munge)"
        )
    root = tmp_path_factory.mktemp("slurm")
    root.chmod(0o700)
    (root / "state").mkdir()
    (root / "munge.key").write_bytes(os.urandom(1024))
    (root / "munge.key").chmod(0o600)
    host = socket.gethostname()
    (root / "slurm.conf").write_text(slurm_conf(root, host, free_port(), [free_port() for _ in NODES]))
    (root / "gres.conf").write_text("Name=gpu Count=1 File=/dev/null\n")
    env = os.environ | {"SLURM_CONF": str(root / "slurm.conf")}
    started = []
    try:
        munged = ["munged", "--force", f"--socket={root}/munge.sock", f"--key-file={root}/munge.key",
                  f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/munge.seed"]  # fmt: skip
        daemons = [
            (munged, "munged.pid"),
            (["slurmctld", "-c", "-f", str(root / "slurm.conf")], "slurmctld.pid"),
        ]
        daemons += [
            (["slurmd", "-N", name, "-f", str(root / "slurm.conf")], f"slurmd-{name}.pid") for name in NODES
        ]
        for command, pid_file in daemons:
            subprocess.run(command, env=env, check=True, capture_output=True)
            pid = int(wait_for(lambda p=root / pid_file: p.exists() and p.read_text().strip(), 20, pid_file))
            started.append(Process(pid))  # a pidfd: the teardown signals this daemon or nothing
        wait_for(
            lambda: (
                subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True)
                .stdout.split()
                .count("idle")
                == len(NODES)
            ),
            30,
            "both nodes to become idle",
        )
        yield env
    finally:
        for daemon in reversed(started):
            daemon.signal(signal.SIGTERM)


def job_state(env: dict, job_id: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return next((field.split("=", 1)[1] for field in out.split() if field.startswith("JobState=")), "")


def start_requeued(env: dict, job_id: str, run_dir: Path) -> int:
    """Wait for the job to requeue itself; the step its stop marker names (read before the next
    start removes it). SLURM holds a requeued job until the credentials of its last start expire
    (cred_expire, 10 s here, 120 s by default); starting it earlier is refused ("credential revoked")."""
    wait_for(lambda: job_state(env, job_id) == "PENDING", 120, "the requeue", interval=0.2)
    return json.loads((run_dir / STOP_MARKER).read_text())["step"]


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [m["step"] for m in metrics(run_dir)] if path.is_file() and path.read_text().endswith("\n") else []


def test_sbatch_on_two_real_slurm_nodes_stops_on_usr1_and_term_requeues_itself_and_resumes_exactly(
    slurm_cluster, tiny_default, tmp_path
):
    """fsdp.sbatch on 2 SLURM nodes x 1 placeholder GPU, the tiny config's own global batch (8 = 2
    ranks x micro-batch 4). (1) USR1 to the batch shell, what --signal=B:USR1@<lead> sends before the
    time limit: passed on to the step, the run checkpoints the step it is at and writes its stop
    marker, the job requeues itself. (2) After the resume, TERM to the batch shell: it sends TERM to
    every process of the step (not to srun, which would kill its step): the same. (3) The third start finishes; every step trained once, the losses
    and the final draft bitwise equal to an uninterrupted 2-rank run."""
    env = slurm_cluster | {"PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    run_dir, reference, log = tmp_path / "run", tmp_path / "reference", tmp_path / "job.out"
    steps = 30
    overrides = [
        f"model.target={tiny_default.target_dir}", f"data.train={tiny_subset(tiny_default, tmp_path, 64)}",
        "data.max_length=96", "objective.num_anchors=8", "train.micro_batch_size=4", f"train.max_steps={steps}",
        "train.save_every=0", "train.export=false", "train.progress_bar=false", "train.log_every=1",
    ]  # fmt: skip
    submit = [
        "sbatch", "--parsable", "--nodes=2", "--gpus-per-node=1", f"--cpus-per-task={os.cpu_count()}",
        f"--output={log}", "launch/slurm/fsdp.sbatch", "configs/tiny-dflash2.yaml", *overrides,
        f"output_dir={run_dir}",
    ]  # fmt: skip
    job_id = subprocess.run(
        submit, cwd=REPO, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()
    wait_for(lambda: len(logged_steps(run_dir)) >= 2, 240, "two training steps", interval=0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=env, check=True)
    first_stop = start_requeued(env, job_id, run_dir)
    wait_for(lambda: len(logged_steps(run_dir)) >= first_stop + 2, 240, "two resumed steps", interval=0.2)
    subprocess.run(["scancel", "--signal=TERM", "--batch", job_id], env=env, check=True)
    second_stop = start_requeued(env, job_id, run_dir)
    state = wait_for(
        lambda: job_state(env, job_id) in ("COMPLETED", "FAILED") and job_state(env, job_id), 300, "the job"
    )
    batch = log.read_text()
    assert state == "COMPLETED", batch[-4000:]
    assert [f"(restart {n}) 2 nodes x 1 GPUs" in batch for n in range(3)] == [True] * 3, batch[-4000:]
    assert batch.count("the run stopped with a checkpoint") == 2 and batch.count("requeueing") == 2
    # each node's own log, per start (the rendezvous decides which node holds rank 0)
    logs = [
        [(run_dir / "slurm" / f"{job_id}.{n}" / f"node{i}.out").read_text() for i in (0, 1)] for n in range(3)
    ]
    starts = ["".join(pair) for pair in logs]
    assert f"stopped on a SIGUSR1 after step {first_stop} of {steps}" in starts[0], starts[0][-4000:]
    assert f"stopped on a SIGTERM after step {second_stop} of {steps}" in starts[1], starts[1][-4000:]
    for text, stopped in ((starts[1], first_stop), (starts[2], second_stop)):  # resumed where it stopped
        resumed = re.findall(r"resumed from \S+/checkpoints/step_(\d{8}) at step (\d+)$", text, re.MULTILINE)
        assert resumed == [(f"{stopped:08d}", str(stopped))], text[-4000:]
    assert all("holds" in log for pair in logs for log in pair)  # both nodes ran a rank, every start
    check_ok(launch_train(2, [*overrides, "backend=fsdp", f"output_dir={reference}"]))
    assert logged_steps(run_dir) == list(range(1, steps + 1))
    assert [m["loss"] for m in metrics(run_dir)] == [m["loss"] for m in metrics(reference)]
    got, expected = (
        load_file(d / "checkpoints" / f"step_{steps:08d}" / "draft.safetensors") for d in (run_dir, reference)
    )
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_multinode_deepspeed_forwards_the_runs_settings_to_every_node(tmp_path):
    """DeepSpeed's pdsh runner forwards over ssh only a few variable prefixes and .deepspeed_env's
    lines: the script hands it one env file with the user's lines and this shell's DFLASH2_* and
    TORCH_* (a collective timeout set for the job reached no node before)."""
    (tmp_path / "hostfile").write_text("node0 slots=8\nnode1 slots=8\n")
    (tmp_path / "home").mkdir()  # the user's file without a newline at its end, then a blank line
    (tmp_path / "home" / ".deepspeed_env").write_text("HOME_SETTING=2\n\n  \nLAST_SETTING=3")
    (tmp_path / ".deepspeed_env").write_text("MY_SETTING=1\n")
    stub = tmp_path / "deepspeed"
    stub.write_text('#!/bin/bash\necho "args: $*"\ncat "$DS_ENV_FILE"\n')
    stub.chmod(0o755)
    env = os.environ | {
        "HOSTFILE": str(tmp_path / "hostfile"),
        "DEEPSPEED": str(stub),
        "DFLASH2_DIST_TIMEOUT_S": "3600",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "HOME": str(tmp_path / "home"),
    }
    out = subprocess.run(
        [str(REPO / "launch/multinode_deepspeed.sh"), "--config", "x.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--hostfile" in out and "--master_addr node0" in out, out
    lines = out.splitlines()
    # every line KEY=value, as DeepSpeed's runner splits them (LAST_SETTING=3MY_SETTING=1 before)
    assert all("=" in line for line in lines[1:]) and "HOME_SETTING=2" in lines and "LAST_SETTING=3" in lines
    for line in ("MY_SETTING=1", "DFLASH2_DIST_TIMEOUT_S=3600", "TORCH_NCCL_ASYNC_ERROR_HANDLING=1"):
        assert line in lines, out
