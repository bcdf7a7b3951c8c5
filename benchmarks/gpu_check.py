"""A one-command check of dflash2 on one CUDA device; prints one JSON summary.

    python benchmarks/gpu_check.py                          # cuda, about 3-5 minutes, at most 8
    python benchmarks/gpu_check.py --device cuda:1 --out gpu_check.json
    python benchmarks/gpu_check.py --device cpu --tiny      # the CPU smoke run CI does (no timings)

Parts, each a subprocess with its own time limit (the whole run stops within --time-limit-s):
  tiny_default     the tiny default under artifacts/tiny (reused when its stamp matches, else built)
  train_deepspeed  `launch/train.py` (the real trainer, one process) on the tiny default, bf16,
  train_fsdp       a few steps with each backend: losses, step times, tokens/s, the export
  step_benchmark   `benchmarks/train_step.py` at a Qwen3-8B-sized draft (hidden 4096, 32/8 heads of
                   128, MLP 12288, 1 layer, vocab 151936, 512 anchors x block 16, S 4096), bf16:
                   step time, tokens/s and model FLOP utilisation (MFU)
  evaluate         `python -m dflash2.evaluate` of the first training run's export (DeepSpeed's, or
                   FSDP's if that run failed) against the tiny target: acceptance length, tokens/s

MFU = model FLOPs of one step / step time / the device's peak dense bf16 FLOP/s (a table of known
GPUs, or --peak-tflops). Model FLOPs of one step (forward + backward), `rows` being the rows a
matmul sees, R = b*N*B block rows, R_s the supervised slot rows, C = b*S context rows:
  - trainable matmuls, 6 FLOPs per weight per row (forward 2, backward 4): the q/k/v/o projections,
    the MLP and the conv kernel projections on the R block rows, every layer's k/v projections on
    the C context rows; the context projection `fc` on the C rows counts 4 (its input, the target
    features, needs no gradient)
  - attention, 12 * R * heads * head_dim * (keys + B) per layer (QK^T and PV, forward and
    backward), keys = the context keys a block scores (S, or a sliding layer's window span)
  - the frozen LM head, 4 * R_s * H * V (the logits and the gradient of the slot rows)
  - the selector's hidden projection, 6 * R_s * H * rank; its codebook products, norms, softmax
    and elementwise work are not counted (well under 1% at this size)

With --tiny the sizes shrink to seconds on a CPU (2 training steps per backend on a 64-sample
subset, a 64-hidden draft, 2 prompts), which is what CI runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "benchmarks"):  # run as a plain script from any directory
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import train_step  # noqa: E402  (benchmarks/train_step.py)

from dflash2.hardware import check_device  # noqa: E402
from dflash2.models.attention import context_key_span  # noqa: E402

TINY_DIR = REPO_ROOT / "artifacts" / "tiny"
TINY_CONFIG = REPO_ROOT / "configs" / "tiny-dflash2.yaml"
BACKENDS = ("deepspeed", "fsdp")
LOSS_TOLERANCE = 0.05  # the backends' bf16 losses of the same seeded steps (reduction order apart)
# Peak dense bf16 tensor FLOP/s (no sparsity), by a substring of torch.cuda.get_device_name();
# the first match wins, so the more specific names come first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H20", 148.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("L4", 121.0),
)

# Per part: (time limit on a GPU run in seconds, time limit with --tiny). The GPU limits add up to
# 460 s, under the default --time-limit-s of 480; the tiny default is built (on the CPU, about a
# minute) only where artifacts/tiny is missing or stale.
TIME_LIMITS_S = {
    "tiny_default": (150, 300),
    "train_deepspeed": (90, 240),
    "train_fsdp": (60, 120),
    "step_benchmark": (100, 120),
    "evaluate": (60, 120),
}
STEP_BENCHMARK = {  # a Qwen3-8B-sized DFlash draft
    "full": ["--vocab", "151936", "--hidden", "4096", "--layers", "1", "--heads", "32", "--kv-heads", "8",
             "--head-dim", "128", "--intermediate", "12288", "--seq-len", "4096", "--anchors", "512",
             "--block-size", "16", "--repeats", "3"],
    "tiny": ["--vocab", "1000", "--hidden", "64", "--layers", "1", "--heads", "2", "--kv-heads", "1",
             "--head-dim", "32", "--intermediate", "128", "--seq-len", "64", "--anchors", "8",
             "--block-size", "4", "--repeats", "1", "--chunk-rows", "16"],
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--tiny", action="store_true", help="CI sizes: seconds on a CPU")
    parser.add_argument(
        "--train-steps", type=int, default=None, help="steps per backend (default 10; 2 with --tiny)"
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="the device's peak dense bf16 TFLOP/s"
    )
    parser.add_argument("--time-limit-s", type=float, default=480.0, help="the whole run stops within this")
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="run directories (default: a temporary one)"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the summary JSON here")
    args = parser.parse_args(argv)
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise SystemExit(f"--device={args.device!r}: use cuda, cuda:N or cpu")
    if args.train_steps is None:
        args.train_steps = 2 if args.tiny else 10
    if args.train_steps < 1:
        raise SystemExit(f"--train-steps={args.train_steps}: must be >= 1")
    return args


# ------------------------------------------------------------------ running parts


def child_env(device: str) -> dict[str, str]:
    """The environment of every part: `cuda:N` is exposed as the only visible GPU (the trainer and the
    benchmarks then use cuda:0); `cpu` hides every GPU, so the trainer's backends pick the CPU."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "1")
    elif ":" in device:
        env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
    return env


