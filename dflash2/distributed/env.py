"""Process-group start-up (torchrun, the deepspeed launcher, or plain `python`) and backend construction."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from dflash2.distributed.base import Backend
from dflash2.distributed.registry import backend_class
from dflash2.faults import enter_startup, startup_timeout

# DeepSpeed JIT-compiles ops (on CPU, its shared-memory comm op at init_distributed) behind a `lock`
# file in the torch extensions directory; those builds take seconds to a few minutes
BUILD_LOCK_STALE_S = 900.0


def extensions_dir() -> Path:
    """Where torch (and so DeepSpeed) builds JIT extensions."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")


def stale_build_locks(root: Path, max_age_s: float = BUILD_LOCK_STALE_S) -> list[Path]:
    """Build locks under `root` older than any build: left by a build that was killed part-way."""
    now = time.time()
    locks = [*root.glob("*/lock"), *root.glob("*/*/lock")] if root.is_dir() else []
    return [lock for lock in locks if now - lock.stat().st_mtime > max_age_s]


def check_build_locks() -> None:
    """A killed build's lock makes every later DeepSpeed start wait on it forever, printing nothing:
    refuse to start instead, naming the file."""
    stale = stale_build_locks(extensions_dir())
    if stale:
        names = ", ".join(str(lock) for lock in stale)
        raise ValueError(
            f"{names}: a build lock older than {BUILD_LOCK_STALE_S / 60:.0f} min, left by a DeepSpeed op "
            "build that was killed part-way; DeepSpeed would wait on it forever. Unless a job on this "
            "machine is still compiling, delete it and start again"
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _local_rank_from_argv(argv: list[str]) -> int | None:
    """The deepspeed launcher may pass `--local_rank=N` (or `--local_rank N`) instead of setting LOCAL_RANK."""
    for i, arg in enumerate(argv):
        if arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            return int(arg.split("=", 1)[1])
        if arg in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            return int(argv[i + 1])
    return None


# The launcher variables _fill_launch_env set for a plain `python` run (a one-process world), unset
# again when that world ends, so that the process (a notebook) starts later runs and launchers with
# the environment it had.
_set_for_one_process: list[str] = []


# Task counts that srun and MPI launchers set in each task they start; none of them sets RANK.
TASK_COUNT_VARIABLES = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def _refuse_tasks_without_launcher() -> None:
    """Many tasks started without a torch launcher (`srun -n 8 python launch/train.py`, mpirun, the
    deepspeed launcher's slurm/openmpi modes) would each run a one-process world of its own, all
    on one device and one output directory: refused, naming the launchers that work."""
    for name in TASK_COUNT_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            raise ValueError(
                f"{name}={value}: this process is one of {value} tasks started without torchrun or the "
                "deepspeed launcher (no RANK is set), and each would train alone. Under SLURM submit "
                "launch/slurm/<name>.sbatch (one torchrun agent per node); elsewhere start the run "
                "with torchrun or deepspeed"
            )


def _fill_launch_env() -> None:
    if "LOCAL_RANK" not in os.environ:
        argv_local_rank = _local_rank_from_argv(sys.argv)
        if argv_local_rank is not None:
            os.environ["LOCAL_RANK"] = str(argv_local_rank)
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        _refuse_tasks_without_launcher()
        # plain `python`: a one-process world on this machine
        added = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            added["MASTER_PORT"] = str(_free_port())
        _set_for_one_process[:] = [name for name in added if name not in os.environ]
        os.environ.update(added)
    missing = [
        name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ
    ]
    if missing:
        raise ValueError(
            f"launcher environment is incomplete: {missing} unset; launch with torchrun or deepspeed"
        )
    os.environ.setdefault("LOCAL_RANK", "0")


def init_distributed(backend_name: str) -> tuple[int, int, int]:
    """Start the default process group (gloo on CPU, nccl on CUDA) the way backend `backend_name`
    starts it; returns (rank, world_size, local_rank).

    Works under torchrun, under the deepspeed launcher and as a plain one-process `python` run.
    Idempotent: a second call returns the existing group's coordinates. Collectives wait at most
    `startup_timeout()` (DFLASH2_STARTUP_TIMEOUT_S) until the first step lowers every group's wait to
    `collective_timeout()` (dflash2.faults.enter_steps); groups made in between must pass
    `startup_timeout()` too (new_group does not inherit it)."""
    backend = backend_class(backend_name)
    _fill_launch_env()
    local_rank = int(os.environ["LOCAL_RANK"])
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        backend.start_process_group("nccl" if torch.cuda.is_available() else "gloo", startup_timeout())
        enter_startup()
    return dist.get_rank(), dist.get_world_size(), local_rank


def shutdown_distributed() -> None:
    """End a finished run cleanly: every rank waits for the others, then the process group is torn
    down before interpreter exit (left to exit handlers, a communication thread can abort the process
    after the run has already succeeded)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _unset_one_process_env()


@contextmanager
def distributed_run() -> Iterator[None]:
    """Around a run that calls init_distributed: `shutdown_distributed` when it succeeds. After a
    failure in a plain `python` run (a one-process world, no launcher), its process group is
    destroyed without waiting for anybody and the launcher variables it set are unset, so that the
    process (a notebook) can start another run; under a launcher nothing changes: the failing rank's
    process exits, and the job's store still carries its error report (dflash2.errors)."""
    try:
        yield
    except BaseException:
        if _set_for_one_process:
            if dist.is_initialized():
                dist.destroy_process_group()
            _unset_one_process_env()
        raise
    shutdown_distributed()


def _unset_one_process_env() -> None:
    for name in _set_for_one_process:
        os.environ.pop(name, None)
    _set_for_one_process.clear()


def build_backend(
    name: str,
    ds_config_path: str | None,
    micro_batch_size: int,
    grad_accum_steps: int,
    *,
    target_group: dist.ProcessGroup | None = None,
    draft_group: dist.ProcessGroup | None = None,
    scope: object | None = None,
) -> Backend:
    """The backend `name`, after init_distributed(name). `ds_config_path` is required for deepspeed
    only; `scope` is what the backend's role_scope yielded (disaggregated roles)."""
    return backend_class(name).build(
        ds_config_path,
        micro_batch_size,
        grad_accum_steps,
        target_group=target_group,
        draft_group=draft_group,
        scope=scope,
    )
