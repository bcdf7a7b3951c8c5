"""Training: `build_*` functions, one `train_step`, and a short loop.

Every rank runs the same calls in the same order; rank 0 only guards file writes and logs.
`dflash2.run` picks the topology and calls `build_setup` and `fit`; the entry point is
`launch/train.py --config <yaml> [key=value ...]`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dflash2.capture.features import FeatureSource, split_last_hidden, target_features
from dflash2.checkpoint import TrainState, check_resume, load_checkpoint, resume_point, save_checkpoint
from dflash2.config import RunConfig, torch_dtype
from dflash2.data.loader import anchor_generators, collate, micro_batches, pad_token_id_of
from dflash2.data.prepare import build_dataset
from dflash2.distributed import Backend
from dflash2.export import export_draft
from dflash2.faults import collective_section, stop_request, write_stop_marker
from dflash2.identity import data_identity, target_identity, tokenizer_identity
from dflash2.models import TargetHead, build_draft
from dflash2.models.config import draft_value, load_config_dict
from dflash2.objective import ObjectiveConfig, compute_objective, plan_blocks, summarize_metrics
from dflash2.target.head import load_target_head, target_num_parameters
from dflash2.timing import StepTimer
from dflash2.train_log import TrainLogger


@dataclass
class Setup:
    backend: Backend
    target: nn.Module | None  # None when features come from disk or from capture ranks
    head: TargetHead
    draft: nn.Module  # the sharded, callable draft
    draft_config: dict
    layer_ids: list[int]
    dataset: object  # a datasets.Dataset with input_ids, loss_mask
    pad_token_id: int
    objective: ObjectiveConfig
    contract: dict
    tokenizer: object
    # OfflineFeatures or the capture ranks' FeatureReceiver; None: online capture
    features: FeatureSource | None = None


# ------------------------------------------------------------------ build


def build_contract(cfg: RunConfig, draft_config: dict, data_parallel_size: int) -> dict:
    """What a checkpoint is only valid for (training.md section 6); resume compares it field by field.

    The batch enters as the global batch of one optimizer step: how it is split into ranks,
    micro-batches and accumulation steps may change between launches (the data order depends only
    on it), so a run can resume on another number of ranks."""
    value = lambda name: draft_value(draft_config, name)  # noqa: E731
    return {
        "architecture": (draft_config.get("architectures") or ["DFlashDraftModel"])[0],
        "num_draft_layers": draft_config["num_hidden_layers"],
        "hidden_size": draft_config["hidden_size"],
        "target_layer_ids": list(value("target_layer_ids")),
        "block_size": value("block_size"),
        "mask_token_id": value("mask_token_id"),
        "conv_kernel_size": value("conv_kernel_size"),
        "conv_group_size": value("conv_group_size"),
        "selector_rank": value("selector_rank"),
        "selector_top_k": value("selector_top_k"),
        "output_multiplier": value("output_multiplier"),
        "final_logit_softcapping": value("final_logit_softcapping"),
        # the attention pattern: which layers slide, how far, and whether a block sees its later slots
        "sliding_window": draft_config.get("sliding_window"),
        "layer_types": list(draft_config.get("layer_types") or []),
        "is_causal": draft_config.get("is_causal"),
        "selector_loss_alpha": cfg.objective.selector_loss_alpha,
        "selector_mode": cfg.objective.selector_mode,
        "loss_gamma": cfg.objective.loss_gamma,
        "position_weighting": cfg.objective.position_weighting,
        "position_decay": cfg.objective.position_decay,
        "ce_weight": cfg.objective.ce_weight,
        "kl_weight": cfg.objective.kl_weight,
        "tv_weight": cfg.objective.tv_weight,
        "distill_temperature": cfg.objective.distill_temperature,
        "num_anchors": cfg.objective.num_anchors,
        "target": target_identity(cfg.model.target),
        "tokenizer": tokenizer_identity(cfg.model.target),
        "dataset": data_identity(cfg.data.train),
        # the rendering of the same data (e.g. the thinking mode)
        "chat_template_kwargs": dict(cfg.data.chat_template_kwargs),
        "global_batch_size": cfg.train.micro_batch_size * cfg.train.grad_accum_steps * data_parallel_size,
        "seed": cfg.seed,
    }


def build_target(cfg: RunConfig, backend: Backend, load_full: bool) -> tuple[nn.Module | None, TargetHead]:
    """The sharded frozen target and its head. When features come from elsewhere (disk, capture ranks)
    only the embedding and LM head are read from the target's safetensors: the target is never loaded."""
    dtype = torch_dtype(cfg.precision)
    target_dtype = cfg.target_torch_dtype
    if not load_full:
        total = target_num_parameters(cfg.model.target)
        print(f"[dflash2] rank {backend.rank}: holds 0/{total} target parameters (head only)", flush=True)
        return None, load_target_head(cfg.model.target, target_dtype, backend.device).to(dtype)
    target = backend.load_target(cfg.model.target, target_dtype)
    local, total = backend.parameter_numel(target)
    print(f"[dflash2] rank {backend.rank}: holds {local}/{total} target parameters", flush=True)
    return target, backend.target_head(target, dtype)


