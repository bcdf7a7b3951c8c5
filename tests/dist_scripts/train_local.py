"""Launched by tests/test_local_backend.py (plain python): a run of the tiny config trained by
LocalBackend in this process, with no process group, through the same build_setup and fit as
launch/train.py. Arguments: the run config's path, then its overrides."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from dflash2.config import load_run_config  # noqa: E402
from dflash2.distributed import LocalBackend  # noqa: E402
from dflash2.run_plan import resolve_run  # noqa: E402
from dflash2.train import build_setup, fit  # noqa: E402


def main() -> None:
    cfg = load_run_config(sys.argv[1], sys.argv[2:])
    plan = resolve_run(cfg)
    fit(build_setup(plan, LocalBackend.from_run_config(plan.config)))
    assert not dist.is_initialized(), "LocalBackend started a process group"


if __name__ == "__main__":
    main()
