"""Train a DFlash / DFlash 2 draft.

    python launch/train.py --config configs/tiny-dflash2.yaml [key=value ...]
    torchrun --nproc_per_node N launch/train.py --config ... backend=fsdp
    deepspeed --num_gpus N launch/train.py --config ... backend=deepspeed

Overrides are dotted keys of the run config (docs/configuration.md), e.g. output_dir=runs/x
train.max_steps=100 backend=fsdp. The config is validated before any process group starts.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dflash2.config import load_run_config  # noqa: E402
from dflash2.run import run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = parser.parse_args(argv)
    # DeepSpeed 0.19 calls collectives that torch 2.13 deprecates, once per step: keep the log readable.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
    cfg = load_run_config(args.config, args.overrides)
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
