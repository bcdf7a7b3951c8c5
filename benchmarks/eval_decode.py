"""Benchmark speculative decoding: where a verify step's time goes, against the target's own decoding.

Each prompt (the first `--num-prompts` of `--data`, rendered as `python -m dflash2.evaluate` renders
them) is decoded greedily for exactly `--max-new-tokens` tokens (stop tokens are ignored, so every
run does the same number of steps), twice, interleaved as `python -m dflash2.evaluate` does: by the
target alone (KV-cached, one forward per token) and by speculative decoding, whose every verify
step is timed region by region (`dflash2.timing.StepTimer`, breakdown on; the regions are listed
in `dflash2.decode`). The draft is `--draft` (an export), or by default an untrained draft built
from `--draft-config` with its backbone sized to the target (hidden, heads, MLP, vocabulary, as the
target has them), `--draft-layers` layers, block `--block-size` and `--target-layers` target
layers spread over the target's depth (seed 0). An untrained draft accepts almost nothing, so
there is one verify step per generated token: the most steps a generation of that length can need.
Time per step hardly depends on the weights.

Reported: tokens/s of both decodes and their ratio, the mean acceptance length, the mean wall and
CPU time of one plain decoding step (target alone, per token) and of one verify step, split into
its regions (self time: a region's own time without the regions inside it; `other` is the step's
time outside every region), a verify step in plain decoding steps, and the speedup that step would
give at a few acceptance lengths (`tau x plain step / verify step`), and what a few-row GEMM of
the target's shapes costs in each weight layout (`gemm_cpu_ms`). The median CPU time of the
draft's block over the first and the last `--window-steps` steps tells whether a draft step costs
more late in a generation than early.

    .venv/bin/python benchmarks/eval_decode.py --max-new-tokens 128 --num-prompts 2 --threads 1
    .venv/bin/python benchmarks/eval_decode.py --target artifacts/smollm2/target \\
        --draft-layers 1 --block-size 8 --max-new-tokens 64 --num-prompts 2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a plain script from any directory
    sys.path.insert(0, str(REPO_ROOT))

from dflash2 import decode  # noqa: E402
from dflash2.config import torch_dtype  # noqa: E402
from dflash2.evaluate import (  # noqa: E402
    WARM_UP_TOKENS,
    encode_prompt,
    load_models,
    read_prompts,
    run_settings,
    warm_up,
)
from dflash2.models import TargetHead, build_draft  # noqa: E402
from dflash2.models.config import default_target_layer_ids, load_config_dict  # noqa: E402
from dflash2.target.hooks import decoder_layers  # noqa: E402
from dflash2.target.layout import decoding_product  # noqa: E402
from dflash2.target.state import use_decoding_layout  # noqa: E402
from dflash2.timing import ITERATION, StepTimer  # noqa: E402

TAUS = (1.5, 2.0, 3.0, 4.0)  # acceptance lengths the speedup is projected at


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--target", type=Path, default=REPO_ROOT / "artifacts/tiny/target", help="target directory")
    add("--data", type=Path, default=REPO_ROOT / "artifacts/tiny/data/heldout.jsonl", help="prompts")
    add("--draft", type=Path, default=None, help="export directory (default: an untrained draft)")
    add("--draft-config", type=Path, default=REPO_ROOT / "configs/draft/tiny-dflash2.json")
    add("--draft-layers", type=int, default=None, help="untrained draft's layers (default: the config's)")
    add("--block-size", type=int, default=None, help="untrained draft's block (default: the config's)")
    add("--target-layers", type=int, default=None, help="target layers it reads (default: the config's)")
    add("--max-new-tokens", type=int, default=512)
    add("--num-prompts", type=int, default=2)
    add("--window-steps", type=int, default=64, help="draft steps timed at the start and at the end")
    add("--device", default="cpu")
    add("--precision", choices=("fp32", "bf16"), default="fp32", help="dtype of the target, draft and head")
    add("--plain-layout", action="store_true", help="keep the weights as loaded (no use_decoding_layout)")
    add("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    add("--json", type=Path, default=None, help="write the report to this JSON file")
    args = parser.parse_args(argv)
    for name in ("num_prompts", "window_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.max_new_tokens < 2:  # the first token comes from the prefill: no verify step to time
        raise ValueError(f"--max-new-tokens={args.max_new_tokens}: must be >= 2 (one verify step at least)")
    return args


def sized_draft_config(args: argparse.Namespace, target_config) -> dict:
    """`--draft-config` with the target's backbone sizes and the requested layers / block."""
    cfg = load_config_dict(args.draft_config)
    text = target_config.get_text_config()
    for key in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
    ):
        cfg[key] = getattr(text, key)
    cfg["head_dim"] = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    dflash = cfg["dflash_config"]
    layers = args.draft_layers or cfg["num_hidden_layers"]
    cfg["num_hidden_layers"], cfg["layer_types"] = layers, [cfg["layer_types"][-1]] * layers
    cfg["num_target_layers"] = dflash["num_target_layers"] = text.num_hidden_layers
    num_ids = args.target_layers or len(dflash["target_layer_ids"])
    dflash["target_layer_ids"] = default_target_layer_ids(text.num_hidden_layers, num_ids)
    dflash["block_size"] = args.block_size or dflash["block_size"]
    if "conv_group_size" in dflash and text.hidden_size % dflash["conv_group_size"]:
        dflash["conv_group_size"] = next(g for g in (16, 12, 8, 4, 2, 1) if text.hidden_size % g == 0)
    dflash["mask_token_id"] = text.vocab_size - 1  # never proposed by a draft this untrained
    return cfg


