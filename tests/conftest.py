"""Shared fixtures: the tiny default (built once under artifacts/tiny, cached by its stamp)."""

from __future__ import annotations

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
