"""The optimizer every backend steps: torch AdamW in weight-decay groups, its LambdaLR schedule
(dflash2.schedule) and one optimizer update (clip, step, schedule, zero grads)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from dflash2.config import OptimConfig
from dflash2.schedule import lr_factor

ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8


def lr_multiplier(optim: OptimConfig) -> Callable[[int], float]:
    """LR factor for the `step`-th optimizer update (0-based), as LambdaLR wants it."""

    def factor(step: int) -> float:
        return lr_factor(
            step,
            warmup_steps=optim.warmup_steps,
            total_steps=optim.max_steps,
            min_lr_ratio=optim.min_lr_ratio,
            schedule=optim.schedule,
        )

    return factor


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: `weight_decay` on the weight matrices of linear layers, none elsewhere.

    Decayed: attention and MLP projections, `fc`, the conv `kernel_projection` (zero at init: decay
    pulls the dynamic kernel back toward the static one) and the selector's `hidden_projection`.
    Not decayed: norm weights and biases (scales and offsets, not capacity), the conv `base_kernel`
    (identity at init: decay would pull it toward zero, i.e. toward silencing the sublayer, not toward
    the identity) and the selector codebooks (embedding-like tables: a row of a rare token gets a
    gradient rarely but would shrink every step). Decided by module type, so the groups are the same
    before and after sharding (FSDP2 keeps the module tree; ZeRO-3 partitions after the optimizer is
    built). Both groups exist whatever weight_decay is (when non-empty): the optimizer state's layout
    does not depend on its value.
    """
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (decay if isinstance(module, nn.Linear) and name == "weight" else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def build_optimizer(
    model: nn.Module, optim: OptimConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """torch AdamW over `model`'s trainable parameters in weight_decay_groups, and its LambdaLR
    schedule (the same objects for every backend)."""
    # fused: one pass over each parameter and its two moments instead of one per elementwise op (the
    # same update up to rounding); on the CPU it cuts the step of a DFlash 2 draft, whose selector
    # codebooks [V, rank] are its largest tensors, by about a tenth (docs/benchmarks.md)
    optimizer = torch.optim.AdamW(
        weight_decay_groups(model, optim.weight_decay),
        lr=optim.lr,
        betas=ADAM_BETAS,
        eps=ADAM_EPS,
        fused=True,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(optim))


def continue_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, optim: OptimConfig) -> list[str]:
    """After a resume restored the optimizer and its schedule: set the next update's LR from this
    run's schedule (its warmup_steps, schedule, min_lr_ratio and max_steps may differ from the saved
    run's, whose LR at the step reached the restored groups hold), at the restored base LR. Returns a
    note for each run config value that a resume does not apply (lr and weight_decay are restored)."""
    groups = scheduler.optimizer.param_groups
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() reports
    notes = []
    if not math.isclose(scheduler.base_lrs[0], optim.lr, rel_tol=1e-6):
        notes.append(
            f"train.lr={optim.lr:g} is not applied: a resumed run keeps its checkpoint's {scheduler.base_lrs[0]:g}"
        )
    saved_decay = max(group["weight_decay"] for group in groups)
    if not math.isclose(saved_decay, optim.weight_decay, rel_tol=1e-6):
        notes.append(
            f"train.weight_decay={optim.weight_decay:g} is not applied: a resumed run keeps its checkpoint's {saved_decay:g}"
        )
    return notes


def step_optimizer(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler
) -> float:
    """One update: optimizer step, scheduler step, gradients freed; returns the LR the update used.
    Clipping comes before it, as the backend computes the (sharded) gradient norm."""
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(lr)
