"""Launching the real entry points from tests: commands, environment, checked results, metrics."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
import weakref
from contextlib import suppress
from pathlib import Path

from dflash2.faults import children_of, process_environ

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "tiny-dflash2.yaml"
TRAIN = REPO / "launch" / "train.py"
# a tiny run takes 5-60 s here; DeepSpeed's comm op is compiled before any test (tests/conftest.py),
# so a run that takes minutes is stuck: fail it soon enough that a CI log shows why
TIMEOUT_S = 300


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def train_command(nproc: int, overrides: list[str], config: Path = TINY_CONFIG) -> list[str]:
    """`python launch/train.py` for one process, under torchrun for more."""
    launcher = [sys.executable] if nproc == 1 else torchrun(nproc)
    return [*launcher, str(TRAIN), "--config", str(config), *overrides]


def run(command: list[str], *, extra_env: dict | None = None, timeout: float = TIMEOUT_S):
    """Run from the repo root, one torch thread per process (several processes share 2 cores)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(extra_env or {})}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def check_ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"run failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def metrics(run_dir: Path) -> list[dict]:
    """The per-step records the trainer writes to <output_dir>/metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tiny_subset(tiny_default, directory: Path, num_lines: int) -> Path:
    """The first lines of the tiny training set: enough for a few steps, quick to tokenize."""
    lines = tiny_default.train_jsonl.read_text().splitlines(keepends=True)[:num_lines]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "train.jsonl"
    path.write_text("".join(lines))
    return path


def launch_train(nproc: int, overrides: list[str], **kwargs) -> subprocess.CompletedProcess:
    return run(train_command(nproc, overrides), **kwargs)


def short_tiny_run(tiny_default, directory: Path, *overrides: str, num_lines: int = 32, steps: int = 8):
    """One process trains the tiny default `steps` steps on the first `num_lines` lines of its data
    (short sequences, 8 anchors, micro-batch 2, lr 3e-3 without warmup, no export), `overrides` on
    top. Returns (the finished process, its metrics.jsonl records)."""
    data = tiny_subset(tiny_default, directory, num_lines)
    base = [
        f"model.target={tiny_default.target_dir}",
        f"data.train={data}",
        "data.max_length=96",
        "objective.num_anchors=8",
        "train.micro_batch_size=2",
        f"train.max_steps={steps}",
        "train.warmup_steps=0",
        "train.lr=3e-3",
        "train.log_every=1",
        "train.progress_bar=false",
        "train.export=false",
        f"output_dir={directory / 'run'}",
    ]
    result = check_ok(launch_train(1, [*base, *overrides]))
    return result, metrics(directory / "run")


def load_script(script: str):
    """A script of the repository (data_prep/..., launch/...) imported as a module, nothing run.
    What its import puts in os.environ is undone: launch/torchrun.py's torchrun defaults (SIGUSR1
    handled) are for its own process, and would reach the launchers later tests start."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(script).stem + "_cli", REPO / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass of the script looks its module up there
    environ = dict(os.environ)
    try:
        spec.loader.exec_module(module)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return module


def run_script_main(monkeypatch, script: str, arguments: list[str]) -> None:
    """Run data_prep/<script>'s main() in this process with `arguments` as its argv."""
    module = load_script(script)
    monkeypatch.setattr(sys, "argv", [Path(script).name, *arguments])
    module.main()


# ---- runs started in the background and signalled (the `launched` fixture starts them) -------------


class Process:
    """A process held by a pidfd, not by its id: a signal or a liveness check reaches that process or
    nothing. Ids wrap at kernel.pid_max (32768 here) and a suite run takes about 7,000 of them (every
    process and every thread takes one), so a bare id kept past its process's end may come to name a
    newer process of another test, or a thread of a pytest worker (a signal to a thread's id reaches
    its whole process)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = os.pidfd_open(pid)  # ProcessLookupError if it is gone already
        weakref.finalize(self, os.close, self.fd)

    def alive(self) -> bool:
        """Not yet ended (a pidfd turns readable when its process ends)."""
        return not select.select([self.fd], [], [], 0)[0]

    def signal(self, sig: int) -> None:
        """Send `sig` unless the process has ended."""
        with suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.fd, sig)

    def environ(self) -> dict[str, str]:
        return process_environ(self.pid)


def children(pid: int) -> list[Process]:
    """The live children of `pid`, oldest first, held by pidfds."""
    found = []
    for child in children_of(pid):
        with suppress(ProcessLookupError):  # ended meanwhile
            found.append(Process(child))
    return found


def wait_gone(processes: list[Process], timeout: float) -> float:
    start = time.monotonic()
    while any(process.alive() for process in processes):
        assert time.monotonic() - start < timeout, (
            f"processes {[p.pid for p in processes]} still alive after {timeout:.0f} s"
        )
        time.sleep(0.1)
    return time.monotonic() - start


def wait_for_line(log: Path, text: str, process: subprocess.Popen) -> None:
    """Until `text` is in the log of a running launch."""
    deadline = time.monotonic() + TIMEOUT_S
    while text not in log.read_text():
        assert process.poll() is None, f"the run ended before {text!r}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {text!r} after {TIMEOUT_S} s"
        time.sleep(0.05)


def wait_for_step(log: Path, step: int, process: subprocess.Popen) -> None:
    """Until the console line of `step` (`step N/...`, logged by rank 0) is in the log of a launch."""
    wait_for_line(log, f"step {step}/", process)


def seeded_rng() -> random.Random:
    """The random draws of a fault test (which step, which rank, which signal): a new seed every run,
    printed, so that a failure shows it with its captured output; DFLASH2_TEST_SEED=<seed> replays it."""
    seed = int(os.environ.get("DFLASH2_TEST_SEED") or random.randrange(2**32))
    print(f"fault test seed {seed} (DFLASH2_TEST_SEED={seed} replays these draws)")
    return random.Random(seed)
