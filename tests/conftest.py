"""Shared fixtures: the tiny default (built once under artifacts/tiny, cached by its stamp)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from dflash2.data.tiny_default import TinyDefault, build_tiny_default

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_default() -> TinyDefault:
    return build_tiny_default(REPO_ROOT / "artifacts" / "tiny")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_default: TinyDefault):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_default.target_dir)


@pytest.fixture
def launched():
    """Start runs in sessions of their own; whatever is left of them (launcher, workers in their own
    sessions, a frozen worker) is killed at the end of the test."""
    processes: list[subprocess.Popen] = []
    pids: set[int] = set()

    def start(command: list[str], log: Path, extra_env: dict | None = None) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(log, "w") as out:
            process = subprocess.Popen(
                command, cwd=REPO_ROOT, env={**env, **(extra_env or {})}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        processes.append(process)
        return process

    start.track = pids.update  # workers found later
    yield start
    for pid in pids | {p.pid for p in processes}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for process in processes:
        process.wait(timeout=30)
