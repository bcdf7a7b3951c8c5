"""Collation and a deterministic, resumable data-parallel sample order.

Order: every epoch is a permutation of the sample indices that depends only on (seed, epoch)
(`epoch_order`). The permutation is cut into global batches of one optimizer step each,
`world_size * grad_accum_steps * batch_size` samples; an incomplete last one is dropped, so every
rank runs the same number of steps and no step spans two epochs. Micro-step j of a step takes the
j-th slice of `world_size * batch_size` samples of its global batch, and rank r the r-th slice of
`batch_size` samples of that (`rank_batches`). Which samples a step trains on depends only on the
global batch size, not on how it is split into ranks and micro-steps, so a run can resume on another
number of ranks; resuming at step `start_step` of an epoch yields exactly the batches an
uninterrupted run would have yielded from there, so a checkpoint only needs (epoch, step in epoch).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch


def pad_token_id_of(tokenizer) -> int:
    """The tokenizer's pad id; 0 when it has none (padding positions are masked out anyway)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def collate(samples: Sequence[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad samples with `input_ids` and `loss_mask` lists into [b, S] long tensors.

    Returns `input_ids`, `loss_mask` and `attention_mask`; padding has loss_mask 0 and
    attention_mask 0.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    length = max(len(sample["input_ids"]) for sample in samples)
    input_ids = torch.full((len(samples), length), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(samples), length), dtype=torch.long)
    attention_mask = torch.zeros((len(samples), length), dtype=torch.long)
    for row, sample in enumerate(samples):
        num_tokens = len(sample["input_ids"])
        if len(sample["loss_mask"]) != num_tokens:
            raise ValueError(
                f"sample {row}: loss_mask has {len(sample['loss_mask'])} entries for {num_tokens} tokens"
            )
        input_ids[row, :num_tokens] = torch.as_tensor(sample["input_ids"], dtype=torch.long)
        loss_mask[row, :num_tokens] = torch.as_tensor(sample["loss_mask"], dtype=torch.long)
        attention_mask[row, :num_tokens] = 1
    return {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask}


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """A permutation of range(num_samples) that depends only on (seed, epoch)."""
    if num_samples < 0 or seed < 0 or epoch < 0:
        raise ValueError(f"num_samples, seed and epoch must be >= 0, got {num_samples}, {seed}, {epoch}")
    return np.random.default_rng([seed, epoch]).permutation(num_samples).tolist()


def num_steps_per_epoch(num_samples: int, global_batch_size: int) -> int:
    """Full global batches (optimizer steps) per epoch; the incomplete last one is dropped."""
    return num_samples // global_batch_size


def rank_batches(
    order: Sequence[int],
    batch_size: int,
    rank: int,
    world_size: int,
    grad_accum_steps: int = 1,
    start_step: int = 0,
) -> Iterator[list[int]]:
    """Yield this rank's micro-batches of sample indices, `grad_accum_steps` per optimizer step, for
    steps start_step, start_step + 1, ... of the epoch.

    Step k's global batch is `order[k*S : (k+1)*S]` with S = world_size * grad_accum_steps *
    batch_size; its micro-step j is `[j*G : (j+1)*G]` of that with G = world_size * batch_size, and
    rank r takes `[r*batch_size : (r+1)*batch_size]` of the micro-step.
    """
    if batch_size < 1 or world_size < 1 or grad_accum_steps < 1:
        raise ValueError(
            f"batch_size, world_size and grad_accum_steps must be >= 1, got {batch_size}, {world_size} "
            f"and {grad_accum_steps}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    micro_size = world_size * batch_size
    num_steps = num_steps_per_epoch(len(order), micro_size * grad_accum_steps)
    if not 0 <= start_step <= num_steps:
        raise ValueError(f"start_step must be in [0, {num_steps}] for this epoch, got {start_step}")
    first_micro = start_step * grad_accum_steps
    for micro in range(first_micro, num_steps * grad_accum_steps):
        first = micro * micro_size + rank * batch_size
        yield list(order[first : first + batch_size])


def micro_batches(
    num_samples: int,
    batch_size: int,
    grad_accum_steps: int,
    seed: int,
    rank: int,
    num_ranks: int,
    *,
    epoch: int = 0,
    start_step: int = 0,
) -> Iterator[tuple[int, int, list[int]]]:
    """Data-parallel rank `rank`'s micro-batches in the deterministic order, endlessly, from
    optimizer step `start_step` of `epoch` on (a checkpoint's data position). Yields (epoch, steps
    of the epoch done once this micro-batch's step is, sample indices)."""
    check_one_global_batch(num_samples, batch_size, grad_accum_steps, num_ranks)
    while True:
        order = epoch_order(num_samples, seed, epoch)
        batches = rank_batches(order, batch_size, rank, num_ranks, grad_accum_steps, start_step)
        for micro, indices in enumerate(batches):
            yield epoch, start_step + micro // grad_accum_steps + 1, indices
        epoch, start_step = epoch + 1, 0


@dataclass(frozen=True)
class StepBatch:
    """One optimizer step of a rank: its epoch, the steps of that epoch done once it is, and the
    sample indices of each of its `grad_accum_steps` micro-batches."""

    epoch: int
    step_in_epoch: int
    micro: list[list[int]]


def check_one_global_batch(num_samples: int, batch_size: int, grad_accum_steps: int, num_ranks: int) -> None:
    """A step draws one global batch of distinct samples: the dataset must hold one."""
    global_batch = batch_size * grad_accum_steps * num_ranks
    if num_samples < global_batch:
        raise ValueError(
            f"the dataset has {num_samples} samples, fewer than one global batch (micro_batch_size "
            f"{batch_size} x grad_accum_steps {grad_accum_steps} x {num_ranks} ranks): give more data, or "
            "a smaller train.micro_batch_size or train.global_batch_size"
        )


def step_batches(
    num_samples: int,
    batch_size: int,
    grad_accum_steps: int,
    seed: int,
    rank: int,
    num_ranks: int,
    *,
    epoch: int = 0,
    start_step: int = 0,
) -> Iterator[StepBatch]:
    """Rank `rank`'s optimizer steps in the deterministic order, endlessly, from step `start_step` of
    `epoch` on: `micro_batches` grouped by step (no step spans two epochs). The one step order of the
    loop, the capture ranks and the pipeline benchmark."""
    stream = micro_batches(
        num_samples, batch_size, grad_accum_steps, seed, rank, num_ranks, epoch=epoch, start_step=start_step
    )
    while True:
        micro = [next(stream) for _ in range(grad_accum_steps)]
        yield StepBatch(micro[-1][0], micro[-1][1], [indices for _, _, indices in micro])


def anchor_generators(seed: int, epoch: int, indices: list[int]) -> list[torch.Generator]:
    """One generator per sample, from (seed, epoch, sample index): a sample's anchors do not depend
    on the number of ranks or on resuming, so runs of any layout see the same blocks."""
    states = [np.random.SeedSequence([seed, epoch, i]).generate_state(1)[0] for i in indices]
    return [torch.Generator().manual_seed(int(s)) for s in states]
