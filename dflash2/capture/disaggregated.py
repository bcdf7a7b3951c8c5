"""Disaggregated topology: capture ranks run the target, trainer ranks train the draft.

Ranks [0, N) (N = capture_ranks) hold the frozen target, sharded among themselves, and run its
forward; ranks [N, world) hold the draft, sharded among themselves, plus the target's embedding and
LM head read from its safetensors (never the whole target). Trainer t (its data-parallel rank
among the trainers) is served by capture rank t % N. Capture ranks walk the trainers' own
deterministic data order, from the trainers' checkpointed data position, and send each micro-batch's
features point-to-point: a header [b, S, D, dtype, sample indices...] then the features as bytes.
Up to PREFETCH_DEPTH batches per trainer are in flight, so capture of step n+1 overlaps training of
step n; a trainer checks that the samples it receives are the ones it is about to train on.

Failure: torchrun tears down every worker when one fails; without it, the process groups made here
time out after DFLASH2_DIST_TIMEOUT_S seconds (default 1800), so a dead peer stops the job, never
hangs it.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections import deque
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dflash2.capture.features import extract_features
from dflash2.config import RunConfig, save_run_config
from dflash2.data.loader import collate, pad_token_id_of
from dflash2.distributed import build_backend, init_distributed
from dflash2.distributed.base import local_parameter_numel

PREFETCH_DEPTH = 2
TIMEOUT_ENV = "DFLASH2_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800
# Test hook: "<global rank>:<n>" makes that trainer fail when it asks for its n-th micro-batch.
INJECT_FAILURE_ENV = "DFLASH2_INJECT_FAILURE"
HEADER_FIELDS = 4  # b, S, D (feature bytes per position), dtype code; then b sample indices
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def check_disaggregated(cfg: RunConfig, world_size: int | None = None) -> None:
    """Refuse what this topology cannot run (before any process group starts when world_size is None)."""
    if cfg.backend != "fsdp":
        raise ValueError(
            f"topology=disaggregated needs backend=fsdp (got backend={cfg.backend}): the target is sharded over the "
            "capture ranks only and the draft over the trainer ranks only, and the deepspeed backend partitions "
            "over the whole world (zero.Init and deepspeed.initialize take no sub-group here); set backend=fsdp"
        )
    if world_size is not None and not 1 <= cfg.capture_ranks < world_size:
        raise ValueError(
            f"capture_ranks={cfg.capture_ranks} must be in [1, {world_size - 1}] for {world_size} processes: "
            "at least one capture rank and one trainer rank (launch more processes or lower capture_ranks)"
        )


def capture_schedule(num_capture: int, num_trainers: int) -> list[list[int | None]]:
    """rounds[j][c]: the trainer capture rank c serves in sub-round j of every micro-batch, or None
    (a padding forward: the sharded target's forward is collective, so all capture ranks run it)."""
    num_rounds = math.ceil(num_trainers / num_capture)
    return [
        [t if (t := j * num_capture + c) < num_trainers else None for c in range(num_capture)]
        for j in range(num_rounds)
    ]


def _timeout() -> timedelta:
    seconds = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    if seconds <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={seconds} must be > 0 (seconds)")
    return timedelta(seconds=seconds)


# ------------------------------------------------------------------ transfer


class FeatureSender:
    """Capture side: non-blocking sends, at most `depth` micro-batches in flight per trainer."""

    def __init__(self, group: dist.ProcessGroup, header_size: int, device: torch.device, depth: int) -> None:
        self.group, self.header_size, self.device, self.depth = group, header_size, device, depth
        self.in_flight: dict[int, deque] = {}

    def _send(self, dst: int, header: list[int], payload: torch.Tensor | None) -> None:
        pending = self.in_flight.setdefault(dst, deque())
        while len(pending) >= self.depth:
            for work in pending.popleft()[0]:
                work.wait()
        header_t = torch.full((self.header_size,), -1, dtype=torch.long, device=self.device)
        header_t[: len(header)] = torch.tensor(header, dtype=torch.long)
        works = [dist.isend(header_t, dst, group=self.group)]
        if payload is not None:
            works.append(dist.isend(payload, dst, group=self.group))
        pending.append((works, header_t, payload))  # tensors stay alive until their send completes

    def send(self, dst: int, indices: list[int], features: torch.Tensor) -> None:
        """features [b, S, K*H] for samples `indices`, sent as raw bytes (any dtype over any backend)."""
        payload = features.contiguous().view(torch.uint8)  # [b, S, K*H * itemsize]
        b, seq_len, num_bytes = payload.shape
        self._send(dst, [b, seq_len, num_bytes, DTYPE_CODES[features.dtype], *indices], payload)

    def close(self) -> None:
        """An end marker (b = 0) to every trainer, then wait for everything to be delivered."""
        for dst in list(self.in_flight):
            self._send(dst, [0, 0, 0, 0], None)
        for pending in self.in_flight.values():
            for works, *_ in pending:
                for work in works:
                    work.wait()


class FeatureReceiver:
    """Trainer side: a thread receives features from capture rank `src` into a bounded queue
    (the prefetch); `batch(indices, seq_len)` is the same call as OfflineFeatures.batch."""

    def __init__(
        self, src: int, group: dist.ProcessGroup, header_size: int, device: torch.device, depth: int
    ) -> None:
        self.src, self.group, self.header_size, self.device = src, group, header_size, device
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.num_served = 0
        self.fail_at = _injected_failure()
        self.thread = threading.Thread(target=self._receive_all, name="feature-receiver", daemon=True)
        self.thread.start()

    def _receive_all(self) -> None:
        try:
            while True:
                header = torch.empty(self.header_size, dtype=torch.long, device=self.device)
                dist.recv(header, self.src, group=self.group)
                b, seq_len, num_bytes, code = header[:HEADER_FIELDS].tolist()
                if b == 0:
                    self.queue.put(None)
                    return
                payload = torch.empty(b, seq_len, num_bytes, dtype=torch.uint8, device=self.device)
                dist.recv(payload, self.src, group=self.group)
                indices = header[HEADER_FIELDS : HEADER_FIELDS + b].tolist()
                self.queue.put((indices, payload.view(CODE_DTYPES[code])))
        except Exception as error:  # handed to the training thread, which raises it
            self.queue.put(error)

    def batch(self, indices: list[int], seq_len: int) -> torch.Tensor:
        self.num_served += 1
        if self.fail_at == self.num_served:
            raise RuntimeError(f"injected failure ({INJECT_FAILURE_ENV}) at micro-batch {self.num_served}")
        item = self.queue.get()
        if isinstance(item, Exception):
            raise RuntimeError(f"receiving features from capture rank {self.src} failed: {item}") from item
        if item is None:
            raise RuntimeError(
                f"capture rank {self.src} has no more features for micro-batch {self.num_served}"
            )
        received, features = item
        if received != list(indices) or features.shape[1] != seq_len:
            raise RuntimeError(
                f"micro-batch {self.num_served}: capture rank {self.src} sent samples {received} "
                f"({features.shape[1]} positions), this trainer expects {list(indices)} ({seq_len}); "
                "capture and trainer ranks disagree on the data order"
            )
        return features


def _injected_failure() -> int | None:
    spec = os.environ.get(INJECT_FAILURE_ENV)
    if not spec:
        return None
    rank, micro_batch = spec.split(":")
    return int(micro_batch) if int(rank) == dist.get_rank() else None


# ------------------------------------------------------------------ the two roles


def _num_micro_batches(cfg: RunConfig, start_step: int) -> int:
    """What fit() will consume from `start_step` on."""
    last_step = min(cfg.train.max_steps, cfg.train.stop_at_step or cfg.train.max_steps)
    return max(0, last_step - start_step) * cfg.train.grad_accum_steps


@torch.no_grad()
def run_capture_rank(
    cfg: RunConfig, capture_group: dist.ProcessGroup, transfer_group: dist.ProcessGroup
) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from dflash2.capture.offline import draft_layer_ids
    from dflash2.checkpoint import read_train_state, resume_point
    from dflash2.data.loader import micro_batches
    from dflash2.data.prepare import build_dataset

    num_capture, num_trainers = cfg.capture_ranks, dist.get_world_size() - cfg.capture_ranks
    train = cfg.train
    backend = _group_backend(cfg, capture_group)
    layer_ids = draft_layer_ids(cfg, AutoConfig.from_pretrained(cfg.model.target))
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.target)
    pad_id = pad_token_id_of(tokenizer)
    dataset = build_dataset(cfg.data, tokenizer, is_main=False)
    target = backend.load_target(cfg.model.target, cfg.target_torch_dtype)
    local, total = local_parameter_numel(target)
    print(f"[dflash2] capture rank {backend.rank}: holds {local}/{total} target parameters", flush=True)

    state = read_train_state(resume_point(train.resume, Path(cfg.output_dir)))
    rounds = capture_schedule(num_capture, num_trainers)
    mine = [t for row in rounds if (t := row[backend.rank]) is not None]
    streams = {
        t: micro_batches(
            len(dataset),
            train.micro_batch_size,
            cfg.seed,
            t,
            num_trainers,
            epoch=state.epoch,
            start_batch=state.batch_in_epoch,
        )
        for t in mine
    }
    sender = FeatureSender(
        transfer_group, HEADER_FIELDS + train.micro_batch_size, backend.device, PREFETCH_DEPTH
    )
    for _ in range(_num_micro_batches(cfg, state.step)):
        for row in rounds:
            trainer = row[backend.rank]
            indices = next(streams[trainer])[2] if trainer is not None else []
            samples = [dataset[i] for i in indices] or [{"input_ids": [pad_id], "loss_mask": [0]}]
            batch = collate(samples, pad_id)
            hidden = backend.target_hidden_states(target, batch["input_ids"], batch["attention_mask"])
            if trainer is not None:
                sender.send(num_capture + trainer, indices, extract_features(hidden, layer_ids))
    sender.close()


