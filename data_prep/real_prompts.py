"""Build real prompts from text the Python install has (no network): training prompts from the
standard library's docstrings, held-out prompts from the docstrings of other modules (kept out of
training) and, out of domain, from the pydoc reference topics.

    python data_prep/real_prompts.py --out artifacts/demo-real/prompts --num-train 1200 --num-heldout 64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dflash2.data.real_prompts import build_real_prompts  # noqa: E402
from dflash2.errors import add_debug_flag, exit_process, run_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", required=True, help="output directory (train.jsonl, heldout.jsonl, heldout_topics.jsonl)"
    )
    parser.add_argument("--num-train", type=int, default=1200, help="training prompts")
    parser.add_argument("--num-heldout", type=int, default=64, help="prompts in each held-out file")
    parser.add_argument("--seed", type=int, default=0, help="draws the passages and the instructions")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    for flag, value in (("--num-train", args.num_train), ("--num-heldout", args.num_heldout)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    print(json.dumps(build_real_prompts(args.out, args.num_train, args.num_heldout, args.seed)))
    return 0


if __name__ == "__main__":
    exit_process(run_main(main))
