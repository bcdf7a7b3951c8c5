"""Memory planning on the meta device: what every rank holds for a run config, before any GPU is used.

    python -m dflash2.plan configs/recipes/qwen3.6-27b-dflash2-8gpu-zero3.yaml --world-size 8 \\
        --target-config configs/target/qwen3.6-27b.json [--device-gb 79] [key=value ...]

Exit codes: 0 the run fits on every rank; 2 a user error, among them a train.global_batch_size that
the data-parallel ranks cannot split; 3 (EXIT_DOES_NOT_FIT) a role needs more than --device-gb, so
a script can gate a launch on it. The plan ends with the size of one checkpoint and its write time
at --write-gb-per-s (the file system's write bandwidth, default 1 GB/s): the SLURM signal lead time
must cover one step plus that write (launch/slurm/README.md).

The draft is built with `build_draft` and the target with `AutoModelForCausalLM.from_config`, both on
`torch.device("meta")`, so parameter counts and sharding units are exact while nothing is allocated.
Activations are estimates from the shapes of one micro-batch (see `draft_activation_bytes`). The plan
follows the run config: backend (ZeRO-3 / FSDP2 shard over the data-parallel ranks), precision,
topology (colocated, or disaggregated with the target on `capture_ranks` only) and the DeepSpeed
JSON's offload settings.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dflash2.capture.transfer import PREFETCH_DEPTH
from dflash2.config import BACKENDS, RunConfig, load_run_config, read_json_object
from dflash2.distributed import backend_class
from dflash2.distributed.base import DTYPE_BYTES, count_params
from dflash2.distributed.base import MemoryItem as Item
from dflash2.distributed.registry import check_backend_config
from dflash2.errors import EXIT_DOES_NOT_FIT, OverridesParser, add_debug_flag, exit_process, run_main
from dflash2.models import build_draft
from dflash2.models.attention import context_key_span

GIB = 2**30
DEVICE_GB = 79.0  # an 80 GB H100 leaves torch 79.1 GiB (85.0e9 bytes)
GB = 1e9
FP32 = DTYPE_BYTES["fp32"]
# A checkpoint's bytes per draft parameter, summed over ranks: draft.safetensors (fp32 weights, rank 0)
# and backend/ (every rank's shard of the fp32 weights or master weights and AdamW's two moments).
CHECKPOINT_WEIGHT_BYTES, CHECKPOINT_STATE_BYTES = FP32, 3 * FP32
DEFAULT_WRITE_GB_PER_S = 1.0
# CUDA context, NCCL buffers and allocator fragmentation: a typical allowance, not a measurement.
RUNTIME_ALLOWANCE_BYTES = 2 * GIB

# Saved-for-backward tensors of one draft layer, counted per element of the shapes they scale with
# (read off the layer code, checked against a real CPU run in tests/test_plan.py). "act" tensors are
# in the compute dtype; RMSNorm and the attention softmax keep fp32 copies whatever the dtype.
LAYER_HIDDEN_ACT, LAYER_HIDDEN_FP32 = 20, 2  # per block row x H: norms, convs, residuals, projections
LAYER_HEADS_ACT, LAYER_HEADS_FP32 = 5, 1  # per block row x (nh + 2 nkv) x d: q/k/v, norms, RoPE
LAYER_MLP_ACT = 4  # per block row x I: gate, up, activation, product
LAYER_CONTEXT_ACT, LAYER_CONTEXT_FP32 = 4, 1  # per context row x nkv x d: context keys/values, k_norm
ACTIVATION_NOTES = {
    "scores": "[b, nh, N, B, keys+B] per layer (keys: S, or window + tile in sliding layers): fp32 softmax + copy, mask",
    "hidden": "block rows x (H, heads), context K/V, per layer",
    "mlp": "block rows x I x 4, per layer",
    "context": "fc + hidden_norm over [b, S, H]",
    "final norm": "[b, N, B, H]",
    "objective": "slot rows, CE gradient, selector rows and candidates' head rows",
    "backward (one layer)": "gradients of one layer's activations",
}


@dataclass
class RolePlan:
    """The memory of one rank of a role (all ranks of a role hold the same)."""

    role: str  # "colocated" (target and draft on every rank), or "capture" / "trainer" (disaggregated)
    num_ranks: int
    items: list[Item] = field(default_factory=list)

    def total(self, where: str = "gpu") -> float:
        return sum(item.num_bytes for item in self.items if item.where == where)


@dataclass
class Plan:
    header: list[str]
    roles: list[RolePlan]
    device_bytes: float
    warnings: list[str] = field(default_factory=list)
    checkpoint_bytes: float = 0.0


# ------------------------------------------------------------------ models on meta


def check_positive(flag: str, value: float) -> None:
    """A GiB or GB/s option: a finite number > 0 (nan would compare as fitting, a negative as not)."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} must be a number > 0, got {value}")


