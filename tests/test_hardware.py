"""bf16 only where the CPU computes it: the flags read from /proc/cpuinfo, the demo's default
precision and its budget, and the warning of a bf16 run on a CPU that emulates bf16."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import torch

from dflash2.hardware import (
    check_device,
    cpu_flags,
    cpu_has_native_bf16,
    default_cpu_precision,
    slow_bf16_warning,
)
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


def test_a_device_the_machine_lacks_is_one_message_naming_the_fix(monkeypatch):
    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="--device 'cdua' is not a device: use cpu, or cuda"):
        check_device("cdua")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ValueError, match="--device cuda: this machine has no usable CUDA device; use --device cpu"
    ):
        check_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match="has 2 CUDA device"):
        check_device("cuda:2")


def test_the_real_demo_refuses_train_overrides_of_what_it_sets(capsys):
    demo_real = load_script("launch/demo_real.py")
    assert demo_real._parse_args(["--train", "objective.num_anchors=32"]).train == [
        "objective.num_anchors=32"
    ]
    for item, fix in (("train.max_steps=100", "use --steps"), ("data.max_length=512", "use --max-length")):
        with pytest.raises(SystemExit):
            demo_real._parse_args(["--train", item])
        assert f"--train {item}: the demo sets {item.split('=')[0]} itself; {fix}" in capsys.readouterr().err


def test_the_real_demo_reuses_only_drafts_of_the_recipe_asked(tmp_path):
    """--reuse-drafts: the summary records the command's recipe, so the drafts must have it."""
    import argparse

    from dflash2.config import load_run_config, save_run_config

    demo_real = load_script("launch/demo_real.py")
    draft = {
        "architectures": ["X"],
        "num_hidden_layers": 2,
        "dflash_config": {"block_size": 4, "target_layer_ids": [1]},
    }
    configs = {}
    for name in demo_real.CONFIGS:
        (tmp_path / name / "export").mkdir(parents=True)
        (tmp_path / name / "export" / "config.json").write_text(json.dumps(draft))
        (tmp_path / name / "export" / "training_run.json").write_text(json.dumps({"step": 10}))
        trained = ["precision=bf16", "objective.num_anchors=64", "train.lr=0.001"]
        save_run_config(
            load_run_config(demo_real.REPO / demo_real.CONFIGS[name], trained),
            tmp_path / name / "config.yaml",
        )
        configs[name] = tmp_path / f"{name}.json"
        configs[name].write_text(json.dumps(draft))
    # the overrides read as a launch reads them: 1e-3 is the float the run trained with
    args = argparse.Namespace(steps=10, precision="bf16", train=["objective.num_anchors=64", "train.lr=1e-3"])
    assert demo_real.reused_drafts(args, tmp_path, configs) == {
        n: tmp_path / n / "export" for n in demo_real.CONFIGS
    }
    configs["dflash2"].write_text(json.dumps({**draft, "num_hidden_layers": 3}))
    args.train = ["objective.num_anchors=32"]
    with pytest.raises(SystemExit) as refused:
        demo_real.reused_drafts(args, tmp_path, configs)
    assert "dflash2's num_hidden_layers is 2, these flags make 3" in str(refused.value)
    assert "dflash trained with objective.num_anchors=64, not 32" in str(refused.value)
