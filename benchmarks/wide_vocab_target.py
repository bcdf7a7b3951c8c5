"""A random target and draft with a full-size vocabulary, for benchmarks/pipeline.py.

The tiny default's vocabulary (1024) makes the LM head negligible; this writes a target whose head
has Qwen3's vocabulary (151936 by default), with the tiny default's tokenizer (its ids are a prefix
of the larger vocabulary), a matching DFlash 2 draft config, and long conversations (one sequence
of about `--tokens` tokens each, built from the tiny training set), so that one micro-batch sends
`anchors x (block - 1)` rows through the head. Weights are random: only the shapes matter.

    python benchmarks/wide_vocab_target.py --out /tmp/wide
    python benchmarks/pipeline.py <the overrides it prints>
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_TARGET = REPO_ROOT / "artifacts" / "tiny" / "target"
TINY_DRAFT = REPO_ROOT / "configs" / "draft" / "tiny-dflash2.json"
TINY_TRAIN = REPO_ROOT / "artifacts" / "tiny" / "data" / "train.jsonl"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out", type=Path, required=True, help="output directory (target/, draft.json, long.jsonl)")
    add("--vocab", type=int, default=151936, help="vocabulary size of the target head")
    add("--hidden", type=int, default=256, help="target and draft hidden size")
    add("--target-layers", type=int, default=2, help="target decoder layers")
    add("--tokens", type=int, default=1100, help="about this many tokens per conversation")
    add("--samples", type=int, default=64, help="conversations written")
    add("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.vocab < 1024:
        raise ValueError(f"--vocab {args.vocab}: must hold the tiny tokenizer's 1024 ids (use >= 1024)")
    if not TINY_TARGET.is_dir():
        raise ValueError(f"{TINY_TARGET} is missing: build the tiny default first (make tiny)")
    return args


def write_target(args: argparse.Namespace, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(TINY_TARGET)
    config.update(
        {
            "vocab_size": args.vocab,
            "hidden_size": args.hidden,
            "intermediate_size": 3 * args.hidden,
            "num_hidden_layers": args.target_layers,
            "layer_types": ["full_attention"] * args.target_layers,
            "head_dim": 64,
            "num_attention_heads": args.hidden // 64,
            "num_key_value_heads": max(args.hidden // 128, 1),
        }
    )
    torch.manual_seed(args.seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(TINY_TARGET / name, out / name)


def write_draft(args: argparse.Namespace, path: Path) -> None:
    """The tiny DFlash 2 draft at the benchmark size of docs/benchmarks.md: one layer, hidden 256."""
    draft = json.loads(TINY_DRAFT.read_text())
    draft.update(
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=1,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(args.hidden // 128, 1),
        head_dim=64,
        vocab_size=args.vocab,
        num_target_layers=args.target_layers,
        layer_types=["full_attention"],
    )
    draft["dflash_config"].update(
        num_target_layers=args.target_layers,
        target_layer_ids=[args.target_layers - 1],
        selector_top_k=16,
    )
    path.write_text(json.dumps(draft, indent=2) + "\n")


def write_conversations(args: argparse.Namespace, path: Path) -> None:
    """Long replies made of the tiny training set's replies (about 4 characters a token)."""
    replies = [
        turn["content"]
        for line in TINY_TRAIN.read_text().splitlines()
        for turn in json.loads(line)["conversations"]
        if turn["role"] == "assistant"
    ]
    with path.open("w") as f:
        cursor = 0
        for i in range(args.samples):
            parts, length = [], 0
            while length < 4 * args.tokens:
                parts.append(replies[cursor % len(replies)])
                length += len(parts[-1]) + 1
                cursor += 1
            conversation = [
                {"role": "user", "content": "Write out the practice answers."},
                {"role": "assistant", "content": " ".join(parts)},
            ]
            f.write(json.dumps({"id": f"long-{i:05d}", "conversations": conversation}) + "\n")


def main(argv: list[str] | None = None) -> None:
    try:
        args = parse_args(argv)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    args.out.mkdir(parents=True, exist_ok=True)
    write_target(args, args.out / "target")
    write_draft(args, args.out / "draft.json")
    write_conversations(args, args.out / "long.jsonl")
    print(
        f"model.target={args.out / 'target'} model.draft_config={args.out / 'draft.json'} "
        f"data.train={args.out / 'long.jsonl'} data.max_length=1024"
    )


if __name__ == "__main__":
    main()
