"""Atomic checkpoints, the `latest` pointer, rotation, resume with the contract check, and the train
state. This module alone knows the layout of a checkpoint directory; everything else asks it.

Layout of `run_dir/checkpoints/step_XXXXXXXX/`:
  draft_config.json, draft.safetensors (full fp32 draft weights, what export reads), contract.json,
  train_state.json, rng_rank{r}.safetensors + rng_rank{r}.json, backend/ (each rank's shard of draft,
  optimizer and scheduler state, readable by any number of ranks), COMPLETE (written last).
A checkpoint is written into `.tmp-step_XXXXXXXX` and renamed when complete, so a crash mid-save
never touches the previous checkpoint and a half-written directory is never picked. Durable: every file
and directory of it is fsynced before COMPLETE is written, and COMPLETE before `latest` moves; a
checkpoint is deleted COMPLETE first. A failed write (a full disk, ...) removes what it wrote and
leaves `latest` as it was. Everything loads from safetensors and JSON: no pickles.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from dflash2.config import RunConfig, read_json_object
from dflash2.distributed.base import Backend
from dflash2.distributed.state_io import check_backend_meta, rank_files
from dflash2.errors import ReportedError
from dflash2.identity import RunIdentity
from dflash2.models.config import load_config_dict
from dflash2.safetensors_io import fsync_path, save_tensors, write_durably

CHECKPOINTS = "checkpoints"
LATEST = "latest"
COMPLETE = "COMPLETE"
STEP_PREFIX = "step_"
STEP_DIR = re.compile(r"step_(\d+)")
TMP_PREFIX = ".tmp-"
SET_ASIDE = "set_aside"  # checkpoints of another run a launch replaced (save_checkpoint)
DRAFT_WEIGHTS = "draft.safetensors"
DRAFT_CONFIG = "draft_config.json"
CONTRACT = "contract.json"
TRAIN_STATE = "train_state.json"
BACKEND = "backend"  # the backend's sharded state (dflash2.distributed.state_io)


@dataclass
class TrainState:
    """Where the loop stands; saved as train_state.json in every checkpoint."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    step_in_epoch: int = 0  # optimizer steps done in this epoch (each one global batch)


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


class CheckpointWriteError(ReportedError):
    """A checkpoint could not be written (a full disk, a lost mount, ...); nothing of it is left."""


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first (root last)."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(directory) / name)
        fsync_path(Path(directory))


