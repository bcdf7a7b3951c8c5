"""One process: the whole target and the whole draft in this process, collectives the identity.
What the Python API trains with (a notebook, a script, a test; no process group), and what a
one-process launch trains with under `backend: local` (launch/train.py starts a one-rank group
there, for its stop and timeout handling; the step calls no collective). fp32, or bf16 compute on
fp32 master weights: the mixed precision of FSDP2's policy, on plain tensors."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from dflash2.config import OptimConfig, Precision, sharded_backends, torch_dtype
from dflash2.distributed.base import (
    DTYPE_BYTES,
    Backend,
    MemoryItem,
    ParamCounts,
    RankLayout,
    expect_run_config,
    fp32_draft_state,
)
from dflash2.optim import build_optimizer, step_optimizer
from dflash2.target.head import TargetHead
from dflash2.target.load import load_full_target

if TYPE_CHECKING:
    from dflash2.config import RunConfig


class LocalBackend(Backend):
    """`device`: where the target and the draft run (None: the accelerator, else the CPU)."""

    name = "local"

    def __init__(
        self,
        *,
        micro_batch_size: int = 1,
        grad_accum_steps: int = 1,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__(
            RankLayout.single(device), micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps
        )
        self.draft: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.max_grad_norm = 0.0
        self._micro_steps = 0
        # bf16: (master, working copy) per parameter; the optimizer steps the fp32 masters, the draft
        # computes with the bf16 copies (empty in fp32, where the draft's own parameters are stepped)
        self._copies: list[tuple[nn.Parameter, nn.Parameter]] = []

    @classmethod
    def start_process_group(cls, comm: str, timeout: timedelta) -> None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size != 1:
            raise ValueError(
                f"backend=local trains in one process, but this launch started {world_size} "
                f"(WORLD_SIZE): use {sharded_backends()}, or launch one process (python launch/train.py)"
            )
        super().start_process_group(comm, timeout)

    @classmethod
    def plan_draft_state(
        cls, counts: ParamCounts, precision: str, num_shards: int, offload: tuple[bool, bool]
    ) -> list[MemoryItem]:
        items = fp32_draft_state(counts, 1, f"{counts.total / 1e9:.3f} B, whole, fp32")
        if precision == "fp32":
            return items
        note = f"{precision}, whole (and one parameter's {precision} gradient at a time)"
        working = MemoryItem("draft working copy", counts.total * DTYPE_BYTES[precision], note)
        return [*items, working]

    @classmethod
    def plan_gathered(cls, counts: ParamCounts, dtype_bytes: int, with_grads: bool) -> tuple[float, str]:
        return 0.0, "nothing: every parameter is held whole"

    @classmethod
    def build(
        cls,
        config_path: str | None,
        micro_batch_size: int,
        grad_accum_steps: int,
        *,
        target_group: dist.ProcessGroup | None = None,
        draft_group: dist.ProcessGroup | None = None,
        scope: object | None = None,
    ) -> LocalBackend:
        if config_path is not None or target_group is not None or draft_group is not None:
            raise ValueError(f"backend {cls.name!r} runs in one process: it takes no ds_config and no group")
        return cls(micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps)

    @classmethod
    def from_run_config(
        cls, cfg: RunConfig, *, group: dist.ProcessGroup | None = None, scope: object | None = None
    ) -> LocalBackend:
        """The run's batch layout for one process (train.global_batch_size decides the accumulation)."""
        expect_run_config(cfg)
        return super().from_run_config(cfg.with_batch_layout(1), group=group, scope=scope)

    # ---- target -------------------------------------------------------------------------------------

    def _load_target(self, target_dir: str, dtype: torch.dtype) -> nn.Module:
        return load_full_target(target_dir, dtype, self.device)

    def target_head(self, target: nn.Module, dtype: torch.dtype) -> TargetHead:
        return TargetHead.from_target(target, dtype).to(self.device)

    # ---- draft --------------------------------------------------------------------------------------

    def setup_draft(self, draft: nn.Module, optim: OptimConfig, precision: Precision) -> nn.Module:
        """fp32: the draft's own parameters are trained. bf16: as FSDP2's MixedPrecisionPolicy(bf16,
        reduce fp32) on one rank, on plain tensors: the optimizer steps fp32 master weights, the draft
        computes with bf16 copies of its parameters (buffers stay fp32), and each parameter's bf16
        gradient is added to its master's fp32 gradient as soon as backward has it (so at most one
        parameter's bf16 gradient exists at a time). The draft's state_dict() holds the masters."""
        self._take_optim_config(optim)
        self.draft = draft.float().to(self.device)
        self.optimizer, self.scheduler = build_optimizer(self.draft, optim)  # over the fp32 parameters
        self.max_grad_norm = optim.max_grad_norm
        self.compute_dtype = torch_dtype(precision)
        self._copies = []
        if precision != "fp32":
            self._copies = _working_copies(self.draft, self.compute_dtype)
        return self.draft

    def _masters(self) -> dict[str, torch.Tensor]:
        """The draft's state dict: its fp32 parameters, or in bf16 the fp32 masters (which its
        state-dict hook puts in place of the working copies)."""
        return self._require_draft().state_dict()

    def _require_draft(self) -> nn.Module:
        if self.draft is None:
            raise RuntimeError("call setup_draft() first")
        return self.draft

    def backward(self, loss: torch.Tensor) -> None:
        self._require_draft()
        loss.backward()  # gradients accumulate in .grad across micro-steps (in bf16: the masters')
        self._micro_steps += 1

    def step(self) -> dict[str, float]:
        self._require_draft()
        self._check_micro_step(self._micro_steps)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        lr = step_optimizer(self.optimizer, self.scheduler)
        self._refresh_copies()
        self._micro_steps = 0
        return {"grad_norm": float(grad_norm), "lr": lr}

    def _refresh_copies(self) -> None:
        with torch.no_grad():
            for master, copy in self._copies:
                copy.copy_(master)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().clone()

    def barrier(self) -> None:
        pass

    # ---- state --------------------------------------------------------------------------------------

    def full_draft_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.float().cpu().clone() for name, t in self._masters().items()}

    def save_state(self, ckpt_dir: Path) -> None:
        state = {
            "model": self._masters(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.scheduler.state_dict(),
        }
        self._write_rank_state(ckpt_dir, state)

    def load_state(self, ckpt_dir: Path, num_saved_ranks: int) -> None:
        state = self._read_rank_state(ckpt_dir, num_saved_ranks, lambda shape: (0, _numel(shape)))
        with torch.no_grad():
            for name, tensor in self._masters().items():
                tensor.copy_(state["model"][name].view(tensor.shape))
        self._refresh_copies()
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["lr_scheduler"])
        self._continue_schedule(self.scheduler)
        self._micro_steps = 0


