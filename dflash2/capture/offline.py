"""Offline capture: run the frozen target once over the dataset and store every sample's features.

Layout of a features directory:
  shard-RRRRR-NNNNN.safetensors   features of the samples rank R captured, one tensor [S_i, K*H] per
                                  sample, named by the sample's index in the dataset, and the target's
                                  final-normed last hidden state [S_i, H] (the LM head's input, the
                                  teacher of the KL / TV terms), named "<index>.last_hidden"
  manifest.json                   identities of the target config, tokenizer and data, the layer ids,
                                  the target dtype, max_length, the shard and length of every sample,
                                  and `last_hidden_dim` (H; absent in directories captured before the
                                  last hidden state was stored: they serve the cross-entropy only);
                                  format 2 (features kept during regeneration, `fused.py`) also names
                                  each sample's tensor in its shard (`sample_keys`), whose first
                                  `sample_length` positions are the sample's
The manifest is written last, by rank 0, after every rank has closed its shards: a crash mid-capture
leaves no manifest, and a directory without one is refused.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from dflash2.capture.features import capture_samples, split_last_hidden
from dflash2.config import RunConfig
from dflash2.distributed import Backend
from dflash2.identity import RunIdentity
from dflash2.safetensors_io import save_tensors

MANIFEST = "manifest.json"
FORMAT = "dflash2-features/1"
FORMAT_KEYED = "dflash2-features/2"  # with sample_keys
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
PRECISION_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}  # manifest dtype -> run config precision name
VALIDATED_FIELDS = ("target", "tokenizer", "data", "chat_template_kwargs", "max_length", "target_layer_ids")


def feature_identity(cfg: RunConfig, layer_ids: list[int], identity: RunIdentity | None = None) -> dict:
    """What a features directory is only valid for; OfflineFeatures compares it field by field.
    `identity`: the run's input identities when already hashed (default: hashed here)."""
    identity = identity or RunIdentity.of(cfg.model.target, cfg.data.train)
    return {
        "target": identity.target,
        "tokenizer": identity.tokenizer,
        "data": identity.dataset,
        "chat_template_kwargs": dict(cfg.data.chat_template_kwargs),
        "max_length": cfg.data.max_length,
        "target_layer_ids": [int(i) for i in layer_ids],
        "dtype": DTYPE_NAMES[cfg.target_torch_dtype],  # the target ran (and the features are stored) in it
    }


# ------------------------------------------------------------------ writing


class ShardWriter:
    """Buffers one rank's per-sample features and writes a safetensors shard every `shard_bytes`."""

    def __init__(self, out_dir: Path, rank: int, shard_bytes: int) -> None:
        self.out_dir, self.rank, self.shard_bytes = out_dir, rank, shard_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffered_bytes = 0
        self.sample_shard: dict[int, str] = {}  # sample index -> shard file name
        self.num_shards = 0

    def add(self, index: int, features: torch.Tensor, last_hidden: torch.Tensor) -> None:
        self.buffer[str(index)] = features.contiguous()
        self.buffer[last_hidden_name(index)] = last_hidden.contiguous()
        self.buffered_bytes += (features.numel() + last_hidden.numel()) * features.element_size()
        if self.buffered_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        name = f"shard-{self.rank:05d}-{self.num_shards:05d}.safetensors"
        save_tensors(self.buffer, self.out_dir / name)
        self.sample_shard.update({int(index): name for index in self.buffer if index.isdigit()})
        self.buffer, self.buffered_bytes, self.num_shards = {}, 0, self.num_shards + 1


def last_hidden_name(index: int | str) -> str:
    return f"{index}.last_hidden"


def _capture_rounds(num_samples: int, rank: int, world_size: int, batch_size: int) -> list[list[int]]:
    """This rank's batches (samples rank, rank + world, ...), padded with empty batches so that every
    rank runs the same number of target forwards: the sharded forward is collective."""
    mine = list(range(rank, num_samples, world_size))
    num_rounds = math.ceil(math.ceil(num_samples / world_size) / batch_size)
    batches = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
    return batches + [[] for _ in range(num_rounds - len(batches))]


@torch.no_grad()
def capture_dataset(
    backend: Backend,
    target: torch.nn.Module,
    dataset,
    layer_ids: list[int],
    out_dir: Path,
    *,
    hidden_size: int,
    pad_token_id: int,
    batch_size: int,
    shard_bytes: int,
) -> dict[int, str]:
    """Capture this rank's share of `dataset` (features and the last hidden state) into shards under
    `out_dir`; returns sample -> shard name. Collective over the target's group: every rank calls it
    with the same dataset."""
    writer = ShardWriter(out_dir, backend.rank, shard_bytes)
    for indices in _capture_rounds(len(dataset), backend.rank, backend.world_size, batch_size):
        capture_into(writer, backend, target, dataset, indices, layer_ids, hidden_size, pad_token_id)
    writer.flush()
    return writer.sample_shard