def _remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint directory COMPLETE first (made durable before the rest goes), so that a
    crash during the deletion never leaves a marked but partial checkpoint."""
    marker = path / COMPLETE
    if marker.exists():
        marker.unlink()
        fsync_path(path)
    shutil.rmtree(path)


# ---- contract ----------------------------------------------------------------------------------------


def _as_json(obj: Any) -> Any:
    """Tuples become lists, as they do after a round trip through contract.json."""
    return json.loads(json.dumps(obj))


# The run's own fields of the contract (the draft's come from DraftSpec.contract_fields): field -> the
# run config key that sets it. The one table of them: `run_contract` fills them, a refusal names the
# override that restores them. `global_batch_size` is the key's value once resolved for the ranks.
RUN_CONTRACT_KEYS = {
    "selector_loss_alpha": "objective.selector_loss_alpha",
    "selector_mode": "objective.selector_mode",
    "selector_grad": "objective.selector_grad",
    "loss_gamma": "objective.loss_gamma",
    "position_weighting": "objective.position_weighting",
    "position_decay": "objective.position_decay",
    "ce_weight": "objective.ce_weight",
    "kl_weight": "objective.kl_weight",
    "tv_weight": "objective.tv_weight",
    "distill_temperature": "objective.distill_temperature",
    "num_anchors": "objective.num_anchors",
    "supervised_tokens": "objective.supervised_tokens",
    "labels": "objective.labels",
    "loss_vocab_size": "objective.loss_vocab_size",
    # the rendering of the same data (e.g. the thinking mode), and which of its conversations are
    # kept (a sample's index picks its place in the data order and its anchors)
    "chat_template_kwargs": "data.chat_template_kwargs",
    "max_length": "data.max_length",
    "duplicates": "data.duplicates",
    "global_batch_size": "train.global_batch_size",
    "seed": "seed",
}


# Fields that joined the contract with their config key (a few minutes apart, in one change), with
# the value every checkpoint written before behaved as: a saved contract that lacks one reads as that
# value, so an older checkpoint resumes under it and is refused, with the override that restores it,
# under any other value.
CONTRACT_FIELDS_ADDED = {
    "ce_weight": 1.0,
    "kl_weight": 0.0,
    "tv_weight": 0.0,
    "distill_temperature": 1.0,
    "position_weighting": "gamma",
    "position_decay": 0.8,
    "selector_grad": "backbone",
}
# Fields whose config key existed before it joined the contract: what a checkpoint without one was
# trained with is not recorded (any value was possible), so an absent field is not compared.
CONTRACT_FIELDS_UNRECORDED = ("supervised_tokens", "labels", "loss_vocab_size", "max_length", "duplicates")


def run_contract(cfg: RunConfig, identity: RunIdentity, global_batch_size: int) -> dict[str, Any]:
    """The run's part of the contract: the RUN_CONTRACT_KEYS fields, the identities of its target,
    tokenizer and data, and the global batch of one optimizer step."""
    fields = {}
    for field, key in RUN_CONTRACT_KEYS.items():
        value = cfg
        for name in key.split("."):
            value = getattr(value, name)
        fields[field] = copy.deepcopy(value)
    identities = {"target": identity.target, "tokenizer": identity.tokenizer, "dataset": identity.dataset}
    return {**fields, **identities, "global_batch_size": global_batch_size}


def _restoring_override(field: str, value: Any) -> str:
    """`key=value` that sets a contract field back to `value`, quoted for a shell when it must be."""
    text = json.dumps(value) if isinstance(value, (dict, list)) or value is None else str(value)
    item = f"{RUN_CONTRACT_KEYS[field]}={text}"
    return f"'{item}'" if any(c in item for c in " {}[]\"'") else item


def validate_contract(saved: dict, new: dict) -> None:
    """Raise ValueError listing every field whose saved and new values differ (or that one side lacks);
    the fields a run config key sets come with the override that resumes (`train.global_batch_size=16`)."""
    saved, new = _as_json(saved), _as_json(new)
    older = {f: v for f, v in CONTRACT_FIELDS_ADDED.items() if f in new and f not in saved}
    unrecorded = {f: new[f] for f in CONTRACT_FIELDS_UNRECORDED if f in new and f not in saved}
    saved = {**older, **unrecorded, **saved}

    def show(contract: dict, field: str) -> str:
        return repr(contract[field]) if field in contract else "<absent>"

    mismatches = [
        f"  {field}: saved {show(saved, field)}, new {show(new, field)}"
        for field in sorted(set(saved) | set(new))
        if field not in saved or field not in new or saved[field] != new[field]
    ]
    if mismatches:
        restoring = [
            _restoring_override(field, saved[field])
            for field in sorted(set(saved) & set(new) & set(RUN_CONTRACT_KEYS))
            if saved[field] != new[field]
        ]
        resume = f"To resume, add these overrides: {' '.join(restoring)}\n" if restoring else ""
        raise ValueError(
            "the checkpoint was written by a different run setup; resuming would not continue the same run.\n"
            "Mismatched contract fields:\n"
            + "\n".join(mismatches)
            + "\n"
            + resume
            + "Restore these settings, or start a new run directory."
        )


# ---- RNG ---------------------------------------------------------------------------------------------


def _save_rng(prefix: Path, generators: dict[str, torch.Generator]) -> None:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = state
    for name, generator in generators.items():
        tensors[f"generator.{name}"] = generator.get_state()
    save_tensors(tensors, str(prefix) + ".safetensors")
    version, mt_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    _write_json(
        Path(str(prefix) + ".json"),
        {
            "python": [version, list(mt_state), gauss],
            "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        },
    )


def _load_rng(prefix: Path, generators: dict[str, torch.Generator]) -> None:
    tensors = load_file(str(prefix) + ".safetensors")
    saved_generators = {key.split(".", 1)[1] for key in tensors if key.startswith("generator.")}
    if saved_generators != set(generators):
        raise ValueError(
            f"checkpoint generators: saved {sorted(saved_generators)}, new {sorted(generators)}; "
            "pass the same named generators to save_checkpoint and load_checkpoint"
        )
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        cuda_states = [
            tensors[f"torch_cuda_{i}"]
            for i in range(torch.cuda.device_count())
            if f"torch_cuda_{i}" in tensors
        ]
        torch.cuda.set_rng_state_all(cuda_states)
    for name, generator in generators.items():
        generator.set_state(tensors[f"generator.{name}"])
    states = json.loads(Path(str(prefix) + ".json").read_text())
    version, mt_state, gauss = states["python"]
    random.setstate((version, tuple(mt_state), gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = states["numpy"]
    np.random.set_state((np_name, np.array(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_gauss))


# ---- save --------------------------------------------------------------------------------------------


def save_checkpoint(
    backend: Backend,
    run_dir: Path,
    step: int,
    *,
    draft_config: dict,
    contract: dict,
    train_state: dict,
    keep_last: int,
    generators: dict[str, torch.Generator] | None = None,
) -> Path:
    """Write checkpoint `step` (collective: every rank calls it); returns its final directory.

    `train_state` is JSON the loop needs to continue (epoch, batch position in the epoch, ...); the
    global step is stored with it. `generators` are named torch generators the loop draws from
    (e.g. anchor sampling), saved per rank beside the global RNG states. A complete checkpoint of
    this very step already there (another run's: `set_aside_later_checkpoints`) is set aside, never
    deleted, and put back if the new one cannot be renamed into place.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(run_dir) / CHECKPOINTS
    final = root / step_dir_name(step)
    tmp = root / f"{TMP_PREFIX}{step_dir_name(step)}"
    if backend.is_main:
        with _cleanup_on_write_error(backend, root, final, tmp):
            if tmp.exists():  # left by a crash during an earlier save of this step
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
    backend.barrier()

    draft_state = backend.full_draft_state_dict()
    with _cleanup_on_write_error(backend, root, final, tmp):
        if backend.is_main:
            save_tensors({name: t.contiguous() for name, t in draft_state.items()}, tmp / DRAFT_WEIGHTS)
            _write_json(tmp / DRAFT_CONFIG, draft_config)
            _write_json(tmp / CONTRACT, contract)
            _write_json(tmp / TRAIN_STATE, {**train_state, "step": step})
        _save_rng(tmp / f"rng_rank{backend.rank:05d}", generators or {})
        backend.save_state(tmp / BACKEND)
    backend.barrier()
    # Every file and directory on disk before COMPLETE says they are. Every rank flushes, so that the
    # files a rank wrote on its own node reach the disk of a shared file system too.
    with _cleanup_on_write_error(backend, root, final, tmp):
        _fsync_tree(tmp)
    backend.barrier()

    if backend.is_main:
        _publish(backend, root, tmp, final, step, keep_last)
    backend.barrier()
    return final


def _publish(backend: Backend, root: Path, tmp: Path, final: Path, step: int, keep_last: int) -> None:
    """Rank 0's end of a save: COMPLETE, the rename into place (a complete checkpoint of this step
    set aside first, put back if the rename fails), `latest`, the rotation."""
    with _cleanup_on_write_error(backend, root, final, tmp):
        write_durably(tmp / COMPLETE, json.dumps({"step": step, "world_size": backend.world_size}))
        fsync_path(tmp)
        moved = _set_aside(root, lambda n: n == step)
        try:
            if final.exists():  # a partial directory of this step (a complete one was set aside)
                _remove_checkpoint(final)
            os.rename(tmp, final)
        except OSError:
            for place, aside in moved:  # back where `latest` and a resume find them
                os.rename(aside, place)
            raise
    with _cleanup_on_write_error(backend, root, final, final):
        fsync_path(root)
        _write_latest(root, final.name)
    _rotate(root, keep_last, keep=final.name)
    if moved:
        print(f"[dflash2] set aside another run's checkpoint of step {step}: {moved[0][1]}", flush=True)


def set_aside_later_checkpoints(backend: Backend, run_dir: Path, start_step: int) -> None:
    """At the start of a launch that starts at `start_step` (0: a fresh run; else the step resumed
    from; collective): the complete checkpoints of later steps in `run_dir` are another run's, one
    this launch replaces (train.resume=none, or an earlier checkpoint resumed), and are moved to
    `checkpoints/set_aside/`, so that neither `latest` nor the rotation mixes the two runs, as the
    metrics.jsonl and TensorBoard logs, trimmed to `start_step` at the same moment, do not; what
    interrupted saves and deletions left goes too."""
    root = Path(run_dir) / CHECKPOINTS
    if backend.is_main and root.is_dir():
        _remove_leftovers(root)
        moved = _set_aside(root, lambda n: n > start_step)
        if moved:
            print(
                f"[dflash2] set aside {len(moved)} checkpoint(s) of another run, of steps after this "
                f"launch's start (step {start_step}), so that they are neither resumed nor rotated with this "
                f"run's: {', '.join(str(aside) for _, aside in moved)}. Resume one with "
                "train.resume=<its directory>, or delete them.",
                flush=True,
            )
    backend.barrier()


def _remove_leftovers(root: Path) -> None:
    """Remove what an interrupted save or deletion left in `root` (`.tmp-step_*` directories, and
    `step_*` directories without COMPLETE): none is a checkpoint, and each may hold a whole draft
    and its optimizer state."""
    for path in root.iterdir():
        partial_step = STEP_DIR.fullmatch(path.name) and not (path / COMPLETE).is_file()
        stale_tmp = path.name.startswith(f"{TMP_PREFIX}{STEP_PREFIX}")
        if path.is_dir() and (partial_step or stale_tmp):
            shutil.rmtree(path)


def _set_aside(root: Path, of_step: Callable[[int], bool]) -> list[tuple[Path, Path]]:
    """Move the complete checkpoints whose step `of_step` selects to `root/set_aside/` (a name taken
    there gets a suffix); returns (where it was, where it went) of each. Each move is one rename:
    nothing is copied, and a crash between two moves leaves every checkpoint complete in one place
    or the other."""
    later = [path for path in _complete_step_dirs(root) if of_step(int(STEP_DIR.fullmatch(path.name)[1]))]
    if not later:
        return []
    aside = root / SET_ASIDE
    aside.mkdir(exist_ok=True)
    moved = []
    for path in later:
        dest, n = aside / path.name, 1
        while dest.exists():
            n += 1
            dest = aside / f"{path.name}-{n}"
        os.rename(path, dest)
        moved.append((path, dest))
    fsync_path(aside)
    fsync_path(root)
    return moved


@contextmanager
def _cleanup_on_write_error(backend: Backend, root: Path, final: Path, partial: Path) -> Iterator[None]:
    """Turn a failed write into CheckpointWriteError (path, free space, what is left) after removing
    `partial`, the directory being written; `latest` never moves before the last write succeeded."""
    try:
        yield
    except (OSError, SafetensorError) as error:
        free = _free_space(root)  # when the write failed, before the partial checkpoint goes
        if (partial / COMPLETE).is_file():
            _remove_checkpoint(partial)
        shutil.rmtree(partial, ignore_errors=True)
        latest = find_latest(root.parent)
        raise CheckpointWriteError(
            f"rank {backend.rank}: writing checkpoint {final} failed: {error}. {free} free on its file "
            f"system. The partial checkpoint was removed; the latest checkpoint is still {latest or 'none'}. "
            "Free some space (or set output_dir on a larger file system) and resume."
        ) from error


def _free_space(path: Path) -> str:
    while not path.exists() and path != path.parent:  # the checkpoints directory may not exist yet
        path = path.parent
    free = shutil.disk_usage(path).free
    return f"{free / 2**30:.1f} GiB" if free >= 2**30 else f"{free / 2**20:.1f} MiB"


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f"{TMP_PREFIX}{LATEST}"
    write_durably(tmp, name + "\n")
    os.replace(tmp, root / LATEST)
    fsync_path(root)


def _complete_step_dirs(root: Path) -> list[Path]:
    """Complete checkpoint dirs, oldest first."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and (p / COMPLETE).is_file()]
    return sorted(dirs, key=lambda p: int(STEP_DIR.fullmatch(p.name)[1]))


def _rotate(root: Path, keep_last: int, keep: str) -> None:
    complete = _complete_step_dirs(root)
    for old in complete[: max(0, len(complete) - keep_last)]:
        if old.name != keep:
            _remove_checkpoint(old)


# ---- find / load -------------------------------------------------------------------------------------


def find_latest(run_dir: Path) -> Path | None:
    """The newest complete `step_*` dir: the one the `latest` pointer names, unless a crash came
    between a checkpoint's rename and the pointer's update (a launch sets aside every checkpoint after
    its start, so the newest complete one is always this run's). `.tmp-*` dirs and dirs without
    COMPLETE never count."""
    complete = _complete_step_dirs(Path(run_dir) / CHECKPOINTS)
    return complete[-1] if complete else None


def load_checkpoint(
    backend: Backend,
    ckpt_dir: Path,
    *,
    contract: dict,
    generators: dict[str, torch.Generator] | None = None,
) -> dict:
    """Validate the contract, then restore backend state and this rank's RNG (collective); returns train_state.

    Call after backend.setup_draft(); the draft must be built exactly as in the saved run. The number
    of ranks may differ from the saved run's: the backend state is re-cut for this number of ranks,
    and the per-rank RNG states (which nothing in the training step draws from: anchors come from
    per-sample generators) are then left as they were at start-up.
    """
    ckpt_dir = Path(ckpt_dir)
    check_resume(ckpt_dir, contract, (backend.rank, backend.world_size))
    num_saved_ranks = check_backend_meta(ckpt_dir / BACKEND, backend.name)
    backend.load_state(ckpt_dir / BACKEND, num_saved_ranks)
    if num_saved_ranks == backend.world_size:
        _load_rng(ckpt_dir / f"rng_rank{backend.rank:05d}", generators or {})
    elif generators:
        raise ValueError(
            f"{ckpt_dir} was saved by {num_saved_ranks} ranks, this run has {backend.world_size}: named "
            "generators are per rank and cannot be re-cut; resume on the same number of ranks"
        )
    elif backend.is_main:
        print(
            f"[dflash2] resuming a checkpoint of {num_saved_ranks} ranks on {backend.world_size}: the "
            "draft, optimizer and data position are re-cut; per-rank RNG states stay as at start-up"
        )
    backend.barrier()
    return _checkpoint_json(Path(ckpt_dir), TRAIN_STATE)


def check_resume(ckpt_dir: Path, contract: dict, reader: tuple[int, int] | None = None) -> None:
    """Refuse to resume from anything but a complete, intact checkpoint written under the same
    contract (no collective, nothing loaded: call it before the target loads). `reader`: see
    check_intact."""
    check_complete(ckpt_dir)
    validate_contract(read_contract(ckpt_dir), contract)
    check_intact(ckpt_dir, reader)


# checkpoints found intact in this process (by path and COMPLETE marker, which a checkpoint written
# again at the same path replaces): their backend state, and the RNG files checked so far
_intact: dict[tuple, set[int]] = {}
STATE_ONLY = (0, 0)  # a `reader` of no rank: the backend state every rank reads, no RNG state


def check_intact(ckpt_dir: Path, reader: tuple[int, int] | None = None) -> None:
    """The files a resume reads are there and whole (a copy cut short, a file system that lost a
    write after COMPLETE): the backend state's (which every rank reads: each saved rank's files, and
    any other file under backend/) and the RNG state of `reader` = (rank, world size), which a rank
    reads where the saved world size is its own; `reader` None: every rank's RNG state. A JSON file
    must parse, a safetensors header be whole and cover its file (a file cut short). The full draft
    weights, which export reads and a resume does not, are export's to check. Reads JSON and headers
    only, each once a process; no collective."""
    ckpt_dir = Path(ckpt_dir)
    meta = _checkpoint_json(ckpt_dir, f"{BACKEND}/backend.json")
    saved = meta.get("world_size")
    if not isinstance(saved, int) or isinstance(saved, bool) or saved < 1:
        raise _damaged(ckpt_dir, f"its {BACKEND}/backend.json has no number of ranks (world_size: {saved!r})")
    marker = os.stat(ckpt_dir / COMPLETE)
    key = (ckpt_dir.resolve(), marker.st_dev, marker.st_ino, marker.st_mtime_ns)
    paths = set()
    if key not in _intact:
        paths |= set(rank_files(ckpt_dir / BACKEND, saved)) | set((ckpt_dir / BACKEND).rglob("*"))
    if reader is None:
        ranks = set(range(saved))
    else:
        ranks = {reader[0]} if reader[1] == saved else set()
    ranks -= _intact.get(key, set())
    paths |= {ckpt_dir / f"rng_rank{rank:05d}{ext}" for rank in ranks for ext in (".json", ".safetensors")}
    for name in sorted(path.relative_to(ckpt_dir).as_posix() for path in paths):
        if name.endswith(".json"):
            _checkpoint_json(ckpt_dir, name)
        elif name.endswith(".safetensors"):
            _check_tensors(ckpt_dir, name)
    _intact.setdefault(key, set()).update(ranks)


def check_complete(ckpt_dir: Path) -> None:
    if not (Path(ckpt_dir) / COMPLETE).is_file():
        raise ValueError(
            f"{ckpt_dir} is not a complete checkpoint (no {COMPLETE} marker); resume from a checkpoint "
            f"directory that has one, e.g. <output_dir>/{CHECKPOINTS}/{step_dir_name(100)}"
        )


def read_contract(ckpt_dir: Path) -> dict:
    """The contract a checkpoint was written under (contract.json): the run's settings it holds."""
    return _checkpoint_json(Path(ckpt_dir), CONTRACT)


def resume_point(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint a run resumes from: `train.resume` is auto (the latest in run_dir, if any),
    none, or any checkpoint directory (its step is read from its train state, never from its name)."""
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest(run_dir)
    path = Path(resume)
    if not path.is_dir():
        raise ValueError(f"train.resume={resume!r}: no such checkpoint directory (or use auto|none)")
    check_complete(path)  # before anything reads it: a run directory, checkpoints/, a partial write
    return path


def read_train_state(ckpt_dir: Path | None) -> TrainState:
    """The train state saved in `ckpt_dir` (no collective, nothing restored); a fresh one for None."""
    if ckpt_dir is None:
        return TrainState()
    return TrainState(**_checkpoint_json(Path(ckpt_dir), TRAIN_STATE))


_WAY_ON = (
    "resume from an earlier checkpoint (train.resume=<its directory>), or start over with train.resume=none"
)


def _damaged(ckpt_dir: Path, what: str, way_on: str = _WAY_ON) -> ValueError:
    return ValueError(f"checkpoint {ckpt_dir} is damaged: {what}; {way_on}")


def _checkpoint_json(ckpt_dir: Path, name: str, way_on: str = _WAY_ON) -> dict:
    """A JSON file of a checkpoint; missing or malformed (a damaged checkpoint) is a ValueError naming
    it and the way on."""
    if not (ckpt_dir / name).is_file():
        raise _damaged(ckpt_dir, f"it has no {name}", way_on)
    return read_json_object(ckpt_dir / name, f"checkpoint {ckpt_dir} is damaged: its {name}", way_on)


def _check_tensors(ckpt_dir: Path, name: str, way_on: str = _WAY_ON) -> None:
    """A safetensors file of a checkpoint is there, its header whole and covering the file (what a
    file cut short breaks); a ValueError naming it and the way on otherwise."""
    if not (ckpt_dir / name).is_file():
        raise _damaged(ckpt_dir, f"it has no {name}", way_on)
    try:
        with safe_open(str(ckpt_dir / name), framework="pt"):
            pass
    except (SafetensorError, OSError) as error:
        raise _damaged(ckpt_dir, f"its {name} is not a whole safetensors file ({error})", way_on) from None


def holds_draft(path: Path) -> bool:
    """Whether `path` is a checkpoint directory with the full draft weights and config."""
    return (path / DRAFT_CONFIG).is_file() and (path / DRAFT_WEIGHTS).is_file()


def read_draft(ckpt_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(full fp32 draft state dict, draft config dict) of a checkpoint: what export reads."""
    ckpt_dir = Path(ckpt_dir)
    way_on = "export an earlier checkpoint of the run, or resume the run and export the next one"
    _check_tensors(ckpt_dir, DRAFT_WEIGHTS, way_on)
    config = _checkpoint_json(ckpt_dir, DRAFT_CONFIG, way_on)
    return load_file(ckpt_dir / DRAFT_WEIGHTS), load_config_dict(config)
