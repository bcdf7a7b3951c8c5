"""collate, epoch_order and rank_batches against slow reference loops."""

from __future__ import annotations

import pytest
import torch

from dflash2.data.loader import collate, epoch_order, rank_batches


def test_collate_right_pads_against_a_python_loop():
    samples = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
        {"input_ids": [9], "loss_mask": [1]},
        {"input_ids": [1, 2, 3, 4, 8], "loss_mask": [0, 0, 1, 1, 1]},
    ]
    batch = collate(samples, pad_token_id=0)
    for key in ("input_ids", "loss_mask", "attention_mask"):
        assert batch[key].dtype == torch.long and batch[key].shape == (3, 5)
    for row, sample in enumerate(samples):
        for position in range(5):
            inside = position < len(sample["input_ids"])
            assert batch["input_ids"][row, position] == (sample["input_ids"][position] if inside else 0)
            assert batch["loss_mask"][row, position] == (sample["loss_mask"][position] if inside else 0)
            assert batch["attention_mask"][row, position] == int(inside)


def test_collate_rejects_mismatched_mask():
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 tokens"):
        collate([{"input_ids": [1, 2], "loss_mask": [1]}], pad_token_id=0)


def test_epoch_order_is_a_permutation_fixed_by_seed_and_epoch():
    order = epoch_order(103, seed=7, epoch=2)
    assert sorted(order) == list(range(103))
    assert order == epoch_order(103, seed=7, epoch=2)
    assert order != epoch_order(103, seed=7, epoch=3)
    assert order != epoch_order(103, seed=8, epoch=2)
    assert order != list(range(103))


def _reference_batches(order, batch_size, world_size, grad_accum_steps=1):
    """Per optimizer step, per micro-step, per rank: consecutive chunks of batch_size, as long as a
    whole step's worth is left."""
    step_size = batch_size * world_size * grad_accum_steps
    steps = []
    while len(order) >= step_size:
        step, order = order[:step_size], order[step_size:]
        chunks = [step[i : i + batch_size] for i in range(0, step_size, batch_size)]
        steps.append([chunks[j * world_size : (j + 1) * world_size] for j in range(grad_accum_steps)])
    return steps


@pytest.mark.parametrize(
    "num_samples,batch_size,world_size,accum",
    [(103, 4, 3, 1), (24, 2, 4, 1), (10, 3, 1, 1), (5, 3, 2, 1), (103, 4, 3, 2), (23, 2, 1, 3)],
)
def test_rank_batches_partition_each_step(num_samples, batch_size, world_size, accum):
    order = epoch_order(num_samples, seed=1, epoch=0)
    per_rank = [list(rank_batches(order, batch_size, rank, world_size, accum)) for rank in range(world_size)]
    expected = _reference_batches(order, batch_size, world_size, accum)
    num_steps = num_samples // (batch_size * world_size * accum)
    assert len(expected) == num_steps and all(len(b) == num_steps * accum for b in per_rank)
    for step, micro_steps in enumerate(expected):
        for micro, global_batch in enumerate(micro_steps):
            taken = [per_rank[rank][step * accum + micro] for rank in range(world_size)]
            assert taken == global_batch
    used = [index for batches in per_rank for batch in batches for index in batch]
    assert len(set(used)) == len(used)  # nothing repeats within the epoch


def test_a_step_trains_on_the_same_samples_whatever_the_split():
    """Global batch 12: 3 ranks x 4, 1 rank x 4 x 3 micro-steps, 2 ranks x 2 x 3 micro-steps."""
    order = epoch_order(50, seed=2, epoch=0)

    def per_step(batch_size, world_size, accum):
        micros = [list(rank_batches(order, batch_size, r, world_size, accum)) for r in range(world_size)]
        return [
            sorted(i for r in range(world_size) for m in micros[r][s * accum : (s + 1) * accum] for i in m)
            for s in range(len(micros[0]) // accum)
        ]

    assert per_step(4, 3, 1) == per_step(4, 1, 3) == per_step(2, 2, 3)
    assert len(per_step(4, 3, 1)) == 50 // 12


def test_rank_batches_resume_at_start_step():
    order = epoch_order(50, seed=3, epoch=1)
    for rank in range(2):
        full = list(rank_batches(order, 4, rank, 2, grad_accum_steps=2))
        assert list(rank_batches(order, 4, rank, 2, 2, start_step=2)) == full[4:]
        assert list(rank_batches(order, 4, rank, 2, 2, start_step=len(full) // 2)) == []


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"rank": 2, "world_size": 2}, "rank must be in"),
        ({"batch_size": 0}, "batch_size, world_size and grad_accum_steps must be >= 1"),
        ({"start_step": 99}, "start_step must be in"),
    ],
)
def test_rank_batches_rejects_bad_arguments(kwargs, message):
    arguments = {"order": list(range(10)), "batch_size": 2, "rank": 0, "world_size": 1} | kwargs
    with pytest.raises(ValueError, match=message):
        list(rank_batches(**arguments))