def capture_into(
    writer: ShardWriter,
    backend: Backend,
    target: torch.nn.Module,
    dataset,
    indices: list[int],
    layer_ids: list[int],
    hidden_size: int,
    pad_token_id: int,
) -> None:
    """One forward of `target` over samples `indices`; each sample's features and last hidden state,
    cut to its length, added to `writer`."""
    captured = capture_samples(backend, target, dataset, indices, layer_ids, pad_token_id, True).cpu()
    features, last_hidden = split_last_hidden(captured, hidden_size, True)
    for row, index in enumerate(indices):
        length = len(dataset[index]["input_ids"])
        writer.add(index, features[row, :length].clone(), last_hidden[row, :length].clone())


def write_manifest(
    out_dir: Path,
    identity: dict,
    sample_shard: dict[int, str],
    lengths: list[int],
    meta: dict,
    sample_keys: list[str] | None = None,
) -> None:
    """Atomically write the manifest (rank 0, after all shards exist); `sample_keys`: each sample's
    tensor name in its shard (format 2; default: the sample's index)."""
    num_samples = len(lengths)
    missing = [i for i in range(num_samples) if i not in sample_shard]
    assert not missing, f"no shard holds samples {missing[:10]}"
    shards = sorted(set(sample_shard.values()))
    shard_index = {name: i for i, name in enumerate(shards)}
    manifest = {
        "format": FORMAT if sample_keys is None else FORMAT_KEYED,
        **identity,
        **meta,
        "num_samples": num_samples,
        "shards": shards,
        "sample_shard": [shard_index[sample_shard[i]] for i in range(num_samples)],
        "sample_length": lengths,
    }
    if sample_keys is not None:
        manifest["sample_keys"] = sample_keys
    tmp = out_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest) + "\n")
    os.replace(tmp, out_dir / MANIFEST)


def capture_to_dir(
    cfg: RunConfig,
    backend: Backend,
    target: torch.nn.Module,
    dataset,
    layer_ids: list[int],
    out_dir: Path,
    *,
    hidden_size: int,
    pad_token_id: int,
    batch_size: int,
    shard_bytes: int,
    identity: RunIdentity | None = None,
) -> Path:
    """The whole offline capture of run `cfg` into `out_dir` (collective over the target's group):
    shards from every rank, then the manifest from rank 0 (`identity`: as in feature_identity)."""
    out_dir = Path(out_dir)
    if backend.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / MANIFEST).unlink(missing_ok=True)  # the old one would describe shards about to change
    backend.barrier()
    sample_shard = capture_dataset(
        backend,
        target,
        dataset,
        layer_ids,
        out_dir,
        hidden_size=hidden_size,
        pad_token_id=pad_token_id,
        batch_size=batch_size,
        shard_bytes=shard_bytes,
    )
    gathered = [None] * backend.world_size
    dist.all_gather_object(gathered, sample_shard, group=backend.target_group)
    if backend.is_main:
        merged = {index: name for part in gathered for index, name in part.items()}
        lengths = [len(ids) for ids in dataset["input_ids"]]
        meta = {"feature_dim": hidden_size * len(layer_ids), "last_hidden_dim": hidden_size}
        write_manifest(out_dir, feature_identity(cfg, layer_ids, identity), merged, lengths, meta)
        print(f"[dflash2] captured {len(lengths)} samples into {out_dir}", flush=True)
    backend.barrier()
    return out_dir


# ------------------------------------------------------------------ reading


def _mismatch_message(features_dir: Path, field: str, saved, current) -> str:
    return (
        f"{features_dir / MANIFEST}: {field} is {saved!r} in the features but {current!r} in this run; "
        f"the features were captured for a different setup. Re-run data_prep/capture.py --config <this run's "
        f"config> --out {features_dir} (or set data.features_dir to features captured for this run)"
    )


