"""Build the tiny default target, tokenizer and chat data (cached; see dflash2.fixtures.tiny_default)."""

from __future__ import annotations

import argparse
import json

from dflash2.errors import add_debug_flag, exit_process, run_main
from dflash2.fixtures.tiny_default import build_tiny_default


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="artifacts/tiny", help="output directory (default: artifacts/tiny)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    tiny = build_tiny_default(args.out, force=args.force)
    info = json.loads((tiny.root / "build_info.json").read_text())
    print(f"tiny default at {tiny.root}")
    print(f"  target: {tiny.target_dir}\n  train: {tiny.train_jsonl}\n  heldout: {tiny.heldout_jsonl}")
    print(f"  final train loss {info['final_train_loss']}, built in {info['build_seconds']} s")
    print(f"  sample prompt: {info['sample_prompt']!r}\n  greedy reply: {info['sample_greedy']!r}")
    return 0


if __name__ == "__main__":
    exit_process(run_main(main))
