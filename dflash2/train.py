"""Training: `build_*` functions, one `train_step`, and a short loop.

Every rank runs the same calls in the same order; rank 0 only guards file writes and logs.
`dflash2.run` picks the topology and calls `build_setup` and `fit`; the entry point is
`launch/train.py --config <yaml> [key=value ...]`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from dflash2.capture.features import FeatureSource, split_last_hidden, target_features
from dflash2.capture.offline import OfflineFeatures, feature_identity
from dflash2.checkpoint import (
    TrainState,
    check_resume,
    load_checkpoint,
    save_checkpoint,
    set_aside_later_checkpoints,
)
from dflash2.config import RunConfig, torch_dtype
from dflash2.data.loader import StepBatch, anchor_generators, check_one_global_batch, collate, step_batches
from dflash2.distributed import Backend
from dflash2.errors import ReportedError
from dflash2.export import export_draft
from dflash2.faults import (
    collective_section,
    enter_startup,
    enter_steps,
    stop_marker,
    stop_request,
    write_stop_marker,
)
from dflash2.hardware import warn_if_slow_bf16
from dflash2.models import TargetHead, build_draft
from dflash2.objective import ObjectiveConfig, compute_objective, plan_blocks, supervised_mask
from dflash2.run_plan import RunPlan
from dflash2.target.draft_init import init_from_target
from dflash2.target.head import load_target_head, loss_vocabulary, target_num_parameters
from dflash2.timing import StepTimer
from dflash2.train_log import TrainLogger


@dataclass
class Setup:
    """What the loop runs on: the run plan and what was built from it."""

    plan: RunPlan
    backend: Backend
    draft: nn.Module  # what backend.setup_draft returned: called like the draft
    draft_config: dict  # the draft's config as built (draft.config.to_dict()): draft_config.json
    head: TargetHead
    dataset: datasets.Dataset  # input_ids, loss_mask
    target: nn.Module | None = None  # None: features from disk or from capture ranks
    features: FeatureSource | None = None  # OfflineFeatures or the capture ranks' FeatureReceiver
    fitted: bool = False  # `fit` ran on it: its draft, optimizer and schedule are past the resume point
    stepped: bool = False  # `train_step` ran on it (by `fit` or by hand): the same

    @property
    def cfg(self) -> RunConfig:
        return self.plan.config

    @property
    def objective(self) -> ObjectiveConfig:
        return self.plan.objective

    @property
    def contract(self) -> dict:
        return self.plan.contract

    @property
    def layer_ids(self) -> list[int]:
        return self.plan.layer_ids

    @property
    def pad_token_id(self) -> int:
        return self.plan.pad_token_id

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.plan.tokenizer

    @property
    def selector(self) -> nn.Module | None:
        """The draft's candidate selector (DFlash 2), None for v1."""
        return getattr(self.backend.unwrap(self.draft), "candidate_selector", None)


# ------------------------------------------------------------------ build


def build_target(plan: RunPlan, backend: Backend, load_full: bool) -> tuple[nn.Module | None, TargetHead]:
    """The sharded frozen target and its head. When features come from elsewhere (disk, capture ranks)
    only the embedding and LM head are read from the target's safetensors: the target is never loaded."""
    cfg = plan.config
    dtype = torch_dtype(cfg.precision)
    target_dtype = cfg.target_torch_dtype
    if not load_full:
        total = target_num_parameters(cfg.model.target)
        print(f"[dflash2] rank {backend.rank}: holds 0/{total} target parameters (head only)", flush=True)
        head = load_target_head(cfg.model.target, target_dtype, backend.device, config=plan.target_config)
        return None, head.to(dtype)
    target = backend.load_target(cfg.model.target, target_dtype)
    local, total = backend.parameter_numel(target)
    print(f"[dflash2] rank {backend.rank}: holds {local}/{total} target parameters", flush=True)
    return target, backend.target_head(target, dtype)


def offline_features(plan: RunPlan) -> OfflineFeatures | None:
    """The features of data.features_dir, checked against this run; None: capture online."""
    cfg = plan.config
    if not cfg.data.features_dir:
        return None
    identity = feature_identity(cfg, plan.layer_ids, plan.identity)
    return OfflineFeatures(cfg.data.features_dir, identity, last_hidden=cfg.objective.needs_teacher)


