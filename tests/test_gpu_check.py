"""benchmarks/gpu_check.py: its CPU parts end to end (`--device cpu --tiny`, no timing asserted) and its
model-FLOP formula against torch's FLOP counter."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check  # noqa: E402
import train_step  # noqa: E402

SMALL = ["--vocab", "1000", "--hidden", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2",
         "--head-dim", "32", "--intermediate", "256", "--seq-len", "96", "--anchors", "16",
         "--block-size", "4", "--batch", "2", "--chunk-rows", "32", "--device", "cpu"]  # fmt: skip


@pytest.mark.parametrize("window", [None, 24], ids=["full", "sliding24"])
def test_model_flops_formula_matches_the_flop_counter(window):
    """The MFU numerator: the stated formula against every matmul torch counts in a real step
    (forward + backward, the chunked LM head included); the formula leaves out only the selector's
    codebook products."""
    argv = SMALL + ([] if window is None else ["--sliding-window", str(window)])
    args = train_step.parse_args(argv)
    draft, head, batch, cfg = train_step.build_case(args, args.anchors[0])
    counter = FlopCounterMode(display=False)
    with counter:
        supervised_rows = train_step.training_step(draft, head, batch, cfg, naive=False, seed=0)
    flops = gpu_check.model_flops(args, supervised_rows)
    # (counting the sliding layer's attention over all S keys would be 8% off here)
    assert flops["total"] == pytest.approx(counter.get_total_flops(), rel=0.02)


def test_peak_table_finds_known_gpus_and_asks_otherwise():
    assert gpu_check.peak_flops("NVIDIA H100 80GB HBM3", None)[0] == 989e12
    assert gpu_check.peak_flops("NVIDIA H100 PCIe", None)[0] == 756e12
    assert gpu_check.peak_flops("NVIDIA A100-SXM4-80GB", None)[0] == 312e12
    assert gpu_check.peak_flops("Some Future GPU", None)[0] is None
    assert gpu_check.peak_flops(None, 100.0)[0] == 100e12


def test_all_ok_asks_for_right_results_not_only_finished_parts():
    ok = {name: {"status": "ok"} for name in gpu_check.TIME_LIMITS_S}
    for backend in gpu_check.BACKENDS:
        ok[f"train_{backend}"]["losses_finite"] = True
    ok["evaluate"].update(num_prompts=2, outputs_equal_target=2)
    assert all(gpu_check.result_checks(ok, 0.01).values())
    assert not gpu_check.result_checks(ok, 0.2)["backends' losses within 0.05"]
    ok["evaluate"]["outputs_equal_target"] = 1  # a CUDA path that decodes other tokens
    assert not gpu_check.result_checks(ok, 0.01)["speculative outputs equal the target's"]
    ok["train_fsdp"]["losses_finite"] = False
    assert not gpu_check.result_checks(ok, 0.01)["train_fsdp losses finite"]


def test_a_device_the_machine_lacks_stops_before_any_part(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "run_checks", lambda *a: pytest.fail("a part ran"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda: this machine has no usable CUDA device"):
        gpu_check.main(["--device", "cuda", "--work-dir", str(tmp_path)])


@pytest.mark.slow
def test_cpu_tiny_run_covers_every_part(
    tiny_default, tmp_path
):  # built first: the check's own build reuses it
    """What CI runs: both backends train the tiny default in bf16 (one process each, the real
    trainer), the step benchmark and the evaluation run, and one JSON summary comes out."""
    out = tmp_path / "summary.json"
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--tiny",
               "--work-dir", str(tmp_path / "work"), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert json.loads(proc.stdout) == summary  # the one JSON document on stdout
    parts = summary["parts"]
    assert summary["all_ok"] and set(parts) == set(gpu_check.TIME_LIMITS_S)
    assert all(summary["checks"].values()) and "speculative outputs equal the target's" in summary["checks"]
    for backend in gpu_check.BACKENDS:
        run = parts[f"train_{backend}"]
        assert run["steps"] == 2 and run["losses_finite"] and Path(run["export"], "config.json").is_file()
    # the same seeded bf16 steps with either backend
    assert summary["backend_loss_max_abs_diff"] < 0.05
    bench = parts["step_benchmark"]
    assert bench["model_flops_per_step"]["total"] > 0 and bench["tokens_per_s"] > 0
    assert bench["mfu"] is None and "pass --peak-tflops" in bench["peak_source"]
    evaluation = parts["evaluate"]
    assert 1.0 <= evaluation["mean_acceptance_length"] <= 8 and 2 <= evaluation["generated_tokens"] <= 32
    assert evaluation["speedup"] == pytest.approx(
        evaluation["tokens_per_s"] / evaluation["target_tokens_per_s"]
    )
    assert math.isfinite(summary["seconds"]) and summary["environment"]["device"] == "cpu"
