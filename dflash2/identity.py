"""Identities (content hashes) of the target, tokenizer and data, for the resume contract and the
offline-capture manifest: a checkpoint or a feature cache is only valid for the inputs it was made from."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def target_identity(target_dir: str | Path) -> str:
    """Hash of the target's config.json (canonical JSON, so key order and whitespace do not matter)."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    return _sha(json.dumps(config, sort_keys=True).encode())


def tokenizer_identity(tokenizer_dir: str | Path) -> str:
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(tokenizer_dir) / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def data_identity(path: str | Path) -> str:
    """Hash of a data file, or of every file under a directory (relative names included)."""
    path = Path(path)
    if path.is_file():
        return _sha(path.read_bytes())
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class RunIdentity:
    """The identities of a run's inputs, hashed once per run: the target's config, its tokenizer and
    the training data (`data.train`)."""

    target: str
    tokenizer: str
    dataset: str

    @classmethod
    def of(cls, target_dir: str | Path, data_path: str | Path) -> RunIdentity:
        return cls(target_identity(target_dir), tokenizer_identity(target_dir), data_identity(data_path))
