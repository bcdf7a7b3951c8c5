"""The learning-rate schedule: linear warmup, then cosine decay (or constant)."""

from __future__ import annotations

import math
from typing import Literal


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float,
    schedule: Literal["cosine", "constant"] = "cosine",
) -> float:
    """LR factor of the `step`-th optimizer update (0-based): (step + 1) / warmup_steps during the
    warmup, then 1 (constant) or a cosine from 1 down to min_lr_ratio at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
