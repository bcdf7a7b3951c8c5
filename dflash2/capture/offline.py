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
The manifest is written last, by rank 0, after every rank has closed its shards and every shard is
on disk (fsynced): a crash mid-capture leaves no manifest, and a directory without one is refused.
The manifest records each shard's size, checked when training opens the directory.

Resume. Each shard names its samples and what they are features of (`feature_identity` and the
widths) in its safetensors metadata. A capture into a directory that holds shards of the same setup
(a crash, a full disk) captures only the samples no shard holds; shards of another setup, shards
without the metadata and the temporary files of an interrupted write are removed first.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from dflash2.capture.features import capture_samples, split_last_hidden
from dflash2.config import RunConfig
from dflash2.distributed import Backend
from dflash2.identity import RunIdentity
from dflash2.safetensors_io import fsync_path, save_tensors, write_durably

MANIFEST = "manifest.json"
SHARD_GLOB = "shard-*.safetensors"
OPEN_SHARDS = 64  # memory-mapped shards a reader keeps open (a map each; see OfflineFeatures)
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
    """Buffers one rank's per-sample features and writes a safetensors shard every `shard_bytes`,
    whole or not at all, on disk when `flush` returns, its samples and `stamp` (what they are
    features of) in its metadata. `first_number`: the number of its first shard (a resumed capture
    continues after the shards already there)."""

    def __init__(
        self, out_dir: Path, rank: int, shard_bytes: int, stamp: dict | None = None, first_number: int = 0
    ) -> None:
        self.out_dir, self.rank, self.shard_bytes, self.stamp = out_dir, rank, shard_bytes, stamp
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffered_bytes = 0
        self.sample_shard: dict[int, str] = {}  # sample index -> shard file name
        self.num_shards = first_number

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
        samples = sorted(int(index) for index in self.buffer if index.isdigit())
        metadata = {"samples": json.dumps(samples)}
        if self.stamp is not None:
            metadata["stamp"] = json.dumps(self.stamp, sort_keys=True)
        tmp = self.out_dir / f".{name}.tmp"
        save_tensors(self.buffer, tmp, metadata=metadata)
        fsync_path(tmp)
        os.replace(tmp, self.out_dir / name)  # whole or absent: a crash mid-write leaves only the tmp
        self.sample_shard.update(dict.fromkeys(samples, name))
        self.buffer, self.buffered_bytes, self.num_shards = {}, 0, self.num_shards + 1


def last_hidden_name(index: int | str) -> str:
    return f"{index}.last_hidden"


def _capture_rounds(todo: list[int], rank: int, world_size: int, batch_size: int) -> list[list[int]]:
    """This rank's batches of the samples `todo` (every world_size-th from its rank), padded with
    empty batches so that every rank runs the same number of target forwards: the sharded forward
    is collective."""
    mine = todo[rank::world_size]
    num_rounds = math.ceil(math.ceil(len(todo) / world_size) / batch_size)
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
    todo: list[int] | None = None,
    stamp: dict | None = None,
    first_number: int = 0,
) -> dict[int, str]:
    """Capture this rank's share of `todo` (default: the whole dataset) into shards under `out_dir`
    (features and the last hidden state; `stamp` and `first_number` as in ShardWriter); returns
    sample -> shard name. Collective over the target's group: every rank calls it with the same
    dataset and `todo`."""
    todo = list(range(len(dataset))) if todo is None else todo
    writer = ShardWriter(out_dir, backend.rank, shard_bytes, stamp, first_number)
    for indices in _capture_rounds(todo, backend.rank, backend.world_size, batch_size):
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
    """Write the manifest (rank 0, after all shards exist), atomically and on disk after every shard
    it names; `sample_keys`: each sample's tensor name in its shard (format 2; default: the sample's
    index). It records each shard's size in bytes, which the reader checks."""
    num_samples = len(lengths)
    missing = [i for i in range(num_samples) if i not in sample_shard]
    assert not missing, f"no shard holds samples {missing[:10]}"
    shards = sorted(set(sample_shard.values()))  # each fsynced by its writer before its rename
    fsync_path(out_dir)  # the shards' names before the manifest that lists them
    shard_index = {name: i for i, name in enumerate(shards)}
    manifest = {
        "format": FORMAT if sample_keys is None else FORMAT_KEYED,
        **identity,
        **meta,
        "num_samples": num_samples,
        "shards": shards,
        "shard_bytes": [(out_dir / name).stat().st_size for name in shards],
        "sample_shard": [shard_index[sample_shard[i]] for i in range(num_samples)],
        "sample_length": lengths,
    }
    if sample_keys is not None:
        manifest["sample_keys"] = sample_keys
    tmp = out_dir / f".{MANIFEST}.tmp"
    write_durably(tmp, json.dumps(manifest) + "\n")
    os.replace(tmp, out_dir / MANIFEST)
    fsync_path(out_dir)


def shard_stamp(identity: dict, meta: dict) -> dict:
    """What a shard's features are features of: the directory's identity and the widths."""
    return {**identity, **meta}


def _shard_number(name: str) -> tuple[int, int]:
    """(rank, number) of `shard-RRRRR-NNNNN.safetensors`."""
    _, rank, number = Path(name).stem.split("-")
    return int(rank), int(number)


