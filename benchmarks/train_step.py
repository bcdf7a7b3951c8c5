"""Benchmark one training step of the DFlash objective: chunked CE against the naive unchunked path.

A step is forward + backward of `dflash2.objective.compute_objective` on a randomly initialised
draft, with random target features and a random `TargetHead`. For every anchor count in
`--anchors` and every variant (`chunked`: the fused chunked CE; `naive`: full [rows, V] logits
through autograd; `kl`: chunked CE + KL to the target's distribution; `tv`: chunked 0.1 CE + 0.9 TV)
it reports the median step time over `--repeats` (after one warm-up step),
anchors/s, supervised slot tokens/s and the peak memory the step adds on top of the model and
inputs.

Every measured (anchor count, variant) pair runs in its own fresh subprocess, so one variant's
allocator state never inflates another's peak:
  - CPU: the kernel's peak-RSS mark is reset (`/proc/self/clear_refs`) after the model and inputs
    are built; the peak is the process's VmHWM (/proc/self/status) after the steps, minus the RSS then.
  - CUDA: `torch.cuda.max_memory_allocated()` after the steps, minus `memory_allocated()` before.

Example (see docs/benchmarks.md for the recorded runs):
    .venv/bin/python benchmarks/train_step.py --vocab 151936 --hidden 256 --layers 1 \\
        --seq-len 1024 --anchors 512 --block-size 8 --json /tmp/bench.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a plain script from any directory
    sys.path.insert(0, str(REPO_ROOT))

from dflash2.config import ObjectiveSection  # noqa: E402
from dflash2.hardware import status_kib  # noqa: E402
from dflash2.models import TargetHead, build_draft  # noqa: E402
from dflash2.models.config import ARCHITECTURES, DFLASH2  # noqa: E402
from dflash2.objective import ObjectiveConfig, compute_objective  # noqa: E402

VARIANTS = ("chunked", "naive", "kl", "tv")
# The objective settings of each variant: the chunked CE alone (chunked, and naive through autograd),
# CE + KL to the target's distribution, and the 0.1 CE + 0.9 TV mix (both chunked, with a random
# final-normed target hidden state [batch, S, H] as the teacher's input).
VARIANT_OBJECTIVE = {
    "chunked": {},
    "naive": {},
    "kl": {"ce_weight": 1.0, "kl_weight": 1.0},
    "tv": {"ce_weight": 0.1, "tv_weight": 0.9},
}
RESULT_PREFIX = "BENCH_RESULT "  # marks the worker's result line on stdout
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NUM_TARGET_LAYERS = 36  # a Qwen3-8B-sized target; the draft reads one target layer per draft layer


# ------------------------------------------------------------------ arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--vocab", type=int, default=151936, help="vocabulary size V of the target head")
    add("--hidden", type=int, default=256, help="draft (and target) hidden size H")
    add("--layers", type=int, default=1, help="draft layers (one captured target layer each)")
    add("--heads", type=int, default=4, help="attention heads")
    add("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    add("--head-dim", type=int, default=64, help="per-head dimension")
    add("--intermediate", type=int, default=768, help="MLP intermediate size")
    add("--seq-len", type=int, default=1024, help="sequence length S (all tokens supervised)")
    add("--anchors", type=int, nargs="+", default=[128, 512], help="anchor counts N to measure")
    add("--block-size", type=int, default=8, help="block size B")
    add(
        "--sliding-window",
        type=int,
        default=None,
        help="make every draft layer sliding_attention with this window (default: full attention)",
    )
    add("--batch", type=int, default=1, help="sequences per step")
    add("--repeats", type=int, default=3, help="timed steps per measurement (median reported)")
    add("--architecture", default=DFLASH2.name, choices=list(ARCHITECTURES))
    add(
        "--chunk-rows",
        type=int,
        default=ObjectiveSection.model_fields["logits_chunk_rows"].default,
        help="rows per logits chunk",
    )
    add(
        "--variants",
        nargs="+",
        default=["chunked", "naive"],
        choices=VARIANTS,
        help="objective paths to run (kl: CE + KL, tv: 0.1 CE + 0.9 TV, against a random teacher)",
    )
    add("--dtype", default="float32", choices=sorted(DTYPES), help="draft, head and feature dtype")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    add("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    add("--seed", type=int, default=0)
    add("--json", type=Path, default=None, help="write the results to this JSON file")
    add("--worker", nargs=2, metavar=("ANCHORS", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _validate(args)
    return args


def _validate(args: argparse.Namespace) -> None:
    positive = ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "seq_len")
    for name in (*positive, "block_size", "batch", "repeats", "chunk_rows"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.sliding_window is not None and args.sliding_window < 1:
        raise ValueError(
            f"--sliding-window={args.sliding_window}: must be >= 1 (or omitted for full attention)"
        )
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads={args.threads}: must be >= 1 (or omitted for torch's default)")
    if args.block_size < 2:
        raise ValueError(f"--block-size={args.block_size}: a block needs an anchor and >= 1 slot (>= 2)")
    too_many = [n for n in args.anchors if not 1 <= n <= args.seq_len - 1]
    if too_many:
        raise ValueError(
            f"--anchors {too_many}: each must be in [1, seq_len - 1 = {args.seq_len - 1}]; "
            "raise --seq-len or lower --anchors"
        )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device={args.device}: CUDA is not available here; use --device cpu")
    if args.device == "cpu" and not Path("/proc/self/clear_refs").exists():
        raise ValueError("CPU peak memory needs Linux /proc/self/clear_refs; run on Linux or on CUDA")


# ------------------------------------------------------------------ the measured step


def draft_config(args: argparse.Namespace) -> dict:
    """An HF-form draft config of the requested size (all layers full attention, or all sliding with
    --sliding-window; no softcap)."""
    dflash = {
        "block_size": args.block_size,
        "mask_token_id": args.vocab - 1,
        "target_layer_ids": [
            round(i * (NUM_TARGET_LAYERS - 1) / max(args.layers, 1)) for i in range(args.layers)
        ],
    }
    arch = ARCHITECTURES[args.architecture]
    if arch.conv:
        dflash.update(conv_kernel_size=2, conv_group_size=16)
    if arch.selector:
        dflash.update(selector_rank=32, selector_top_k=16)
    window = {}
    if args.sliding_window is not None:
        window = {"sliding_window": args.sliding_window, "use_sliding_window": True}
    layer_type = "full_attention" if args.sliding_window is None else "sliding_attention"
    return {
        "architectures": [args.architecture],
        "model_type": "qwen3",
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "rope_theta": 10000.0,
        "max_position_embeddings": max(args.seq_len + args.block_size, 512),
        "vocab_size": args.vocab,
        "num_target_layers": NUM_TARGET_LAYERS,
        "tie_word_embeddings": False,
        "is_causal": False,
        "layer_types": [layer_type] * args.layers,
        **window,
        "dflash_config": dflash,
    }


def build_case(args: argparse.Namespace, num_anchors: int, variant: str = "chunked"):
    """(draft, head, batch, objective config) of `variant` on args.device, all random and seeded."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    draft = build_draft(draft_config(args)).to(device=device, dtype=dtype).train()
    head = TargetHead(
        torch.randn(args.vocab, args.hidden, dtype=dtype) * 0.02,
        torch.randn(args.vocab, args.hidden, dtype=dtype) * 0.02,
    ).to(device)
    num_features = len(draft.target_layer_ids) * args.hidden
    batch = {
        "input_ids": torch.randint(0, args.vocab - 1, (args.batch, args.seq_len), device=device),
        "loss_mask": torch.ones(args.batch, args.seq_len, dtype=torch.long, device=device),
        "features": torch.randn(args.batch, args.seq_len, num_features, dtype=dtype, device=device),
    }
    settings = VARIANT_OBJECTIVE[variant]
    if settings:  # the teacher's input: the target's final-normed last hidden state
        batch["target_last_hidden"] = torch.randn(
            args.batch, args.seq_len, args.hidden, dtype=dtype, device=device
        )
    cfg = ObjectiveConfig.for_draft(
        draft, num_anchors=num_anchors, logits_chunk_rows=args.chunk_rows, **settings
    )
    return draft, head, batch, cfg


