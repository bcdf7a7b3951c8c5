"""Benchmark speculative decoding: wall time for a fixed number of new tokens, and whether one draft
step costs more late in a generation than early.

Each prompt (the first `--num-prompts` of `--data`, rendered as `python -m dflash2.evaluate` renders
them) is decoded greedily for exactly `--max-new-tokens` tokens: stop tokens are ignored, so every
run does the same number of steps. The draft is `--draft` (an export), or by default an untrained
draft built from `--draft-config` (seed 0): it accepts almost nothing, so there is one draft step per
generated token, the most draft work a generation of that length can need.

Reported: the total wall time, process CPU time and tokens/s of `dflash2.evaluate.evaluate_prompts`,
the mean acceptance length, and the median CPU time of one draft step (`dflash2.evaluate.draft_block`)
over the first and over the last `--window-steps` steps of each generation. CPU time (all threads)
is reported next to wall time because it depends less on other load on a shared host.

    .venv/bin/python benchmarks/eval_decode.py --target artifacts/tiny/target \\
        --data artifacts/tiny/data/heldout.jsonl --max-new-tokens 512 --num-prompts 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a plain script from any directory
    sys.path.insert(0, str(REPO_ROOT))

from dflash2 import evaluate as ev  # noqa: E402
from dflash2.models import TargetHead, build_draft  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--target", type=Path, default=REPO_ROOT / "artifacts/tiny/target", help="target directory")
    add("--data", type=Path, default=REPO_ROOT / "artifacts/tiny/data/heldout.jsonl", help="prompts")
    add("--draft", type=Path, default=None, help="export directory (default: an untrained draft)")
    add("--draft-config", type=Path, default=REPO_ROOT / "configs/draft/tiny-dflash2.json")
    add("--max-new-tokens", type=int, default=512)
    add("--num-prompts", type=int, default=2)
    add("--window-steps", type=int, default=64, help="draft steps timed at the start and at the end")
    add("--device", default="cpu")
    add("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    add("--json", type=Path, default=None, help="write the report to this JSON file")
    args = parser.parse_args(argv)
    for name in ("max_new_tokens", "num_prompts", "window_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    return args


def load(args: argparse.Namespace):
    """(draft, target, head, tokenizer) on args.device, fp32, eval mode."""
    if args.draft is not None:
        return ev.load_models(args.draft, args.target, args.device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target).to(args.device).eval()
    torch.manual_seed(0)
    draft = build_draft(args.draft_config, target_config=target.config, tokenizer=tokenizer)
    return draft.to(args.device).eval(), target, TargetHead.from_target(target), tokenizer


def timed_draft_steps(step_times: list[float]):
    """`dflash2.evaluate.draft_block` that also appends its process CPU time to `step_times`."""
    draft_block = ev.draft_block

    def timed(*args, **kwargs):
        start = time.process_time()
        out = draft_block(*args, **kwargs)
        step_times.append(time.process_time() - start)
        return out

    return timed


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    draft, target, head, tokenizer = load(args)
    prompts = [ev.encode_prompt(m, tokenizer) for m in ev.read_prompts(args.data, args.num_prompts)]
    early, late, original = [], [], ev.draft_block
    results = []
    cpu_start = time.process_time()
    try:
        for ids in prompts:
            step_times: list[float] = []
            ev.draft_block = timed_draft_steps(step_times)
            summary, _ = ev.evaluate_prompts(draft, target, head, [ids], max_new_tokens=args.max_new_tokens)
            results.append(summary)
            early += step_times[: args.window_steps]
            late += step_times[-args.window_steps :]
    finally:
        ev.draft_block = original
    cpu = time.process_time() - cpu_start
    wall = sum(r["wall_s"] for r in results)
    generated = sum(r["generated_tokens"] for r in results)
    report = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "prompt_tokens": [len(ids) for ids in prompts],
        "generated_tokens": generated,
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens_per_s": generated / wall,
        "mean_acceptance_length": statistics.mean(r["mean_acceptance_length"] for r in results),
        "draft_step_cpu_s_first_steps": statistics.median(early),
        "draft_step_cpu_s_last_steps": statistics.median(late),
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