def build_setup(cfg: RunConfig, backend: Backend, features: FeatureSource | None = None) -> Setup:
    """`features`: where the step gets features (offline features, the capture ranks' receiver),
    chosen by dflash2.run; None: the step runs the target itself (online capture)."""
    from transformers import AutoConfig, AutoTokenizer

    target_config = AutoConfig.from_pretrained(cfg.model.target)
    draft_config = load_config_dict(cfg.model.draft_config)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.target)
    # Validate the draft against the target (hidden/vocab sizes, layer ids, mask token) before
    # loading anything big.
    torch.manual_seed(cfg.seed)
    draft = build_draft(
        draft_config, target_config=target_config, tokenizer=tokenizer, source=cfg.model.draft_config
    )
    layer_ids = list(draft.target_layer_ids)
    normalized = draft.config.to_dict()
    contract = build_contract(cfg, normalized, backend.draft_world_size)
    ckpt = resume_point(cfg.train.resume, Path(cfg.output_dir))
    if ckpt is not None:  # a refused resume stops here, before the target loads and the data is read
        check_resume(ckpt, contract)
    target, head = build_target(cfg, backend, load_full=features is None)
    dataset = build_dataset(cfg.data, tokenizer, backend.is_main)
    objective = ObjectiveConfig.for_draft(draft, **cfg.objective.model_dump())
    model = backend.setup_draft(draft, cfg.train, cfg.precision)
    pad_id = pad_token_id_of(tokenizer)
    return Setup(
        backend=backend,
        target=target,
        head=head,
        draft=model,
        draft_config=normalized,
        layer_ids=layer_ids,
        dataset=dataset,
        pad_token_id=pad_id,
        objective=objective,
        contract=contract,
        tokenizer=tokenizer,
        features=features,
    )


# ------------------------------------------------------------------ step


def load_batch(setup: Setup, indices: list[int]) -> dict[str, torch.Tensor]:
    """Samples `indices` collated and on the device: input_ids, loss_mask, attention_mask [b, S]."""
    samples = [setup.dataset[i] for i in indices]
    return {k: v.to(setup.backend.device) for k, v in collate(samples, setup.pad_token_id).items()}


def capture_features(setup: Setup, batch: dict, indices: list[int]) -> torch.Tensor:
    """[b, S, K*H] features of the micro-batch, followed by the target's last hidden state [b, S, H]
    when the objective needs the teacher (dflash2.capture.features)."""
    if setup.features is not None:
        return setup.features.batch(indices, batch["input_ids"].shape[1])
    last_hidden = setup.objective.needs_teacher
    return target_features(setup.backend, setup.target, batch, setup.layer_ids, last_hidden)


def add_features(setup: Setup, batch: dict, captured: torch.Tensor) -> None:
    """Put the captured tensor into the batch: `features`, and `target_last_hidden` when needed."""
    captured = captured.to(setup.backend.compute_dtype)
    features, last_hidden = split_last_hidden(captured, setup.head.hidden_size, setup.objective.needs_teacher)
    batch["features"] = features
    if last_hidden is not None:
        batch["target_last_hidden"] = last_hidden


def train_step(
    setup: Setup, micro: list[list[int]], epochs: list[int], seed: int, timer: StepTimer
) -> tuple[dict, dict]:
    """One optimizer step over `grad_accum_steps` micro-batches. Returns (metric sums reduced over
    ranks, timings). The loss is normalised by the global weight sum of the whole step. `timer` has
    started the step; its regions are free unless timed (dflash2.timing)."""
    backend = setup.backend
    batches = [load_batch(setup, idx) for idx in micro]
    plans = [
        plan_blocks(b["input_ids"], b["loss_mask"], setup.objective, anchor_generators(seed, epoch, idx))
        for b, epoch, idx in zip(batches, epochs, micro)
    ]
    global_weight = backend.all_reduce_sum(sum(p.weights.sum() for p in plans).to(backend.device))
    sums: dict[str, torch.Tensor] = {}
    for batch, indices, plan in zip(batches, micro, plans):
        with torch.no_grad(), timer.region("capture"):
            add_features(setup, batch, capture_features(setup, batch, indices))
        with timer.region("objective"):
            out = compute_objective(setup.draft, setup.head, batch, setup.objective, blocks=plan)
        with timer.region("backward"):
            backend.backward(out.loss_sum / global_weight)
        for k, v in out.metrics.items():
            sums[k] = sums.get(k, 0) + v.detach().float()
        sums["input_tokens"] = sums.get("input_tokens", 0) + batch["attention_mask"].sum().float()
    with timer.region("optimizer"):
        stats = backend.step()
    reduced = all_reduce_metrics(backend, sums)
    # capture_s: time spent getting features (online capture, disk reads, or waiting for capture ranks)
    return reduced, {"capture_s": timer.seconds("capture"), **stats}


