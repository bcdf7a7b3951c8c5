"""DeepSpeed ZeRO-3: a frozen partitioned target engine beside a trainable partitioned draft engine."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import deepspeed
import torch
from deepspeed.utils import safe_get_full_fp32_param
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

from dflash2.config import OptimConfig
from dflash2.distributed.base import Backend, build_optimizer
from dflash2.distributed.ds_config import set_ds_value
from dflash2.models.target_head import TargetHead, head_tensors


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
        if self.target_group is not None or self.draft_group is not None:
            raise NotImplementedError(
                "the deepspeed backend shards over the whole world; use fsdp for sub-groups"
            )
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
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        return engine

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
        optimizer, scheduler = build_optimizer([p for p in draft.parameters() if p.requires_grad], optim)
        self.engine, *_ = deepspeed.initialize(
            model=draft, optimizer=optimizer, lr_scheduler=scheduler, config=config
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
        engine = self._require_engine()
        optimizer_state = engine.optimizer.state_dict()
        optimizer_state.pop("loss_scaler")  # an object; bf16/fp32 training uses no loss scaling
        state = {
            "optimizer": optimizer_state,
            "lr_scheduler": engine.lr_scheduler.state_dict(),
            "engine": {
                "global_steps": engine.global_steps,
                "global_samples": engine.global_samples,
                "micro_steps": engine.micro_steps,
                "skipped_steps": engine.skipped_steps,
            },
        }
        self._write_rank_state(ckpt_dir, state)

    def load_state(self, ckpt_dir: Path) -> None:
        engine = self._require_engine()
        state = self._read_rank_state(ckpt_dir)
        optimizer_state = state["optimizer"]
        optimizer_state["loss_scaler"] = engine.optimizer.loss_scaler
        # ZeRO-3 picks entry [dp rank] of the list: each rank hands in only its own partition
        per_rank = [None] * self.world_size
        per_rank[self.rank] = optimizer_state
        engine.optimizer.load_state_dict(per_rank, load_optimizer_states=True, load_from_fp32_weights=True)
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        for key, value in state["engine"].items():
            setattr(engine, key, value)
        self._micro_steps = 0
        self.barrier()


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, deepspeed.DeepSpeedEngine) else module
