"""The public Python API: the names `dflash2` exports, and README.md's "Python API" block run as written."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dflash2

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def python_api_block() -> str:
    """The first ```python block of README.md's section "## Python API"."""
    text = README.read_text()
    assert "\n## Python API\n" in text, "README.md has no '## Python API' section"
    section = text.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    assert "```python\n" in section, "the Python API section has no ```python block"
    return section.split("```python\n", 1)[1].split("\n```", 1)[0] + "\n"


def test_every_public_name_is_its_modules_object():
    for name in dflash2.__all__:
        module = importlib.import_module(dflash2._PUBLIC[name])
        assert getattr(dflash2, name) is getattr(module, name), name
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        dflash2.not_a_name  # noqa: B018


def test_import_dflash2_loads_nothing_else():
    code = "import sys, dflash2; print(sorted(m for m in sys.modules if m.startswith(('dflash2', 'torch'))))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['dflash2']"


def test_the_readme_block_is_short_and_uses_the_public_api():
    block = python_api_block()
    assert len(block.splitlines()) < 30
    assert "dflash2.fit(" in block and "dflash2.export_draft(" in block and "evaluate(" in block


def logged_losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_readme_block_runs_and_trains_as_a_launched_run(tmp_path):
    for name in ("configs", "artifacts", "ds_configs"):
        (tmp_path / name).symlink_to(REPO / name)
    script = tmp_path / "python_api.py"
    script.write_text(python_api_block())
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    measured = re.search(r"^tau \d\.\d\d, \d+\.\d\dx the target alone$", run.stdout, re.MULTILINE)
    assert measured, run.stdout[-2000:]  # the block's last line: the evaluation ran
    assert dflash2.check_export(tmp_path / "runs/python-api/export") == []
    api = logged_losses(tmp_path / "runs/python-api")
    assert len(api) == 4

    # the same overrides through the launcher: one FSDP2 process
    tiny = REPO / "artifacts" / "tiny"
    launched = subprocess.run(
        [
            sys.executable,
            str(REPO / "launch" / "train.py"),
            "--config",
            "configs/tiny-dflash2.yaml",
            "backend=fsdp",
            f"model.target={tiny / 'target'}",
            f"data.train={tiny / 'data' / 'train.jsonl'}",
            "output_dir=runs/launched",
            "train.max_steps=4",
            "train.log_every=1",
            "train.resume=none",
            "train.export=false",
            "train.progress_bar=false",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert launched.returncode == 0, launched.stderr[-4000:]
    assert api == pytest.approx(logged_losses(tmp_path / "runs/launched"), rel=1e-6)