def expect_type(value: object, expected: type, name: str, how: str) -> None:
    """A Python API argument of the wrong type, as one message naming where the right one comes from."""
    if not isinstance(value, expected):
        raise ValueError(f"{name} must be a {expected.__name__} ({how}), not {type(value).__name__}")


def build_setup(plan: RunPlan, backend: Backend, features: FeatureSource | None = None) -> Setup:
    """`features`: where the step gets features, when not from the config (the disaggregated
    trainers pass the capture ranks' receiver); None: as the config says, the offline features of
    data.features_dir when it is set, else the step runs the target itself (online capture).
    `backend` is built for the plan's batch layout (`LocalBackend.from_run_config(plan.config)`).
    Seeds torch's global RNG with the run's seed (the draft's initialisation), as a launch does."""
    expect_type(plan, RunPlan, "plan", "dflash2.resolve_run(cfg)")
    expect_type(backend, Backend, "backend", "LocalBackend.from_run_config(plan.config)")
    enter_startup()  # collectives wait DFLASH2_STARTUP_TIMEOUT_S until this rank's first step
    cfg = plan.config
    check_batch_layout(backend, cfg)
    if features is None:
        features = offline_features(plan)
    warn_if_slow_bf16(
        backend.device, torch_dtype(cfg.precision), cfg.target_torch_dtype, is_main=backend.is_main
    )
    torch.manual_seed(cfg.seed)
    draft = build_draft(plan.draft_source)
    draft_config = draft.config.to_dict()
    if plan.resume_from is not None:  # a refused resume stops here, before the target loads
        check_resume(plan.resume_from, plan.contract, (backend.rank, backend.world_size))
    elif cfg.model.init_from_target:
        summary = init_from_target(draft, cfg.model.target, plan.target_config, cfg.model.init_target_layers)
        if backend.is_main:
            print(f"[dflash2] {summary}", flush=True)
    dataset = plan.dataset(backend.is_main)
    t = cfg.train  # before the target loads and anything is written (fit's first step would find it)
    check_one_global_batch(len(dataset), t.micro_batch_size, t.grad_accum_steps, backend.draft_world_size)
    target, head = build_target(plan, backend, load_full=features is None)
    if isinstance(features, OfflineFeatures):
        features.check_samples(dataset)
    if cfg.objective.loss_vocab_size is not None:
        restrict_loss_vocab(head, dataset, plan.objective, backend.is_main)
    model = backend.setup_draft(draft, cfg.train, cfg.precision)
    enter_startup()  # again: the groups the backend made for the draft (DeepSpeed's) get it too
    return Setup(plan, backend, model, draft_config, head, dataset, target=target, features=features)


def check_batch_layout(backend: Backend, cfg: RunConfig) -> None:
    """The backend steps the optimizer after as many micro-batches of the size the run loads."""
    t = cfg.train
    built = (backend.micro_batch_size, backend.grad_accum_steps)
    if built != (t.micro_batch_size, t.grad_accum_steps):
        raise ValueError(
            f"the backend was built for micro-batch {built[0]} x {built[1]} accumulation steps on "
            f"{backend.draft_world_size} data-parallel rank(s), the plan is {t.micro_batch_size} x "
            f"{t.grad_accum_steps}: resolve the plan for the ranks the backend trains on "
            f"(dflash2.resolve_run(cfg, {backend.draft_world_size})) and build the backend from its config, "
            "e.g. dflash2.LocalBackend.from_run_config(plan.config)"
        )


