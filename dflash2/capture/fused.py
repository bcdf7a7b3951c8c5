"""Features kept while the target regenerates the replies (`data_prep/regenerate.py --capture-config`).

Offline capture (`offline.py`) runs the target once more over every regenerated conversation; the
regeneration had already run it over every prompt and reply token. With `--capture-config` the
local generator keeps those forwards' layer outputs (`dflash2.target.recorded_generate`) and
`StagedFeatures` writes them, one `fused-NNNNN.safetensors` file per regenerated batch, into the
features directory, before the batch's lines reach the regenerated file. After the last batch,
`finish_fused_capture` writes the manifest of the usual features directory (format 2: each sample
names its tensor, `sample_keys`, so the staged files serve as they are): a sample's staged features
are used when their token ids are the prepared dataset's (truncated to `data.max_length`, a prefix
of them); any other sample (a conversation with turns after its last reply, a reply regenerated
without `--capture-config` or before a crash, ...) is captured by a forward of the target here,
into `shard-*` files. Training reads the directory as any other (`data.features_dir`).

The staged features come from the generation's incremental forwards: equal to those of one forward
over the conversation up to floating-point rounding (in bf16, about 1% of a deep layer's norm).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from dflash2.capture.offline import (
    MANIFEST,
    ShardWriter,
    capture_into,
    feature_identity,
    write_manifest,
)
from dflash2.config import RunConfig
from dflash2.data.regenerate import Reply
from dflash2.distributed.local_backend import LocalBackend
from dflash2.identity import RunIdentity
from dflash2.safetensors_io import fsync_path, save_tensors

STAGED_GLOB = "fused-*.safetensors"


def staged_number(path: Path) -> int:
    """N of `fused-N.safetensors` (at least 5 digits: past 99999 the names no longer sort by it)."""
    return int(path.stem.split("-")[1])


def regeneration_stamp(cfg: RunConfig, layer_ids: list[int], identity: RunIdentity) -> dict:
    """What staged features are features of: feature_identity less the data and max_length (the
    finish checks each sample's token ids against the prepared data instead)."""
    stamp = feature_identity(cfg, layer_ids, identity)
    return {key: value for key, value in stamp.items() if key not in ("data", "max_length")}


class StagedFeatures:
    """A FeatureSink: each batch's recorded features as one safetensors file in `out_dir`, tagged
    with `stamp` (what they are features of: target, tokenizer, layers, dtype, chat template)."""

    def __init__(self, out_dir: str | Path, stamp: dict, hidden_size: int) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.stamp, self.hidden_size = stamp, hidden_size
        numbers = [staged_number(path) for path in self.out_dir.glob(STAGED_GLOB)]
        self.next_number = max(numbers, default=-1) + 1

    def add(self, ids: list[str], replies: list[Reply | str]) -> None:
        tensors, kept = {}, []
        for sample_id, reply in zip(ids, replies):
            if not isinstance(reply, Reply) or reply.features is None:
                continue
            key = str(len(kept))
            tensors[key] = reply.features[:, : -self.hidden_size].contiguous()
            tensors[f"{key}.last_hidden"] = reply.features[:, -self.hidden_size :].contiguous()
            tensors[f"{key}.input_ids"] = torch.tensor(reply.feature_ids, dtype=torch.long)
            kept.append(sample_id)
        if not kept:
            return
        path = self.out_dir / f"fused-{self.next_number:05d}.safetensors"
        tmp = path.with_name(f".{path.name}.tmp")
        save_tensors(tensors, tmp, metadata={"ids": json.dumps(kept), "stamp": json.dumps(self.stamp)})
        fsync_path(tmp)
        os.replace(tmp, path)  # whole or absent: a crash mid-write leaves only the tmp file
        self.next_number += 1


def _staged_index(out_dir: Path, stamp: dict) -> tuple[dict[str, tuple[str, str]], int]:
    """sample id -> (file name, tensor key) of its newest staged features with this `stamp`, and the
    number of staged files made for another setup (ignored)."""
    index, num_other = {}, 0
    for path in sorted(out_dir.glob(STAGED_GLOB), key=staged_number):  # oldest first: the newest wins
        with safe_open(str(path), framework="pt") as staged:
            metadata = staged.metadata()
        if json.loads(metadata["stamp"]) != stamp:
            num_other += 1
            continue
        for key, sample_id in enumerate(json.loads(metadata["ids"])):
            index[sample_id] = (path.name, str(key))
    return index, num_other


def _staged_ids_match(out_dir: Path, place: tuple[str, str], input_ids: list[int]) -> bool:
    with safe_open(str(out_dir / place[0]), framework="pt") as staged:
        ids = staged.get_tensor(f"{place[1]}.input_ids").tolist()
    return len(ids) >= len(input_ids) and ids[: len(input_ids)] == list(input_ids)


def _capture_rest(
    model,
    dataset,
    indices: list[int],
    layer_ids: list[int],
    writer: ShardWriter,
    pad_token_id: int,
    batch_size: int,
) -> None:
    """The offline capture's forward (capture_samples, in this one process) for the samples without
    staged features."""
    backend = LocalBackend(device=next(model.parameters()).device)
    hidden_size = model.config.get_text_config().hidden_size
    for first in range(0, len(indices), batch_size):
        batch = indices[first : first + batch_size]
        capture_into(writer, backend, model, dataset, batch, layer_ids, hidden_size, pad_token_id)
    writer.flush()


def finish_fused_capture(
    out_dir: str | Path,
    dataset,
    identity: dict,
    stamp: dict,
    model,
    *,
    layer_ids: list[int],
    pad_token_id: int,
    batch_size: int,
    shard_bytes: int,
) -> dict[str, int]:
    """Write the manifest of `out_dir` for `dataset` (the prepared regenerated file): staged features
    where they match, a forward of `model` for the rest. `identity`: offline.feature_identity of the
    run. Returns counts: `num_staged` (samples served by staged features), `num_captured` (by a
    forward here), `num_other_setup` (staged files of another setup, ignored)."""
    out_dir = Path(out_dir)
    (out_dir / MANIFEST).unlink(missing_ok=True)
    for old in out_dir.glob("shard-*.safetensors"):  # a previous finish's forwards, redone below
        old.unlink()
    staged, num_other = _staged_index(out_dir, stamp)
    sample_shard, sample_keys, rest = {}, {}, []
    for index, sample_id in enumerate(dataset["id"]):
        place = staged.get(sample_id)
        if place is not None and _staged_ids_match(out_dir, place, dataset[index]["input_ids"]):
            sample_shard[index], sample_keys[index] = place
        else:
            rest.append(index)
    writer = ShardWriter(out_dir, 0, shard_bytes)
    _capture_rest(model, dataset, rest, layer_ids, writer, pad_token_id, batch_size)
    sample_shard.update(writer.sample_shard)
    sample_keys.update({index: str(index) for index in writer.sample_shard})
    hidden_size = model.config.get_text_config().hidden_size
    lengths = [len(ids) for ids in dataset["input_ids"]]
    meta = {"feature_dim": hidden_size * len(layer_ids), "last_hidden_dim": hidden_size}
    keys = [sample_keys[i] for i in range(len(lengths))]
    write_manifest(out_dir, identity, sample_shard, lengths, meta, sample_keys=keys)
    return {"num_staged": len(lengths) - len(rest), "num_captured": len(rest), "num_other_setup": num_other}
