"""dflash2.timing.StepTimer against a fake clock and a fake asynchronous device.

The fake device models CUDA's asynchrony: a launch returns at once and its work only shows on the
clock when the device is synchronised. A region timed with synchronisation at its boundaries must
then hold exactly the work launched inside it; on CPU (no synchronisation) the timer must read the
clock exactly as a plain perf_counter difference would and never touch torch.cuda.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash2.timing import ITERATION, STEP, StepTimer, region


class FakeDevice:
    """A clock, a CPU-time clock, and an asynchronous device whose work lands on synchronize()."""

    def __init__(self) -> None:
        self.now = self.cpu = 0.0
        self.pending = 0.0
        self.syncs = 0

    def host(self, seconds: float) -> None:  # host work: wall and CPU time pass at once
        self.now += seconds
        self.cpu += seconds

    def launch(self, seconds: float) -> None:  # device work: returns at once, runs until synchronised
        self.pending += seconds

    def synchronize(self) -> None:
        self.syncs += 1
        self.now += self.pending
        self.pending = 0.0


def timer_on(device: FakeDevice, *, asynchronous: bool, **kwargs) -> StepTimer:
    return StepTimer(
        torch.device("cpu"),
        clock=lambda: device.now,
        cpu_clock=lambda: device.cpu,
        synchronize=device.synchronize if asynchronous else None,
        **kwargs,
    )


def one_step(device: FakeDevice, timer: StepTimer) -> float:
    """A step shaped like train_step: data, a capture, the draft's work, logging after the step."""
    timer.start_step()
    device.host(0.5)  # collate and plan
    with timer.region("capture"):
        device.launch(3.0)  # the target forward's kernels
        device.host(0.25)  # launching them
    with timer.region("objective"):
        device.launch(2.0)
        with region("head_matmul"):  # the objective marks its part without a timer in hand
            device.launch(1.0)
    step_s = timer.step_seconds()
    device.host(0.125)  # logging
    timer.finish()
    return step_s


def test_cpu_timer_reads_the_clock_like_perf_counter_and_never_synchronizes(monkeypatch):
    def no_cuda(*_):
        raise AssertionError("a CPU timer synchronised CUDA")

    monkeypatch.setattr(torch.cuda, "synchronize", no_cuda)
    device = FakeDevice()
    reads = []
    timer = StepTimer(
        torch.device("cpu"), clock=lambda: reads.append(1) or device.now, cpu_clock=lambda: device.cpu
    )
    timer.start_step()
    device.host(0.5)
    with timer.region("capture"):
        device.host(2.0)
    device.host(1.0)
    with timer.region("capture"):  # a second micro-batch: captures add up
        device.host(0.75)
    assert timer.seconds("capture") == 2.75
    assert timer.step_seconds() == 4.25
    before = len(reads)
    with timer.region("objective"):  # not timed without breakdown: no record, no clock read
        device.host(1.0)
    assert timer.seconds("objective") == 0.0 and len(reads) == before
    timer.finish()


def test_synchronised_regions_hold_the_work_launched_inside_them():
    device = FakeDevice()
    timer = timer_on(device, asynchronous=True, keep_history=True)
    step_s = one_step(device, timer)
    step = timer.history[-1]
    # without synchronisation the capture would read 0.25 s (its launches) and the objective's
    # work would land in whatever read the clock next
    assert step["capture"].wall == 3.25
    assert step["capture"].cpu == 0.25  # the host's own time only
    assert step_s == step[STEP].wall == 0.5 + 3.25 + 3.0  # the objective's work is in the step
    assert step[ITERATION].wall == step_s + 0.125
    assert "objective" not in step and "objective/head_matmul" not in step  # breakdown off
    assert device.syncs == 5  # step start, capture open and close, step end, iteration end


def test_breakdown_times_nested_regions_by_path_inclusive_and_exclusive():
    device = FakeDevice()
    timer = timer_on(device, asynchronous=True, breakdown=True, keep_history=True)
    one_step(device, timer)
    step = timer.history[-1]
    assert step["objective"].wall == 3.0 and step["objective"].self_wall == 2.0
    assert step["objective/head_matmul"].wall == step["objective/head_matmul"].self_wall == 1.0
    assert step["capture"].wall == step["capture"].self_wall == 3.25


def test_region_outside_a_timed_region_is_free_and_records_nothing():
    device = FakeDevice()
    timer = timer_on(device, asynchronous=True, breakdown=True, keep_history=True)
    with region("head_matmul"):  # e.g. the objective called from a test or from evaluation
        device.launch(1.0)
    assert device.syncs == 0
    timer.start_step()
    with region("head_matmul"):  # a step is open but no region of it is: still nothing
        device.launch(1.0)
    timer.step_seconds()
    timer.finish()
    assert set(timer.history[-1]) == {STEP, ITERATION}


def test_time_module_counts_forwards_inside_the_enclosing_region():
    device = FakeDevice()
    module = nn.Linear(2, 2)
    original = module.forward
    module.forward = lambda x: (device.launch(0.5), original(x))[1]
    for breakdown in (True, False):
        timer = timer_on(device, asynchronous=True, breakdown=breakdown, keep_history=True)
        hooks = timer.time_module(module, "draft_forward")
        module(torch.ones(2))  # outside a step: not timed
        timer.start_step()
        with timer.region("objective"):
            module(torch.ones(2))
            device.launch(0.25)
        timer.step_seconds()
        timer.finish()
        for hook in hooks:
            hook.remove()
        step = timer.history[-1]
        if breakdown:
            assert step["objective/draft_forward"].wall == 0.5
            assert step["objective"].self_wall == 0.25
        else:
            assert set(step) == {STEP, ITERATION}


def test_cuda_device_synchronizes_that_device_by_default(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    cuda = torch.device("cuda", 1)
    timer = StepTimer(cuda)
    timer.start_step()
    with timer.region("capture"):
        pass
    timer.step_seconds()
    assert calls == [cuda] * 4


def test_misnested_close_is_an_error():
    device = FakeDevice()
    timer = timer_on(device, asynchronous=False, breakdown=True)
    timer.start_step()
    timer.open("objective")
    device.host(0.25)
    with pytest.raises(AssertionError, match="closing 'backward' inside 'objective'"):
        timer.close("backward")
    device.host(0.5)
    timer.close("objective")  # the region stays open until closed by its own name
    assert timer.seconds("objective") == 0.75


def test_a_run_synchronises_only_at_its_step_and_capture_boundaries():
    """Without breakdown or history (a run): per step one synchronisation at its start, two per
    capture region and one when the step time is read, whatever else the loop marks."""
    device = FakeDevice()
    timer = timer_on(device, asynchronous=True)
    for _ in range(3):
        device.syncs = 0
        timer.start_step()
        for _ in range(2):  # two micro-batches
            with timer.region("capture"):
                device.launch(1.0)
            for name in ("objective", "backward"):
                with timer.region(name), region("head_matmul"):
                    device.launch(1.0)
        with timer.region("optimizer"):
            device.launch(1.0)
        assert timer.step_seconds() == 7.0
        assert device.syncs == 1 + 2 * 2 + 1