def load(args: argparse.Namespace):
    """(draft, target, head, tokenizer) on args.device in --precision, eval mode, laid out for
    decoding (as `python -m dflash2.evaluate` loads them) unless --plain-layout."""
    dtype = torch_dtype(args.precision)
    if args.draft is not None:
        return load_models(args.draft, args.target, args.device, dtype, decoding_layout=not args.plain_layout)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(args.device).eval()
    torch.manual_seed(0)
    draft = build_draft(sized_draft_config(args, target.config)).to(args.device, dtype).eval()
    head = TargetHead.from_target(target)
    if not args.plain_layout:
        use_decoding_layout(target, draft, head)
    return draft, target, head, tokenizer


def gemm_layouts(target, rows: tuple[int, ...], repeats: int = 20) -> dict:
    """Median CPU ms of the products of the target's LM head and of the largest linear of its first
    layer (random values in the target's dtype) over a few rows: `F.linear` on the weight [out, in]
    row-major (`as_loaded`) and stored transposed (`transposed`), and what use_decoding_layout runs
    (`decoding_layout`: dflash2.target.layout.decoding_product over both layouts). One weight at a
    time, so a small one stays in the CPU's caches: the per-layer products of a real forward, which
    read every layer's weights from memory, are measured by the verify step itself."""
    from torch.nn import functional as F

    out = {}
    linears = [m for m in decoder_layers(target)[0].modules() if hasattr(m, "weight") and m.weight.dim() == 2]
    largest = max(linears, key=lambda m: m.weight.numel()).weight  # an MLP projection
    for weight in (target.get_output_embeddings().weight, largest):
        as_loaded = torch.randn(weight.shape, dtype=weight.dtype)
        transposed = as_loaded.t().contiguous().t()
        products = {
            "as_loaded": partial(F.linear, weight=as_loaded),
            "transposed": partial(F.linear, weight=transposed),
            "decoding_layout": partial(
                decoding_product, weight=as_loaded, weight_t=transposed.t(), bias=None
            ),
        }
        for m in rows:
            x = torch.randn(m, weight.shape[1], dtype=weight.dtype)
            for name, product in products.items():
                times = []
                for _ in range(repeats):
                    start = time.process_time()
                    product(x)
                    times.append(time.process_time() - start)
                out[f"{tuple(weight.shape)} x {m} rows, {name}"] = 1e3 * statistics.median(times)
    return out


def step_breakdown(history: list[dict]) -> dict:
    """Mean self time (wall, CPU) of every region of a verify step, and of the rest (`other`)."""
    paths = sorted({path for step in history for path in step if path != ITERATION})
    out = {}
    for path in paths:
        times = [step[path] for step in history if path in step]
        out[path] = {
            "wall_ms": 1e3 * sum(t.self_wall for t in times) / len(history),
            "cpu_ms": 1e3 * sum(t.self_cpu for t in times) / len(history),
        }
    step_wall = 1e3 * statistics.mean(step[ITERATION].wall for step in history)
    step_cpu = 1e3 * statistics.mean(step[ITERATION].cpu for step in history)
    out["other"] = {
        "wall_ms": max(0.0, step_wall - sum(out[p]["wall_ms"] for p in paths)),
        "cpu_ms": max(0.0, step_cpu - sum(out[p]["cpu_ms"] for p in paths)),
    }
    out["step"] = {"wall_ms": step_wall, "cpu_ms": step_cpu}
    return out


