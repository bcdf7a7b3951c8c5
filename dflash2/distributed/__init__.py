"""Distribution behind one interface: DeepSpeed ZeRO-3 or FSDP2 (imported lazily by build_backend)."""

from dflash2.distributed.base import Backend, lr_multiplier
from dflash2.distributed.env import build_backend, init_distributed, role_scope, shutdown_distributed

__all__ = [
    "Backend",
    "build_backend",
    "init_distributed",
    "lr_multiplier",
    "role_scope",
    "shutdown_distributed",
]