def run_trainer_rank(
    cfg: RunConfig, trainer_group: dist.ProcessGroup, transfer_group: dist.ProcessGroup
) -> dict:
    from dflash2.train import build_setup, fit

    train = cfg.train
    backend = _group_backend(cfg, trainer_group)
    if backend.is_main:
        save_run_config(cfg, Path(cfg.output_dir) / "config.yaml")
    source = backend.rank % cfg.capture_ranks  # trainer t is served by capture rank t % N
    receiver = FeatureReceiver(
        source, transfer_group, HEADER_FIELDS + train.micro_batch_size, backend.device, PREFETCH_DEPTH
    )
    summary = fit(cfg, build_setup(cfg, backend, features=receiver))
    receiver.thread.join()  # it ends on the capture rank's end marker
    return summary


def _group_backend(cfg: RunConfig, group: dist.ProcessGroup):
    """A backend whose target and draft are both sharded over one role's group (capture or trainers)."""
    train = cfg.train
    return build_backend(
        cfg.backend,
        None,
        train.micro_batch_size,
        train.grad_accum_steps,
        target_group=group,
        draft_group=group,
    )


def run_disaggregated(cfg: RunConfig) -> dict[str, float]:
    """Entry point for topology=disaggregated (every rank calls it); returns the trainers' last metrics
    ({} on capture ranks)."""
    check_disaggregated(cfg)
    init_distributed(cfg.backend)
    check_disaggregated(cfg, dist.get_world_size())
    num_capture, world_size, timeout = cfg.capture_ranks, dist.get_world_size(), _timeout()
    # every rank creates every group, in the same order
    capture_group = dist.new_group(list(range(num_capture)), timeout=timeout)
    trainer_group = dist.new_group(list(range(num_capture, world_size)), timeout=timeout)
    transfer_group = dist.new_group(list(range(world_size)), timeout=timeout)
    t0 = time.perf_counter()
    if dist.get_rank() < num_capture:
        run_capture_rank(cfg, capture_group, transfer_group)
        summary = {}
    else:
        summary = run_trainer_rank(cfg, trainer_group, transfer_group)
    dist.barrier(group=transfer_group)  # the job ends together (capture ranks may host the store)
    if dist.get_rank() == 0:
        print(f"[dflash2] disaggregated run done in {time.perf_counter() - t0:.1f} s", flush=True)
    return summary
