"""Wall and CPU time of a training step and of named regions inside it.

On CUDA, kernels run asynchronously: a clock read right after a call measures launching the work,
not doing it. So a `StepTimer` on a CUDA device synchronises the device at every boundary it times,
and a region's time is the work launched inside it. On CPU nothing synchronises (the work is done
when the call returns): a boundary costs two clock reads.

A run times each step and its `capture` regions (`train/step_time_s`, `train/feature_wait_s`): on
CUDA that is one synchronisation at each capture boundary and at each end of a step. With
`breakdown=True` (benchmarks/pipeline.py) every region named by the loop, by the objective
(`region("head_matmul")`) or by a caller is timed too; a region opened inside another is recorded
under its path ("objective/head_matmul"), both inclusive and exclusive of the regions inside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

ALWAYS_TIMED = frozenset({"capture"})  # what a run logs; everything else only with breakdown=True
STEP = "step"  # the step as logged: from start_step() to step_seconds()
ITERATION = "iteration"  # from start_step() to the next start_step() (or finish()): logging included
_NOT_TIMED = nullcontext()
_ACTIVE: list[StepTimer] = []  # timers with an open region, innermost last (see `region`)


@dataclass
class Seconds:
    """Time of one region path summed over a step: wall and CPU (this process, all threads),
    inclusive and exclusive of the regions opened inside it."""

    wall: float = 0.0
    cpu: float = 0.0
    self_wall: float = 0.0
    self_cpu: float = 0.0

    def add(self, wall: float, cpu: float, child_wall: float, child_cpu: float) -> None:
        self.wall += wall
        self.cpu += cpu
        self.self_wall += wall - child_wall
        self.self_cpu += cpu - child_cpu


@dataclass
class _Open:
    path: str
    wall: float
    cpu: float
    child_wall: float = 0.0
    child_cpu: float = 0.0


@dataclass
class _Step:
    wall: float
    cpu: float
    regions: dict[str, Seconds] = field(default_factory=dict)


class StepTimer:
    """Times steps and the named regions inside them (see the module docstring).

    `keep_history`: keep every finished step's region times in `history` (for benchmarks).
    `clock`, `cpu_clock` and `synchronize` are injectable for tests; `synchronize` defaults to
    `torch.cuda.synchronize(device)` on a CUDA device and to nothing otherwise.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        breakdown: bool = False,
        keep_history: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] = time.process_time,
        synchronize: Callable[[], None] | None = None,
    ) -> None:
        if synchronize is None and device.type == "cuda":
            synchronize = lambda: torch.cuda.synchronize(device)  # noqa: E731
        self.breakdown = breakdown
        self.keep_history = keep_history
        self.history: list[dict[str, Seconds]] = []
        self._clock, self._cpu_clock, self._synchronize = clock, cpu_clock, synchronize
        self._step: _Step | None = None
        self._open: list[_Open] = []

    def _now(self) -> tuple[float, float]:
        if self._synchronize is not None:
            self._synchronize()
        return self._clock(), self._cpu_clock()

    # ---- steps ---------------------------------------------------------------------------------

    def start_step(self) -> None:
        """Begin a step (finishing the previous one: its iteration ends here)."""
        self.finish()
        self._step = _Step(*self._now())

    @property
    def started(self) -> bool:
        """Whether a step is open (start_step() ran and finish() did not since)."""
        return self._step is not None

    def step_seconds(self) -> float:
        """Wall seconds since start_step(); recorded as the step's `step` time."""
        assert self._step is not None, "start_step() first"
        wall, cpu = self._now()
        self._step.regions[STEP] = Seconds(wall - self._step.wall, cpu - self._step.cpu)
        return wall - self._step.wall

    def finish(self) -> None:
        """End the current step's iteration (no-op when none is open)."""
        if self._step is None:
            return
        assert not self._open, f"regions still open at the end of a step: {[o.path for o in self._open]}"
        if self.keep_history:  # a run keeps none: no clock read, no synchronisation
            wall, cpu = self._now()
            iteration = Seconds(wall - self._step.wall, cpu - self._step.cpu)
            self.history.append({**self._step.regions, ITERATION: iteration})
        self._step = None

    def seconds(self, name: str) -> float:
        """Wall seconds of top-level region `name` so far in this step (0 when it never ran)."""
        assert self._step is not None, "start_step() first"
        found = self._step.regions.get(name)
        return found.wall if found is not None else 0.0

    # ---- regions -------------------------------------------------------------------------------

    def region(self, name: str):
        """Context manager timing `name` in this step; a no-op unless `name` is timed."""
        if self._step is None or not (self.breakdown or name in ALWAYS_TIMED):
            return _NOT_TIMED
        return self._timed(name)

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        self.open(name)
        try:
            yield
        finally:
            self.close(name)

    def open(self, name: str) -> None:
        """Open region `name` (prefer `region`; this is for hooks that cannot use a `with`)."""
        path = f"{self._open[-1].path}/{name}" if self._open else name
        self._open.append(_Open(path, *self._now()))
        _ACTIVE.append(self)

    def close(self, name: str) -> None:
        innermost = self._open[-1].path if self._open else None
        assert innermost is not None and innermost.rsplit("/", 1)[-1] == name, (
            f"closing {name!r} inside {innermost!r}"
        )
        assert _ACTIVE[-1] is self, "regions of two timers interleaved"
        wall, cpu = self._now()
        opened = self._open.pop()
        _ACTIVE.pop()
        wall, cpu = wall - opened.wall, cpu - opened.cpu
        self._step.regions.setdefault(opened.path, Seconds()).add(
            wall, cpu, opened.child_wall, opened.child_cpu
        )
        if self._open:
            self._open[-1].child_wall += wall
            self._open[-1].child_cpu += cpu

    def time_module(self, module: nn.Module, name: str) -> list:
        """Time every forward of `module` as region `name` (breakdown only); returns the hook handles.

        The pre-hook goes first, so work that wrappers do around the forward (e.g. FSDP's all-gather
        of the parameters) is counted in the region."""

        def pre_hook(*_) -> None:
            if self._step is not None and self.breakdown:
                self.open(name)

        def post_hook(*_) -> None:
            if self._step is not None and self.breakdown:
                self.close(name)

        return [
            module.register_forward_pre_hook(pre_hook, prepend=True),
            module.register_forward_hook(post_hook, always_call=True),
        ]


def region(name: str):
    """Time `name` as a region of the step whose timed region encloses this call (the objective's
    way to mark its parts without knowing about the loop); a no-op when no timed region is open."""
    return _ACTIVE[-1].region(name) if _ACTIVE else _NOT_TIMED