def child_device(device: str) -> str:
    return "cpu" if device == "cpu" else "cuda"


def run_part(command: list[str], env: dict[str, str], timeout_s: float) -> tuple[dict, str]:
    """Run `command` in its own process group; on timeout the whole group is killed (a part may
    start processes of its own). Returns ({status, seconds, output tails on failure}, stdout)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=max(timeout_s, 1.0))
        status = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        status = "timeout"
    result = {"status": status, "seconds": round(time.perf_counter() - start, 2), "time_limit_s": timeout_s}
    if status != "ok":
        result["returncode"] = proc.returncode
        result["stderr_tail"] = stderr[-3000:]
        result["stdout_tail"] = stdout[-1500:]
    return result, stdout


class Deadline:
    """Each part gets its own limit, cut to what is left of the whole run's."""

    def __init__(self, total_s: float, reserve_s: float = 5.0) -> None:
        self.end = time.perf_counter() + total_s - reserve_s

    def limit(self, part_limit_s: float) -> float:
        return max(0.0, min(part_limit_s, self.end - time.perf_counter()))


def part_limit(name: str, tiny: bool) -> float:
    return float(TIME_LIMITS_S[name][1 if tiny else 0])


# ------------------------------------------------------------------ the parts


def tiny_default_command() -> list[str]:
    code = (
        f"from dflash2.fixtures.tiny_default import build_tiny_default; build_tiny_default({str(TINY_DIR)!r})"
    )
    return [sys.executable, "-c", code]


def train_command(backend: str, run_dir: Path, data: Path, steps: int) -> list[str]:
    overrides = [
        f"backend={backend}", "precision=bf16", f"output_dir={run_dir}", f"data.train={data}",
        f"train.max_steps={steps}", "train.save_every=0", "train.log_every=1", "train.warmup_steps=1",
        "train.progress_bar=false", "train.export=true", "train.resume=none",  # a reused --work-dir trains anew
    ]  # fmt: skip
    return [sys.executable, str(REPO_ROOT / "launch" / "train.py"), "--config", str(TINY_CONFIG), *overrides]


