"""Distribution behind one interface: DeepSpeed ZeRO-3, FSDP2 (the registry imports the one a run
names) or LocalBackend (one process, no process group)."""

from dflash2.distributed.base import Backend, RankLayout
from dflash2.distributed.env import (
    build_backend,
    distributed_run,
    init_distributed,
    shutdown_distributed,
)
from dflash2.distributed.local_backend import LocalBackend
from dflash2.distributed.registry import backend_class

__all__ = [
    "Backend",
    "LocalBackend",
    "RankLayout",
    "backend_class",
    "build_backend",
    "distributed_run",
    "init_distributed",
    "shutdown_distributed",
]
