"""launch/train.py with one trainer of a disaggregated run failing (tests/test_disaggregated.py).

    torchrun ... tests/dist_scripts/train_failing_trainer.py --fail-at <global rank>:<n> --config ...

makes that rank raise when it asks for its n-th micro-batch of features (`--stall-at`: stop responding
there, its feature receiver still running; `--slow-finish <global rank>:<seconds>`: take that long more
to finish the run after its last step, a slow final checkpoint and export; `--slow-save`: that much
more for each checkpoint); everything else is the
real entry point, unchanged.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch.distributed as dist  # noqa: E402

from dflash2.capture.transfer import FeatureReceiver  # noqa: E402


def fail_at(rank: int, micro_batch: int, stall: bool) -> None:
    receive = FeatureReceiver.batch

    def batch(self: FeatureReceiver, indices: list[int], seq_len: int):
        if dist.get_rank() == rank and self.num_served + 1 == micro_batch:
            if stall:
                print(f"rank {rank} stalls at micro-batch {micro_batch}", flush=True)
                time.sleep(3600)
            raise RuntimeError(f"injected failure at micro-batch {micro_batch}")
        return receive(self, indices, seq_len)

    FeatureReceiver.batch = batch


def slow_down(function: str, rank: int, seconds: float) -> None:
    """dflash2.train.<function> (`_finish`: the end of a run; `save`: a checkpoint) takes `seconds`
    more on that rank."""
    from dflash2 import train

    original = getattr(train, function)

    def slow(*args, **kwargs):
        if dist.get_rank() == rank:
            time.sleep(seconds)
        return original(*args, **kwargs)

    setattr(train, function, slow)


if __name__ == "__main__":
    slow = {"--slow-finish": "_finish", "--slow-save": "save"}
    if len(sys.argv) < 3 or sys.argv[1] not in ("--fail-at", "--stall-at", *slow):
        sys.exit(
            f"usage: {Path(__file__).name} --fail-at|--stall-at <global rank>:<micro-batch> "
            "| --slow-finish|--slow-save <global rank>:<seconds> <launch/train.py arguments>"
        )
    rank, number = sys.argv[2].split(":")
    if sys.argv[1] in slow:
        slow_down(slow[sys.argv[1]], int(rank), float(number))
    else:
        fail_at(int(rank), int(number), stall=sys.argv[1] == "--stall-at")
    sys.argv = [str(REPO / "launch" / "train.py"), *sys.argv[3:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