def restrict_loss_vocab(head: TargetHead, dataset, objective: ObjectiveConfig, is_main: bool) -> None:
    """Restrict the loss to the objective.loss_vocab_size tokens most frequent among the dataset's
    supervised tokens (objective.supervised_tokens: the replies, or every token); every rank counts
    the whole dataset, so all agree; one line on rank 0."""
    size = objective.loss_vocab_size
    if size >= head.vocab_size:
        raise ValueError(
            f"objective.loss_vocab_size={size} is not below the target's vocabulary ({head.vocab_size}); "
            "set a smaller one, or null for the whole vocabulary"
        )
    every_token = objective.supervised_tokens == "all"
    labels = [
        torch.tensor(ids) if every_token else torch.tensor(ids)[torch.tensor(mask) > 0]
        for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"])
    ]
    ids = loss_vocabulary(labels, head.vocab_size, size)
    if len(ids) < objective.top_k:
        raise ValueError(
            f"the training labels hold only {len(ids)} distinct tokens, fewer than the objective's top-k "
            f"({objective.top_k}); set objective.loss_vocab_size=null"
        )
    head.restrict_loss_vocab(ids)
    if is_main:
        supervised = torch.cat(labels)
        covered = torch.isin(supervised, ids).float().mean().item()
        print(
            f"[dflash2] loss vocabulary: the {len(ids)} most frequent of {head.vocab_size} tokens, "
            f"{100 * covered:.2f}% of the {len(supervised)} supervised tokens",
            flush=True,
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


def train_step(setup: Setup, step: StepBatch, timer: StepTimer) -> tuple[dict, dict]:
    """One optimizer step over its `grad_accum_steps` micro-batches. Returns (metric sums reduced over
    ranks, timings). The loss is normalised by the global weight sum of the whole step. `timer` has
    started the step (`timer.start_step()`); its regions are free unless timed (dflash2.timing).
    `step` is one item of `dflash2.data.loader.step_batches`, as `fit` draws them."""
    expect_type(setup, Setup, "setup", "dflash2.build_setup(plan, backend)")
    if not timer.started:  # checked before anything moves: the end of the step reads the timer
        raise ValueError(
            "start the timer's step first: timer.start_step(), then train_step(setup, step, timer)"
        )
    micro = getattr(step, "micro", None)
    if not isinstance(micro, list) or len(micro) != setup.backend.grad_accum_steps:
        got = f"{len(micro)} micro-batches" if isinstance(micro, list) else type(step).__name__
        raise ValueError(
            f"train_step takes one optimizer step of {setup.backend.grad_accum_steps} micro-batches, got "
            f"{got}: draw steps from dflash2.data.loader.step_batches with the run's "
            "train.micro_batch_size and train.grad_accum_steps (as fit does)"
        )
    setup.stepped = True
    backend, seed = setup.backend, setup.cfg.seed
    batches = [load_batch(setup, idx) for idx in step.micro]
    plans = [
        plan_blocks(
            b["input_ids"],
            supervised_mask(b, setup.objective),
            setup.objective,
            anchor_generators(seed, step.epoch, idx),
            setup.head.loss_vocab,
        )
        for b, idx in zip(batches, step.micro)
    ]
    global_weight = backend.all_reduce_sum(sum(p.weights.sum() for p in plans).to(backend.device))
    sums: dict[str, torch.Tensor] = {}
    selector = setup.selector
    for batch, indices, plan in zip(batches, step.micro, plans):
        with torch.no_grad(), timer.region("capture"):
            add_features(setup, batch, capture_features(setup, batch, indices))
        with timer.region("objective"):
            out = compute_objective(
                setup.draft, setup.head, batch, setup.objective, blocks=plan, selector=selector
            )
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


def save(setup: Setup, state: TrainState) -> Path:
    with collective_section(f"saving the checkpoint of step {state.step}"):
        return save_checkpoint(
            setup.backend,
            setup.plan.run_dir,
            state.step,
            draft_config=setup.draft_config,
            contract=setup.contract,
            train_state=vars(state),
            keep_last=setup.cfg.train.keep_last,
        )


def flushing_subnormals() -> bool:
    """Whether this process's CPU now flushes subnormal floats to zero (torch has no getter)."""
    return (torch.tensor([1e-39], dtype=torch.float32) * 1.0).item() == 0.0


@contextmanager
def subnormals_flushed(device: torch.device) -> Iterator[None]:
    """On a CPU, flush subnormal floats (below 1.2e-38 in fp32) to zero inside the block.

    The softmax tails of the chunked loss and the gradients they make are full of them, and a CPU
    computes on a subnormal dozens of times slower: flushing them took 15% off a SmolLM2 DFlash 2
    step (docs/training.md, "bf16 on a CPU"). Values that small change no loss and no update in a visible digit.
    The flag is per process and restored afterwards to what it was. A GPU is left as it is."""
    if device.type != "cpu":
        yield
        return
    before = flushing_subnormals()
    if not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(before)


def fit(
    setup: Setup, *, timer: StepTimer | None = None, stop_vote: Callable[[], bool] | None = None
) -> dict[str, float]:
    """Train from the resume point to train.last_step, or until any rank is asked to stop (a stop
    signal, dflash2.faults): then every rank ends after the same step and the run checkpoints there.
    `timer`: how steps are timed (default: each step and its capture, dflash2.timing);
    benchmarks/pipeline.py passes one that times every region. `stop_vote`: this rank's vote in the
    stop decision (default: whether it received a stop signal). On a CPU the steps run with
    subnormals flushed to zero (`subnormals_flushed`).

    Returns the last step's metrics (`loss`, `insample_accept_len`, ...), or `{}` when the run had
    no step left to take (it had reached train.max_steps). A Setup is fitted once: to go on, build
    another from `resolve_run` (train.resume=auto continues from the checkpoint this one wrote)."""
    expect_type(setup, Setup, "setup", "dflash2.build_setup(plan, backend)")
    if setup.fitted or setup.stepped:
        done = "was fitted already" if setup.fitted else "took steps with train_step"
        raise ValueError(
            f"this Setup {done}: its draft, optimizer and schedule are past its resume point, and fit "
            "counts its steps from there. Call dflash2.resolve_run and dflash2.build_setup again "
            "(train.resume=auto continues from the latest checkpoint)"
        )
    setup.fitted = True
    with subnormals_flushed(setup.backend.device):
        return _fit(setup, timer, stop_vote)


def _fit(setup: Setup, timer: StepTimer | None, stop_vote: Callable[[], bool] | None) -> dict[str, float]:
    backend, t = setup.backend, setup.cfg.train
    timer = timer or StepTimer(backend.device)
    stop_request.stopped = False  # an earlier fit's in this process
    if backend.is_main:  # an earlier launch's stop, now being resumed: a marker says this launch's only
        stop_marker(setup.plan.run_dir).unlink(missing_ok=True)
    state = _resume(setup)
    start = state.step
    if start > t.last_step and backend.is_main:  # at it exactly: the run is done, and says so at its end
        limit = "train.stop_at_step" if t.last_step < t.max_steps else "train.max_steps"
        print(
            f"[dflash2] the checkpoint is at step {start}, past {limit}={t.last_step}: no step to train",
            flush=True,
        )
    with collective_section("setting aside the checkpoints of steps after this launch's start"):
        set_aside_later_checkpoints(backend, setup.plan.run_dir, start)  # as the logs below trim theirs
    logger = TrainLogger(setup.plan.run_dir, t, start_step=start, enabled=backend.is_main)
    try:
        summary, saved, saved_step = _loop(setup, state, logger, timer, stop_vote)
    except BaseException:
        logger.close()  # what was logged reaches the disk
        raise
    if state.step > saved_step:  # nothing new to save when a stop came before this launch's first step
        saved = save(setup, state)
    _finish(setup, state, saved, logger, start)
    return summary


def _loop(
    setup: Setup,
    state: TrainState,
    logger: TrainLogger,
    timer: StepTimer,
    stop_vote: Callable[[], bool] | None,
) -> tuple[dict[str, float], Path | None, int]:
    """The steps from `state` to train.last_step, or to a stop every rank agreed on, with the periodic
    checkpoints; returns the last step's metrics, the latest checkpoint and its step."""
    backend, t = setup.backend, setup.cfg.train
    order = (len(setup.dataset), t.micro_batch_size, t.grad_accum_steps, setup.cfg.seed, backend.rank)
    steps = step_batches(*order, backend.draft_world_size, epoch=state.epoch, start_step=state.step_in_epoch)
    summary: dict[str, float] = {}
    saved, saved_step = setup.plan.resume_from, state.step
    while state.step < t.last_step:
        with collective_section(f"the stop vote before step {state.step + 1}"):
            if stop_request.agreed(backend, stop_vote() if stop_vote else None):
                stop_request.stopped = True
                break
        timer.start_step()
        step = next(steps)
        state.epoch, state.step_in_epoch = step.epoch, step.step_in_epoch
        with collective_section(f"training step {state.step + 1}"):
            sums, timing = train_step(setup, step, timer)
        enter_steps()  # from this rank's first step on, collectives wait DFLASH2_DIST_TIMEOUT_S
        state.step += 1
        summary = setup.objective.summarize(sums)
        logger.log(state.step, summary, sums, timing, timer.step_seconds())
        check_finite(state.step, summary, timing, saved)
        if t.save_every and state.step % t.save_every == 0 and state.step < t.last_step:
            saved, saved_step = save(setup, state), state.step
    timer.finish()
    return summary, saved, saved_step


def check_finite(step: int, summary: dict[str, float], timing: dict, saved: Path | None) -> None:
    """Stop a run whose loss or gradient went non-finite, naming the step and the terms (the same on
    every rank: the values are reduced over ranks); its weights are not checkpointed."""
    values = {"loss": summary["loss"], "base_loss": summary["base_loss"], "grad_norm": timing["grad_norm"]}
    if summary.get("selector_weight_fraction", 0) > 0:  # NaN by definition over no selector slot
        values["selector_loss"] = summary["selector_loss"]
    bad = {name: value for name, value in values.items() if not math.isfinite(value)}
    if bad:
        terms = ", ".join(f"{name} {value}" for name, value in bad.items())
        lower = (
            f"resume from the latest checkpoint ({saved}) with more train.warmup_steps (the new schedule "
            "applies from the resumed step; a resume keeps the checkpoint's train.lr), or start again "
            "(train.resume=none) with a lower train.lr"
            if saved
            else "start again with a lower train.lr or more train.warmup_steps"
        )
        raise ReportedError(
            f"training diverged at step {step}: {terms}. Its update is not checkpointed; {lower}"
        )


def _resume(setup: Setup) -> TrainState:
    """The train state to start from: the resume point's (its backend state restored), or a fresh one."""
    backend, ckpt = setup.backend, setup.plan.resume_from
    state = TrainState()
    if ckpt is not None:
        state = TrainState(**load_checkpoint(backend, ckpt, contract=setup.contract))
        if backend.is_main:
            print(f"[dflash2] resumed from {ckpt} at step {state.step}")
    if backend.is_main:
        t = setup.cfg.train
        print(
            f"[dflash2] global batch {setup.contract['global_batch_size']} samples per step: micro-batch "
            f"{t.micro_batch_size} x {t.grad_accum_steps} accumulation steps x {backend.draft_world_size} ranks"
        )
    return state


def _finish(setup: Setup, state: TrainState, saved: Path | None, logger: TrainLogger, start: int) -> None:
    """After the last step and its checkpoint: the final export, the stop marker of a stopped run,
    the end message."""
    cfg, backend = setup.cfg, setup.backend
    if cfg.train.export and state.step == cfg.train.max_steps:
        training_run = {"step": state.step, "chat_template_kwargs": dict(cfg.data.chat_template_kwargs)}
        export_final(setup, setup.plan.run_dir / "export", training_run)
    logger.close()
    report_end(backend, setup.plan.run_dir, state.step, cfg.train.max_steps, saved, start)


def report_end(
    backend: Backend, run_dir: Path, step: int, max_steps: int, saved: Path | None, start: int
) -> None:
    """The end of a launch that started at step `start` on the console and, after a stop, the stop
    marker (dflash2.faults) that every rank waits for: srun may end the other ranks as soon as one
    has exited."""
    if stop_request.stopped:
        if backend.is_main:
            write_stop_marker(run_dir, step, saved, start)
        backend.barrier()
    if backend.is_main:
        print(end_message(step, max_steps, saved), flush=True)
    stop_request.served()  # a later fit in this process does not stop on it


def end_message(step: int, max_steps: int, checkpoint: Path | None) -> str:
    if not stop_request.stopped:
        return f"[dflash2] done: step {step}, checkpoint {checkpoint}"
    asked = ("a " if stop_request.signal_name else "") + stop_request.describe()
    if checkpoint is None:  # stopped before this run's first step
        return (
            f"[dflash2] stopped on {asked} after step {step} of {max_steps}: no checkpoint yet; "
            "run the same command again to start"
        )
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


if __name__ == "__main__":  # python -m dflash2.train: a newcomer's guess at the training command
    from dflash2.errors import not_a_command

    not_a_command("dflash2.train")
