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


def _reference_batches(order, batch_size, world_size):
    """Per global batch, per rank: cut the order into consecutive chunks of batch_size."""
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    global_batches = []
    while len(chunks) >= world_size and len(chunks[world_size - 1]) == batch_size:
        global_batches.append(chunks[:world_size])
        chunks = chunks[world_size:]
    return global_batches


@pytest.mark.parametrize(
    "num_samples,batch_size,world_size", [(103, 4, 3), (24, 2, 4), (10, 3, 1), (5, 3, 2)]
)
def test_rank_batches_partition_each_global_batch(num_samples, batch_size, world_size):
    order = epoch_order(num_samples, seed=1, epoch=0)
    per_rank = [list(rank_batches(order, batch_size, rank, world_size)) for rank in range(world_size)]
    expected = _reference_batches(order, batch_size, world_size)
    assert all(
        len(batches) == len(expected) == num_samples // (batch_size * world_size) for batches in per_rank
    )
    for step, global_batch in enumerate(expected):
        taken = [per_rank[rank][step] for rank in range(world_size)]
        assert taken == global_batch
        flat = [index for batch in taken for index in batch]
        assert len(set(flat)) == len(flat) == batch_size * world_size  # no overlap between ranks
    used = [index for batches in per_rank for batch in batches for index in batch]
    assert len(set(used)) == len(used)  # nothing repeats within the epoch


def test_rank_batches_resume_at_start_batch():
    order = epoch_order(50, seed=3, epoch=1)
    for rank in range(2):
        full = list(rank_batches(order, 4, rank, 2))
        assert list(rank_batches(order, 4, rank, 2, start_batch=4)) == full[4:]
        assert list(rank_batches(order, 4, rank, 2, start_batch=len(full))) == []


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"rank": 2, "world_size": 2}, "rank must be in"),
        ({"batch_size": 0}, "batch_size and world_size must be >= 1"),
        ({"start_batch": 99}, "start_batch must be in"),
    ],
)
def test_rank_batches_rejects_bad_arguments(kwargs, message):
    arguments = {"order": list(range(10)), "batch_size": 2, "rank": 0, "world_size": 1} | kwargs
    with pytest.raises(ValueError, match=message):
        list(rank_batches(**arguments))