def scan_shards(out_dir: Path, stamp: dict, num_samples: int) -> tuple[dict[int, str], list[str]]:
    """The samples the complete shards of `stamp` in `out_dir` hold (sample -> shard name), and the
    files a capture of `stamp` cannot use (removed by the caller): shards of another setup or
    without the metadata, and the temporary files of interrupted writes."""
    held, unusable = {}, [path.name for path in out_dir.glob(".shard-*.tmp")]
    wanted = json.dumps(stamp, sort_keys=True)
    for path in sorted(out_dir.glob(SHARD_GLOB)):
        try:
            with safe_open(str(path), framework="pt") as shard:
                metadata = shard.metadata() or {}
        except Exception:  # not a safetensors file (cut short by something else than our writer)
            metadata = {}
        samples = json.loads(metadata["samples"]) if "samples" in metadata else None
        if metadata.get("stamp") != wanted or samples is None or any(i >= num_samples for i in samples):
            unusable.append(path.name)
            continue
        held.update(dict.fromkeys(samples, path.name))
    return held, unusable


def _capture_plan(out_dir: Path, stamp: dict, lengths: list[int], token_bytes: int) -> dict:
    """Rank 0's start of a capture into `out_dir`: remove what it cannot use, find what it holds, and
    check that the rest fits on its file system. Returns {"held": sample -> shard, "error": message
    or None, "note": a line to print or None}."""
    (out_dir / MANIFEST).unlink(missing_ok=True)  # the old one would describe shards about to change
    held, unusable = scan_shards(out_dir, stamp, len(lengths))
    for name in unusable:
        (out_dir / name).unlink(missing_ok=True)
    remaining = sum(n for i, n in enumerate(lengths) if i not in held) * token_bytes
    free = shutil.disk_usage(out_dir).free
    notes = []
    if held:
        shards = len(set(held.values()))
        notes.append(
            f"resuming the capture in {out_dir}: {len(held)} of {len(lengths)} samples are in {shards} shards already"
        )
    if unusable:
        notes.append(f"removed {len(unusable)} shard files of another setup or cut short")
    error = None
    if remaining > free:
        error = (
            f"capturing the remaining {len(lengths) - len(held)} samples needs about {remaining / 2**30:.1f} GiB "
            f"in {out_dir}, which has {free / 2**30:.1f} GiB free: free some space or choose another --out "
            "(a capture interrupted by a full disk resumes where it stopped)"
        )
    return {"held": held, "error": error, "note": "; ".join(notes) or None}


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
    shards from every rank, then the manifest from rank 0 (`identity`: as in feature_identity). What
    complete shards of the same setup already hold there is not captured again (the module's
    "Resume")."""
    out_dir = Path(out_dir)
    directory_identity = feature_identity(cfg, layer_ids, identity)
    meta = {"feature_dim": hidden_size * len(layer_ids), "last_hidden_dim": hidden_size}
    stamp = shard_stamp(directory_identity, meta)
    lengths = [len(ids) for ids in dataset["input_ids"]]
    plan = None
    if backend.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        token_bytes = (len(layer_ids) + 1) * hidden_size * cfg.target_torch_dtype.itemsize
        plan = _capture_plan(out_dir, stamp, lengths, token_bytes)
    plans = [None] * backend.world_size
    dist.all_gather_object(plans, plan, group=backend.target_group)
    plan = next(p for p in plans if p is not None)
    if plan["error"]:
        raise ValueError(plan["error"])
    if backend.is_main and plan["note"]:
        print(f"[dflash2] {plan['note']}", flush=True)
    held = plan["held"]
    numbers = [number for rank, number in map(_shard_number, set(held.values())) if rank == backend.rank]
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
        todo=[i for i in range(len(lengths)) if i not in held],
        stamp=stamp,
        first_number=max(numbers, default=-1) + 1,
    )
    gathered = [None] * backend.world_size
    dist.all_gather_object(gathered, sample_shard, group=backend.target_group)
    if backend.is_main:
        merged = {**held, **{index: name for part in gathered for index, name in part.items()}}
        write_manifest(out_dir, directory_identity, merged, lengths, meta)
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
        self._check_shard_sizes()
        # shard index -> open safetensors handle, the OPEN_SHARDS most recently read: each holds a
        # memory map, and a long run reads every shard (a 1M-sample capture has tens of thousands,
        # past Linux's default of 65530 maps a process may hold)
        self._files: OrderedDict[int, object] = OrderedDict()

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

    def _check_shard_sizes(self) -> None:
        """Every shard the manifest names is there, as large as when it was written (a directory
        copied in part, a file cut short): refused at start rather than hours into a run."""
        sizes = self.manifest.get("shard_bytes")  # absent in directories written before it was recorded
        for i, name in enumerate(self.manifest["shards"]):
            path = self.features_dir / name
            found = path.stat().st_size if path.is_file() else None
            if found is None or (sizes is not None and found != sizes[i]):
                state = "is missing" if found is None else f"has {found} bytes, {sizes[i]} when written"
                raise ValueError(
                    f"data.features_dir={str(self.features_dir)!r}: shard {name} {state}; copy the directory "
                    f"again, or recapture: data_prep/capture.py --config <this run's config> --out {self.features_dir}"
                )

    def _shard(self, shard: int):
        if shard in self._files:
            self._files.move_to_end(shard)
            return self._files[shard]
        if len(self._files) >= OPEN_SHARDS:
            self._files.popitem(last=False)  # its map goes with the handle (read tensors are copies)
        handle = safe_open(str(self.features_dir / self.manifest["shards"][shard]), framework="pt")
        self._files[shard] = handle
        return handle

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
