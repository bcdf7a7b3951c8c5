"""Tokenize a training_jsonl file with the target's chat template into a dataset with loss masks."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


from dflash2.config import json_object_arg, load_tokenizer, require_path  # noqa: E402
from dflash2.data.prepare import describe, prepare_dataset, save_prepared  # noqa: E402
from dflash2.errors import add_debug_flag, exit_process, run_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input", required=True, help="training_jsonl file")
    parser.add_argument(
        "--tokenizer", required=True, help="target model directory (its tokenizer and chat template)"
    )
    parser.add_argument(
        "--out", required=True, help="output directory (datasets save_to_disk + summary.json)"
    )
    parser.add_argument(
        "--max-length", type=int, required=True, help="truncate rendered samples to this many tokens"
    )
    parser.add_argument(
        "--on-error", choices=("skip", "fail"), default="skip", help="malformed lines: skip or stop"
    )
    parser.add_argument(
        "--duplicates",
        choices=("keep", "drop"),
        default="keep",
        help="conversations equal to an earlier one: keep (default) or drop; reported either way",
    )
    parser.add_argument(
        "--chat-template-kwargs",
        type=json_object_arg,
        default=None,
        help="JSON passed to apply_chat_template, e.g. '{\"enable_thinking\": false}'",
    )
    parser.add_argument(
        "--end-of-turn", default=None, help="end-of-turn marker of replies (default: eos token)"
    )
    parser.add_argument(
        "--num-proc",
        type=int,
        default=1,
        help="worker processes that render the lines (default 1); the result is the same with any number",
    )
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out} is a file: give a directory for the prepared dataset")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    require_path(args.input, "--input", "file", "a training_jsonl file")
    require_path(args.tokenizer, "--tokenizer", "dir", "the target's local model directory")

    tokenizer = load_tokenizer(args.tokenizer, "--tokenizer")
    dataset, summary = prepare_dataset(
        args.input,
        tokenizer,
        args.max_length,
        on_error=args.on_error,
        chat_template_kwargs=args.chat_template_kwargs,
        end_of_turn=args.end_of_turn,
        duplicates=args.duplicates,
        num_proc=args.num_proc,
    )
    save_prepared(dataset, summary, args.out)
    print(f"{describe(summary)} -> {args.out}")
    return 0


if __name__ == "__main__":
    exit_process(run_main(main))
