"""The one interface between the training loop and a distribution backend (ZeRO-3, FSDP2, or one
local process).

The loop never asks which backend it has: it calls these methods on every rank, in the same order.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from dflash2.config import BACKENDS, PRECISIONS, OptimConfig, Precision, RunConfig, torch_dtype
from dflash2.distributed import state_io
from dflash2.optim import continue_schedule
from dflash2.target.head import TargetHead

if TYPE_CHECKING:
    from dflash2.config import RunConfig


def sharded_block_types(model: nn.Module) -> tuple[str, ...]:
    """Class names of the blocks sharded one by one (Hugging Face's `_no_split_modules` convention)."""
    return tuple(getattr(model, "_no_split_modules", None) or ())


DTYPE_BYTES = {name: torch_dtype(name).itemsize for name in PRECISIONS}  # bytes per element of each precision


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model, by the units the backends shard and gather.

    `blocks` are the modules named in `_no_split_modules` (one FSDP unit each); `root` is everything
    else (the root unit). `largest_module` is the largest set of a module's own parameters: ZeRO-3
    gathers module by module.
    """

    total: int
    blocks: tuple[int, ...]
    root: int
    largest_module: int

    @property
    def largest_block(self) -> int:
        return max(self.blocks, default=0)


def count_params(model: nn.Module) -> ParamCounts:
    block_types = set(sharded_block_types(model))
    blocks = tuple(
        sum(p.numel() for p in module.parameters())
        for module in list(model.modules())[1:]
        if type(module).__name__ in block_types
    )
    total = sum(p.numel() for p in model.parameters())
    largest_module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return ParamCounts(total=total, blocks=blocks, root=total - sum(blocks), largest_module=largest_module)


@dataclass
class MemoryItem:
    """One line of a rank's memory in the planner: `where` is "gpu" or "cpu" (offloaded)."""

    name: str
    num_bytes: float
    note: str = ""
    where: str = "gpu"


def fp32_draft_state(counts: ParamCounts, num_shards: int, held: str) -> list[MemoryItem]:
    """The planner's lines for fp32 draft weights, gradients and AdamW's two moments, a rank holding
    1 / `num_shards` of each (`held`: how the notes say it)."""
    numel, fp32 = counts.total / num_shards, DTYPE_BYTES["fp32"]
    return [
        MemoryItem("draft parameters", numel * fp32, held),
        MemoryItem("draft gradients", numel * fp32, held),
        MemoryItem("draft optimizer state", numel * 2 * fp32, "AdamW exp_avg + exp_avg_sq, fp32"),
    ]


def default_device(local_rank: int = 0) -> torch.device:
    """This process's accelerator (its local rank's CUDA device), else the CPU."""
    return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class RankLayout:
    """Where a backend runs: its rank and size among the draft's data-parallel ranks (what data
    sharding, checkpoint files and rank-0-only writes go by), the local rank and the device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @classmethod
    def of_group(cls, group: dist.ProcessGroup | None = None) -> RankLayout:
        """This process in `group` (None: the whole world) of the started process group."""
        if not dist.is_initialized():
            raise RuntimeError("call dflash2.distributed.init_distributed() before building a backend")
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        return cls(dist.get_rank(group), dist.get_world_size(group), local_rank, default_device(local_rank))

    @classmethod
    def single(cls, device: str | torch.device | None = None) -> RankLayout:
        """One process and no process group, on `device` (None: the accelerator, else the CPU)."""
        return cls(0, 1, 0, default_device() if device is None else torch.device(device))


class Backend(ABC):
    """Owns the process groups, the frozen sharded target and the trainable sharded draft.

    `target_group` holds the target's shards, `draft_group` is the draft's data-parallel group; both
    default to the whole world. Every method documented as collective must be called on every rank
    of the group concerned.
    """

    name: ClassVar[str]  # its key in config.BACKENDS (also written into its checkpoints)
    # dtypes the frozen target may be loaded in (load_target refuses others)
    target_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16)

    def __init__(
        self,
        layout: RankLayout,
        *,
        micro_batch_size: int,
        grad_accum_steps: int,
        target_group: dist.ProcessGroup | None = None,
        draft_group: dist.ProcessGroup | None = None,
    ) -> None:
        assert micro_batch_size >= 1 and grad_accum_steps >= 1, "validated by the run config"
        self.rank = layout.rank
        self.world_size = layout.world_size
        self.local_rank = layout.local_rank
        self.device = layout.device
        self.is_main = self.rank == 0
        self.optim_config: OptimConfig | None = None  # set by setup_draft
        self.micro_batch_size = micro_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.target_group = target_group
        self.draft_group = draft_group
        self.draft_world_size = layout.world_size
        # floating-point inputs of the draft must be cast to this dtype (set by setup_draft)
        self.compute_dtype = torch.float32

    # ---- construction (class methods: no process group needed) ---------------------------------------

    @classmethod
    def start_process_group(cls, comm: str, timeout: timedelta) -> None:
        """Start the default process group with communication backend `comm` (gloo or nccl)."""
        dist.init_process_group(backend=comm, timeout=timeout)

    @classmethod
    def role_scope(cls, group: dist.ProcessGroup) -> AbstractContextManager[object | None]:
        """What this backend needs for a role that runs on `group` alone while the rest of the world
        runs other code (the disaggregated topology): build and use the backend inside it, passing
        the `as` value to build as `scope`. Most backends need nothing."""
        return nullcontext()

    @classmethod
    def config_file(cls, cfg: RunConfig) -> str | None:
        """The file of the run config this backend reads its own settings from (None: none)."""
        return None

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
    ) -> Backend:
        """The backend after the process group started; `scope` is what role_scope yielded."""
        if config_path is not None:
            readers = " or ".join(repr(n) for n, entry in BACKENDS.items() if entry.files)
            raise ValueError(
                f"ds_config {config_path!r} is only used by backend {readers}; unset it for {cls.name!r}"
            )
        return cls(
            layout=RankLayout.of_group(draft_group),
            micro_batch_size=micro_batch_size,
            grad_accum_steps=grad_accum_steps,
            target_group=target_group,
            draft_group=draft_group,
        )

    @classmethod
    def from_run_config(
        cls, cfg: RunConfig, *, group: dist.ProcessGroup | None = None, scope: object | None = None
    ) -> Backend:
        """The run's backend; with `group`, target and draft are both sharded over that group only."""
        expect_run_config(cfg)
        return cls.build(
            cls.config_file(cfg),
            cfg.train.micro_batch_size,
            cfg.train.grad_accum_steps,
            target_group=group,
            draft_group=group,
            scope=scope,
        )

    def load_target(self, target_dir: str, dtype: torch.dtype) -> nn.Module:
        """Hugging Face causal LM from a safetensors dir: frozen, eval(), sharded over the target group."""
        if dtype not in self.target_dtypes:
            names = " or ".join(str(d).removeprefix("torch.") for d in self.target_dtypes)
            raise ValueError(f"target dtype must be {names} (fp16 is unsupported), got {dtype}")
        return self._load_target(target_dir, dtype)

    # ---- the planner's arithmetic (class methods: dflash2.plan, on the meta device) ----------------

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        """What this backend reads besides the run config (its own files), checked before anything
        loads; a ValueError names the fix. Nothing by default."""
        return None

    @classmethod
    def plan_offload(cls, cfg: RunConfig) -> tuple[bool, bool]:
        """(parameters, optimizer state) offloaded to the host by this backend's settings."""
        return False, False

    @classmethod
    def plan_note(cls, offload: tuple[bool, bool]) -> str:
        """What the plan's header says of this backend's settings."""
        return ""

    @classmethod
    def plan_draft_state(
        cls, counts: ParamCounts, precision: str, num_shards: int, offload: tuple[bool, bool]
    ) -> list[MemoryItem]:
        """Parameters, gradients and AdamW state of the draft, sharded over `num_shards` ranks."""
        raise NotImplementedError(f"backend {cls.name!r} has no memory plan")

    @classmethod
    def plan_gathered(cls, counts: ParamCounts, dtype_bytes: int, with_grads: bool) -> tuple[float, str]:
        """Bytes of parameters held unsharded at the peak of a forward/backward, and how."""
        raise NotImplementedError(f"backend {cls.name!r} has no memory plan")

    @abstractmethod
    def _load_target(self, target_dir: str, dtype: torch.dtype) -> nn.Module:
        """load_target after its dtype check."""

    @abstractmethod
    def target_head(self, target: nn.Module, dtype: torch.dtype) -> TargetHead:
        """Full embedding + LM head on every rank, gathered from the shards (collective)."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The model itself inside what load_target or setup_draft returned (to reach its layers)."""
        return model

    def parameter_numel(self, module: nn.Module) -> tuple[int, int]:
        """(elements this rank holds, elements of the full model): shows that a model is really sharded."""
        local = total = 0
        for param in module.parameters():
            held, full = self._param_numel(param)
            local, total = local + held, total + full
        return local, total

    def _param_numel(self, param: torch.Tensor) -> tuple[int, int]:
        """(elements this rank holds, elements of the full parameter)."""
        return param.numel(), param.numel()

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
    def setup_draft(self, draft: nn.Module, optim: OptimConfig, precision: Precision) -> nn.Module:
        """Shard the trainable draft, build AdamW + LR schedule; returns the module to call like the draft."""

    def _take_optim_config(self, optim: OptimConfig) -> None:
        """First thing of setup_draft: a backend trains one draft (a second would leave its optimizer
        stepping the second while the first Setup computes with the first)."""
        if self.optim_config is not None:
            raise ValueError(
                "this backend trains a draft already (an earlier build_setup or setup_draft): build a "
                "backend for each Setup, e.g. dflash2.LocalBackend.from_run_config(plan.config)"
            )
        self.optim_config = optim

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

    def _continue_schedule(self, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
        """The end of load_state: the next update's LR from this run's schedule, and a note for each
        optimizer setting the resume keeps from the checkpoint (dflash2.optim.continue_schedule)."""
        assert self.optim_config is not None, "setup_draft sets it"
        for note in continue_schedule(scheduler, self.optim_config):
            if self.is_main:
                print(f"[dflash2] {note}", flush=True)

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


def expect_run_config(cfg: object) -> None:
    if not isinstance(cfg, RunConfig):
        raise ValueError(
            f"from_run_config takes a RunConfig (plan.config, or dflash2.load_run_config(path)), "
            f"not {type(cfg).__name__}"
        )
