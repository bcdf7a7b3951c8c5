"""Pickle-free storage of the backends' sharded state, readable on any number of ranks.

A nested structure of dicts, lists, tuples, scalars and tensors is split into a safetensors file
(the tensors, under their path in the structure) and a JSON file (everything else, with each tensor
replaced by a reference). Loading never unpickles anything.

A sharded tensor (a DTensor sharded on dim 0, or a `FlatShard`) is stored as this rank's contiguous
piece of the tensor seen flattened, with the full shape and the piece's first element. Every rank
writes the same structure, so a tensor's pieces across the saved ranks cover it; `ShardedState`
reads any element range of it back from the pieces that hold it, which is how a checkpoint written
by N ranks resumes on M.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from dflash2.safetensors_io import save_tensors

FORMAT = 2  # 1: each rank's state loaded only by the same rank of the same number of ranks
_TENSOR = "__tensor__"
_SHARD = "__shard__"
_TUPLE = "__tuple__"
_DICT = "__dict__"


@dataclass
class FlatShard:
    """Elements [start, start + local.numel()) of a tensor of `shape`, seen flattened (row-major)."""

    local: torch.Tensor
    shape: tuple[int, ...]
    start: int


def dtensor_shard(tensor: DTensor) -> FlatShard:
    """A DTensor sharded on dim 0 (FSDP2): its local rows are one contiguous piece of the flattened tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    assert tuple(local_shape[1:]) == tuple(tensor.shape[1:]) and not any(offset[1:]), tensor.placements
    row_numel = math.prod(tensor.shape[1:])
    return FlatShard(tensor.to_local(), tuple(tensor.shape), offset[0] * row_numel if local_shape[0] else 0)


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, DTensor):
        obj = dtensor_shard(obj)
    if isinstance(obj, FlatShard):
        tensors[path] = obj.local.detach().cpu().reshape(-1).clone()
        return {_SHARD: path, "shape": list(obj.shape), "start": obj.start}
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().cpu().contiguous().clone()
        return {_TENSOR: path}
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


def save_state(obj: Any, prefix: Path) -> None:
    """Write `prefix`.safetensors and `prefix`.json; sharded tensors as this rank's piece."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(obj, "root", tensors)
    save_tensors(tensors, str(prefix) + ".safetensors")
    Path(str(prefix) + ".json").write_text(json.dumps(tree))


def _shard_starts(tree: Any, starts: dict[str, int]) -> None:
    """Collect {path: first element} of every sharded tensor's piece in a saved tree."""
    if isinstance(tree, list):
        for value in tree:
            _shard_starts(value, starts)
    elif isinstance(tree, dict):
        if _SHARD in tree:
            starts[tree[_SHARD]] = tree["start"]
        for value in tree.get(_TUPLE, []) + [value for _, value in tree.get(_DICT, [])]:
            _shard_starts(value, starts)


def rank_files(directory: Path, num_ranks: int) -> list[Path]:
    """The files that `num_ranks` ranks' save_state wrote under `directory`: a JSON structure and a
    safetensors file each."""
    return [
        Path(directory) / f"rank{rank:05d}{ext}"
        for rank in range(num_ranks)
        for ext in (".json", ".safetensors")
    ]


class ShardedState:
    """The state that `num_ranks` ranks saved with `save_state` under `directory/rankRRRRR`."""

    def __init__(self, directory: Path, num_ranks: int) -> None:
        self.prefixes = [Path(directory) / f"rank{rank:05d}" for rank in range(num_ranks)]
        missing = [str(path) for path in rank_files(directory, num_ranks) if not path.is_file()]
        if missing:
            raise ValueError(f"incomplete checkpoint: missing {missing}; resume from another checkpoint")
        self.trees = [json.loads(Path(str(p) + ".json").read_text()) for p in self.prefixes]

    def load(self, local_range: Callable[[tuple[int, ...]], tuple[int, int]]) -> Any:
        """Rank 0's structure, with each plain tensor as saved by rank 0 and each sharded tensor of
        shape s replaced by elements `local_range(s)` = [begin, end) of it (a 1-D tensor), gathered
        from the pieces of every saved rank."""
        with ExitStack() as stack:
            files = [
                stack.enter_context(safe_open(str(p) + ".safetensors", framework="pt")) for p in self.prefixes
            ]
            pieces = []  # per saved rank: {path: (first element, number of elements)}
            for tree, file in zip(self.trees, files):
                starts: dict[str, int] = {}
                _shard_starts(tree, starts)
                pieces.append(
                    {path: (start, file.get_slice(path).get_shape()[0]) for path, start in starts.items()}
                )

            def read(path: str, shape: tuple[int, ...]) -> torch.Tensor:
                begin, end = local_range(shape)
                parts = []
                for file, held in zip(files, pieces):
                    start, numel = held[path]
                    lo, hi = max(begin, start), min(end, start + numel)
                    if lo < hi:
                        parts.append((lo, file.get_slice(path)[lo - start : hi - start]))
                parts.sort(key=lambda part: part[0])
                assert sum(p.numel() for _, p in parts) == end - begin, (path, begin, end)
                if not parts:
                    return files[0].get_slice(path)[0:0]  # an empty piece, in the saved dtype
                return torch.cat([p for _, p in parts])

            return _decode(self.trees[0], files[0], read)


def _decode(obj: Any, file, read: Callable[[str, tuple[int, ...]], torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(value, file, read) for value in obj]
    if isinstance(obj, dict):
        if _SHARD in obj:
            return read(obj[_SHARD], tuple(obj["shape"]))
        if _TENSOR in obj:
            return file.get_tensor(obj[_TENSOR])
        if _TUPLE in obj:
            return tuple(_decode(value, file, read) for value in obj[_TUPLE])
        return {key: _decode(value, file, read) for key, value in obj[_DICT]}
    return obj


def chunk_range(numel: int, rank: int, num_ranks: int) -> tuple[int, int]:
    """Elements [begin, end) of rank `rank` when `numel` elements are cut into `num_ranks` chunks of
    ceil(numel / num_ranks) (the last ones shorter or empty): ZeRO-3's partitions of a flattened
    parameter, and FSDP2's dim-0 shards counted in rows."""
    size = math.ceil(numel / num_ranks)
    return min(numel, rank * size), min(numel, (rank + 1) * size)


def write_backend_meta(ckpt_dir: Path, backend_name: str, world_size: int) -> None:
    meta = {"backend": backend_name, "world_size": world_size, "format": FORMAT}
    (ckpt_dir / "backend.json").write_text(json.dumps(meta))


def check_backend_meta(ckpt_dir: Path, backend_name: str) -> int:
    """The sharded state loads only into the backend that wrote it; returns the number of ranks that did."""
    meta_path = ckpt_dir / "backend.json"
    if not meta_path.is_file():
        raise ValueError(f"{ckpt_dir} holds no backend state (missing backend.json)")
    meta = json.loads(meta_path.read_text())
    if meta["backend"] != backend_name:
        raise ValueError(
            f"checkpoint backend: saved {meta['backend']!r}, new {backend_name!r}; resume with the same backend"
        )
    if meta.get("format", 1) != FORMAT:
        raise ValueError(
            f"{ckpt_dir.parent} was written in checkpoint format {meta.get('format', 1)} by an older dflash2; "
            f"this version reads format {FORMAT}: resume it with the version that wrote it, or start a new run"
        )
    return meta["world_size"]
