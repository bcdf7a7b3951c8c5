"""DeepSpeed ZeRO-3: a frozen partitioned target engine beside a trainable partitioned draft engine."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Literal

import deepspeed
import torch
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_local_fp32_param,
    safe_get_local_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_optimizer_state,
)
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

from dflash2.config import OptimConfig
from dflash2.distributed import deepspeed_groups, state_io
from dflash2.distributed.base import Backend, build_optimizer
from dflash2.distributed.ds_config import set_ds_value
from dflash2.target.head import TargetHead, head_tensors

OPTIMIZER_KEYS = ("fp32", "exp_avg", "exp_avg_sq")  # fp32: the master weights


class _Zero3Config:
    """What transformers reads from its HfDeepSpeedConfig (which would also require `accelerate`)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def is_zero3(self) -> bool:
        return True


class DeepSpeedBackend(Backend):
    """`ds_config` is a resolved DeepSpeed dict (batch sizes filled in by build_backend)."""

    name = "deepspeed"

    def __init__(self, ds_config: dict[str, Any], **kwargs) -> None:
        super().__init__(**kwargs)
        # a sub-group only inside confine_deepspeed (the disaggregated roles), and one for both models
        self.mpu = deepspeed_groups.active_mpu()
        if self.target_group is not None or self.draft_group is not None:
            assert self.mpu is not None and self.target_group is self.draft_group is self.mpu.group
        if ds_config.get("zero_optimization", {}).get("stage") != 3:
            raise ValueError("DeepSpeed config must set zero_optimization.stage = 3")
        self.ds_config = ds_config
        self.engine: deepspeed.DeepSpeedEngine | None = None
        self._micro_steps = 0

    # ---- target -------------------------------------------------------------------------------------

    def _target_config(self, dtype: torch.dtype) -> dict[str, Any]:
        config = copy.deepcopy(self.ds_config)
        config["bf16"] = {"enabled": dtype == torch.bfloat16}
        config["zero_optimization"].pop("offload_optimizer", None)  # the target has no optimizer
        config.pop("gradient_clipping", None)
        return config

    def load_target(self, target_dir: str, dtype: torch.dtype) -> nn.Module:
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"target dtype must be float32 or bfloat16 (fp16 is unsupported), got {dtype}")
        config = self._target_config(dtype)
        # While registered, from_pretrained builds under zero.Init (partitioned at construction) and
        # loads each weight into its partitions; unregistered afterwards so later models are ordinary.
        zero3_config = _Zero3Config(config)
        set_hf_deepspeed_config(zero3_config)  # transformers keeps only a weak reference
        try:
            model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype)
        finally:
            unset_hf_deepspeed_config()
        model.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=config, mpu=self.mpu)
        engine.eval()
        return engine

    def target_module(self, target: nn.Module) -> nn.Module:
        return _unwrap(target)

    def target_head(self, target: nn.Module, dtype: torch.dtype) -> TargetHead:
        tensors = head_tensors(_unwrap(target))
        # a tied LM head is the embedding itself: gather each parameter once
        params = list({id(p): p for p in tensors if p is not None}.values())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            copies = [None if p is None else p.detach().clone().to(self.device, dtype) for p in tensors]
        return TargetHead(*copies)

    # ---- draft --------------------------------------------------------------------------------------

    def setup_draft(
        self, draft: nn.Module, optim: OptimConfig, precision: Literal["fp32", "bf16"]
    ) -> nn.Module:
        config = copy.deepcopy(self.ds_config)
        set_ds_value(config, "gradient_clipping", optim.max_grad_norm, source="optim.max_grad_norm")
        set_ds_value(config, "bf16.enabled", precision == "bf16", source=f"precision={precision!r}")
        config["zero_allow_untested_optimizer"] = True  # torch AdamW as the client optimizer
        draft.float()  # fp32 master weights; DeepSpeed keeps a bf16 working copy when bf16 is enabled
        optimizer, scheduler = build_optimizer(draft, optim)
        self.engine, *_ = deepspeed.initialize(
            model=draft, optimizer=optimizer, lr_scheduler=scheduler, config=config, mpu=self.mpu
        )
        self.compute_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        return self.engine

    def _require_engine(self) -> deepspeed.DeepSpeedEngine:
        if self.engine is None:
            raise RuntimeError("call setup_draft() first")
        return self.engine

    def backward(self, loss: torch.Tensor) -> None:
        engine = self._require_engine()
        # ZeRO averages gradients over the data-parallel ranks; the loss is already normalised by the
        # global weight sum, so undo the average (and skip DeepSpeed's own division by the accumulation).
        engine.backward(loss * self.draft_world_size, scale_wrt_gas=False)
        self._micro_steps += 1
        if self._micro_steps < self.grad_accum_steps:
            engine.step()  # DeepSpeed counts micro-steps here; it updates only at the boundary

    def step(self) -> dict[str, float]:
        engine = self._require_engine()
        self._check_micro_step(self._micro_steps)
        assert engine.is_gradient_accumulation_boundary()
        lr = engine.get_lr()[0]
        engine.step()
        self._micro_steps = 0
        return {"grad_norm": float(engine.get_global_grad_norm()), "lr": float(lr)}

    # ---- state --------------------------------------------------------------------------------------

    def full_draft_state_dict(self) -> dict[str, torch.Tensor] | None:
        module = _unwrap(self._require_engine())
        state: dict[str, torch.Tensor] = {}
        for name, param in module.named_parameters():
            if param.requires_grad:
                full = safe_get_full_fp32_param(param)  # fp32 master weights, gathered
            else:
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    full = param.detach().clone()
            if self.is_main:
                state[name] = full.float().cpu().clone()
        persistent = set(module.state_dict().keys())
        for name, buffer in module.named_buffers():
            if name in persistent and self.is_main:
                state[name] = buffer.detach().float().cpu().clone()
        return state if self.is_main else None

    def save_state(self, ckpt_dir: Path) -> None:
        """Per trainable parameter, by name: this rank's partition of the fp32 master weights and of
        AdamW's moments (pieces of the flattened parameter, state_io), plus what all ranks share."""
        engine = self._require_engine()
        partitions = {
            name: {key: self._saved_partition(param, key) for key in OPTIMIZER_KEYS}
            for name, param in self._trainable().items()
        }
        adamw = engine.optimizer.optimizer  # the torch AdamW that ZeRO-3 steps on its flat partitions
        (step,) = {float(s["step"]) for s in adamw.state.values()}  # one per flat partition, all equal
        state = {
            "partitions": partitions,
            "optimizer_step": step,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in adamw.param_groups],
            "lr_scheduler": engine.lr_scheduler.state_dict(),
            "engine": {
                "global_steps": engine.global_steps,
                "global_samples": engine.global_samples,
                "micro_steps": engine.micro_steps,
                "skipped_steps": engine.skipped_steps,
            },
        }
        self._write_rank_state(ckpt_dir, state)

    def load_state(self, ckpt_dir: Path, num_saved_ranks: int) -> None:
        engine = self._require_engine()
        local_range = lambda shape: state_io.chunk_range(math.prod(shape), self.rank, self.world_size)  # noqa: E731
        state = self._read_rank_state(ckpt_dir, num_saved_ranks, local_range)
        self._restore_optimizer_globals(state)
        for name, param in self._trainable().items():
            saved = state["partitions"][name]
            for key in OPTIMIZER_KEYS:
                self._restore_partition(param, key, saved[key])
        self._release_persistent_parameters()
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        for key, value in state["engine"].items():
            setattr(engine, key, value)
        self._micro_steps = 0
        self.barrier()

    def _trainable(self) -> dict[str, nn.Parameter]:
        module = _unwrap(self._require_engine())
        return {name: p for name, p in module.named_parameters() if p.requires_grad}

    def _saved_partition(self, param: nn.Parameter, key: str) -> state_io.FlatShard:
        """This rank's ZeRO-3 partition of `param`'s fp32 weights or AdamW moment, without the padding."""
        if key == "fp32":
            local = safe_get_local_fp32_param(param)
        else:
            local = safe_get_local_optimizer_state(param, key)
        begin, end = state_io.chunk_range(param.ds_numel, self.rank, self.world_size)
        return state_io.FlatShard(local.reshape(-1)[: end - begin], tuple(param.ds_shape), begin)

    def _restore_partition(self, param: nn.Parameter, key: str, piece: torch.Tensor) -> None:
        """Write this rank's part of the saved full tensor into the partition (zero padding after the
        last element, as ZeRO-3 pads); the weights also into the partition the forward gathers."""
        partition = torch.zeros(param.ds_tensor.ds_numel, dtype=torch.float32, device=self.device)
        partition[: piece.numel()] = piece
        if key == "fp32":
            safe_set_local_fp32_param(param, partition)
            with torch.no_grad():  # what ZeRO-3's own loader does: working weights from the fp32 master
                param.ds_tensor.data.copy_(partition)
        else:
            safe_set_local_optimizer_state(param, partition, key)

    def _restore_optimizer_globals(self, state: dict) -> None:
        """AdamW's step count and hyper-parameters; its moments start as zeros, to be overwritten."""
        optimizer = self._require_engine().optimizer
        adamw = optimizer.optimizer
        for flat in optimizer.fp32_partitioned_groups_flat:
            # torch AdamW creates this state at its first step: it must exist before the moments are written
            adamw.state[flat] = {
                "step": torch.tensor(state["optimizer_step"], dtype=torch.float32),
                "exp_avg": torch.zeros_like(flat),
                "exp_avg_sq": torch.zeros_like(flat),
            }
        for group, saved in zip(adamw.param_groups, state["param_groups"], strict=True):
            group.update(saved)

    def _release_persistent_parameters(self) -> None:
        """Parameters kept gathered (below stage3_param_persistence_threshold) still hold the old
        weights: release them, as ZeRO-3's own loader does, so the next forward gathers the restored ones."""
        persistent = self._require_engine().optimizer.persistent_parameters
        if persistent:
            persistent[0].partition(persistent)


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, deepspeed.DeepSpeedEngine) else module