def training_summary(run_dir: Path) -> dict:
    """Losses and timings from the trainer's metrics.jsonl; the first step (warm-up) is excluded
    from the median step time."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    timed = records[1:] or records
    step_times = sorted(r["step_time_s"] for r in timed)
    return {
        "steps": len(records),
        "losses": losses,
        "losses_finite": all(math.isfinite(x) for x in losses),
        "median_step_time_s": step_times[len(step_times) // 2],
        "median_tokens_per_s": sorted(r["tokens_per_s"] for r in timed)[len(timed) // 2],
        "export": str(run_dir / "export") if (run_dir / "export" / "config.json").is_file() else None,
    }


def benchmark_args(tiny: bool, device: str) -> list[str]:
    return [*STEP_BENCHMARK["tiny" if tiny else "full"], "--dtype", "bfloat16", "--device", device]


def benchmark_command(bench_args: list[str]) -> list[str]:
    """One measurement of train_step.py in one fresh process (its worker mode: the chunked objective
    at the one anchor count); the result is its line marked RESULT_PREFIX."""
    anchors = train_step.parse_args(bench_args).anchors
    assert len(anchors) == 1
    return [sys.executable, str(train_step.__file__), *bench_args, "--worker", str(anchors[0]), "chunked"]


def model_flops(args: argparse.Namespace, supervised_rows: int) -> dict[str, float]:
    """Model FLOPs of one train_step.py step (forward + backward) by the formula in the docstring.

    `args` are train_step.py's parsed arguments (one anchor count); `supervised_rows` the R_s it
    reported. Returns the total and its parts."""
    config = train_step.draft_config(args)
    dflash = config["dflash_config"]
    hidden, heads, kv_heads, head_dim = args.hidden, args.heads, args.kv_heads, args.head_dim
    block_rows = args.batch * args.anchors[0] * args.block_size
    context_rows = args.batch * args.seq_len
    num_features = len(dflash["target_layer_ids"])
    conv_weights = 0
    if "conv_kernel_size" in dflash:  # two kernel projections (attention, MLP) of H -> 2*T*G per layer
        conv_weights = 2 * hidden * 2 * dflash["conv_kernel_size"] * (hidden // dflash["conv_group_size"])
    block_weights = (
        hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden  # q, k, v, o
        + 3 * hidden * args.intermediate  # gate, up, down
        + conv_weights
    )  # fmt: skip
    layers = config["layer_types"]
    window = config.get("sliding_window")
    keys = [
        context_key_span(args.seq_len, window if kind == "sliding_attention" else None) + args.block_size
        for kind in layers
    ]
    parts = {
        "draft_matmuls": 6 * len(layers) * (block_rows * block_weights + context_rows * 2 * hidden * kv_heads * head_dim)
        + 4 * context_rows * num_features * hidden * hidden,
        "attention": sum(12 * block_rows * heads * head_dim * k for k in keys),
        "lm_head": 4 * supervised_rows * hidden * args.vocab,
        "selector": 6 * supervised_rows * hidden * dflash.get("selector_rank", 0),
    }  # fmt: skip
    parts["total"] = sum(parts.values())
    return parts


def peak_flops(gpu_name: str | None, override_tflops: float | None) -> tuple[float | None, str]:
    """(peak dense bf16 FLOP/s or None, where the number comes from). `gpu_name` is what the
    benchmark's process read from torch.cuda.get_device_name (None on a CPU)."""
    if override_tflops is not None:
        return override_tflops * 1e12, "--peak-tflops"
    if gpu_name is None:
        return None, "no peak known for a CPU; pass --peak-tflops"
    name = gpu_name
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12, f"table entry {key!r} for {name!r}"
    return None, f"{name!r} is not in the peak table; pass --peak-tflops"


def step_benchmark_summary(
    result: dict, bench_args: list[str], gpu_name: str | None, peak_tflops: float | None
) -> dict:
    peak, peak_source = peak_flops(gpu_name, peak_tflops)
    flops = model_flops(train_step.parse_args(bench_args), result["supervised_tokens_per_step"])
    achieved = flops["total"] / result["step_time_s"]
    return {
        "step_time_s": result["step_time_s"],
        "tokens_per_s": result["tokens_per_s"],
        "anchors_per_s": result["anchors_per_s"],
        "peak_memory_mib": result["peak_memory_mib"],
        "model_flops_per_step": flops,
        "achieved_tflops": achieved / 1e12,
        "mfu": achieved / peak if peak else None,
        "peak_source": peak_source,
    }


def evaluate_command(export: Path, tiny: bool, device: str, out: Path) -> list[str]:
    prompts, tokens = ("2", "16") if tiny else ("16", "64")
    return [sys.executable, "-m", "dflash2.evaluate", "--draft", str(export), "--target", str(TINY_DIR / "target"),
            "--data", str(TINY_DIR / "data" / "heldout.jsonl"), "--num-prompts", prompts,
            "--max-new-tokens", tokens, "--device", device, "--out", str(out)]  # fmt: skip


# ------------------------------------------------------------------ main


def training_subset(work: Path, num_lines: int) -> Path:
    lines = (TINY_DIR / "data" / "train.jsonl").read_text().splitlines(keepends=True)[:num_lines]
    path = work / "train_subset.jsonl"
    path.write_text("".join(lines))
    return path


