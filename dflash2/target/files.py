"""Which safetensors file of a Hugging Face model directory holds each tensor (one
`model.safetensors`, or the shards named by `model.safetensors.index.json`), and its tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def tensor_files(model_dir: str | Path) -> dict[str, Path] | None:
    """Tensor name -> the file that holds it (headers only, no tensor is read); None when the
    directory has neither file."""
    model_dir = Path(model_dir)
    single = model_dir / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    return None


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a directory (its one file, or the shards its index names), sorted;
    [] when it has none."""
    files = tensor_files(model_dir)
    return sorted(set(files.values())) if files else []


def load_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of `files` (weight_files), as one state dict."""
    state = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def target_tensor_files(target_dir: str | Path) -> dict[str, Path]:
    """tensor_files of `model.target`; a directory without safetensors is the user's to fix."""
    files = tensor_files(target_dir)
    if files is None:
        raise ValueError(
            f"model.target={str(target_dir)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}; "
            "point it at a Hugging Face directory saved with safetensors"
        )
    return files


def read_tensor(files: dict[str, Path], name: str):
    """Tensor `name` from the file `files` (tensor_files) says holds it."""
    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name)