class OfflineFeatures:
    """Features written by data_prep/capture.py, checked against the run that reads them.

    `expected` is `feature_identity(cfg, layer_ids)` of the current run; any difference is a
    ValueError naming the field, both values and the fix. With `last_hidden` (a run with a KL or TV
    weight), `batch` appends the target's last hidden state: [b, S, K*H + H].
    """

    def __init__(self, features_dir: str | Path, expected: dict, last_hidden: bool = False) -> None:
        self.features_dir = Path(features_dir)
        path = self.features_dir / MANIFEST
        if not path.is_file():
            raise ValueError(
                f"data.features_dir={str(self.features_dir)!r} has no {MANIFEST} (missing, or the capture did not "
                "finish); run data_prep/capture.py --config <run config> --out <features_dir> first"
            )
        self.manifest = json.loads(path.read_text())
        if self.manifest.get("format") not in (FORMAT, FORMAT_KEYED):
            raise ValueError(
                _mismatch_message(self.features_dir, "format", self.manifest.get("format"), FORMAT_KEYED)
            )
        for field in VALIDATED_FIELDS:
            if self.manifest.get(field) != expected[field]:
                raise ValueError(
                    _mismatch_message(self.features_dir, field, self.manifest.get(field), expected[field])
                )
        self._check_dtype(expected["dtype"])
        self.num_samples = int(self.manifest["num_samples"])
        self.feature_dim = int(self.manifest["feature_dim"])
        self.last_hidden = last_hidden
        if last_hidden and "last_hidden_dim" not in self.manifest:
            raise ValueError(
                f"data.features_dir={str(self.features_dir)!r} was captured without the target's last hidden "
                "state, which objective.kl_weight / objective.tv_weight / objective.labels=target need (the "
                "target's distribution); recapture: data_prep/capture.py --config <this run's config> --out "
                f"{self.features_dir} (or train these features with objective.kl_weight=0, "
                "objective.tv_weight=0 and objective.labels=data)"
            )
        self._files: dict[int, object] = {}  # shard index -> open safetensors handle (memory-mapped)

    def check_samples(self, dataset) -> None:
        """The features are those of this run's samples, index by index: as many samples, each as long
        as its captured features (a data setting that keeps other conversations, such as
        data.duplicates or data.on_error, shifts every index after the first difference)."""
        import pyarrow.compute as pc

        lengths = pc.list_value_length(dataset.with_format("arrow")["input_ids"]).to_pylist()
        captured = [int(n) for n in self.manifest["sample_length"]]
        differs = next((i for i, (a, b) in enumerate(zip(lengths, captured)) if a != b), None)
        if len(lengths) == len(captured) and differs is None:
            return
        what = (
            f"{len(captured)} samples were captured, this run's data has {len(lengths)}"
            if differs is None
            else f"sample {differs} has {lengths[differs]} tokens in this run's data but {captured[differs]} "
            "in the features"
        )
        raise ValueError(
            f"data.features_dir={str(self.features_dir)!r} does not hold this run's samples: {what} (the data "
            "settings keep other conversations than at capture: data.duplicates, data.on_error, "
            f"data.max_length); recapture: data_prep/capture.py --config <this run's config> --out {self.features_dir}"
        )

    def _check_dtype(self, expected: str) -> None:
        """Features of a target run in another dtype are other numbers than online capture would give
        this run (casting them would hide it): refuse, naming both ways to agree."""
        saved = self.manifest.get("dtype")
        if saved == expected:
            return
        agree = (
            f"set model.target_dtype={PRECISION_OF_DTYPE[saved]} to train on these features, or "
            if saved in PRECISION_OF_DTYPE
            else ""
        )
        raise ValueError(
            f"{self.features_dir / MANIFEST}: the features were captured with the target in {saved}, but this "
            f"run's target dtype is {expected} (model.target_dtype, default: precision); {agree}re-run "
            f"data_prep/capture.py --config <this run's config> --out {self.features_dir} to capture them in "
            f"{expected}"
        )

    def _shard(self, shard: int):
        if shard not in self._files:
            self._files[shard] = safe_open(
                str(self.features_dir / self.manifest["shards"][shard]), framework="pt"
            )
        return self._files[shard]

    def sample(self, index: int) -> torch.Tensor:
        """Features of sample `index`: [S_i, K*H] (then its last hidden state: [S_i, K*H + H] when
        this reader was asked for it)."""
        if not 0 <= index < self.num_samples:
            raise ValueError(f"sample {index} is not in the features ({self.num_samples} samples captured)")
        shard = self._shard(self.manifest["sample_shard"][index])
        key = self.manifest["sample_keys"][index] if "sample_keys" in self.manifest else str(index)
        length = int(self.manifest["sample_length"][index])
        features = shard.get_slice(key)[:length]
        if not self.last_hidden:
            return features
        return torch.cat([features, shard.get_slice(last_hidden_name(key))[:length]], dim=-1)

    def batch(self, indices: list[int], seq_len: int) -> torch.Tensor:
        """[b, seq_len, K*H] (or K*H + H, see the class): the samples' features, right-padded with zeros."""
        width = self.feature_dim + (int(self.manifest["last_hidden_dim"]) if self.last_hidden else 0)
        out = torch.zeros(len(indices), seq_len, width, dtype=getattr(torch, self.manifest["dtype"]))
        for row, index in enumerate(indices):
            features = self.sample(index)
            if features.shape[0] > seq_len:
                raise ValueError(
                    f"sample {index} has features for {features.shape[0]} positions but the batch has {seq_len}; "
                    "the data changed since capture: re-run data_prep/capture.py"
                )
            out[row, : features.shape[0]] = features
        return out
