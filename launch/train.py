"""Train a DFlash / DFlash 2 draft.

    python launch/train.py --config configs/tiny-dflash2.yaml [key=value ...]
    torchrun --nproc_per_node N launch/train.py --config ... backend=fsdp
    deepspeed --num_gpus N launch/train.py --config ... backend=deepspeed

Overrides are dotted keys of the run config (docs/configuration.md), e.g. output_dir=runs/x
train.max_steps=100 backend=fsdp. The config and every path in it are checked before any process
group starts. SIGTERM, SIGINT or SIGUSR1 stop the run after the current step with a checkpoint.
Exit codes: 0 done, 1 failed, 2 user error, 75 stopped on a signal (run the same command to resume).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dflash2.faults import exit_with_launcher, stop_request  # noqa: E402  (light: stdlib only)

exit_with_launcher()  # first: a worker whose launcher dies while the heavy imports below run still stops
stop_request.install()  # SIGTERM/SIGINT/SIGUSR1 from here on stop the run with a checkpoint (not kill it)

from dflash2.config import check_run_paths, load_run_config  # noqa: E402
from dflash2.errors import EXIT_STOPPED, OverridesParser, add_debug_flag, exit_process, run_main  # noqa: E402
from dflash2.run import run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = OverridesParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    add_debug_flag(parser)
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = parser.parse_args(argv)
    # DeepSpeed 0.19 calls collectives that torch 2.13 deprecates, once per step: keep the log readable.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
    cfg = load_run_config(args.config, args.overrides)
    check_run_paths(cfg)
    run(cfg)
    return EXIT_STOPPED if stop_request.stopped else 0


if __name__ == "__main__":
    exit_process(run_main(main))
