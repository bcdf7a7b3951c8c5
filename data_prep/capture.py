"""Capture target features offline: run the frozen target over the run's dataset once and write the
features to safetensors shards + manifest.json, for training with data.features_dir=<out>.

    python data_prep/capture.py --config configs/tiny-dflash2.yaml --out features/tiny [key=value ...]
    torchrun --nproc_per_node N data_prep/capture.py --config <run yaml> --out <dir> backend=fsdp

The target, draft config (for target_layer_ids), data, max_length, backend and precision come from
the run config, so the features match the run that will read them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dflash2.faults import exit_with_launcher  # noqa: E402  (light: stdlib only)

exit_with_launcher()  # first: a worker whose launcher dies while the heavy imports below run still ends

from dflash2.config import check_run_paths, load_run_config  # noqa: E402
from dflash2.errors import OverridesParser, add_debug_flag, exit_process, run_main  # noqa: E402
from dflash2.run import run_offline_capture  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = OverridesParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config", required=True, help="run config YAML (the run that will train from the features)"
    )
    parser.add_argument("--out", required=True, help="features directory (shards + manifest.json)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="samples per target forward (default: train.micro_batch_size)",
    )
    parser.add_argument("--shard-mb", type=int, default=2048, help="start a new shard after this many MiB")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    add_debug_flag(parser)
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides of the run config")
    args = parser.parse_args(argv)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out} is a file: give a directory for the features")
    cfg = load_run_config(args.config, args.overrides)
    check_run_paths(cfg)
    batch_size = cfg.train.micro_batch_size if args.batch_size is None else args.batch_size
    if batch_size < 1 or args.shard_mb < 1:
        raise ValueError(f"--batch-size ({batch_size}) and --shard-mb ({args.shard_mb}) must be >= 1")
    run_offline_capture(cfg, args.out, batch_size=batch_size, shard_bytes=args.shard_mb << 20)
    return 0


if __name__ == "__main__":
    exit_process(run_main(main))
