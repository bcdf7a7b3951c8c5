"""Where a training step's time goes: the target's capture, the draft step and the real loop, timed
in one run of a run config, with the floor the LM head sets for the objective.

    python benchmarks/pipeline.py [--config configs/tiny-dflash2.yaml] [key=value ...] [--json out.json]
    torchrun --standalone --nproc_per_node 2 benchmarks/pipeline.py backend=fsdp train.micro_batch_size=4
    torchrun --standalone --nproc_per_node 3 benchmarks/pipeline.py backend=fsdp \\
        topology=disaggregated capture_ranks=1 train.micro_batch_size=4

Colocated (every rank captures and trains): one process group, one setup (`dflash2.train.build_setup`)
and the same micro-batches for every pass (the first `--warmup + --steps` optimizer steps of the
run's data order); the first `--warmup` steps of each pass are not reported.

  full       `fit` itself: the loop exactly as a run times it (step and capture)
  capture    the target forward alone (`train.capture_features`) on each micro-batch
  draft      the draft step alone: `train.train_step` on the captured features (draft forward,
             objective, backward, optimizer; capture is a dictionary lookup)
  breakdown  `fit` again with every region timed (dflash2.timing): capture, draft forward,
             objective, LM-head matmuls, backward, gradient reduction, optimizer, logging and
             checkpoint, other
  floor      the bare LM-head matmuls (logits and the input gradient, the head frozen) at the
             objective's shapes: the rows each timed micro-batch supervises, in chunks of
             objective.logits_chunk_rows

Disaggregated: `dflash2.run.run` itself; the first trainer reports how long it waited for features
(`train/feature_wait_s`) against its step time over the timed steps.

Time is wall time (perf_counter) and CPU time of the process (process_time, all threads); on CUDA
every timed boundary synchronises the device. Gradient reduction is the time spent in
torch.distributed's reductions (all_reduce, reduce_scatter*) called inside `backward` and the
optimizer step, found by wrapping those functions before the process group starts; a reduction
launched asynchronously counts only its launch. Prints a table on the first reporting rank and
writes JSON (`--json`). docs/benchmarks.md has recorded runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a plain script from any directory
    sys.path.insert(0, str(REPO_ROOT))

from dflash2.checkpoint import TrainState  # noqa: E402
from dflash2.config import RunConfig, load_run_config  # noqa: E402
from dflash2.data.loader import StepBatch, anchor_generators, step_batches  # noqa: E402
from dflash2.distributed import init_distributed, shutdown_distributed  # noqa: E402
from dflash2.objective import plan_blocks, supervised_mask  # noqa: E402
from dflash2.run import run, run_backend  # noqa: E402
from dflash2.run_plan import resolve_run  # noqa: E402
from dflash2.timing import ITERATION, STEP, StepTimer, region  # noqa: E402
from dflash2.train import Setup, build_setup, capture_features, fit, load_batch, train_step  # noqa: E402

DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny-dflash2.yaml"
PASSES = ("full", "capture", "draft", "breakdown", "floor")
# torch.distributed's reductions: what the backends reduce gradients with (FSDP2: reduce_scatter_single;
# ZeRO-3: reduce_scatter_tensor and all_reduce), and what the loop all-reduces the loss weight with
REDUCTIONS = (
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
)
# (line, what it holds) of the breakdown table, in order; `lines` computes them
BREAKDOWN_LINES = (
    ("capture", "target forward (or feature read / wait)"),
    ("draft_forward", "the draft's forward"),
    ("objective", "objective without the LM-head matmuls"),
    ("head_matmul", "LM-head matmuls inside the objective"),
    ("backward", "backward without gradient reduction"),
    ("grad_reduce", "gradient reduction"),
    ("optimizer", "clip + optimizer + LR step, without reduction"),
    ("log_checkpoint", "logging and checkpoint"),
    ("other", "data, loss-weight and metric all-reduces, loop"),
)


# ------------------------------------------------------------------ arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--config", type=Path, default=DEFAULT_CONFIG, help="run config YAML (default: the tiny default)")
    add("overrides", nargs="*", help="dotted key=value overrides of the run config")
    add("--warmup", type=int, default=2, help="optimizer steps per pass not reported")
    add("--steps", type=int, default=8, help="optimizer steps per pass reported")
    add("--passes", nargs="+", default=None, choices=PASSES, help="colocated passes to run (default: all)")
    add(
        "--floor-repeats",
        type=int,
        default=None,
        help="timings of the bare head matmuls per shape (median; 3)",
    )
    add("--work-dir", type=Path, default=None, help="run directories of the passes (default: a temp dir)")
    add("--json", type=Path, default=None, help="write the results to this JSON file")
    add("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # what only the colocated passes read, when given (a disaggregated run refuses them)
    args.colocated_flags = [
        flag
        for flag, value in (("--passes", args.passes), ("--floor-repeats", args.floor_repeats))
        if value is not None
    ]
    args.passes = args.passes or list(PASSES)
    args.floor_repeats = 3 if args.floor_repeats is None else args.floor_repeats
    if args.warmup < 0 or args.steps < 1 or args.floor_repeats < 1:
        raise ValueError(
            f"--warmup {args.warmup} --steps {args.steps} --floor-repeats {args.floor_repeats}: "
            "use --warmup >= 0, --steps >= 1 and --floor-repeats >= 1"
        )
    if "draft" in args.passes and "capture" not in args.passes:
        raise ValueError("--passes draft trains on the features of the capture pass: add capture")
    return args


def pass_config(cfg: RunConfig, out_dir: Path, num_steps: int) -> RunConfig:
    """The run config of one timed pass: `num_steps` steps from the start, in its own directory."""
    train = cfg.train.model_copy(
        update={"max_steps": num_steps, "stop_at_step": None, "resume": "none", "export": False}
    )
    return cfg.model_copy(update={"output_dir": str(out_dir), "train": train})


# ------------------------------------------------------------------ gradient reduction


def time_reductions() -> None:
    """Time every call of torch.distributed's reductions as a region "reduce" of the step being
    broken down (a no-op outside one). Installed before the process group starts, because DeepSpeed
    keeps a reference to its reduce-scatter function from then on."""
    for name in REDUCTIONS:
        function = getattr(dist, name, None)
        if function is None:
            continue

        @functools.wraps(function)
        def timed(*args, _function=function, **kwargs):
            with region("reduce"):
                return _function(*args, **kwargs)

        setattr(dist, name, timed)


# ------------------------------------------------------------------ colocated passes


class CachedFeatures:
    """Features captured once, served by sample indices (a FeatureSource for the draft-alone pass)."""

    def __init__(self) -> None:
        self.features: dict[tuple[int, ...], torch.Tensor] = {}

    def batch(self, indices: list[int], seq_len: int) -> torch.Tensor:
        features = self.features[tuple(indices)]
        assert features.shape[1] == seq_len, "the capture pass collated these samples differently"
        return features


def run_steps(setup: Setup, num_steps: int) -> list[StepBatch]:
    """The first `num_steps` optimizer steps, as fit takes them."""
    t = setup.cfg.train
    steps = step_batches(
        len(setup.dataset),
        t.micro_batch_size,
        t.grad_accum_steps,
        setup.cfg.seed,
        setup.backend.rank,
        setup.backend.draft_world_size,
    )
    return [next(steps) for _ in range(num_steps)]


def pass_setup(setup: Setup, out_dir: Path, num_steps: int) -> Setup:
    """The setup of one timed pass: `num_steps` steps from the start, in its own directory."""
    config = pass_config(setup.cfg, out_dir, num_steps)
    plan = dataclasses.replace(setup.plan, config=config, resume_from=None, start=TrainState())
    return dataclasses.replace(setup, plan=plan)


def fit_pass(setup: Setup, out_dir: Path, num_steps: int, breakdown: bool) -> list[dict]:
    timer = StepTimer(setup.backend.device, breakdown=breakdown, keep_history=True)
    hooks = timer.time_module(setup.draft, "draft_forward") if breakdown else []
    out_dir.mkdir(parents=True, exist_ok=True)
    fit(pass_setup(setup, out_dir, num_steps), timer=timer)
    for hook in hooks:
        hook.remove()
    return timer.history


def capture_pass(setup: Setup, steps: list) -> tuple[list[dict], CachedFeatures]:
    timer = StepTimer(setup.backend.device, keep_history=True)
    cache = CachedFeatures()
    for step in steps:
        timer.start_step()
        for indices in step.micro:
            batch = load_batch(setup, indices)
            with torch.no_grad(), timer.region("capture"):
                features = capture_features(setup, batch, indices).to(setup.backend.compute_dtype)
            cache.features[tuple(indices)] = features
        timer.step_seconds()
        timer.finish()
    return timer.history, cache


def draft_pass(setup: Setup, steps: list[StepBatch], cache: CachedFeatures) -> list[dict]:
    timer = StepTimer(setup.backend.device, keep_history=True)
    from_cache = dataclasses.replace(setup, features=cache)
    for step in steps:
        timer.start_step()
        train_step(from_cache, step, timer)
        timer.step_seconds()
        timer.finish()
    return timer.history


def supervised_rows(setup: Setup, step: StepBatch) -> list[int]:
    """Rows each micro-batch sends through the LM head (its supervised block slots), as train_step plans them."""
    rows = []
    for indices in step.micro:
        batch = load_batch(setup, indices)
        plan = plan_blocks(
            batch["input_ids"],
            supervised_mask(batch, setup.objective),
            setup.objective,
            anchor_generators(setup.cfg.seed, step.epoch, indices),
        )
        rows.append(int((plan.weights > 0).sum()))
    return rows


def floor_pass(setup: Setup, steps: list[StepBatch], repeats: int) -> list[dict]:
    """Per step: the bare LM-head matmuls of its micro-batches' chunks; each chunk shape is timed
    `repeats` times after a warm-up (median)."""
    weight, bias = setup.head.lm_head_weight, setup.head.lm_head_bias
    chunk_rows, timed = setup.objective.logits_chunk_rows, {}
    timer = StepTimer(setup.backend.device, keep_history=True)

    def chunk_seconds(num_rows: int) -> tuple[float, float]:
        if num_rows not in timed:
            hidden = torch.randn(num_rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
            for _ in range(repeats + 1):
                timer.start_step()
                logits = F.linear(hidden, weight, bias)  # [rows, V], as the objective's forward
                logits @ weight  # [rows, V] @ [V, H]: the input gradient's matmul
                del logits
                timer.step_seconds()
                timer.finish()
            walls = [step[STEP].wall for step in timer.history[-repeats:]]
            cpus = [step[STEP].cpu for step in timer.history[-repeats:]]
            timed[num_rows] = (statistics.median(walls), statistics.median(cpus))
        return timed[num_rows]

    history = []
    for step in steps:
        chunks = [
            chunk_seconds(min(chunk_rows, rows - start))
            for rows in supervised_rows(setup, step)
            for start in range(0, rows, chunk_rows)
        ]
        history.append({"wall": sum(w for w, _ in chunks), "cpu": sum(c for _, c in chunks)})
    return history


# ------------------------------------------------------------------ summaries


def lines(step: dict) -> dict[str, dict[str, float]]:
    """The breakdown table's lines (wall and CPU seconds) of one step of the breakdown pass; they sum
    to the iteration."""
    out: dict[str, dict[str, float]] = {}
    for clock in ("wall", "cpu"):
        values = _lines(step, clock)
        for name, value in values.items():
            out.setdefault(name, {})[clock] = value
    return out


def _lines(step: dict, clock: str) -> dict[str, float]:
    def total(path: str) -> float:  # inclusive of the regions inside
        return getattr(step[path], clock) if path in step else 0.0

    def reductions(part: str) -> float:  # the "reduce" regions anywhere inside top-level region `part`
        return sum(total(p) for p in step if p.startswith(part + "/") and p.endswith("/reduce"))

    values = {
        "capture": total("capture"),
        "draft_forward": total("objective/draft_forward"),
        "objective": getattr(step["objective"], f"self_{clock}") if "objective" in step else 0.0,
        "head_matmul": total("objective/head_matmul"),
        "backward": total("backward") - reductions("backward"),
        "grad_reduce": reductions("backward") + reductions("optimizer"),
        "optimizer": total("optimizer") - reductions("optimizer"),
        "log_checkpoint": total(ITERATION) - total(STEP),
    }
    values["other"] = total(ITERATION) - sum(values.values())
    return values


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def per_clock(values: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {clock: spread([v[clock] for v in values]) for clock in ("wall", "cpu")}


def seconds_of(history: list[dict], path: str) -> list[dict[str, float]]:
    return [
        {"wall": s[path].wall if path in s else 0.0, "cpu": s[path].cpu if path in s else 0.0}
        for s in history
    ]


def summarize_colocated(passes: dict[str, list], warmup: int) -> dict:
    timed = {name: history[warmup:] for name, history in passes.items()}
    out: dict = {}
    if "full" in timed:
        out["full_step"] = per_clock(seconds_of(timed["full"], ITERATION))
        out["full_step_as_logged"] = per_clock(seconds_of(timed["full"], STEP))
    if "capture" in timed:
        out["capture_alone"] = per_clock(seconds_of(timed["capture"], "capture"))
    if "draft" in timed:
        out["draft_alone"] = per_clock(seconds_of(timed["draft"], STEP))
    if {"full", "capture", "draft"} <= set(timed):
        # step by step: the passes ran the same micro-batches, so each step's ratio cancels how long
        # its sequences are
        parts = zip(timed["full"], timed["capture"], timed["draft"])
        ratios = [(f[ITERATION], c["capture"], d[STEP]) for f, c, d in parts]
        out["full_over_parts"] = {
            clock: spread([getattr(f, clock) / (getattr(c, clock) + getattr(d, clock)) for f, c, d in ratios])
            for clock in ("wall", "cpu")
        }
    if "breakdown" in timed:
        steps = [lines(step) for step in timed["breakdown"]]
        out["breakdown_mean"] = {
            name: {clock: statistics.mean(s[name][clock] for s in steps) for clock in ("wall", "cpu")}
            for name, _ in BREAKDOWN_LINES
        }
        out["breakdown_step"] = per_clock(seconds_of(timed["breakdown"], ITERATION))
    if "breakdown" in timed and "floor" in timed:
        objective = [
            {c: s["objective"][c] + s["head_matmul"][c] for c in ("wall", "cpu")}
            for s in map(lines, timed["breakdown"])
        ]
        head = [lines(s)["head_matmul"] for s in timed["breakdown"]]
        floor = timed["floor"]
        out["head_floor"] = per_clock(floor)
        out["objective_over_floor"] = {
            c: spread([o[c] / f[c] for o, f in zip(objective, floor)]) for c in ("wall", "cpu")
        }
        out["head_matmul_over_floor"] = {
            c: spread([h[c] / f[c] for h, f in zip(head, floor)]) for c in ("wall", "cpu")
        }
    return out


def history_json(history: list) -> list:
    """Per-step region times as plain JSON (Seconds objects become dicts)."""
    return [
        {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in step.items()}
        for step in history
    ]


# ------------------------------------------------------------------ the two topologies


def measure_colocated(cfg: RunConfig, args: argparse.Namespace, work_dir: Path) -> dict:
    plan = resolve_run(cfg, cfg.data_parallel_size(dist.get_world_size()))  # as run_colocated
    backend = run_backend(plan.config)
    setup = build_setup(plan, backend)
    num_steps = args.warmup + args.steps
    steps = run_steps(setup, num_steps)
    passes: dict[str, list] = {}
    if "full" in args.passes:
        passes["full"] = fit_pass(setup, work_dir / "full", num_steps, breakdown=False)
    if "capture" in args.passes:
        passes["capture"], cache = capture_pass(setup, steps)
    if "draft" in args.passes:
        passes["draft"] = draft_pass(setup, steps, cache)
    if "breakdown" in args.passes:
        passes["breakdown"] = fit_pass(setup, work_dir / "breakdown", num_steps, breakdown=True)
    if "floor" in args.passes:
        passes["floor"] = floor_pass(setup, steps, args.floor_repeats)
    summary = summarize_colocated(passes, args.warmup)
    rows = supervised_rows(setup, steps[-1]) if "floor" in args.passes else None
    mine = {"rank": dist.get_rank(), "summary": summary, "last_step_rows": rows}
    mine["passes"] = {name: history_json(history) for name, history in passes.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"reporting_rank": 0, "ranks": everyone}


def measure_disaggregated(cfg: RunConfig, args: argparse.Namespace, work_dir: Path) -> dict:
    out_dir = work_dir / "disaggregated"
    reporting_rank = cfg.capture_ranks  # the first trainer: it writes metrics.jsonl
    run(pass_config(cfg, out_dir, args.warmup + args.steps))  # ends the process group
    if (os.environ.get("RANK") or "0") != str(reporting_rank):
        return {"reporting_rank": reporting_rank}
    lines_ = (out_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines_][args.warmup :]
    waits = [r["feature_wait_s"] for r in records]
    step_times = [r["step_time_s"] for r in records]
    return {
        "reporting_rank": reporting_rank,
        "feature_wait_s": spread(waits),
        "step_time_s": spread(step_times),
        "wait_over_step": spread([w / s for w, s in zip(waits, step_times)]),
        "steps": records,
    }


# ------------------------------------------------------------------ report


def environment(world_size: int) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = {
        "device": device,
        "world_size": world_size,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "platform": platform.platform(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def fmt(s: dict[str, float]) -> str:
    return f"{s['median']:8.3f} [{s['min']:.3f}-{s['max']:.3f}]"


def print_colocated(result: dict) -> None:
    summary = result["ranks"][result["reporting_rank"]]["summary"]
    print(f"{'':40}{'wall s (median [min-max])':>28}{'CPU s':>28}")
    for key, label in [
        ("capture_alone", "target forward alone (capture)"),
        ("draft_alone", "draft step alone"),
        ("full_step", "full step (fit, logging included)"),
        ("head_floor", "bare LM-head matmuls (floor)"),
    ]:
        if key in summary:
            print(f"{label:40}{fmt(summary[key]['wall']):>28}{fmt(summary[key]['cpu']):>28}")
    for key, label in [
        ("full_over_parts", "full / (capture + draft), per step"),
        ("objective_over_floor", "objective (no draft forward) / floor"),
        ("head_matmul_over_floor", "head matmuls in objective / floor"),
    ]:
        if key in summary:
            print(f"{label:40}{fmt(summary[key]['wall']):>28}{fmt(summary[key]['cpu']):>28}")
    if "breakdown_mean" in summary:
        mean = summary["breakdown_mean"]
        total = {c: sum(line[c] for line in mean.values()) for c in ("wall", "cpu")}
        print(f"\nbreakdown of the full step (every region timed), mean per step{'wall s':>14}{'CPU s':>16}")
        for name, label in BREAKDOWN_LINES:
            wall, cpu = mean[name]["wall"], mean[name]["cpu"]
            share = 100 * wall / total["wall"] if total["wall"] else 0.0
            print(f"  {label:58}{wall:8.4f} {share:4.0f}%{cpu:10.4f}")
        print(f"  {'= iteration':58}{total['wall']:8.4f}      {total['cpu']:10.4f}")
    per_rank = [
        f"rank {r['rank']}: {ratio['wall']['median']:.3f} / {ratio['cpu']['median']:.3f}"
        for r in result["ranks"]
        if (ratio := r["summary"].get("full_over_parts"))
    ]
    if len(per_rank) > 1:
        print("full / (capture + draft), median wall / CPU, by rank: " + "; ".join(per_rank))


def print_disaggregated(result: dict) -> None:
    print(f"first trainer (rank {result['reporting_rank']}), {len(result['steps'])} timed steps")
    for key, label in [
        ("feature_wait_s", "feature wait s"),
        ("step_time_s", "step time s"),
        ("wait_over_step", "wait / step"),
    ]:
        print(f"{label:40}{fmt(result[key]):>28}")


def main(argv: list[str] | None = None) -> dict:
    try:
        args = parse_args(argv)
        cfg = load_run_config(args.config, args.overrides)
        if cfg.topology == "disaggregated" and args.colocated_flags:
            raise ValueError(
                f"{' and '.join(args.colocated_flags)}: the colocated passes' settings; a disaggregated run "
                "is timed as one run (drop them)"
            )
    except ValueError as error:  # a user error: one message that names the fix, no traceback
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    # DeepSpeed 0.19 calls collectives that torch 2.13 deprecates, once per step: keep the log readable.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
    time_reductions()
    init_distributed(cfg.backend)
    world_size = dist.get_world_size()
    holder = [str(args.work_dir or tempfile.mkdtemp(prefix="dflash2-pipeline-"))]
    dist.broadcast_object_list(holder, src=0)  # every rank writes into the same run directories
    work_dir = Path(holder[0])
    started = time.perf_counter()
    if cfg.topology == "disaggregated":
        result = measure_disaggregated(cfg, args, work_dir)
    else:
        result = measure_colocated(cfg, args, work_dir)
        shutdown_distributed()
    rank = int(os.environ.get("RANK", "0"))
    if rank != result["reporting_rank"]:
        return result
    report = {
        "config": cfg.model_dump(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "environment": environment(world_size),
        "seconds": time.perf_counter() - started,
        **result,
    }
    print(f"\npipeline benchmark: {args.config} {' '.join(args.overrides)}")
    print(
        f"{cfg.topology}, backend {cfg.backend}, {world_size} process(es), {report['environment']['device']}, "
        f"{cfg.precision}; {args.steps} timed steps after {args.warmup} warm-up"
    )
    (print_disaggregated if cfg.topology == "disaggregated" else print_colocated)(result)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.work_dir is None:
        shutil.rmtree(work_dir, ignore_errors=True)
    return report


if __name__ == "__main__":
    main()
