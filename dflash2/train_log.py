"""TensorBoard scalars, a one-line console log and a progress bar — rank 0 only."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from tqdm import tqdm

from dflash2.config import TrainConfig


class TrainLogger:
    def __init__(self, run_dir: Path, train: TrainConfig, start_step: int, enabled: bool) -> None:
        self.enabled = enabled
        self.log_every = train.log_every
        self.max_steps = train.max_steps
        self.writer = self.bar = None
        self.unprinted: tuple | None = None  # the last step logged, until its console line is printed
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.tb_dir = run_dir / "tb"
        run_dir.mkdir(parents=True, exist_ok=True)  # a run started from Python has no launcher to make it
        # Both logs keep only the steps up to the one resumed from: the steps a crash cut short are
        # trained again, and neither log doubles back.
        trim_metrics(run_dir / "metrics.jsonl", start_step)
        self.jsonl = open(run_dir / "metrics.jsonl", "a")  # one line per step, for scripts and tests
        self.writer = SummaryWriter(str(self.tb_dir), purge_step=start_step + 1)
        if train.progress_bar:
            self.bar = tqdm(total=self.max_steps, initial=start_step, desc="train", dynamic_ncols=True)

    def log(self, step: int, summary: dict[str, float], sums: dict, timing: dict, step_s: float) -> None:
        if not self.enabled:
            return
        scalars = dict(summary)
        scalars.update(
            lr=timing["lr"],
            grad_norm=timing["grad_norm"],
            tokens_per_s=float(sums["input_tokens"]) / step_s,
            anchors_per_s=summary["num_anchors"] / step_s,
            capture_fraction=timing["capture_s"] / step_s,
            feature_wait_s=timing["capture_s"],
            step_time_s=step_s,
        )
        for name, value in scalars.items():
            self.writer.add_scalar(f"train/{name}", value, step)
        # NaN and inf are not JSON (json.dumps writes them bare, which strict readers refuse): null
        record = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in scalars.items()}
        self.jsonl.write(json.dumps({"step": step, **record}) + "\n")
        self.jsonl.flush()
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{summary['loss']:.3f}", acc=f"{summary['accuracy']:.3f}")
        self.unprinted = (step, summary, timing, scalars)
        if step % self.log_every == 0 or step == self.max_steps:
            self.print_last()

    def print_last(self) -> None:
        """Print the last step's console line, unless it was printed (every log_every steps, and the
        last step of a launch, which may end before max_steps: stop_at_step, a stop signal)."""
        if self.unprinted is not None:
            line = console_line(*self.unprinted, self.max_steps)
            (tqdm.write if self.bar is not None else print)(line)
            self.unprinted = None
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.print_last()
            self.writer.close()
            self.jsonl.close()
        if self.bar is not None:
            self.bar.close()


def console_line(step: int, summary: dict[str, float], timing: dict, scalars: dict, max_steps: int) -> str:
    """A step's console line: loss, accuracy, coverage, in-sample tau, the distillation terms, lr,
    throughput and the capture's share."""
    line = (
        f"step {step}/{max_steps} | loss {summary['loss']:.4f} | acc {summary['accuracy']:.3f}"
        f" | top-k cov {summary['topk_coverage']:.3f}"
    )
    if "selector_accuracy" in summary:
        line += f" | sel acc {summary['selector_accuracy']:.3f}"
        line += f" | tau {summary['insample_accept_len']:.2f}/{summary['insample_accept_len_selector']:.2f}"
        line += f" (est {summary['est_accept_len']:.2f}/{summary['est_accept_len_selector']:.2f})"
    else:
        line += f" | tau {summary['insample_accept_len']:.2f} (est {summary['est_accept_len']:.2f})"
    line += distill_terms(summary)
    return line + (
        f" | lr {timing['lr']:.2e} | {scalars['tokens_per_s']:.0f} tok/s"
        f" | capture {100 * scalars['capture_fraction']:.0f}%"
    )


def distill_terms(summary: dict[str, float]) -> str:
    """The console's part for a run with the target's distribution: each loss term, sampling's tau."""
    if "tv_loss" not in summary:  # no teacher: the loss is the cross-entropy alone
        return ""
    terms = [name for name in ("ce", "kl", "tv") if f"{name}_loss" in summary]
    line = f" | {'/'.join(terms)} " + "/".join(f"{summary[f'{name}_loss']:.3f}" for name in terms)
    if "insample_accept_len_sampled" in summary:
        line += f" | tau sampled {summary['insample_accept_len_sampled']:.2f}"
    return line


def trim_metrics(path: Path, last_step: int) -> None:
    """Keep the lines of metrics.jsonl up to `last_step` (a torn last line goes too), atomically."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # cut off by a crash while it was written
            continue
        if record["step"] <= last_step:
            kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
