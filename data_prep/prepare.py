"""Tokenize a training_jsonl file with the target's chat template into a dataset with loss masks."""

from __future__ import annotations

import argparse
import json
import logging

from transformers import AutoTokenizer

from dflash2.data.prepare import prepare_dataset, save_prepared


def main() -> None:
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
        "--chat-template-kwargs",
        type=json.loads,
        default=None,
        help="JSON passed to apply_chat_template, e.g. '{\"enable_thinking\": false}'",
    )
    parser.add_argument(
        "--end-of-turn", default=None, help="end-of-turn marker of replies (default: eos token)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    dataset, summary = prepare_dataset(
        args.input,
        tokenizer,
        args.max_length,
        on_error=args.on_error,
        chat_template_kwargs=args.chat_template_kwargs,
        end_of_turn=args.end_of_turn,
    )
    save_prepared(dataset, summary, args.out)
    print(
        f"kept {summary['num_kept']} of {summary['num_lines']} samples, dropped {summary['num_dropped']} "
        f"{summary['dropped_by_reason']}, truncated {summary['num_truncated']}; "
        f"{summary['num_supervised_tokens']} supervised of {summary['num_tokens']} tokens -> {args.out}"
    )


if __name__ == "__main__":
    main()
