"""bf16 only where the CPU computes it: the flags read from /proc/cpuinfo, the demo's default
precision and its budget, and the warning of a bf16 run on a CPU that emulates bf16."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import torch

from dflash2.hardware import cpu_flags, cpu_has_native_bf16, default_cpu_precision, slow_bf16_warning
from tests.run_helpers import load_script

CPU = torch.device("cpu")
ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx avx2 fma\n\nprocessor\t: 1\n"
ZEN5 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: avx2 avx512f amx_bf16 amx_tile amx_int8\n"
NEOVERSE_V1 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n"


def cpuinfo(tmp_path: Path, text: str, name: str = "cpuinfo") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "native"),
    [(ZEN3, False), (ZEN5, True), (SAPPHIRE_RAPIDS, True), (NEOVERSE_V1, True), ("processor\t: 0\n", False)],
)
def test_native_bf16_from_cpuinfo(tmp_path, text, native):
    assert cpu_has_native_bf16(cpuinfo(tmp_path, text)) is native


def test_unreadable_cpuinfo_counts_as_no_bf16(tmp_path):
    assert cpu_flags(tmp_path / "missing") == frozenset()
    assert default_cpu_precision(tmp_path / "missing")[0] == "fp32"


@pytest.mark.skipif(platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists(), reason="x86 Linux")
def test_agrees_with_torchs_own_cpu_checks():
    """PyTorch's CPU probes (cpuid, not /proc/cpuinfo) say the same of this machine."""
    torch_says = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert cpu_has_native_bf16() is bool(torch_says)


def test_default_cpu_precision(tmp_path):
    assert default_cpu_precision(cpuinfo(tmp_path, ZEN5, "zen5"))[0] == "bf16"
    precision, why = default_cpu_precision(cpuinfo(tmp_path, ZEN3))
    assert precision == "fp32" and "--precision bf16" in why


def test_slow_bf16_warning(tmp_path):
    zen3 = cpuinfo(tmp_path, ZEN3)
    warning = slow_bf16_warning(CPU, torch.float32, torch.bfloat16, cpuinfo=zen3)
    assert warning and "precision=fp32" in warning and "--precision fp32" in warning
    assert slow_bf16_warning(CPU, torch.float32, cpuinfo=zen3) is None
    assert slow_bf16_warning(torch.device("cuda"), torch.bfloat16, cpuinfo=zen3) is None
    assert slow_bf16_warning(CPU, torch.bfloat16, cpuinfo=cpuinfo(tmp_path, ZEN5, "zen5")) is None


def test_cpu_bf16_benchmark_runs(capsys):
    """benchmarks/cpu_bf16.py: both dtypes measured, the same verdict as dflash2.hardware (a smoke
    test: the speeds of a shared CI host prove nothing)."""
    import importlib.util

    from tests.conftest import REPO_ROOT

    spec = importlib.util.spec_from_file_location("cpu_bf16", REPO_ROOT / "benchmarks" / "cpu_bf16.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.main(["--rows", "32", "--seconds", "0.05"])
    assert report["native_bf16"] is cpu_has_native_bf16()
    assert report["gflops_fp32"] > 0 and report["gflops_bf16"] > 0
    assert json.loads(capsys.readouterr().out) == report


@pytest.mark.parametrize(
    ("argv", "replies", "steps", "line"),
    [
        (["--precision", "bf16"], 1024, 1500, "budget 1024 replies, 1500 steps a draft: the bf16 budget"),
        (["--precision", "fp32"], 512, 800, "budget 512 replies, 800 steps a draft: the fp32 budget"),
        (
            ["--precision", "fp32", "--steps", "1500"],
            512,
            1500,
            "budget 512 replies, 1500 steps a draft: the fp32 budget but steps as given",
        ),
        (
            ["--precision", "bf16", "--regen-samples", "1500", "--steps", "2500"],
            1500,
            2500,
            "budget 1500 replies, 2500 steps a draft (as given)",
        ),
    ],
)
def test_the_real_demos_budget_follows_its_precision(argv, replies, steps, line):
    """launch/demo_real.py: --regen-samples and --steps left unset come from the budget of the run's
    precision (fp32, on a CPU without bf16 instructions, runs the demo about 1.7x slower: a smaller budget in
    the same 45 minutes); what the command line gives is kept, and one line says which it is."""
    demo_real = load_script("launch/demo_real.py")
    args = demo_real._parse_args(argv)
    assert demo_real.apply_budget(args) == line
    assert (args.regen_samples, args.steps) == (replies, steps)
