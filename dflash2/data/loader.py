"""Collation and a deterministic, resumable data-parallel sample order.

Order: every epoch is a permutation of the sample indices that depends only on (seed, epoch)
(`epoch_order`). The permutation is cut into global batches of `world_size * batch_size` samples;
rank r takes the r-th slice of `batch_size` samples of each global batch (`rank_batches`). An
incomplete last global batch is dropped, so every rank runs the same number of steps. Resuming at
global batch `start_batch` of an epoch yields exactly the batches an uninterrupted run would
have yielded from there, so a checkpoint only needs (epoch, next batch index).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

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


def num_global_batches(num_samples: int, batch_size: int, world_size: int) -> int:
    """Full global batches per epoch (the incomplete last one is dropped)."""
    return num_samples // (batch_size * world_size)


def rank_batches(
    order: Sequence[int], batch_size: int, rank: int, world_size: int, start_batch: int = 0
) -> Iterator[list[int]]:
    """Yield this rank's sample indices for global batches start_batch, start_batch + 1, ...

    Global batch i is `order[i*G : (i+1)*G]` with G = world_size * batch_size; rank r takes
    `[r*batch_size : (r+1)*batch_size]` of it.
    """
    if batch_size < 1 or world_size < 1:
        raise ValueError(f"batch_size and world_size must be >= 1, got {batch_size} and {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    num_batches = num_global_batches(len(order), batch_size, world_size)
    if not 0 <= start_batch <= num_batches:
        raise ValueError(f"start_batch must be in [0, {num_batches}] for this epoch, got {start_batch}")
    global_size = world_size * batch_size
    for batch in range(start_batch, num_batches):
        first = batch * global_size + rank * batch_size
        yield list(order[first : first + batch_size])


def micro_batches(
    num_samples: int,
    batch_size: int,
    seed: int,
    rank: int,
    num_ranks: int,
    *,
    epoch: int = 0,
    start_batch: int = 0,
) -> Iterator[tuple[int, int, list[int]]]:
    """Data-parallel rank `rank`'s micro-batches in the deterministic order, endlessly, from global
    batch `start_batch` of `epoch` on (a checkpoint's data position). Yields (epoch, position after
    this batch, sample indices)."""
    per_global = batch_size * num_ranks
    if num_samples < per_global:
        raise ValueError(
            f"the dataset has {num_samples} samples, fewer than one global micro-batch "
            f"(micro_batch_size {batch_size} x {num_ranks} ranks)"
        )
    while True:
        order = epoch_order(num_samples, seed, epoch)
        batches = rank_batches(order, batch_size, rank, num_ranks, start_batch=start_batch)
        for position, indices in enumerate(batches, start=start_batch + 1):
            yield epoch, position, indices
        epoch, start_batch = epoch + 1, 0


def anchor_generators(seed: int, epoch: int, indices: list[int]) -> list[torch.Generator]:
    """One generator per sample, from (seed, epoch, sample index): a sample's anchors do not depend
    on the number of ranks or on resuming, so runs of any layout see the same blocks."""
    states = [np.random.SeedSequence([seed, epoch, i]).generate_state(1)[0] for i in indices]
    return [torch.Generator().manual_seed(int(s)) for s in states]
