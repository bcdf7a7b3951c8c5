"""Pickle-free storage of nested state (optimizer / scheduler / engine state dicts).

A nested structure of dicts, lists, tuples, scalars and tensors is split into a safetensors file
(the tensors, under their path in the structure) and a JSON file (everything else, with each tensor
replaced by a reference). Loading never unpickles anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_DICT = "__dict__"


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        is_dtensor = isinstance(obj, DTensor)
        local = obj.to_local() if is_dtensor else obj
        tensors[path] = local.detach().cpu().contiguous().clone()
        return {_TENSOR: path, "dtensor": is_dtensor}  # recorded for readers; load gives the local shard
    if isinstance(obj, dict):
        # keys may be ints (optimizer state is keyed by parameter index): keep them as pairs
        return {_DICT: [[key, _encode(value, f"{path}.{key}", tensors)] for key, value in obj.items()]}
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(value, f"{path}.{i}", tensors) for i, value in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(value, f"{path}.{i}", tensors) for i, value in enumerate(obj)]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} at {path!r} without pickling")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(value, tensors) for value in obj]
    if isinstance(obj, dict):
        if _TENSOR in obj:
            return tensors[obj[_TENSOR]]
        if _TUPLE in obj:
            return tuple(_decode(value, tensors) for value in obj[_TUPLE])
        return {key: _decode(value, tensors) for key, value in obj[_DICT]}
    return obj


def save_state(obj: Any, prefix: Path) -> None:
    """Write `prefix`.safetensors and `prefix`.json. DTensors are stored as their local shard."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(obj, "root", tensors)
    save_file(tensors, str(prefix) + ".safetensors")
    Path(str(prefix) + ".json").write_text(json.dumps(tree))


def load_state(prefix: Path) -> Any:
    """Inverse of save_state (DTensors come back as plain local tensors)."""
    tensors = load_file(str(prefix) + ".safetensors")
    return _decode(json.loads(Path(str(prefix) + ".json").read_text()), tensors)


def write_backend_meta(ckpt_dir: Path, backend_name: str, world_size: int) -> None:
    (ckpt_dir / "backend.json").write_text(json.dumps({"backend": backend_name, "world_size": world_size}))


def check_backend_meta(ckpt_dir: Path, backend_name: str, world_size: int) -> None:
    """The sharded state loads only into the same backend on the same number of ranks."""
    meta_path = ckpt_dir / "backend.json"
    if not meta_path.is_file():
        raise ValueError(f"{ckpt_dir} holds no backend state (missing backend.json)")
    meta = json.loads(meta_path.read_text())
    if meta["backend"] != backend_name:
        raise ValueError(
            f"checkpoint backend: saved {meta['backend']!r}, new {backend_name!r}; resume with the same backend"
        )
    if meta["world_size"] != world_size:
        raise ValueError(
            f"checkpoint world_size: saved {meta['world_size']}, new {world_size}; resume on the same number of ranks"
        )