def training_step(draft, head, batch, cfg, naive: bool, seed: int) -> int:
    """Forward + backward of the objective; returns the number of supervised slot rows.

    The anchor generator is re-seeded every step, so every step (and both variants) does the
    same work on the same anchors.
    """
    draft.zero_grad(set_to_none=False)
    generator = torch.Generator().manual_seed(seed)
    out = compute_objective(draft, head, batch, cfg, generator, naive=naive)
    out.loss_sum.backward()
    return int(out.metrics["slot_count"].sum())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args: argparse.Namespace, num_anchors: int, variant: str) -> dict:
    """Build, warm up once, time `repeats` steps; peak memory above the post-build baseline."""
    device = torch.device(args.device)
    draft, head, batch, cfg = build_case(args, num_anchors, variant)
    # Gradient buffers exist in a real loop before any step: allocate them as part of the baseline.
    for p in draft.parameters():
        p.grad = torch.zeros_like(p)
    gc.collect()
    baseline = _reset_peak_memory(device)
    naive = variant == "naive"
    rows = training_step(draft, head, batch, cfg, naive, args.seed)  # warm-up
    times, cpu_times = [], []
    for _ in range(args.repeats):
        _synchronize(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        training_step(draft, head, batch, cfg, naive, args.seed)
        _synchronize(device)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    peak = _peak_memory(device) - baseline
    step_time = statistics.median(times)
    valid_anchors = args.batch * num_anchors  # every position is supervised: all anchors are valid
    return {
        "num_anchors": num_anchors,
        "variant": variant,
        "step_time_s": step_time,
        "step_times_s": times,
        # CPU seconds of all threads: less sensitive than wall time to other load on a shared host.
        "cpu_time_s": statistics.median(cpu_times),
        "anchors_per_s": valid_anchors / step_time,
        "tokens_per_s": rows / step_time,
        "supervised_tokens_per_step": rows,
        "peak_memory_bytes": peak,
        "peak_memory_mib": peak / 2**20,
    }


def _reset_peak_memory(device: torch.device) -> int:
    """Reset the peak-memory mark; returns the current usage in bytes (the baseline)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    # Writing 5 resets this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0). Not
    # getrusage's ru_maxrss: a child starts with its parent's peak there, which no reset clears.
    Path("/proc/self/clear_refs").write_text("5")
    return status_kib("VmRSS") * 1024


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return status_kib("VmHWM") * 1024


# ------------------------------------------------------------------ orchestration


def run_in_subprocess(argv: list[str], num_anchors: int, variant: str) -> dict:
    """One measurement in a fresh interpreter; its result is the line marked RESULT_PREFIX."""
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", str(num_anchors), variant]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise RuntimeError(
            f"benchmark worker (anchors={num_anchors}, variant={variant}) failed with exit code "
            f"{proc.returncode}:\n{proc.stderr[-4000:]}"
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, f"expected one result line from the worker, got:\n{proc.stdout}"
    return json.loads(lines[0].removeprefix(RESULT_PREFIX))


def summarize(results: list[dict]) -> dict:
    """Chunked/naive ratios per anchor count, and how the step time scales with the anchors."""
    by_key = {(r["num_anchors"], r["variant"]): r for r in results}
    anchors = sorted({r["num_anchors"] for r in results})
    summary: dict = {"chunked_vs_naive": {}, "scaling": {}, "distill_vs_chunked": {}}
    for n in anchors:
        for variant in ("kl", "tv"):
            if (n, variant) in by_key and (n, "chunked") in by_key:
                summary["distill_vs_chunked"].setdefault(str(n), {})[variant] = _ratios(
                    by_key[n, variant], by_key[n, "chunked"]
                )
        if (n, "chunked") in by_key and (n, "naive") in by_key:
            summary["chunked_vs_naive"][str(n)] = _ratios(by_key[n, "chunked"], by_key[n, "naive"])
    for variant in VARIANTS:
        runs = {n: by_key[n, variant] for n in anchors if (n, variant) in by_key}
        if len(runs) >= 2:
            smallest = min(runs)
            summary["scaling"][variant] = {
                f"{n}_over_{smallest}": {
                    "anchor_ratio": n / smallest,
                    "time_ratio": runs[n]["step_time_s"] / runs[smallest]["step_time_s"],
                    "cpu_time_ratio": runs[n]["cpu_time_s"] / runs[smallest]["cpu_time_s"],
                }
                for n in sorted(runs)
                if n != smallest
            }
    return summary


def _ratios(run: dict, base: dict) -> dict:
    return {
        "memory_ratio": run["peak_memory_bytes"] / max(base["peak_memory_bytes"], 1),
        "time_ratio": run["step_time_s"] / base["step_time_s"],
        "cpu_time_ratio": run["cpu_time_s"] / base["cpu_time_s"],
    }


def environment(args: argparse.Namespace) -> dict:
    info = {
        "device": args.device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_threads": args.threads or torch.get_num_threads(),
        "platform": platform.platform(),
    }
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    return info


def _print_table(results: list[dict]) -> None:
    header = ("anchors", "variant", "step s", "cpu s", "anchors/s", "tokens/s", "peak MiB")
    print("".join(f"{h:>10}" for h in header))
    for r in results:
        print(
            f"{r['num_anchors']:>10}{r['variant']:>10}{r['step_time_s']:>10.3f}{r['cpu_time_s']:>10.3f}"
            f"{r['anchors_per_s']:>10.1f}{r['tokens_per_s']:>10.1f}{r['peak_memory_mib']:>10.1f}"
        )


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker is not None:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        result = measure(args, int(args.worker[0]), args.worker[1])
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return result
    results = [run_in_subprocess(argv, n, variant) for n in args.anchors for variant in args.variants]
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"},
        "environment": environment(args),
        "results": results,
        "summary": summarize(results),
    }
    _print_table(results)
    print(json.dumps(report["summary"], indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
