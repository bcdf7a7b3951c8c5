"""step_batches against a slow loop that cuts each epoch's permutation by hand (data/loader.py's
docstring): step k of an epoch is order[k*S:(k+1)*S], S = ranks x accumulation x micro size, its
micro-step j the j-th slice of ranks x micro size samples, rank r the r-th slice of that."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dflash2.data.loader import StepBatch, step_batches


def slow_steps(num_samples, batch_size, accum, seed, rank, num_ranks, epoch, start_step, count):
    """(epoch, steps of the epoch done, micro-batches) of `count` steps, from the definition."""
    out = []
    global_batch, micro_size = batch_size * accum * num_ranks, batch_size * num_ranks
    while len(out) < count:
        order = np.random.default_rng([seed, epoch]).permutation(num_samples).tolist()
        for k in range(start_step, num_samples // global_batch):
            step = order[k * global_batch : (k + 1) * global_batch]
            micro = []
            for j in range(accum):
                sub = step[j * micro_size : (j + 1) * micro_size]
                micro.append(sub[rank * batch_size : (rank + 1) * batch_size])
            out.append((epoch, k + 1, micro))
            if len(out) == count:
                break
        epoch, start_step = epoch + 1, 0
    return out


def taken(stream, count) -> list[tuple[int, int, list[list[int]]]]:
    steps = list(itertools.islice(stream, count))
    assert all(isinstance(s, StepBatch) for s in steps)
    return [(s.epoch, s.step_in_epoch, s.micro) for s in steps]


@pytest.mark.parametrize(
    "batch_size, accum, num_ranks", [(1, 1, 1), (4, 1, 1), (2, 3, 1), (2, 2, 2), (1, 4, 3)]
)
def test_each_layout_yields_the_slow_loops_steps_across_epochs(batch_size, accum, num_ranks):
    num_samples, seed = 29, 7  # 29 is no multiple of any global batch: the last one is dropped
    steps_per_epoch = num_samples // (batch_size * accum * num_ranks)
    count = 2 * steps_per_epoch + 1  # crosses two epoch boundaries
    for rank in range(num_ranks):
        got = taken(step_batches(num_samples, batch_size, accum, seed, rank, num_ranks), count)
        assert got == slow_steps(num_samples, batch_size, accum, seed, rank, num_ranks, 0, 0, count)
        assert [e for e, _, _ in got].count(0) == steps_per_epoch  # no step spans two epochs


def test_a_mid_epoch_resume_continues_the_uninterrupted_order():
    args = (40, 2, 2, 3, 1, 2)  # samples, micro, accumulation, seed, rank, ranks: 5 steps per epoch
    full = taken(step_batches(*args), 12)
    for done in (1, 4, 5, 7):
        epoch, step_in_epoch, _ = full[done - 1]  # step 5 ends epoch 0: resumed at its end
        resumed = taken(step_batches(*args, epoch=epoch, start_step=step_in_epoch), 12 - done)
        assert resumed == full[done:]


def test_the_global_batch_of_a_step_does_not_depend_on_its_layout():
    """What a step trains on depends only on the global batch (a run resumes on another number of ranks)."""
    num_samples, seed, global_batch = 48, 11, 8
    by_layout = {}
    for batch_size, accum, num_ranks in [(8, 1, 1), (4, 2, 1), (4, 1, 2), (1, 4, 2), (2, 1, 4)]:
        streams = [step_batches(num_samples, batch_size, accum, seed, r, num_ranks) for r in range(num_ranks)]
        steps = [taken(s, 9) for s in streams]
        by_layout[batch_size, accum, num_ranks] = [
            sorted(i for rank in steps for micro in rank[k][2] for i in micro) for k in range(9)
        ]
        assert len(by_layout[batch_size, accum, num_ranks][0]) == global_batch
    first = next(iter(by_layout.values()))
    assert all(layout == first for layout in by_layout.values())


def test_too_small_a_dataset_is_refused_naming_the_batch():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        next(step_batches(7, 4, 2, 0, 0, 1))