def load_target_config(path: str | Path):
    """A transformers config from a config.json file or a checkpoint directory holding one."""
    from transformers import AutoConfig

    path = Path(path)
    if path.is_dir():
        return AutoConfig.from_pretrained(path)
    if not path.is_file():
        raise ValueError(f"target config {path} does not exist; pass --target-config <config.json or dir>")
    data = read_json_object(path, f"target config {path}")
    if "model_type" not in data:
        raise ValueError(f"{path}: a target config.json needs a model_type (e.g. qwen3)")
    return AutoConfig.for_model(**data)


def meta_models(cfg: RunConfig, target_config) -> tuple[nn.Module, nn.Module]:
    """(draft, target) on the meta device; the draft is validated against the target config."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        draft = build_draft(cfg.model.draft_config, target_config=target_config)
        target = AutoModelForCausalLM.from_config(target_config)
    return draft, target


# ------------------------------------------------------------------ pieces


@dataclass(frozen=True)
class StepShapes:
    """Shapes of one micro-batch (see docs/architecture.md for the letters)."""

    batch: int  # b
    seq_len: int  # S
    num_anchors: int  # N
    block_size: int  # B
    hidden: int  # H
    intermediate: int  # draft I
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_features: int  # K target layers captured
    teacher: bool  # the target's last hidden state captured too (a KL or TV weight, labels: target)
    selector_top_k: int  # 0 without a selector
    selector_rank: int
    sliding_windows: tuple[int | None, ...]  # per draft layer: its window, None for full attention


def step_shapes(cfg: RunConfig, draft: nn.Module) -> StepShapes:
    c = draft.config
    selector = getattr(draft, "candidate_selector", None)
    return StepShapes(
        batch=cfg.train.micro_batch_size,
        seq_len=cfg.data.max_length,
        num_anchors=cfg.objective.num_anchors,
        block_size=draft.block_size,
        hidden=c.hidden_size,
        intermediate=c.intermediate_size,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        num_features=len(draft.target_layer_ids),
        teacher=cfg.objective.needs_teacher,
        selector_top_k=selector.top_k if selector is not None else 0,
        selector_rank=selector.predecessor_codebook.shape[1] if selector is not None else 0,
        sliding_windows=tuple(layer.self_attn.sliding_window for layer in draft.layers),
    )


def draft_activation_bytes(s: StepShapes, act: int) -> dict[str, float]:
    """Saved-for-backward bytes of one draft step (forward of every layer + the objective's rows).

    `act` is the compute dtype's size in bytes. Every block's slots score the context keys of its
    layer (`context_key_span`: the whole context, or a sliding layer's window tile) and its own block,
    so the scores are [b, nh, N, B, keys + B] per layer, kept as the fp32 softmax output plus a
    compute-dtype copy. The window-bounded path also keeps per-tile copies of the block's q, k, v;
    below fp32, the score products keep fp32 copies of q and k.
    """
    rows = s.batch * s.num_anchors * s.block_size  # block rows, b * N * B
    context_rows = s.batch * s.seq_len
    heads_width = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    score_bytes = FP32 + (act if act != FP32 else 0)
    upcast = FP32 if act != FP32 else 0  # fp32 copies of q, k for the scores
    out: dict[str, float] = {"scores": 0.0, "hidden": 0.0, "mlp": 0.0}
    largest_layer = 0.0
    for window in s.sliding_windows:
        keys = context_key_span(s.seq_len, window)
        windowed = keys < s.seq_len
        layer = {
            "scores": rows * s.num_heads * (keys + s.block_size) * score_bytes + rows * keys,  # + bool mask
            "hidden": rows * s.hidden * (LAYER_HIDDEN_ACT * act + LAYER_HIDDEN_FP32 * FP32)
            + rows * heads_width * (LAYER_HEADS_ACT * act + LAYER_HEADS_FP32 * FP32 + windowed * act)
            + rows * (s.num_heads + s.num_kv_heads) * s.head_dim * upcast
            + context_rows * s.num_kv_heads * s.head_dim * (LAYER_CONTEXT_ACT * act + LAYER_CONTEXT_FP32 * FP32 + upcast),
            "mlp": rows * s.intermediate * LAYER_MLP_ACT * act,
        }  # fmt: skip
        for name, value in layer.items():
            out[name] += value
        largest_layer = max(largest_layer, sum(layer.values()))
    supervised = s.batch * s.num_anchors * (s.block_size - 1)
    out.update(
        {
            # fc output, hidden_norm (+ fp32 copy), RoPE tables; final norm of the block rows
            "context": context_rows * s.hidden * (2 * act + FP32)
            + 2 * (context_rows + rows) * s.head_dim * act,
            "final norm": rows * s.hidden * (2 * act + FP32),
            # gathered slot rows, their fp32 gradient from the chunked CE, selector codebook rows, and
            # the LM-head rows of each slot's top-k candidates that the selector's unary scores keep
            "objective": supervised * s.hidden * (act + FP32)
            + supervised * s.selector_top_k * (s.selector_rank + s.selector_top_k) * 3 * act
            + supervised * s.selector_top_k * s.hidden * act,
            "backward (one layer)": largest_layer,  # gradients of one layer's activations
        }
    )
    return out


def capture_items(target: nn.Module, s: StepShapes, target_bytes: int, act: int) -> list[Item]:
    """No-grad target forward: hooks keep the outputs of the K captured layers (and, for a teacher,
    the final-normed last hidden state) beside the running hidden state, one layer's intermediates
    live at a time, and the captured features [b, S, K*H] (+ H) are kept for the draft."""
    tokens = s.batch * s.seq_len
    captured = s.num_features + int(s.teacher)
    widest_layer = max(
        sum(m.out_features for m in block.modules() if isinstance(m, nn.Linear))
        for block in target.modules()
        if type(block).__name__ in set(target._no_split_modules or ())
    )
    return [
        Item("target layer outputs", tokens * s.hidden * (captured + 1) * target_bytes,
             f"{captured} hooked outputs + the running [b, S, H]"),
        Item("target layer working set", tokens * (widest_layer + 2 * s.hidden) * target_bytes,
             "one layer's projections, upper bound"),
        Item("captured features", tokens * captured * s.hidden * act,
             "[b, S, (K+1)*H]: the last hidden state too" if s.teacher else "[b, S, K*H]"),
    ]  # fmt: skip


def sent_features(target_part: list[Item], num_capture: int, num_trainers: int) -> list[Item]:
    """Disaggregated capture rank: up to PREFETCH_DEPTH micro-batches in flight per trainer served."""
    one = next(i.num_bytes for i in target_part if i.name == "captured features")
    served = math.ceil(num_trainers / num_capture)
    note = f"{PREFETCH_DEPTH} in flight x {served} trainer(s)"
    return [Item("features being sent", one * PREFETCH_DEPTH * served, note)]


def received_features(target_part: list[Item]) -> Item:
    """Disaggregated trainer rank: the prefetch queue, one micro-batch arriving and one in use."""
    one = next(i.num_bytes for i in target_part if i.name == "captured features")
    return Item(
        "received features", one * (PREFETCH_DEPTH + 2), f"{PREFETCH_DEPTH} queued + 1 arriving + 1 in use"
    )


def logits_item(cfg: RunConfig, vocab_size: int, supervised_rows: int) -> Item:
    if cfg.objective.needs_teacher:
        # distill_loss: a third of logits_chunk_rows a chunk, in three fp32 [rows, V] buffers (the
        # logits, the teacher's -p, a work buffer), and the head product's output and the gradient's
        # cast in the compute dtype
        rows = min(max(1, cfg.objective.logits_chunk_rows // 3), supervised_rows)
        act = DTYPE_BYTES[cfg.precision]
        note = f"{rows} rows x {vocab_size} x (3 fp32 + 2 {cfg.precision}): a third of the chunk with the teacher"
        return Item("logits chunk", rows * vocab_size * (3 * FP32 + 2 * act), note)
    rows = min(cfg.objective.logits_chunk_rows, supervised_rows)
    return Item("logits chunk", rows * vocab_size * FP32 * 3, f"{rows} rows x {vocab_size} x fp32 x 3")


# ------------------------------------------------------------------ the plan


def plan_run(cfg: RunConfig, *, world_size: int, target_config, device_gb: float = DEVICE_GB) -> Plan:
    """Per-role memory of `cfg` on `world_size` ranks. Disaggregated runs have two roles.
    `target_config`: a transformers config, or the path of a config.json or of a directory holding one."""
    if isinstance(target_config, (str, Path)):
        target_config = load_target_config(target_config)
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    if BACKENDS[cfg.backend].one_process and world_size != 1:
        raise ValueError(
            f"backend={cfg.backend} runs in one process, not {world_size}: plan it with --world-size 1"
        )
    num_capture = cfg.capture_ranks if cfg.topology == "disaggregated" else 0
    if num_capture and world_size <= num_capture:
        raise ValueError(
            f"capture_ranks={num_capture} leaves no trainer rank on {world_size} ranks; raise --world-size"
        )
    try:
        cfg = cfg.with_batch_layout(cfg.data_parallel_size(world_size))
    except ValueError as error:
        raise ValueError(f"{error} (--world-size {world_size})") from None
    draft, target = meta_models(cfg, target_config)
    shapes = step_shapes(cfg, draft)
    check_backend_config(cfg)
    offload = backend_class(cfg.backend).plan_offload(cfg)
    target_part = target_items(cfg, target, shapes, num_capture or world_size, offload)
    draft_part = draft_items(cfg, draft, target, shapes, world_size - num_capture, offload)
    roles = role_plans(target_part, draft_part, world_size, num_capture)
    header = plan_header(cfg, draft, target, shapes, world_size, num_capture, offload)
    checkpoint = count_params(draft).total * (CHECKPOINT_WEIGHT_BYTES + CHECKPOINT_STATE_BYTES)
    plan = Plan(header=header, roles=roles, device_bytes=device_gb * GIB, checkpoint_bytes=checkpoint)
    plan.warnings = [
        f"{role.role} ranks need {role.total() / GIB:.1f} GiB > {device_gb:g} GiB per device: {_fit_hint(cfg, role.role)}"
        for role in roles
        if role.total() > plan.device_bytes
    ]
    return plan


def _fit_hint(cfg: RunConfig, role: str) -> str:
    """What may make `role`'s ranks fit: capture ranks hold target shards only; offload is DeepSpeed's."""
    offload = (
        "or offload (ds_config=ds_configs/zero3_offload.json)"
        if cfg.backend == "deepspeed"
        else "or offload with backend=deepspeed ds_config=ds_configs/zero3_offload.json (FSDP2 here offloads nothing)"
    )
    if role == "capture":
        lower = (
            "train.micro_batch_size or data.max_length"
            if cfg.train.micro_batch_size > 1
            else "data.max_length"
        )
        return f"add capture ranks (capture_ranks), lower {lower}, {offload}"
    levers = ["train.micro_batch_size"] if cfg.train.micro_batch_size > 1 else []
    levers += ["data.max_length", "objective.num_anchors", "objective.logits_chunk_rows"]
    return f"lower {', '.join(levers[:-1])} or {levers[-1]}, add ranks, {offload}"


def target_items(
    cfg: RunConfig, target: nn.Module, shapes: StepShapes, num_shards: int, offload: tuple[bool, bool]
) -> list[Item]:
    """What a rank holding a target shard holds for it: the shard, the gathered units, the capture."""
    counts, backend = count_params(target), backend_class(cfg.backend)
    target_bytes = DTYPE_BYTES[cfg.model.target_dtype or cfg.precision]
    return [
        Item("target shards", counts.total * target_bytes / num_shards,
             f"{counts.total / 1e9:.2f} B / {num_shards}", "cpu" if offload[0] else "gpu"),
        Item("target gathered", *backend.plan_gathered(counts, target_bytes, with_grads=False)),
        *capture_items(target, shapes, target_bytes, DTYPE_BYTES[cfg.precision]),
    ]  # fmt: skip


def draft_items(
    cfg: RunConfig,
    draft: nn.Module,
    target: nn.Module,
    shapes: StepShapes,
    num_shards: int,
    offload: tuple[bool, bool],
) -> list[Item]:
    """What a rank training the draft holds: its state, gathered units, the borrowed head, activations."""
    counts, act, backend = count_params(draft), DTYPE_BYTES[cfg.precision], backend_class(cfg.backend)
    vocab = target.get_input_embeddings().weight.shape[0]
    head_numel = sum(
        m.weight.numel() for m in (target.get_input_embeddings(), target.get_output_embeddings())
    )
    supervised = shapes.batch * shapes.num_anchors * (shapes.block_size - 1)
    activations = draft_activation_bytes(shapes, act)
    return [
        *backend.plan_draft_state(counts, cfg.precision, num_shards, offload),
        Item("draft gathered", *backend.plan_gathered(counts, act, with_grads=True)),
        Item("embedding + LM head copy", head_numel * act, f"2 x [{vocab}, {shapes.hidden}], full on every rank"),
        *[Item(f"draft activations: {k}", v, ACTIVATION_NOTES[k]) for k, v in activations.items()],
        logits_item(cfg, vocab, supervised),
    ]  # fmt: skip


def role_plans(
    target_part: list[Item], draft_part: list[Item], world_size: int, num_capture: int
) -> list[RolePlan]:
    """One role holding both parts (colocated), or capture ranks and trainer ranks (disaggregated)."""
    allowance = Item("runtime allowance", RUNTIME_ALLOWANCE_BYTES, "CUDA context, NCCL, fragmentation")
    if not num_capture:
        return [RolePlan("colocated", world_size, [*target_part, *draft_part, allowance])]
    num_trainers = world_size - num_capture
    sent = sent_features(target_part, num_capture, num_trainers)
    return [
        RolePlan("capture", num_capture, [*target_part, *sent, allowance]),
        RolePlan("trainer", num_trainers, [*draft_part, received_features(target_part), allowance]),
    ]


def plan_header(
    cfg: RunConfig,
    draft: nn.Module,
    target: nn.Module,
    shapes: StepShapes,
    world_size: int,
    num_capture: int,
    offload: tuple[bool, bool],
) -> list[str]:
    offload_note = backend_class(cfg.backend).plan_note(offload)
    layout = (
        f" = {num_capture} capture + {world_size - num_capture} trainer"
        if num_capture
        else ", each runs target and draft"
    )
    target_total, draft_total = count_params(target).total, count_params(draft).total
    return [
        f"backend {cfg.backend}{offload_note}, precision {cfg.precision}, "
        f"target dtype {cfg.model.target_dtype or cfg.precision}",
        f"topology {cfg.topology}: {world_size} ranks{layout}",
        f"target {type(target).__name__}: {target_total / 1e9:.3f} B parameters, sharded over {num_capture or world_size}",
        f"draft {type(draft).__name__}: {draft_total / 1e9:.3f} B parameters, sharded over {world_size - num_capture}",
        f"micro-batch {shapes.batch} x {shapes.seq_len} tokens, {shapes.num_anchors} anchors x block "
        f"{shapes.block_size}, logits chunk {cfg.objective.logits_chunk_rows} rows",
        f"global batch {shapes.batch * cfg.train.grad_accum_steps * (world_size - num_capture)}: micro-batch "
        f"{shapes.batch} x {cfg.train.grad_accum_steps} accumulation steps x {world_size - num_capture} ranks",
    ]


def checkpoint_line(plan: Plan, write_gb_per_s: float) -> str:
    """The size of one checkpoint and how long writing it takes at `write_gb_per_s`."""
    seconds = plan.checkpoint_bytes / (write_gb_per_s * GB)
    return (
        f"checkpoint: {plan.checkpoint_bytes / GB:.3g} GB (fp32 draft weights + every rank's shard of "
        f"weights and AdamW moments); about {math.ceil(seconds)} s to write at {write_gb_per_s:g} GB/s"
    )


def format_plan(plan: Plan, write_gb_per_s: float = DEFAULT_WRITE_GB_PER_S) -> str:
    lines = [*plan.header, ""]
    for role in plan.roles:
        title = f"per {role.role} rank ({role.num_ranks} rank{'s' if role.num_ranks > 1 else ''})"
        lines.append(f"{title:<42} {'GiB':>8}")
        for item in role.items:
            where = " [cpu]" if item.where == "cpu" else ""
            lines.append(f"  {item.name + where:<40} {item.num_bytes / GIB:8.2f}   {item.note}")
        verdict = "fits" if role.total() <= plan.device_bytes else "DOES NOT FIT"
        lines.append(
            f"  {'total on the device':<40} {role.total() / GIB:8.2f}   of {plan.device_bytes / GIB:g} GiB: {verdict}"
        )
        if role.total("cpu"):
            lines.append(f"  {'total offloaded to CPU':<40} {role.total('cpu') / GIB:8.2f}")
        lines.append("")
    lines += [checkpoint_line(plan, write_gb_per_s), ""]
    lines += [f"WARNING: {w}" for w in plan.warnings]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = OverridesParser(
        prog="python -m dflash2.plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", help="run config YAML")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--world-size", type=int, default=8, help="total ranks (GPUs) of the run (default 8)")
    parser.add_argument(
        "--device-gb",
        type=float,
        default=DEVICE_GB,
        help=f"usable memory per device in GiB (default {DEVICE_GB:g}: an 80 GB H100's, as torch.cuda.mem_get_info reports it)",
    )
    parser.add_argument(
        "--target-config", default=None, help="target config.json or directory (default: model.target)"
    )
    parser.add_argument(
        "--write-gb-per-s",
        type=float,
        default=DEFAULT_WRITE_GB_PER_S,
        help=f"checkpoint write bandwidth in GB/s, for the write time (default {DEFAULT_WRITE_GB_PER_S:g})",
    )
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)  # overrides may follow the options
    check_positive("--write-gb-per-s", args.write_gb_per_s)
    check_positive("--device-gb", args.device_gb)
    cfg = load_run_config(args.config, args.overrides)
    target_config = load_target_config(args.target_config or cfg.model.target)
    plan = plan_run(cfg, world_size=args.world_size, target_config=target_config, device_gb=args.device_gb)
    print(format_plan(plan, args.write_gb_per_s), end="")
    return EXIT_DOES_NOT_FIT if plan.warnings else 0


if __name__ == "__main__":
    exit_process(run_main(main))
