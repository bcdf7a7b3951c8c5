"""The whole pipeline end to end on the embedded tiny default (`make demo`).

build the tiny default -> regenerate the replies with the target -> train a DFlash and a DFlash 2
draft with two-process ZeRO-3 through launch/train.py -> export both -> measure the real acceptance
length of an untrained draft, the DFlash draft and the DFlash 2 draft on held-out prompts -> run the
serving gate -> print a summary and write runs/demo/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tqdm import tqdm  # noqa: E402

from dflash2.data.tiny_default import build_tiny_default  # noqa: E402


def stage(number: int, total: int, title: str) -> None:
    print(f"\n=== [{number}/{total}] {title}", flush=True)


STEP_LINE = re.compile(r"^step (\d+)/(\d+) ")
BAR = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} steps [{elapsed}{postfix}]"


def run(command: list[str], log: Path) -> None:
    """Run a stage's command: its full output goes to a log file; the console gets a progress bar
    driven by the trainer's `step N/M` lines, plus the run's own [dflash2] messages."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log.parent.mkdir(parents=True, exist_ok=True)
    bar = None
    with open(log, "w") as f:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in proc.stdout:
            f.write(line)
            if match := STEP_LINE.match(line):
                step, total = int(match[1]), int(match[2])
                bar = bar or tqdm(total=total, desc="  train", dynamic_ncols=True, bar_format=BAR)
                bar.update(step - bar.n)
                bar.set_postfix_str(line.split("|")[1].strip())  # the loss
            elif line.startswith(("[dflash2]", "regenerat")) or "Traceback" in line:
                tqdm.write("  " + line.rstrip())
        if bar:
            bar.close()
        if proc.wait() != 0:
            raise SystemExit(f"stage failed ({' '.join(command[:4])} ...); see {log}")


def train(name: str, config: str, data: Path, out: Path, steps: int) -> Path:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run(
        [
            *torchrun,
            "launch/train.py",
            "--config",
            config,
            f"output_dir={out}",
            f"data.train={data}",
            "backend=deepspeed",
            f"train.max_steps={steps}",
            "train.save_every=0",
            "train.resume=none",
            "train.progress_bar=false",
            "train.log_every=5",
        ],
        out.parent / f"{name}.log",
    )
    return out / "export"


def export_untrained(out: Path) -> Path:
    import torch

    from dflash2.export import export_draft
    from dflash2.models import build_draft

    torch.manual_seed(0)
    return export_draft(build_draft(REPO / "configs/draft/tiny-dflash2.json"), out, dtype=torch.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="runs/demo")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per draft")
    parser.add_argument("--regen-samples", type=int, default=800, help="training conversations to regenerate")
    parser.add_argument("--eval-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start, total = time.time(), 7

    stage(1, total, "tiny default: tokenizer, conversations, trained tiny Qwen3 target (cached)")
    tiny = build_tiny_default(REPO / "artifacts" / "tiny")
    print(f"  target {tiny.target_dir}")

    stage(2, total, f"regenerate {args.regen_samples} training replies with the target (greedy)")
    regen = out / "data" / "train.regenerated.jsonl"
    subset = out / "data" / "train.subset.jsonl"
    subset.parent.mkdir(parents=True, exist_ok=True)
    lines = Path(tiny.train_jsonl).read_text().splitlines()[: args.regen_samples]
    subset.write_text("\n".join(lines) + "\n")
    run(
        [
            sys.executable,
            "data_prep/regenerate.py",
            "--input",
            str(subset),
            "--out",
            str(regen),
            "--target",
            str(tiny.target_dir),
            "--batch-size",
            "64",
            "--max-new-tokens",
            "96",
        ],
        out / "regenerate.log",
    )

    stage(3, total, "train DFlash (v1), 2-process ZeRO-3")
    export_v1 = train("dflash", "configs/tiny-dflash.yaml", regen, out / "dflash", args.steps)
    stage(4, total, "train DFlash 2, 2-process ZeRO-3")
    export_v2 = train("dflash2", "configs/tiny-dflash2.yaml", regen, out / "dflash2", args.steps)

    stage(5, total, "acceptance length on held-out prompts (speculative decoding against the target)")
    from transformers.utils import logging as hf_logging

    from dflash2.evaluate import evaluate

    hf_logging.disable_progress_bar()
    untrained = export_untrained(out / "untrained" / "export")
    taus = {}
    drafts = [("tau_untrained", untrained), ("tau_dflash", export_v1), ("tau_dflash2", export_v2)]
    for key, draft in tqdm(drafts, desc="  evaluate", dynamic_ncols=True):
        result = evaluate(
            draft,
            tiny.target_dir,
            tiny.heldout_jsonl,
            num_prompts=args.eval_prompts,
            max_new_tokens=args.max_new_tokens,
            temperature=0.0,
            seed=0,
            out_json=draft.parent / "eval.json",
            tb_dir=draft.parent / "tb",
            plot_path=draft.parent / "acceptance.png",
        )
        taus[key] = result["mean_acceptance_length"]
        tqdm.write(f"  {key:14s} {taus[key]:.3f}")

    stage(6, total, "serving gate: overfit, export, reload, decode")
    gate_json = out / "serving_gate" / "result.json"
    run(
        [
            sys.executable,
            "-m",
            "dflash2.serving_gate",
            "--config",
            "configs/tiny-dflash2.yaml",
            "--data",
            str(tiny.train_jsonl),
            "--out",
            str(gate_json),
            f"output_dir={out / 'serving_gate'}",
        ],
        out / "serving_gate.log",
    )
    gate = json.loads(gate_json.read_text())

    stage(7, total, "summary")
    summary = {
        **taus,
        "serving_gate_passed": bool(gate["passed"]),
        "serving_gate_accept_length": gate["spec_accept_length"],
        "export_dflash": str(export_v1),
        "export_dflash2": str(export_v2),
        "target": str(tiny.target_dir),
        "heldout_data": str(tiny.heldout_jsonl),
        "tensorboard": str(out),
        "wall_time_s": round(time.time() - start, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    rows = [
        ("untrained draft tau", f"{taus['tau_untrained']:.2f}"),
        ("DFlash tau", f"{taus['tau_dflash']:.2f}"),
        ("DFlash 2 tau", f"{taus['tau_dflash2']:.2f}"),
        (
            "serving gate",
            f"{'PASSED' if gate['passed'] else 'FAILED'} (tau {gate['spec_accept_length']:.2f})",
        ),
        ("wall time", f"{summary['wall_time_s']:.0f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    print(f"\n  summary:     {out / 'summary.json'}")
    print(f"  TensorBoard: .venv/bin/tensorboard --logdir {out}")
    return 0 if gate["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