def decode_all(args, draft, target, head, prompts) -> tuple[list, list, list, float, float]:
    """Both decodes of every prompt, interleaved like dflash2.evaluate: (speculative results, the
    target's own, every prompt's verify-step timings, CPU seconds of each decode)."""
    timer = StepTimer(torch.device(args.device), breakdown=True, keep_history=True)
    spec, plain, histories, cpu = [], [], [], {"spec": 0.0, "target": 0.0}

    def timed(kind: str, results: list, run) -> None:
        start = time.process_time()
        results.append(run())
        cpu[kind] += time.process_time() - start

    new = args.max_new_tokens
    # as dflash2.evaluate: one-time costs (a GPU's kernel loading, the allocator's first growth) on
    # untimed decodes, not on the first timed one
    warm_up([draft], target, head, prompts[0], True, min(new, WARM_UP_TOKENS), 0.0)
    for index, ids in enumerate(prompts):
        runs = [
            ("target", plain, partial(decode.timed_target_generate, target, ids, max_new_tokens=new)),
            (
                "spec",
                spec,
                partial(
                    decode.speculative_generate, draft, target, head, ids, max_new_tokens=new, timer=timer
                ),
            ),
        ]
        for kind, results, run in runs if index % 2 == 0 else runs[::-1]:  # taking turns at going first
            timed(kind, results, run)
        histories.append(timer.history)
        timer.history = []
    return spec, plain, histories, cpu["spec"], cpu["target"]


def report_of(args, prompts, spec, plain, histories, spec_cpu_s: float, plain_cpu_s: float) -> dict:
    steps = [step for history in histories for step in history]
    breakdown = step_breakdown(steps)
    spec_tokens, plain_tokens = sum(len(r.output_ids) for r in spec), sum(len(r.output_ids) for r in plain)
    spec_wall, plain_wall = sum(r.wall_s for r in spec), sum(r.wall_s for r in plain)
    plain_step_ms = 1e3 * plain_wall / plain_tokens
    block_cpu = [step["draft_block"].cpu for step in steps]
    windows = [[s["draft_block"].cpu for s in h] for h in histories]
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "prompt_tokens": [len(ids) for ids in prompts],
        "generated_tokens": spec_tokens,
        "outputs_equal_target": sum(r.output_ids == t.output_ids for r, t in zip(spec, plain)),
        "mean_acceptance_length": statistics.mean(t for r in spec for t in r.acceptance_lengths),
        "spec_tokens_per_s": spec_tokens / spec_wall,
        "target_tokens_per_s": plain_tokens / plain_wall,
        "speedup": (spec_tokens / spec_wall) / (plain_tokens / plain_wall),
        "wall_s": spec_wall,
        "target_wall_s": plain_wall,
        "cpu_s": spec_cpu_s,  # of the speculative decodes
        "target_cpu_s": plain_cpu_s,
        "plain_step_ms": plain_step_ms,
        "plain_step_cpu_ms": 1e3 * plain_cpu_s / plain_tokens,
        "verify_step": breakdown,
        "verify_step_in_plain_steps": breakdown["step"]["wall_ms"] / plain_step_ms,
        "verify_step_in_plain_steps_cpu": breakdown["step"]["cpu_ms"] / (1e3 * plain_cpu_s / plain_tokens),
        "projected_speedup": {str(t): t * plain_step_ms / breakdown["step"]["wall_ms"] for t in TAUS},
        "draft_step_cpu_s_first_steps": statistics.median(x for w in windows for x in w[: args.window_steps]),
        "draft_step_cpu_s_last_steps": statistics.median(x for w in windows for x in w[-args.window_steps :]),
        "draft_step_cpu_s_mean": statistics.mean(block_cpu),
        "torch_threads": torch.get_num_threads(),
    }


def print_table(report: dict) -> None:
    print(f"{'region':<28} {'wall ms':>9} {'cpu ms':>9}")
    for path, t in report["verify_step"].items():
        print(f"{path:<28} {t['wall_ms']:>9.2f} {t['cpu_ms']:>9.2f}")
    print(f"{'plain decoding step':<28} {report['plain_step_ms']:>9.2f}")
    print(
        f"verify step = {report['verify_step_in_plain_steps']:.2f} plain steps; tau {report['mean_acceptance_length']:.2f}"
    )
    print(
        f"tokens/s: speculative {report['spec_tokens_per_s']:.1f}, target alone {report['target_tokens_per_s']:.1f}"
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    draft, target, head, tokenizer = load(args)
    # rendered as dflash2.evaluate renders them: with the export's training run's template arguments
    template_kwargs = run_settings(args.draft, None)[0] if args.draft is not None else None
    prompts = [
        encode_prompt(m, tokenizer, template_kwargs) for m in read_prompts(args.data, args.num_prompts)
    ]
    report = report_of(args, prompts, *decode_all(args, draft, target, head, prompts))
    report["gemm_cpu_ms"] = gemm_layouts(target, (1, draft.block_size))
    report["dtypes"] = {
        name: str(next(m.parameters()).dtype) for name, m in (("target", target), ("draft", draft))
    }
    print(json.dumps(report, indent=2))
    print_table(report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
