"""A frozen Hugging Face target: for FSDP2 without a full copy per rank, or whole (load_full_target).

The model is built on the meta device (no memory), sharded with `fully_shard`, given empty local
shards, and each rank then reads only its own rows of every tensor from the safetensors files. The
rows are read with plain file reads, not through a memory map: the pages of a mapped file count
towards the process's resident memory while it is open, so slicing half of every tensor through a
map costs as much host memory as loading all of it (docs/benchmarks.md). Checkpoint names are mapped
to module names by transformers' own renaming rules for the model class (e.g. a
`model.language_model.*` checkpoint into a `*ForCausalLM`); checkpoint tensors the model lacks (a
vision tower) are skipped, as `from_pretrained` skips them. Mixture-of-experts checkpoints that store
each expert apart (Qwen3-MoE) are read into the model's fused expert tensors [E, ...], expert by
expert, as transformers' merge rule for them stacks them (`StackedExperts`).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dflash2.target.files import target_tensor_files

READ_BLOCK_BYTES = 16 << 20  # host memory in flight per read, whatever the tensor's size
# safetensors dtype names (https://github.com/huggingface/safetensors, format.md)
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _safetensors_header(path: Path) -> tuple[dict, int]:
    """(tensor name -> {dtype, shape, data_offsets}, byte offset where the data section starts)."""
    with open(path, "rb") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_size))
    header.pop("__metadata__", None)
    return header, 8 + header_size


def _copy_rows(path: Path, entry: dict, data_start: int, first_row: int, local: torch.Tensor) -> None:
    """Copy rows [first_row, first_row + len(local)) of one tensor of a safetensors file into `local`
    (a scalar: itself), through a host buffer of at most READ_BLOCK_BYTES, cast to local's dtype."""
    dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"]
    begin, end = entry["data_offsets"]
    rows = local.reshape(1, -1) if not shape else local  # a scalar is one row of one element
    row_bytes = (end - begin) // max(1, shape[0]) if shape else end - begin
    block_rows = max(1, READ_BLOCK_BYTES // max(1, row_bytes))
    with open(path, "rb", buffering=0) as f:
        for block in range(0, rows.shape[0], block_rows):
            num_rows = min(block_rows, rows.shape[0] - block)
            buffer = bytearray(row_bytes * num_rows)
            if not buffer:  # zero-size rows
                continue
            f.seek(data_start + begin + (first_row + block) * row_bytes)
            if f.readinto(buffer) != len(buffer):
                raise ValueError(f"{path}: truncated safetensors file; download the target again")
            piece = torch.frombuffer(buffer, dtype=dtype).reshape(num_rows, *rows.shape[1:])
            rows[block : block + num_rows].copy_(piece)


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's local tensor, its first row in the full tensor): FSDP2 shards dim 0."""
    if not isinstance(tensor, DTensor):
        return tensor, 0
    local_shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    assert tuple(local_shape[1:]) == tuple(tensor.shape[1:]) and not any(offset[1:]), tensor.placements
    return tensor.to_local(), offset[0] if local_shape[0] else 0


@dataclass(frozen=True)
class StackedExperts:
    """A fused expert tensor [E, ...] that the checkpoint stores per expert: expert e's slice is the
    concatenation, on its first dim, of `parts[p][e]` (checkpoint names) for p in order (transformers'
    MergeModulelist(dim=0), then Concatenate(dim=1) when there are several parts, e.g. gate and up)."""

    parts: tuple[tuple[str, ...], ...]


def read_local_shards(
    model: nn.Module, names: dict[str, str | StackedExperts], files: dict[str, Path]
) -> None:
    """Fill this rank's shard of every tensor from the checkpoint, casting the file's dtype to the model's."""
    headers: dict[Path, tuple[dict, int]] = {}

    def copy(name: str, first_row: int, local: torch.Tensor) -> None:
        path = files[name]
        if path not in headers:
            headers[path] = _safetensors_header(path)
        header, data_start = headers[path]
        _copy_rows(path, header[name], data_start, first_row, local)

    for source, tensor in _tensors_to_read(model, names).items():
        local, first_row = _local_rows(tensor)
        with torch.no_grad():
            if isinstance(source, StackedExperts):
                _copy_experts(source, first_row, local, copy)
            else:
                copy(source, first_row, local)


def _copy_experts(source: StackedExperts, first_expert: int, local: torch.Tensor, copy) -> None:
    """This rank's experts of a fused tensor (FSDP2 shards dim 0: whole experts); in each expert's
    slice the parts fill equal shares of its first dim, in order (gate, then up)."""
    rows = local.shape[1] // len(source.parts)
    assert rows * len(source.parts) == local.shape[1], (source, tuple(local.shape))
    for row in range(local.shape[0]):
        for index, part in enumerate(source.parts):
            copy(part[first_expert + row], 0, local[row, index * rows : (index + 1) * rows])


def build_on_meta(target_dir: str, dtype: torch.dtype) -> nn.Module:
    """The target's module tree from its config.json, parameters and buffers on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target_dir)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def checkpoint_names(model: nn.Module, checkpoint_keys: list[str]) -> dict[str, str | StackedExperts]:
    """Model state-dict name -> checkpoint tensor name (or the per-expert names of a fused expert
    tensor), by transformers' renaming and expert-merging rules for this class."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    model_keys = model.state_dict()
    names: dict[str, str | StackedExperts] = {}
    experts: dict[str, dict[tuple[int, int], str]] = {}  # fused name -> (part, expert) -> checkpoint name
    for key in checkpoint_keys:
        renamed, source_pattern = rename_source_key(
            key, renamings, converters, model.base_model_prefix, model_keys
        )
        if renamed not in model_keys:
            continue
        if source_pattern is None:
            names[renamed] = key
            continue
        converter = next(c for c in converters if source_pattern in c.source_patterns)
        part = converter.source_patterns.index(source_pattern)
        experts.setdefault(renamed, {})[part, _expert_index(key, source_pattern, converter, model)] = key
    for name, found in experts.items():
        names[name] = _stacked(name, found)
    return names


def _expert_index(key: str, source_pattern: str, converter, model: nn.Module) -> int:
    """The expert number in `key`, when `converter` only stacks experts (and concatenates parts)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    operations = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
    if operations not in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]):
        raise ValueError(
            f"checkpoint tensor {key!r} must be converted ({[type(op).__name__ for op in converter.operations]}) "
            f"to load into {type(model).__name__}, which sharded FSDP2 loading does not do; use "
            "backend=deepspeed"
        )
    pattern = re.escape(source_pattern).replace(r"\*", r"(\d+)")
    return int(re.search(pattern, key).group(1))


def _stacked(name: str, found: dict[tuple[int, int], str]) -> StackedExperts:
    num_parts = 1 + max(part for part, _ in found)
    num_experts = 1 + max(expert for _, expert in found)
    missing = [(p, e) for p in range(num_parts) for e in range(num_experts) if (p, e) not in found]
    if missing:
        raise ValueError(
            f"the target checkpoint lacks {len(missing)} expert tensors of {name}; point model.target at "
            "the complete Hugging Face directory"
        )
    return StackedExperts(tuple(tuple(found[p, e] for e in range(num_experts)) for p in range(num_parts)))


def _tensors_to_read(
    model: nn.Module, names: dict[str, str | StackedExperts]
) -> dict[str | StackedExperts, torch.Tensor]:
    """Checkpoint name -> this rank's (sharded) tensor to fill; a tensor shared by several names
    (tied embeddings) is read once, from whichever name the checkpoint holds."""
    by_tensor: dict[int, list[str]] = {}
    state = model.state_dict(keep_vars=True)
    for name, tensor in state.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    to_read, missing = {}, []
    for aliases in by_tensor.values():
        stored = [name for name in aliases if name in names]
        if not stored:
            missing.append(aliases[0])
            continue
        to_read[names[stored[0]]] = state[stored[0]].detach()  # shares the local shard's storage
    if missing:
        raise ValueError(
            f"the target checkpoint lacks {len(missing)} tensors of {type(model).__name__}, e.g. "
            f"{missing[:3]}; point model.target at the complete Hugging Face directory"
        )
    return to_read


def load_sharded_target(
    target_dir: str, dtype: torch.dtype, device: torch.device, shard: Callable[[nn.Module], None]
) -> nn.Module:
    """Build on meta, `shard(model)` (fully_shard), materialise the local shards on `device` and read
    them from the safetensors files. Frozen, eval(). Each rank reads on its own (no collective)."""
    files = target_tensor_files(target_dir)
    model = build_on_meta(target_dir, dtype)
    model.requires_grad_(False)
    model.eval()
    names = checkpoint_names(model, list(files))
    shard(model)
    model.to_empty(device=device)
    read_local_shards(model, names, files)
    init_non_persistent_buffers(model)
    return model


@torch.no_grad()
def init_non_persistent_buffers(model: nn.Module) -> None:
    """Compute the buffers no checkpoint holds (rotary `inv_freq`, ...) after `to_empty` left them
    uninitialised. transformers computes them in each model's `_init_weights`; every parameter and
    saved buffer is flagged as loaded first, so that pass (whose init functions skip flagged
    tensors) initialises nothing else."""
    for tensor in model.state_dict(keep_vars=True).values():
        tensor._is_hf_initialized = True
    for module in model.modules():  # set by the weight init at construction: let the pass run
        module._is_hf_initialized = False
    model.initialize_weights()


def load_full_target(target_dir: str | Path, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """The whole target in this process (no sharding): from_pretrained, frozen, eval(), on `device`.
    A checkpoint that lacks one of the model's weights, which transformers would initialise at
    random with only a log line, is refused (a Qwen3.5 config that ties the LM head at its top level
    but not in its text_config loads an untied, random head)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, output_loading_info=True)
    missing = sorted(info["missing_keys"])
    if missing:
        tie = (
            " The LM head is missing: if the target ties it to the embedding, say so where its text "
            "config is read (tie_word_embeddings: true in config.json's text_config)."
            if any(name.endswith("lm_head.weight") for name in missing)
            else ""
        )
        raise ValueError(
            f"{target_dir}: the checkpoint has no tensor for {missing[:4]}{' ...' if len(missing) > 4 else ''} "
            f"({len(missing)} of the model's weights), which would be initialised at random.{tie}"
        )
    model.requires_grad_(False)
    return model.eval().to(device)