def _working_copies(draft: nn.Module, dtype: torch.dtype) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """Put a `dtype` copy of each parameter of `draft` in its place (one copy for a parameter shared by
    modules or names); the fp32 originals, which the optimizer holds, become the masters. Each copy's
    gradient goes into its master's (in fp32) once backward has accumulated it; the draft's
    state_dict() gives the masters, and its load_state_dict() loads them too."""
    copies: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for module in draft.modules():
        for name, master in list(module._parameters.items()):
            if master is None:
                continue
            if id(master) not in copies:
                copy = nn.Parameter(master.detach().to(dtype), requires_grad=master.requires_grad)
                if copy.requires_grad:
                    copy.register_post_accumulate_grad_hook(_into_master(master))
                copies[id(master)] = (master, copy)
            module._parameters[name] = copies[id(master)][1]
    master_of = {id(copy): master for master, copy in copies.values()}
    by_name = {name: master_of[id(copy)] for name, copy in draft.named_parameters(remove_duplicate=False)}

    def state_dict_of_masters(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
        for name, master in by_name.items():
            if prefix + name in state:  # a Parameter with keep_vars=True, else a detached tensor
                kept = isinstance(state[prefix + name], nn.Parameter)
                state[prefix + name] = master if kept else master.detach()

    def load_into_masters(module: nn.Module, state: dict, prefix: str, *args) -> None:
        with torch.no_grad():  # the values as given (the module then loads their bf16 rounding)
            for name, master in by_name.items():
                value = state.get(prefix + name)
                if isinstance(value, torch.Tensor) and value.shape == master.shape:
                    master.copy_(value)

    draft.register_state_dict_post_hook(state_dict_of_masters)
    draft.register_load_state_dict_pre_hook(load_into_masters)
    return list(copies.values())


def _into_master(master: nn.Parameter):
    def hook(copy: nn.Parameter) -> None:
        grad = copy.grad.float()
        master.grad = grad if master.grad is None else master.grad.add_(grad)
        copy.grad = None

    return hook


def _numel(shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel()