def all_reduce_metrics(backend: Backend, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The step's metric sums (scalars and per-slot vectors) summed over the data-parallel ranks in one
    collective, not one per metric."""
    names = sorted(sums)
    flat = [sums[k].reshape(-1) for k in names]
    total = backend.all_reduce_sum(torch.cat(flat))
    return {k: part.view(sums[k].shape) for k, part in zip(names, total.split([f.numel() for f in flat]))}


# ------------------------------------------------------------------ loop


def save(setup: Setup, cfg: RunConfig, run_dir: Path, state: TrainState) -> Path:
    with collective_section(f"saving the checkpoint of step {state.step}"):
        return save_checkpoint(
            setup.backend,
            run_dir,
            state.step,
            draft_config=setup.draft_config,
            contract=setup.contract,
            train_state=vars(state),
            keep_last=cfg.train.keep_last,
        )


def fit(
    cfg: RunConfig,
    setup: Setup,
    *,
    timer: StepTimer | None = None,
    stop_vote: Callable[[], bool] | None = None,
) -> dict[str, float]:
    """Train from the resume point to train.last_step, or until any rank is asked to stop (a stop
    signal, dflash2.faults): then every rank ends after the same step and the run checkpoints there.
    `timer`: how steps are timed (default: each step and its capture, dflash2.timing);
    benchmarks/pipeline.py passes one that times every region. `stop_vote`: this rank's vote in the
    stop decision (default: whether it received a stop signal)."""
    backend, run_dir = setup.backend, Path(cfg.output_dir)
    timer = timer or StepTimer(backend.device)
    state = TrainState()
    ckpt = resume_point(cfg.train.resume, run_dir)
    if ckpt is not None:
        state = TrainState(**load_checkpoint(backend, ckpt, contract=setup.contract))
        if backend.is_main:
            print(f"[dflash2] resumed from {ckpt} at step {state.step}")
    start_step = state.step
    logger = TrainLogger(run_dir, cfg, start_step=start_step, enabled=backend.is_main)
    t = cfg.train
    if backend.is_main:
        print(
            f"[dflash2] global batch {setup.contract['global_batch_size']} samples per step: micro-batch "
            f"{t.micro_batch_size} x {t.grad_accum_steps} accumulation steps x {backend.draft_world_size} ranks"
        )
    stream = micro_batches(
        len(setup.dataset),
        t.micro_batch_size,
        t.grad_accum_steps,
        cfg.seed,
        backend.rank,
        backend.draft_world_size,
        epoch=state.epoch,
        start_step=state.step_in_epoch,
    )
    summary: dict[str, float] = {}
    last_step = cfg.train.last_step
    saved, saved_step = ckpt, start_step
    while state.step < last_step:
        with collective_section(f"the stop vote before step {state.step + 1}"):
            if stop_request.agreed(backend, stop_vote() if stop_vote else None):
                stop_request.stopped = True
                break
        timer.start_step()
        micro, epochs = [], []
        for _ in range(cfg.train.grad_accum_steps):
            epoch, state.step_in_epoch, indices = next(stream)
            micro.append(indices)
            epochs.append(epoch)
        state.epoch = epoch
        with collective_section(f"training step {state.step + 1}"):
            sums, timing = train_step(setup, micro, epochs, cfg.seed, timer)
        state.step += 1
        summary = summarize_metrics(sums, cfg.objective.selector_loss_alpha)
        logger.log(state.step, summary, sums, timing, timer.step_seconds())
        if cfg.train.save_every and state.step % cfg.train.save_every == 0 and state.step < last_step:
            saved, saved_step = save(setup, cfg, run_dir, state), state.step
    timer.finish()
    if state.step > saved_step:  # nothing new to save when a stop came before this launch's first step
        saved = save(setup, cfg, run_dir, state)
    if cfg.train.export and state.step == cfg.train.max_steps:
        training_run = {"step": state.step, "chat_template_kwargs": dict(cfg.data.chat_template_kwargs)}
        export_final(setup, run_dir / "export", training_run)
    logger.close()
    if stop_request.stopped:  # the marker before any rank exits: srun may end the others at the first exit
        if backend.is_main:
            write_stop_marker(run_dir, state.step, saved)
        backend.barrier()
    if backend.is_main:
        print(end_message(state.step, cfg.train.max_steps, saved), flush=True)
    return summary


def end_message(step: int, max_steps: int, checkpoint: Path | None) -> str:
    if not stop_request.stopped:
        return f"[dflash2] done: step {step}, checkpoint {checkpoint}"
    asked = f"a {stop_request.describe()}" if stop_request.signal_name else "a signal to another rank"
    return (
        f"[dflash2] stopped on {asked} after step {step} of {max_steps}: checkpoint {checkpoint}; "
        "run the same command again to resume"
    )


def export_final(setup: Setup, out_dir: Path, training_run: dict) -> None:
    """The final export, recording the step and chat template arguments that evaluation defaults to."""
    with collective_section("the export's gather of the draft"):
        state = setup.backend.full_draft_state_dict()
    if setup.backend.is_main:
        export_draft(
            state, out_dir, config=setup.draft_config, tokenizer=setup.tokenizer, training_run=training_run
        )
        print(f"[dflash2] exported {out_dir}")
    setup.backend.barrier()
