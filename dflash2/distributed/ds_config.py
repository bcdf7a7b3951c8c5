"""The DeepSpeed JSON of a run: ZeRO / precision knobs from the file, batch sizes from the run config."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from dflash2.config import read_json_object


def resolve_ds_config(
    ds_config: dict[str, Any], *, micro_batch_size: int, grad_accum_steps: int, dp_world_size: int
) -> dict[str, Any]:
    """Write the run's batch sizes into a DeepSpeed JSON that holds only ZeRO / precision knobs.

    A value already in the JSON must be "auto" or agree with the run config.
    """
    config = json.loads(json.dumps(ds_config))
    _check_sections(config)
    sizes = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": micro_batch_size * grad_accum_steps * dp_world_size,
    }
    for key, value in sizes.items():
        set_ds_value(config, key, value, source="the run config")
    return config


def set_ds_value(config: dict[str, Any], key: str, value: Any, *, source: str) -> None:
    """Set `key` (dotted for nested sections) unless the JSON already holds a different concrete value."""
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    current = node.get(leaf, "auto")
    if current != "auto" and current != value:
        raise ValueError(
            f"DeepSpeed config sets {key}={current!r} but {source} gives {value!r}; "
            f'remove it from the DeepSpeed JSON (or set it to "auto")'
        )
    node[leaf] = value


def load_ds_config(path: str | Path) -> dict[str, Any]:
    """The DeepSpeed JSON at `path` (the run config's ds_config); a missing or malformed file is a
    ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"ds_config={str(path)!r} does not exist; set ds_config to a DeepSpeed JSON (e.g. ds_configs/zero3.json)"
        )
    return read_json_object(path, f"ds_config={str(path)!r}")


def check_ds_knobs(config: dict[str, Any], *, max_grad_norm: float, precision: str) -> None:
    """What a run's DeepSpeed JSON may hold, checked before anything loads: ZeRO stage 3, no optimizer,
    scheduler or fp16 (the run config's), and clipping and bf16 as the run config sets them."""
    if (config.get("zero_optimization") or {}).get("stage") != 3:
        raise ValueError("DeepSpeed config must set zero_optimization.stage = 3")
    _check_sections(config)
    probe = copy.deepcopy(config)
    set_ds_value(probe, "gradient_clipping", max_grad_norm, source="train.max_grad_norm")
    set_ds_value(probe, "bf16.enabled", precision == "bf16", source=f"precision={precision!r}")


def _check_sections(config: dict[str, Any]) -> None:
    for section in ("optimizer", "scheduler"):
        if section in config:
            raise ValueError(
                f"DeepSpeed config sets '{section}'; remove it: the optimizer and LR schedule come from the run config"
            )
    if (config.get("fp16") or {}).get("enabled") not in (None, False, "auto"):
        raise ValueError("DeepSpeed config enables fp16; use precision 'bf16' in the run config instead")
