"""Launched by tests/test_draft_config.py (one plain `python` process): two training steps of the real
training code (build_setup + fit, FSDP2 on a world of one) for each (target directory, draft config)
pair, one after the other in one process group. Writes <out>/<name>/run/ (metrics.jsonl, export/);
a pair that fails leaves <out>/<name>/error.txt and ends the launch."""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash2.distributed import build_backend, init_distributed, shutdown_distributed  # noqa: E402
from dflash2.run_plan import resolve_run  # noqa: E402
from dflash2.train import build_setup, fit  # noqa: E402
from tests.dist_scripts.families import family_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True, help="comma-separated name=target_dir=draft_config")
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    init_distributed("fsdp")
    for entry in args.runs.split(","):
        name, target_dir, draft_config = entry.split("=")
        out = Path(args.out) / name
        out.mkdir(parents=True, exist_ok=True)
        run_args = argparse.Namespace(
            draft_config=draft_config, data=args.data, backend="fsdp", ds_config=None
        )
        cfg = family_config(run_args, Path(target_dir), out)
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        try:
            fit(build_setup(resolve_run(cfg), build_backend("fsdp", None, cfg.train.micro_batch_size, 1)))
        except Exception:
            (out / "error.txt").write_text(traceback.format_exc())
            raise
    shutdown_distributed()


if __name__ == "__main__":
    main()
