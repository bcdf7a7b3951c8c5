"""Process-group start-up (torchrun, the deepspeed launcher, or plain `python`) and backend construction."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from dflash2.distributed.base import Backend
from dflash2.distributed.ds_config import resolve_ds_config
from dflash2.faults import collective_timeout

BackendName = Literal["deepspeed", "fsdp"]
BACKEND_NAMES = ("deepspeed", "fsdp")
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


def _fill_launch_env() -> None:
    if "LOCAL_RANK" not in os.environ:
        argv_local_rank = _local_rank_from_argv(sys.argv)
        if argv_local_rank is not None:
            os.environ["LOCAL_RANK"] = str(argv_local_rank)
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        # plain `python`: a one-process world on this machine
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    missing = [
        name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ
    ]
    if missing:
        raise ValueError(
            f"launcher environment is incomplete: {missing} unset; launch with torchrun or deepspeed"
        )
    os.environ.setdefault("LOCAL_RANK", "0")


def init_distributed(backend_name: BackendName) -> tuple[int, int, int]:
    """Start the default process group (gloo on CPU, nccl on CUDA); returns (rank, world_size, local_rank).

    Works under torchrun, under the deepspeed launcher and as a plain one-process `python` run.
    Idempotent: a second call returns the existing group's coordinates. Collectives wait at most
    `collective_timeout()` (DFLASH2_DIST_TIMEOUT_S); groups made later must pass it too (new_group
    does not inherit it).
    """
    if backend_name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend_name!r}")
    _fill_launch_env()
    local_rank = int(os.environ["LOCAL_RANK"])
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        comm = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = collective_timeout()
        if backend_name == "deepspeed":
            import deepspeed

            check_build_locks()

            deepspeed.init_distributed(dist_backend=comm, auto_mpi_discovery=False, timeout=timeout)
        else:
            dist.init_process_group(backend=comm, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), local_rank


def shutdown_distributed() -> None:
    """End a finished run cleanly: every rank waits for the others, then the process group is torn
    down before interpreter exit (left to exit handlers, a communication thread can abort the process
    after the run has already succeeded)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def role_scope(name: BackendName, group: dist.ProcessGroup) -> AbstractContextManager:
    """What backend `name` needs for a role that runs on `group` alone while the rest of the world
    runs other code (the disaggregated topology): build and use the backend inside it. DeepSpeed's
    world-wide collectives are confined to the group; FSDP2 needs nothing."""
    if name != "deepspeed":
        return nullcontext()
    from dflash2.distributed.deepspeed_groups import confine_deepspeed

    return confine_deepspeed(group)


def build_backend(
    name: BackendName,
    ds_config_path: str | None,
    micro_batch_size: int,
    grad_accum_steps: int,
    *,
    target_group: dist.ProcessGroup | None = None,
    draft_group: dist.ProcessGroup | None = None,
) -> Backend:
    """The backend `name`, after init_distributed(name). `ds_config_path` is required for deepspeed only."""
    if name == "deepspeed":
        if ds_config_path is None:
            raise ValueError("backend 'deepspeed' needs a ds_config path (e.g. ds_configs/zero3.json)")
        # each backend module is imported only when chosen: deepspeed is heavy and fsdp runs never need it
        from dflash2.distributed.deepspeed_backend import DeepSpeedBackend

        ds_config = json.loads(Path(ds_config_path).read_text())
        dp_world_size = dist.get_world_size(draft_group)
        resolved = resolve_ds_config(
            ds_config,
            micro_batch_size=micro_batch_size,
            grad_accum_steps=grad_accum_steps,
            dp_world_size=dp_world_size,
        )
        return DeepSpeedBackend(
            resolved,
            micro_batch_size=micro_batch_size,
            grad_accum_steps=grad_accum_steps,
            target_group=target_group,
            draft_group=draft_group,
        )
    if name == "fsdp":
        if ds_config_path is not None:
            raise ValueError(
                f"ds_config {ds_config_path!r} is only used by backend 'deepspeed'; unset it for 'fsdp'"
            )
        from dflash2.distributed.fsdp_backend import FSDPBackend

        return FSDPBackend(
            micro_batch_size=micro_batch_size,
            grad_accum_steps=grad_accum_steps,
            target_group=target_group,
            draft_group=draft_group,
        )
    raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
