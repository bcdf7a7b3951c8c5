"""FSDP2 (`fully_shard`): the frozen target and the trainable draft, each sharded per block + root."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dflash2.config import OptimConfig, Precision, torch_dtype
from dflash2.distributed.base import (
    DTYPE_BYTES,
    Backend,
    MemoryItem,
    ParamCounts,
    fp32_draft_state,
    sharded_block_types,
)
from dflash2.models.selector import CandidateSelector
from dflash2.optim import build_optimizer, step_optimizer
from dflash2.target.head import TargetHead, head_tensors
from dflash2.target.load import load_sharded_target


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class FSDPBackend(Backend):
    name = "fsdp"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.target_mesh = self._mesh(self.target_group)
        self.draft_mesh = self._mesh(self.draft_group)
        self.draft: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.max_grad_norm = 0.0
        self._micro_steps = 0

    def _mesh(self, group: dist.ProcessGroup | None) -> DeviceMesh:
        if group is None:
            return init_device_mesh(self.device.type, (self.world_size,))
        return DeviceMesh.from_group(group, self.device.type)

    def _shard(
        self, model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None
    ) -> None:
        """fully_shard every block named in `_no_split_modules`, then the root (which holds the rest).
        The selector's unit keeps its inputs' dtypes: the objective hands it fp32 unary logits on
        purpose (summed with the pair scores in fp32, as under DeepSpeed and in one process), which
        the policy's input cast would round to bf16."""
        block_types = sharded_block_types(model)
        kwargs = {"mesh": mesh} if mp_policy is None else {"mesh": mesh, "mp_policy": mp_policy}
        for module in list(model.modules())[1:]:
            if type(module).__name__ in block_types:
                unit = kwargs
                if mp_policy is not None and isinstance(module, CandidateSelector):
                    unit = {**kwargs, "mp_policy": dataclasses.replace(mp_policy, cast_forward_inputs=False)}
                fully_shard(module, **unit)
        fully_shard(model, **kwargs)

    @classmethod
    def plan_draft_state(
        cls, counts: ParamCounts, precision: str, num_shards: int, offload: tuple[bool, bool]
    ) -> list[MemoryItem]:
        # fp32 sharded parameters are the master weights; bf16 exists only as gathered compute copies
        return fp32_draft_state(counts, num_shards, f"{counts.total / 1e9:.3f} B / {num_shards}, fp32 shards")

    @classmethod
    def plan_gathered(cls, counts: ParamCounts, dtype_bytes: int, with_grads: bool) -> tuple[float, str]:
        # FSDP2 keeps the root unit unsharded after forward; one block computes while the next prefetches.
        numel = counts.root + 2 * counts.largest_block
        # a block's unsharded gradients (compute dtype) and its fp32 reduce-scatter input, filled while
        # they live, beside the previous block's, which may still be reducing
        grads = counts.largest_block * (dtype_bytes + 2 * DTYPE_BYTES["fp32"]) if with_grads else 0
        note = "root unit + 2 blocks (compute + prefetch)" + (
            " + one block's grads and two fp32 reduce-scatter buffers" if with_grads else ""
        )
        return numel * dtype_bytes + grads, note

    def _param_numel(self, param: torch.Tensor) -> tuple[int, int]:
        if isinstance(param, DTensor):  # FSDP2 shard
            return param.to_local().numel(), param.numel()
        return super()._param_numel(param)

    # ---- target -------------------------------------------------------------------------------------

    def _load_target(self, target_dir: str, dtype: torch.dtype) -> nn.Module:
        # built on the meta device and sharded first: each rank reads only its own shards from disk
        return load_sharded_target(target_dir, dtype, self.device, self._shard_target)

    def _shard_target(self, model: nn.Module) -> None:
        if not sharded_block_types(model):
            raise ValueError(
                f"target {type(model).__name__} declares no _no_split_modules (decoder layer class)"
            )
        self._shard(model, self.target_mesh)

    def target_head(self, target: nn.Module, dtype: torch.dtype) -> TargetHead:
        tensors = head_tensors(target)
        copies = [None if t is None else _full(t.detach()).clone().to(self.device, dtype) for t in tensors]
        return TargetHead(*copies)

    # ---- draft --------------------------------------------------------------------------------------

    def setup_draft(self, draft: nn.Module, optim: OptimConfig, precision: Precision) -> nn.Module:
        self._take_optim_config(optim)
        # fp32 master weights; bf16 only for compute, gradients reduced in fp32
        mp_policy = None
        if precision == "bf16":
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        draft.float()
        self._shard(draft, self.draft_mesh, mp_policy)
        draft.to(self.device)
        for module in draft.modules():
            # Sum, not average, over ranks: the loss is already normalised by the global weight sum.
            # One rank has nothing to reduce, and there a factor (even 1.0) makes FSDP2 divide every
            # gradient into a new tensor each step (about a tenth of a one-rank SmolLM2 DFlash 2
            # step): left unset.
            if isinstance(module, FSDPModule) and self.draft_mesh.size() > 1:
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
        self.draft = draft
        self.optimizer, self.scheduler = build_optimizer(draft, optim)
        self.max_grad_norm = optim.max_grad_norm
        self.compute_dtype = torch_dtype(precision)
        return draft

    def _require_draft(self) -> nn.Module:
        if self.draft is None:
            raise RuntimeError("call setup_draft() first")
        return self.draft

    def backward(self, loss: torch.Tensor) -> None:
        self._require_draft()
        loss.backward()  # gradients accumulate in the sharded .grad across micro-steps
        self._micro_steps += 1

    def step(self) -> dict[str, float]:
        draft = self._require_draft()
        self._check_micro_step(self._micro_steps)
        params = [p for p in draft.parameters() if p.requires_grad]
        grad_norm = _full(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
        lr = step_optimizer(self.optimizer, self.scheduler)
        self._micro_steps = 0
        return {"grad_norm": float(grad_norm), "lr": lr}

    # ---- state --------------------------------------------------------------------------------------

    def full_draft_state_dict(self) -> dict[str, torch.Tensor] | None:
        state = {}
        for name, tensor in self._require_draft().state_dict().items():
            full = _full(tensor.detach())  # collective for sharded tensors: every rank runs it
            if self.is_main:
                state[name] = full.float().cpu().clone()
        return state if self.is_main else None

    def save_state(self, ckpt_dir: Path) -> None:
        draft = self._require_draft()
        state = {
            "model": draft.state_dict(),  # DTensors: stored as this rank's shard
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.scheduler.state_dict(),
        }
        self._write_rank_state(ckpt_dir, state)

    def load_state(self, ckpt_dir: Path, num_saved_ranks: int) -> None:
        draft = self._require_draft()
        state = self._read_rank_state(ckpt_dir, num_saved_ranks, self._local_range)
        with torch.no_grad():
            for name, tensor in draft.state_dict().items():
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                local.copy_(state["model"][name].view(local.shape))
        self.optimizer.load_state_dict(self._as_dtensors(state["optimizer"]))
        self.scheduler.load_state_dict(state["lr_scheduler"])
        self._continue_schedule(self.scheduler)
        self._micro_steps = 0
        self.barrier()

    def _local_range(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The elements of a tensor of `shape` (flattened) that this rank's dim-0 shard holds."""
        local_shape, offset = compute_local_shape_and_global_offset(shape, self.draft_mesh, (Shard(0),))
        row_numel = math.prod(shape[1:])
        begin = offset[0] * row_numel if local_shape[0] else 0
        return begin, begin + math.prod(local_shape)

    def _as_dtensors(self, optimizer_state: dict) -> dict:
        """Wrap this rank's pieces of per-parameter optimizer state into DTensors like their params."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for index, param_state in optimizer_state["state"].items():
            param = params[index]
            if not isinstance(param, DTensor):
                continue
            for key, value in param_state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    param_state[key] = DTensor.from_local(
                        value.view(param.to_local().shape).to(self.device),
                        param.device_mesh,
                        param.placements,
                        shape=param.shape,
                        stride=param.stride(),
                    )
        return optimizer_state
