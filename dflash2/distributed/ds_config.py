"""The DeepSpeed JSON of a run: ZeRO / precision knobs from the file, batch sizes from the run config."""

from __future__ import annotations

import json
from typing import Any


def resolve_ds_config(
    ds_config: dict[str, Any], *, micro_batch_size: int, grad_accum_steps: int, dp_world_size: int
) -> dict[str, Any]:
    """Write the run's batch sizes into a DeepSpeed JSON that holds only ZeRO / precision knobs.

    A value already in the JSON must be "auto" or agree with the run config.
    """
    config = json.loads(json.dumps(ds_config))
    for section in ("optimizer", "scheduler"):
        if section in config:
            raise ValueError(
                f"DeepSpeed config sets '{section}'; remove it: the optimizer and LR schedule come from the run config"
            )
    if config.get("fp16", {}).get("enabled") not in (None, False, "auto"):
        raise ValueError("DeepSpeed config enables fp16; use precision 'bf16' in the run config instead")
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
