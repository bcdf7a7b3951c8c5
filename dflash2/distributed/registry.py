"""A backend name of the run config -> its `Backend` subclass, imported only when chosen (a
deepspeed module is heavy and FSDP runs never need it). The names live in `config.BACKENDS`."""

from __future__ import annotations

import importlib

from dflash2.config import BACKENDS, RunConfig
from dflash2.distributed.base import Backend


def backend_class(name: str) -> type[Backend]:
    """The class of backend `name` (a key of config.BACKENDS)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {tuple(BACKENDS)}, got {name!r}")
    module_name, class_name = BACKENDS[name].cls.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def check_backend_config(cfg: RunConfig) -> None:
    """The checks of run `cfg` that its backend adds (a DeepSpeed JSON's stage, sections, clipping and
    bf16 against the run config), before anything loads."""
    backend_class(cfg.backend).check_config(cfg)