def run_checks(args: argparse.Namespace, work: Path) -> dict:
    env, device = child_env(args.device), child_device(args.device)
    deadline = Deadline(args.time_limit_s)
    parts: dict[str, dict] = {}

    outputs: dict[str, str] = {}

    def run(name: str, command: list[str]) -> dict:
        parts[name], outputs[name] = run_part(command, env, deadline.limit(part_limit(name, args.tiny)))
        return parts[name]

    if run("tiny_default", tiny_default_command())["status"] != "ok":
        return parts
    data = training_subset(work, 64 if args.tiny else 512)
    for backend in BACKENDS:
        run_dir = work / f"train_{backend}"
        if run(f"train_{backend}", train_command(backend, run_dir, data, args.train_steps))["status"] == "ok":
            parts[f"train_{backend}"].update(training_summary(run_dir))
    bench_args = benchmark_args(args.tiny, device)
    if run("step_benchmark", benchmark_command(bench_args))["status"] == "ok":
        (line,) = [
            x for x in outputs["step_benchmark"].splitlines() if x.startswith(train_step.RESULT_PREFIX)
        ]
        result = json.loads(line.removeprefix(train_step.RESULT_PREFIX))
        gpu_name = gpu_name_of(args.device)
        parts["step_benchmark"].update(step_benchmark_summary(result, bench_args, gpu_name, args.peak_tflops))
    exports = [p.get("export") for name, p in parts.items() if name.startswith("train_") and p.get("export")]
    if exports:
        eval_json = work / "evaluate.json"
        if (
            run("evaluate", evaluate_command(Path(exports[0]), args.tiny, device, eval_json))["status"]
            == "ok"
        ):
            summary = json.loads(eval_json.read_text())
            keys = ("mean_acceptance_length", "generated_tokens", "tokens_per_s", "wall_s", "draft")
            keys += ("target_tokens_per_s", "speedup")  # the target alone, same prompts
            keys += ("num_prompts", "outputs_equal_target")
            parts["evaluate"].update({k: summary[k] for k in keys})
    else:
        parts["evaluate"] = {"status": "skipped", "reason": "no training run produced an export"}
    return parts


def gpu_name_of(device: str) -> str | None:
    """The GPU's name, read in this process (after the parts that need the device have run)."""
    if device == "cpu":
        return None
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def environment(args: argparse.Namespace) -> dict:
    import torch

    info = {"device": args.device, "tiny": args.tiny, "torch": torch.__version__}
    if args.device != "cpu":
        info["gpu"] = gpu_name_of(args.device)
        info["cuda"] = torch.version.cuda
    return info


def result_checks(parts: dict, loss_diff: float | None) -> dict[str, bool]:
    """What `all_ok` asks of a run: every part ran, and their results are right, not only present."""
    checks = {f"{name} ran": part["status"] == "ok" for name, part in parts.items()}
    checks["every part ran"] = len(parts) == len(TIME_LIMITS_S)
    for backend in BACKENDS:
        checks[f"train_{backend} losses finite"] = bool(
            parts.get(f"train_{backend}", {}).get("losses_finite")
        )
    checks[f"backends' losses within {LOSS_TOLERANCE}"] = loss_diff is not None and loss_diff < LOSS_TOLERANCE
    evaluation = parts.get("evaluate", {})
    # evaluation runs in fp32: speculative decoding must reproduce the target's greedy output
    equal, prompts = evaluation.get("outputs_equal_target"), evaluation.get("num_prompts")
    checks["speculative outputs equal the target's"] = equal is not None and equal == prompts
    return checks


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device != "cpu":  # before minutes of parts that would fall back to the CPU
        try:
            check_device(args.device)
        except ValueError as error:
            raise SystemExit(f"error: {error}") from None
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        parts = run_checks(args, work)
    losses = [parts.get(f"train_{b}", {}).get("losses") for b in BACKENDS]
    # the two backends run the same seeded steps: their losses agree up to bf16 reduction order
    loss_diff = max(abs(a - b) for a, b in zip(*losses)) if all(losses) else None
    checks = result_checks(parts, loss_diff)
    summary = {
        "environment": environment(args),
        "parts": parts,
        "checks": checks,
        "all_ok": all(checks.values()),
        "backend_loss_max_abs_diff": loss_diff,
        "seconds": round(time.perf_counter() - start, 1),
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
