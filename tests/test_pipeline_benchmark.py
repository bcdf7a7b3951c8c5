"""Smoke test of benchmarks/pipeline.py on the tiny default (one process): every pass runs, the
report is consistent, and what the loop logs is what its timer measured. No timing is asserted.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.run_helpers import REPO, check_ok, metrics, run, tiny_subset

SCRIPT = REPO / "benchmarks" / "pipeline.py"
WARMUP, STEPS = 1, 2
PASSES = ("full", "capture", "draft", "breakdown", "floor")


@pytest.fixture(scope="module")
def bench(tiny_default, tmp_path_factory) -> tuple[dict, Path, str]:
    directory = tmp_path_factory.mktemp("pipeline")
    command = [
        sys.executable,
        str(SCRIPT),
        f"model.target={tiny_default.target_dir}",
        f"data.train={tiny_subset(tiny_default, directory, 48)}",
        "data.max_length=96",
        "objective.num_anchors=8",
        "train.micro_batch_size=2",
        "train.global_batch_size=null",  # the accumulation steps of the overrides, on any number of ranks
        "train.grad_accum_steps=2",
        "train.progress_bar=false",
        "backend=fsdp",
        *("--warmup", str(WARMUP), "--steps", str(STEPS), "--floor-repeats", "1"),
        *("--work-dir", str(directory / "runs"), "--json", str(directory / "report.json")),
    ]
    result = check_ok(run(command))
    return json.loads((directory / "report.json").read_text()), directory / "runs", result.stdout


def test_every_pass_runs_every_step(bench):
    report, _, stdout = bench
    (rank,) = report["ranks"]
    assert set(rank["passes"]) == set(PASSES)
    for name, history in rank["passes"].items():
        assert len(history) == WARMUP + STEPS, name
    assert len(rank["last_step_rows"]) == 2  # grad_accum_steps micro-batches
    # 2 samples x at most 8 anchors x (block 8 - 1) supervised slots
    assert all(0 < rows <= 2 * 8 * 7 for rows in rank["last_step_rows"])
    for label in ("target forward alone", "draft step alone", "full step", "= iteration"):
        assert label in stdout


def test_logged_step_and_wait_are_what_the_timer_measured(bench):
    """On CPU the loop logs plain clock differences of its timer: the step from its start to the
    metrics, the feature wait as the sum of the step's capture regions."""
    report, runs, _ = bench
    timed = report["ranks"][0]["passes"]["full"]
    logged = metrics(runs / "full")
    assert [m["step_time_s"] for m in logged] == [step["step"]["wall"] for step in timed]
    assert [m["feature_wait_s"] for m in logged] == [step["capture"]["wall"] for step in timed]
    for step in timed:
        assert 0 < step["capture"]["wall"] < step["step"]["wall"] <= step["iteration"]["wall"]


def test_breakdown_lines_add_up_to_the_full_step(bench):
    report, _, _ = bench
    summary = report["ranks"][0]["summary"]
    steps = report["ranks"][0]["passes"]["breakdown"][WARMUP:]
    for clock in ("wall", "cpu"):
        lines = summary["breakdown_mean"]
        total = sum(line[clock] for line in lines.values())
        mean_iteration = sum(s["iteration"][clock] for s in steps) / len(steps)
        assert total == pytest.approx(mean_iteration)
        # `other` is the iteration less the timed regions: negative only if a region were counted twice
        assert lines["other"][clock] >= 0, clock
    for name in ("capture", "draft_forward", "objective", "head_matmul", "backward", "optimizer"):
        assert summary["breakdown_mean"][name]["wall"] > 0, name
    assert summary["breakdown_mean"]["grad_reduce"]["wall"] == 0  # one process: nothing to reduce
    for key in ("objective_over_floor", "head_matmul_over_floor"):
        assert key in summary


def test_full_over_parts_pairs_the_passes_step_by_step(bench):
    report, _, _ = bench
    rank = report["ranks"][0]
    full, capture, draft = (rank["passes"][name][WARMUP:] for name in ("full", "capture", "draft"))
    for clock in ("wall", "cpu"):
        ratios = sorted(
            f["iteration"][clock] / (c["capture"][clock] + d["step"][clock])
            for f, c, d in zip(full, capture, draft)
        )
        got = rank["summary"]["full_over_parts"][clock]
        assert (got["min"], got["max"]) == (ratios[0], ratios[-1])
        assert got["median"] == pytest.approx(sum(ratios[:2]) / 2)  # STEPS = 2


def test_bad_arguments_are_one_clear_message(capsys):
    spec = importlib.util.spec_from_file_location("pipeline_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--passes", "draft"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: --passes draft trains on the features of the capture pass: add capture\n"
    )
    # the colocated passes' flags mean nothing to a disaggregated run, which would ignore them
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--floor-repeats", "5", "topology=disaggregated", "capture_ranks=1"])
    assert exit_info.value.code == 2
    assert "--floor-repeats: the colocated passes' settings; a disaggregated run" in capsys.readouterr().err
