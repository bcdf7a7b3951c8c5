"""Smoke test of benchmarks/train_step.py: the script runs end to end and writes a sane report.

Not a performance assertion: the numbers of a tiny config on a shared CI host mean nothing beyond
"positive and consistent with the config".
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "benchmarks" / "train_step.py"

TINY = [
    "--vocab", "1000", "--hidden", "64", "--layers", "1", "--heads", "2", "--kv-heads", "1",
    "--head-dim", "32", "--intermediate", "128", "--seq-len", "48", "--block-size", "4",
    "--batch", "2", "--repeats", "2", "--chunk-rows", "16", "--device", "cpu",
]  # fmt: skip
ANCHORS = (4, 12)
RESULT_FIELDS = {
    "num_anchors", "variant", "step_time_s", "step_times_s", "cpu_time_s", "anchors_per_s",
    "tokens_per_s", "supervised_tokens_per_step", "peak_memory_bytes", "peak_memory_mib",
}  # fmt: skip


def run_benchmark(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), *TINY, *extra]
    return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "report.json"
    proc = run_benchmark(out.parent, "--anchors", *map(str, ANCHORS), "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_every_anchor_count_and_variant_is_measured(report):
    pairs = {(r["num_anchors"], r["variant"]) for r in report["results"]}
    assert pairs == {(n, v) for n in ANCHORS for v in ("chunked", "naive")}
    assert report["config"]["vocab"] == 1000 and report["config"]["anchors"] == list(ANCHORS)
    assert report["environment"]["device"] == "cpu"


def test_results_have_sane_values(report):
    batch, block_size = 2, 4
    for r in report["results"]:
        assert RESULT_FIELDS <= set(r), RESULT_FIELDS - set(r)
        assert len(r["step_times_s"]) == 2 and all(t > 0 for t in r["step_times_s"])
        assert min(r["step_times_s"]) <= r["step_time_s"] <= max(r["step_times_s"])
        # Every position is supervised, so every anchor is valid and has B-1 slot tokens, except
        # that anchors among the last B-2 positions lose the slots that fall past the sequence end.
        full = batch * r["num_anchors"] * (block_size - 1)
        most_lost = batch * sum(range(1, block_size - 1))
        assert full - most_lost <= r["supervised_tokens_per_step"] <= full
        assert r["anchors_per_s"] == pytest.approx(batch * r["num_anchors"] / r["step_time_s"])
        assert r["tokens_per_s"] == pytest.approx(r["supervised_tokens_per_step"] / r["step_time_s"])
        assert r["peak_memory_bytes"] >= 0 and r["peak_memory_mib"] < 4096


def test_summary_ratios_match_results(report):
    by_key = {(r["num_anchors"], r["variant"]): r for r in report["results"]}
    for n in ANCHORS:
        ratios = report["summary"]["chunked_vs_naive"][str(n)]
        chunked, naive = by_key[n, "chunked"], by_key[n, "naive"]
        assert ratios["time_ratio"] == pytest.approx(chunked["step_time_s"] / naive["step_time_s"])
    scaling = report["summary"]["scaling"]["chunked"][f"{ANCHORS[1]}_over_{ANCHORS[0]}"]
    assert scaling["anchor_ratio"] == ANCHORS[1] / ANCHORS[0]
    assert scaling["time_ratio"] == pytest.approx(
        by_key[ANCHORS[1], "chunked"]["step_time_s"] / by_key[ANCHORS[0], "chunked"]["step_time_s"]
    )


def test_bad_anchor_count_is_a_clear_error():
    spec = importlib.util.spec_from_file_location("train_step_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(ValueError, match=r"--anchors \[48\].*raise --seq-len"):
        module.parse_args([*TINY, "--anchors", "48"])


def test_kl_and_tv_variants_are_measured_against_the_chunked_step(tmp_path):
    out = tmp_path / "report.json"
    proc = run_benchmark(tmp_path, "--anchors", "4", "--variants", "chunked", "kl", "tv", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    by_variant = {r["variant"]: r for r in report["results"]}
    assert set(by_variant) == {"chunked", "kl", "tv"}
    ratios = report["summary"]["distill_vs_chunked"]["4"]
    for variant in ("kl", "tv"):
        want = by_variant[variant]["step_time_s"] / by_variant["chunked"]["step_time_s"]
        assert ratios[variant]["time_ratio"] == pytest.approx(want)
        # the same anchors and supervised slots: only the loss differs
        assert (
            by_variant[variant]["supervised_tokens_per_step"]
            == by_variant["chunked"]["supervised_tokens_per_step"]
        )


def test_cpu_peak_memory_is_the_workers_own_under_a_large_parent(tmp_path):
    """The benchmark run from a process whose peak RSS is large (a pytest worker, a notebook): each
    worker it starts measures its own step. getrusage's ru_maxrss starts at the starting process's
    peak and read 0 MiB there. The naive variant holds at least its fp32 logits
    [batch * anchors * (B - 1), V] at its peak."""
    vocab, anchors = 32000, 40
    out = tmp_path / "r.json"
    argv = [str(SCRIPT), *TINY, "--vocab", str(vocab), "--anchors", str(anchors), "--json", str(out)]
    code = (
        "import runpy, sys\n"
        "ballast = b'\\x01' * (1200 * 2**20)  # written: this process's peak RSS is above 1.2 GiB\n"
        f"sys.argv = {argv!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    naive = next(r for r in json.loads(out.read_text())["results"] if r["variant"] == "naive")
    assert naive["peak_memory_bytes"] >= 2 * anchors * 3 * vocab * 4
