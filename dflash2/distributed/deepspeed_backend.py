"""DeepSpeed ZeRO-3: a frozen partitioned target engine beside a trainable partitioned draft engine."""

from __future__ import annotations

import copy
import math
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from dflash2.config import OptimConfig, Precision, torch_dtype
from dflash2.distributed import state_io
from dflash2.distributed.base import DTYPE_BYTES, Backend, MemoryItem, ParamCounts, RankLayout
from dflash2.distributed.ds_config import check_ds_knobs, load_ds_config, resolve_ds_config, set_ds_value
from dflash2.distributed.env import check_build_locks
from dflash2.optim import build_optimizer
from dflash2.target.head import TargetHead, head_tensors

if TYPE_CHECKING:
    import deepspeed

    from dflash2.config import RunConfig
    from dflash2.distributed.deepspeed_groups import GroupMpu

OPTIMIZER_KEYS = ("fp32", "exp_avg", "exp_avg_sq")  # fp32: the master weights


class _Zero3Config:
    """What transformers reads from its HfDeepSpeedConfig (which would also require `accelerate`)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def is_zero3(self) -> bool:
        return True


def _deepspeed():
    """deepspeed, imported where an engine starts or is used: the import takes seconds and its logger
    prints to stdout, which the registry and the planner (class methods only) must not."""
    import deepspeed

    return deepspeed


class DeepSpeedBackend(Backend):
    """`ds_config` is a resolved DeepSpeed dict (batch sizes filled in by build); `mpu` the unit of
    the role's group (what role_scope yielded), None on the whole world."""

    name = "deepspeed"

    def __init__(self, ds_config: dict[str, Any], *, mpu: GroupMpu | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        # a sub-group only inside role_scope (the disaggregated roles), and one for both models
        self.mpu = mpu
        if self.target_group is not None or self.draft_group is not None:
            assert self.mpu is not None and self.target_group is self.draft_group is self.mpu.group
        if ds_config.get("zero_optimization", {}).get("stage") != 3:
            raise ValueError("DeepSpeed config must set zero_optimization.stage = 3")
        self.ds_config = ds_config
        self.engine: deepspeed.DeepSpeedEngine | None = None
        self._micro_steps = 0

    # ---- construction -------------------------------------------------------------------------------

    @classmethod
    def start_process_group(cls, comm: str, timeout: timedelta) -> None:
        check_build_locks()
        _deepspeed().init_distributed(dist_backend=comm, auto_mpi_discovery=False, timeout=timeout)

    @classmethod
    def role_scope(cls, group: dist.ProcessGroup) -> AbstractContextManager[GroupMpu]:
        """DeepSpeed's world-wide collectives confined to `group`; the `as` value is its mpu."""
        from dflash2.distributed.deepspeed_groups import confine_deepspeed

        return confine_deepspeed(group)

    @classmethod
    def config_file(cls, cfg: RunConfig) -> str | None:
        return cfg.ds_config

    @classmethod
    def build(
        cls,
        config_path: str | None,
        micro_batch_size: int,
        grad_accum_steps: int,
        *,
        target_group: dist.ProcessGroup | None = None,
        draft_group: dist.ProcessGroup | None = None,
        scope: GroupMpu | None = None,
    ) -> DeepSpeedBackend:
        if config_path is None:
            raise ValueError(f"backend {cls.name!r} needs a ds_config path (e.g. ds_configs/zero3.json)")
        layout = RankLayout.of_group(draft_group)
        resolved = resolve_ds_config(
            load_ds_config(config_path),
            micro_batch_size=micro_batch_size,
            grad_accum_steps=grad_accum_steps,
            dp_world_size=layout.world_size,
        )
        return cls(
            resolved,
            mpu=scope,
            layout=layout,
            micro_batch_size=micro_batch_size,
            grad_accum_steps=grad_accum_steps,
            target_group=target_group,
            draft_group=draft_group,
        )

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        check_ds_knobs(
            load_ds_config(cfg.ds_config), max_grad_norm=cfg.train.max_grad_norm, precision=cfg.precision
        )

    @classmethod
    def plan_offload(cls, cfg: RunConfig) -> tuple[bool, bool]:
        """(offload_param, offload_optimizer) from the DeepSpeed JSON."""
        zero = load_ds_config(cfg.ds_config).get("zero_optimization", {})

        def offloaded(key: str) -> bool:
            return zero.get(key, {}).get("device", "none") in ("cpu", "nvme")

        return offloaded("offload_param"), offloaded("offload_optimizer")

    @classmethod
    def plan_note(cls, offload: tuple[bool, bool]) -> str:
        return f" (offload param={offload[0]}, optimizer={offload[1]})"

    @classmethod
    def plan_draft_state(
        cls, counts: ParamCounts, precision: str, num_shards: int, offload: tuple[bool, bool]
    ) -> list[MemoryItem]:
        numel, act, fp32 = counts.total / num_shards, DTYPE_BYTES[precision], DTYPE_BYTES["fp32"]
        params_where = "cpu" if offload[0] else "gpu"
        optim_where = "cpu" if offload[1] else "gpu"
        per = f"{counts.total / 1e9:.3f} B / {num_shards}"
        if precision == "fp32":
            return [
                MemoryItem("draft parameters", numel * fp32, f"{per}, fp32 partitions", params_where),
                MemoryItem("draft gradients", numel * fp32, f"{per}, fp32 partitions", optim_where),
                MemoryItem(
                    "draft optimizer state", numel * 2 * fp32, "AdamW exp_avg + exp_avg_sq", optim_where
                ),
            ]
        return [
            MemoryItem("draft parameters", numel * act, f"{per}, bf16 partitions", params_where),
            # the flat gradient partitions live where the optimizer runs (pinned CPU memory under offload)
            MemoryItem("draft gradients", numel * act, f"{per}, bf16 partitions", optim_where),
            MemoryItem(
                "draft fp32 gradients (step)", numel * fp32, "fp32 copy of the partition", optim_where
            ),
            MemoryItem(
                "draft optimizer state", numel * 3 * fp32, "fp32 master + exp_avg + exp_avg_sq", optim_where
            ),
        ]

    @classmethod
    def plan_gathered(cls, counts: ParamCounts, dtype_bytes: int, with_grads: bool) -> tuple[float, str]:
        numel = max(counts.largest_module, 2 * counts.largest_block)
        return numel * dtype_bytes, "largest of one module / 2 blocks (compute + prefetch)"

    def _param_numel(self, param: torch.Tensor) -> tuple[int, int]:
        if hasattr(param, "ds_tensor"):  # ZeRO-3 partitioned parameter
            return param.ds_tensor.numel(), param.ds_numel
        return super()._param_numel(param)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, _deepspeed().DeepSpeedEngine) else model

    # ---- target -------------------------------------------------------------------------------------

    def _target_config(self, dtype: torch.dtype) -> dict[str, Any]:
        config = copy.deepcopy(self.ds_config)
        config["bf16"] = {"enabled": dtype == torch.bfloat16}
        config["zero_optimization"].pop("offload_optimizer", None)  # the target has no optimizer
        config.pop("gradient_clipping", None)
        return config

    def _load_target(self, target_dir: str, dtype: torch.dtype) -> nn.Module:
        from transformers import AutoModelForCausalLM
        from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

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
        engine, *_ = _deepspeed().initialize(model=model, config=config, mpu=self.mpu)
        engine.eval()
        return engine

    def target_head(self, target: nn.Module, dtype: torch.dtype) -> TargetHead:
        tensors = head_tensors(self.unwrap(target))
        # a tied LM head is the embedding itself: gather each parameter once
        params = list({id(p): p for p in tensors if p is not None}.values())
        with _deepspeed().zero.GatheredParameters(params, modifier_rank=None):
            copies = [None if p is None else p.detach().clone().to(self.device, dtype) for p in tensors]
        return TargetHead(*copies)

    # ---- draft --------------------------------------------------------------------------------------

    def setup_draft(self, draft: nn.Module, optim: OptimConfig, precision: Precision) -> nn.Module:
        self._take_optim_config(optim)
        config = copy.deepcopy(self.ds_config)
        set_ds_value(config, "gradient_clipping", optim.max_grad_norm, source="optim.max_grad_norm")
        set_ds_value(config, "bf16.enabled", precision == "bf16", source=f"precision={precision!r}")
        if precision == "bf16":  # gradients reduced in fp32, as FSDP2's reduce_dtype (else bf16 buckets),
            config.setdefault("communication_data_type", "fp32")
            # and summed over the micro-batches of a step in fp32 (else in a bf16 buffer)
            config.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
        config["zero_allow_untested_optimizer"] = True  # torch AdamW as the client optimizer
        draft.float()  # fp32 master weights; DeepSpeed keeps a bf16 working copy when bf16 is enabled
        optimizer, scheduler = build_optimizer(draft, optim)
        self.engine, *_ = _deepspeed().initialize(
            model=draft, optimizer=optimizer, lr_scheduler=scheduler, config=config, mpu=self.mpu
        )
        self.compute_dtype = torch_dtype(precision)
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
        deepspeed = _deepspeed()
        module = self.unwrap(self._require_engine())
        state: dict[str, torch.Tensor] = {}
        for name, param in module.named_parameters():
            if param.requires_grad:
                full = deepspeed.utils.safe_get_full_fp32_param(param)  # fp32 master weights, gathered
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
        self._continue_schedule(engine.lr_scheduler)
        for key, value in state["engine"].items():
            setattr(engine, key, value)
        # DeepSpeed finds an accumulation boundary from its micro-step count: counted in this launch's
        # accumulation steps, a checkpoint of another number of ranks (other accumulation steps) would
        # put a boundary, and an optimizer update, in the middle of this launch's first step
        engine.micro_steps = engine.global_steps * self.grad_accum_steps
        self._micro_steps = 0
        self.barrier()

    def _trainable(self) -> dict[str, nn.Parameter]:
        module = self.unwrap(self._require_engine())
        return {name: p for name, p in module.named_parameters() if p.requires_grad}

    def _saved_partition(self, param: nn.Parameter, key: str) -> state_io.FlatShard:
        """This rank's ZeRO-3 partition of `param`'s fp32 weights or AdamW moment, without the padding."""
        if key == "fp32":
            local = _deepspeed().utils.safe_get_local_fp32_param(param)
        else:
            local = _deepspeed().utils.safe_get_local_optimizer_state(param, key)
        begin, end = state_io.chunk_range(param.ds_numel, self.rank, self.world_size)
        return state_io.FlatShard(local.reshape(-1)[: end - begin], tuple(param.ds_shape), begin)

    def _restore_partition(self, param: nn.Parameter, key: str, piece: torch.Tensor) -> None:
        """Write this rank's part of the saved full tensor into the partition (zero padding after the
        last element, as ZeRO-3 pads); the weights also into the partition the forward gathers."""
        partition = torch.zeros(param.ds_tensor.ds_numel, dtype=torch.float32, device=self.device)
        partition[: piece.numel()] = piece
        if key == "fp32":
            _deepspeed().utils.safe_set_local_fp32_param(param, partition)
            with torch.no_grad():  # what ZeRO-3's own loader does: working weights from the fp32 master
                param.ds_tensor.data.copy_(partition)
        else:
            _deepspeed().utils.safe_set_local_optimizer_state(param, partition, key)

    def _restore_optimizer_globals(self, state: dict) -> None:
        """AdamW's step count and hyper-parameters; its moments start as zeros, to be overwritten."""
        optimizer = self._require_engine().optimizer
        adamw = optimizer.optimizer
        for sub_group, flat in enumerate(optimizer.fp32_partitioned_groups_flat):
            # torch AdamW creates this state at its first step: it must exist before the moments are
            # written; its step count where AdamW keeps it (fused or capturable: on the partition's
            # device). A parameter group larger than ZeRO's sub_group_size holds several partitions.
            group = adamw.param_groups[optimizer.sub_group_to_group_id[sub_group]]
            on_device = group.get("fused") or group.get("capturable")
            adamw.state[flat] = {
                "step": torch.tensor(
                    state["optimizer_step"], dtype=torch.float32, device=flat.device if on_device else "cpu"
                ),
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
