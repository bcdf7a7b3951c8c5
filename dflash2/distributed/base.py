"""The one interface between the training loop and a distribution backend (ZeRO-3 or FSDP2).

The loop never asks which backend it has: it calls these methods on every rank, in the same order.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from dflash2.config import OptimConfig
from dflash2.distributed import state_io
from dflash2.schedule import lr_factor
from dflash2.target.head import TargetHead

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
    schedule (the same objects for both backends)."""
    optimizer = torch.optim.AdamW(
        weight_decay_groups(model, optim.weight_decay), lr=optim.lr, betas=ADAM_BETAS, eps=ADAM_EPS
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(optim))


def sharded_block_types(model: nn.Module) -> tuple[str, ...]:
    """Class names of the blocks sharded one by one (Hugging Face's `_no_split_modules` convention)."""
    return tuple(getattr(model, "_no_split_modules", None) or ())


class Backend(ABC):
    """Owns the process groups, the frozen sharded target and the trainable sharded draft.

    `target_group` holds the target's shards, `draft_group` is the draft's data-parallel group; both
    default to the whole world. Every method documented as collective must be called on every rank
    of the group concerned.
    """

    def __init__(
        self,
        *,
        micro_batch_size: int,
        grad_accum_steps: int,
        target_group: dist.ProcessGroup | None = None,
        draft_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("call dflash2.distributed.init_distributed() before building a backend")
        assert micro_batch_size >= 1 and grad_accum_steps >= 1, "validated by the run config"
        # rank and size among the draft's data-parallel ranks (the whole world unless draft_group is set):
        # what data sharding, checkpoint files and rank-0-only writes go by
        self.rank = dist.get_rank(draft_group)
        self.world_size = dist.get_world_size(draft_group)
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = torch.device(f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu")
        self.is_main = self.rank == 0
        self.micro_batch_size = micro_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.target_group = target_group
        self.draft_group = draft_group
        self.draft_world_size = dist.get_world_size(draft_group)
        # floating-point inputs of the draft must be cast to this dtype (set by setup_draft)
        self.compute_dtype = torch.float32

    @abstractmethod
    def load_target(self, target_dir: str, dtype: torch.dtype) -> nn.Module:
        """Hugging Face causal LM from a safetensors dir: frozen, eval(), sharded over the target group."""

    @abstractmethod
    def target_head(self, target: nn.Module, dtype: torch.dtype) -> TargetHead:
        """Full embedding + LM head on every rank, gathered from the shards (collective)."""

    def target_module(self, target: nn.Module) -> nn.Module:
        """The Hugging Face model inside what load_target returned (to reach its decoder layers)."""
        return target

    @torch.no_grad()
    def target_forward(
        self, target: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> None:
        """One no-grad forward of the sharded target (collective); the features are read by hooks on its
        decoder layers (dflash2.capture.features), so no hidden states or cache are returned."""
        # logits_to_keep=1: the LM head runs on one position only; its output is not used here
        target(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            use_cache=False,
            logits_to_keep=1,
        )

    @abstractmethod
    def setup_draft(
        self, draft: nn.Module, optim: OptimConfig, precision: Literal["fp32", "bf16"]
    ) -> nn.Module:
        """Shard the trainable draft, build AdamW + LR schedule; returns the module to call like the draft."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """`loss` = this rank's micro-batch loss_sum / the global weight sum of the whole optimizer step.

        After the step's last micro-batch, the gradient equals d(sum over ranks and micro-steps)/d(params).
        """

    @abstractmethod
    def step(self) -> dict[str, float]:
        """Clip, optimizer step, scheduler step, zero grads; returns {"grad_norm", "lr"} (pre-clip norm,
        the LR this update used). Call once per optimizer step, after grad_accum_steps backward calls."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the draft's data-parallel ranks; returns a new tensor (collective)."""
        out = tensor.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.draft_group)
        return out

    def barrier(self) -> None:
        """Over the draft's data-parallel ranks (ranks outside it, e.g. capture ranks, do not join)."""
        dist.barrier(group=self.draft_group)

    @abstractmethod
    def full_draft_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full fp32 draft weights on rank 0 under the draft's own names; None on other ranks (collective)."""

    @abstractmethod
    def save_state(self, ckpt_dir: Path) -> None:
        """Each rank writes its shard of draft, optimizer and scheduler state into ckpt_dir, sharded
        tensors as pieces of the full tensors (state_io), so any number of ranks can load it (collective)."""

    @abstractmethod
    def load_state(self, ckpt_dir: Path, num_saved_ranks: int) -> None:
        """Restore what save_state wrote on `num_saved_ranks` ranks, on this number of ranks: each
        rank reads its part of every tensor from the saved ranks' pieces (collective)."""

    def _write_rank_state(self, ckpt_dir: Path, state: dict) -> None:
        """save_state's files: this rank's `state` under ckpt_dir, the backend meta (rank 0), a barrier."""
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        state_io.save_state(state, ckpt_dir / f"rank{self.rank:05d}")
        if self.is_main:
            state_io.write_backend_meta(ckpt_dir, self.name, self.world_size)
        self.barrier()

    def _read_rank_state(
        self, ckpt_dir: Path, num_saved_ranks: int, local_range: Callable[[tuple[int, ...]], tuple[int, int]]
    ) -> dict:
        """This rank's part of what `num_saved_ranks` ranks wrote with _write_rank_state: plain values
        as rank 0 saved them, and of each sharded tensor of shape s the elements `local_range(s)`
        (1-D), gathered from the saved ranks' pieces (state_io)."""
        return state_io.ShardedState(ckpt_dir, num_saved_ranks).load(local_range)

    def _check_micro_step(self, micro_steps: int) -> None:
        if micro_steps != self.grad_accum_steps:
            raise RuntimeError(
                f"step() after {micro_steps} backward calls; expected grad_accum_steps={self.grad_accum_steps}"
            )


def local_parameter_numel(module: nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the full model): shows that a model is really sharded."""
    from torch.distributed.tensor import DTensor

    local = total = 0
    for p in module.parameters():
        if hasattr(p, "ds_tensor"):  # ZeRO-3 partitioned parameter
            local, total = local + p.ds_tensor.numel(), total + p.ds_numel
        elif isinstance(p, DTensor):  # FSDP2 shard
            local, total = local + p.to_local().numel(), total + p.numel()
        else:
            local, total = local + p.numel(), total + p.numel()
    return local, total
