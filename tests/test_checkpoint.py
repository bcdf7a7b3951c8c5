"""Single-process checkpoint logic: contract check, atomic layout, latest pointer, rotation, RNG."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dflash2.checkpoint import (
    CheckpointWriteError,
    check_resume,
    find_latest,
    load_checkpoint,
    resume_point,
    save_checkpoint,
    set_aside_later_checkpoints,
    validate_contract,
)
from dflash2.distributed import state_io

CONTRACT = {"architecture": "DFlash2DraftModel", "block_size": 16, "target_layer_ids": [1, 3], "gamma": None}


class FakeBackend:
    """One rank, no process group: records what the checkpoint code asks of a backend."""

    name, rank, world_size, is_main = "fake", 0, 1, True

    def __init__(self, weight: float = 1.0) -> None:
        self.weight = weight
        self.loaded_from: Path | None = None

    def barrier(self) -> None:
        pass

    def full_draft_state_dict(self) -> dict[str, torch.Tensor]:
        return {"layer.weight": torch.full((2, 3), self.weight)}

    def save_state(self, ckpt_dir: Path) -> None:  # the layout of every real backend (state_io)
        ckpt_dir.mkdir(parents=True)
        state_io.save_state({"weight": self.weight}, ckpt_dir / "rank00000")
        state_io.write_backend_meta(ckpt_dir, self.name, self.world_size)

    def load_state(self, ckpt_dir: Path, num_saved_ranks: int) -> None:
        assert num_saved_ranks == self.world_size
        self.weight = state_io.ShardedState(ckpt_dir, num_saved_ranks).load(lambda shape: (0, 0))["weight"]
        self.loaded_from = ckpt_dir


def save(backend, run_dir: Path, step: int, keep_last: int = 3, **kwargs) -> Path:
    return save_checkpoint(
        backend,
        run_dir,
        step,
        draft_config={"hidden_size": 8},
        contract=CONTRACT,
        train_state={"epoch": 1, "step_in_epoch": step * 2},
        keep_last=keep_last,
        **kwargs,
    )


def test_contract_mismatch_lists_every_field_with_both_values():
    new = {**CONTRACT, "block_size": 8, "target_layer_ids": [1, 2], "num_anchors": 4}
    del new["gamma"]
    with pytest.raises(ValueError) as err:
        validate_contract(CONTRACT, new)
    message = str(err.value)
    assert "block_size: saved 16, new 8" in message
    assert "target_layer_ids: saved [1, 3], new [1, 2]" in message
    assert "num_anchors: saved <absent>, new 4" in message
    assert "gamma: saved None, new <absent>" in message
    assert "architecture" not in message


def test_contract_accepts_tuples_for_saved_lists():
    validate_contract(CONTRACT, {**CONTRACT, "target_layer_ids": (1, 3)})


def test_checkpoint_layout_and_latest_pointer(tmp_path):
    ckpt = save(FakeBackend(weight=2.0), tmp_path, 5)
    assert ckpt == tmp_path / "checkpoints" / "step_00000005"
    names = {p.name for p in ckpt.iterdir()}
    expected = {
        "draft.safetensors",
        "draft_config.json",
        "contract.json",
        "train_state.json",
        "backend",
        "COMPLETE",
    }
    assert expected | {"rng_rank00000.safetensors", "rng_rank00000.json"} == names
    assert torch.equal(load_file(str(ckpt / "draft.safetensors"))["layer.weight"], torch.full((2, 3), 2.0))
    assert json.loads((ckpt / "train_state.json").read_text()) == {
        "epoch": 1,
        "step_in_epoch": 10,
        "step": 5,
    }
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000005"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert find_latest(tmp_path) == ckpt


def test_rotation_keeps_the_last_n(tmp_path):
    for step in (1, 2, 3, 4, 5):
        save(FakeBackend(), tmp_path, step, keep_last=2)
    remaining = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert remaining == ["step_00000004", "step_00000005"]


def test_find_latest_ignores_half_written_dirs(tmp_path):
    assert find_latest(tmp_path) is None
    good = save(FakeBackend(), tmp_path, 2)
    root = tmp_path / "checkpoints"
    # a crash before the rename leaves a .tmp dir; one without the marker is never complete either
    (root / ".tmp-step_00000009").mkdir()
    (root / ".tmp-step_00000009" / "COMPLETE").write_text("{}")
    (root / "step_00000007").mkdir()
    (root / "step_00000007" / "draft.safetensors").write_text("partial")
    assert find_latest(tmp_path) == good
    # without the pointer: the newest complete dir
    (root / "latest").unlink()
    assert find_latest(tmp_path) == good
    # a pointer naming an incomplete dir is not followed
    (root / "latest").write_text("step_00000007\n")
    assert find_latest(tmp_path) == good
    # a crash between a checkpoint's rename and the pointer's update: the newer complete one
    newer = save(FakeBackend(), tmp_path, 3)
    (root / "latest").write_text("step_00000002\n")
    assert find_latest(tmp_path) == newer


def test_resave_after_crash_replaces_leftover_tmp(tmp_path):
    leftover = tmp_path / "checkpoints" / ".tmp-step_00000003"
    leftover.mkdir(parents=True)
    (leftover / "junk").write_text("from a crashed save")
    ckpt = save(FakeBackend(), tmp_path, 3)
    assert not leftover.exists()
    assert not (ckpt / "junk").exists()


def test_a_fresh_run_sets_aside_another_runs_later_checkpoints(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):  # another run's, in the same directory
        save(FakeBackend(weight=float(step)), tmp_path, step)
    # a launch that starts at step 0 (resume=none), then saves steps 2, 4 and 6
    set_aside_later_checkpoints(FakeBackend(), tmp_path, 0)
    assert "set aside 3 checkpoint(s) of another run" in capsys.readouterr().out
    assert find_latest(tmp_path) is None  # `latest` named a checkpoint set aside: nothing to resume
    for step in (2, 4, 6):
        save(FakeBackend(weight=-float(step)), tmp_path, step, keep_last=2)
    # the rotation kept this run's last two; none of the other run's was deleted or resumed
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000004", "step_00000006"]
    assert load_file(str(find_latest(tmp_path) / "draft.safetensors"))["layer.weight"][0, 0] == -6.0
    aside = root / "set_aside"
    assert sorted(p.name for p in aside.iterdir()) == ["step_00000002", "step_00000004", "step_00000006"]
    for step in (2, 4, 6):
        kept = aside / f"step_{step:08d}"
        assert (kept / "COMPLETE").is_file()
        assert load_file(str(kept / "draft.safetensors"))["layer.weight"][0, 0] == float(step)
    # a launch resumed at step 4 sets aside only the later step 6, under a free name, and removes
    # what interrupted saves and deletions left (each may be a whole draft and its optimizer state)
    for leftover in (".tmp-step_00000009", "step_00000008"):
        (root / leftover).mkdir()
        (root / leftover / "draft.safetensors").write_text("partial")
    set_aside_later_checkpoints(FakeBackend(), tmp_path, 4)
    assert find_latest(tmp_path) == root / "step_00000004"
    save(FakeBackend(weight=5.0), tmp_path, 5)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000004", "step_00000005"]
    assert (aside / "step_00000006-2" / "COMPLETE").is_file()
    assert not list(root.glob(".tmp-*"))


def test_saving_a_step_again_keeps_the_first_copy_when_the_rename_fails(tmp_path, monkeypatch):
    import dflash2.checkpoint as checkpoint

    first = save(FakeBackend(weight=1.0), tmp_path, 3)
    rename = os.rename

    def failing(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise OSError(errno.EIO, "Input/output error")
        rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", failing)
    with pytest.raises(CheckpointWriteError):
        save(FakeBackend(weight=2.0), tmp_path, 3)
    # before: deleted, then the rename failed; now back in place, still the one `latest` names
    assert find_latest(tmp_path) == first and (first / "COMPLETE").is_file()
    assert load_file(str(first / "draft.safetensors"))["layer.weight"][0, 0] == 1.0
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_load_restores_rng_generators_and_backend_state(tmp_path):
    generator = torch.Generator().manual_seed(11)
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    torch.randn(5, generator=generator)
    ckpt = save(FakeBackend(weight=4.0), tmp_path, 1, generators={"anchors": generator})
    expected = (torch.rand(4), random.random(), np.random.rand(3), torch.rand(2, generator=generator))

    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    generator.manual_seed(99)
    backend = FakeBackend(weight=0.0)
    train_state = load_checkpoint(backend, ckpt, contract=dict(CONTRACT), generators={"anchors": generator})
    assert train_state["step"] == 1
    assert backend.weight == 4.0 and backend.loaded_from == ckpt / "backend"
    got = (torch.rand(4), random.random(), np.random.rand(3), torch.rand(2, generator=generator))
    assert torch.equal(got[0], expected[0])
    assert got[1] == expected[1]
    assert np.array_equal(got[2], expected[2])
    assert torch.equal(got[3], expected[3])


def test_contract_is_checked_before_any_state_is_touched(tmp_path):
    ckpt = save(FakeBackend(weight=4.0), tmp_path, 1)
    torch.manual_seed(5)
    expected_draw = torch.rand(3)
    torch.manual_seed(5)
    backend = FakeBackend(weight=0.0)
    with pytest.raises(ValueError, match="block_size: saved 16, new 32"):
        load_checkpoint(backend, ckpt, contract={**CONTRACT, "block_size": 32})
    assert backend.loaded_from is None and backend.weight == 0.0
    assert torch.equal(torch.rand(3), expected_draw)  # global RNG untouched


def test_load_refuses_an_incomplete_dir(tmp_path):
    (tmp_path / "step_00000001").mkdir()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(FakeBackend(), tmp_path / "step_00000001", contract=CONTRACT)


def test_state_io_round_trip_without_pickle(tmp_path):
    optimizer = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.1, betas=(0.9, 0.95))
    for p in optimizer.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    optimizer.step()
    state = {"optimizer": optimizer.state_dict(), "counters": {"global_steps": 3}, "none": None}
    state_io.save_state(state, tmp_path / "rank00000")
    loaded = state_io.ShardedState(tmp_path, 1).load(lambda shape: (0, 0))
    assert loaded["counters"] == {"global_steps": 3} and loaded["none"] is None
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)  # tuples stay tuples
    for index, param_state in state["optimizer"]["state"].items():  # int keys survive
        for key, value in param_state.items():
            assert torch.equal(loaded["optimizer"]["state"][index][key], value)
    with pytest.raises(TypeError, match="without pickling"):
        state_io.save_state({"object": object()}, tmp_path / "bad")


@pytest.mark.parametrize("saved_ranks,new_ranks", [(3, 2), (2, 3), (1, 4), (4, 1)])
def test_sharded_state_recuts_pieces_for_another_number_of_ranks(tmp_path, saved_ranks, new_ranks):
    """Pieces of flattened tensors written by `saved_ranks` ranks (uneven, some empty) read back
    as the pieces of `new_ranks` ranks: each equals that slice of the original tensor."""
    full = {
        "weight": torch.randn(7, 3, generator=torch.Generator().manual_seed(0)),
        "bias": torch.arange(2, dtype=torch.bfloat16),  # fewer elements than ranks: empty pieces
    }
    for rank in range(saved_ranks):
        pieces = {}
        for name, tensor in full.items():
            begin, end = state_io.chunk_range(tensor.numel(), rank, saved_ranks)
            pieces[name] = state_io.FlatShard(tensor.reshape(-1)[begin:end], tuple(tensor.shape), begin)
        state_io.save_state({"params": pieces, "step": torch.tensor(4.0)}, tmp_path / f"rank{rank:05d}")
    saved = state_io.ShardedState(tmp_path, saved_ranks)
    for rank in range(new_ranks):
        loaded = saved.load(lambda shape, r=rank: state_io.chunk_range(int(np.prod(shape)), r, new_ranks))
        for name, tensor in full.items():
            begin, end = state_io.chunk_range(tensor.numel(), rank, new_ranks)
            assert torch.equal(loaded["params"][name], tensor.reshape(-1)[begin:end]), (name, rank)
        assert torch.equal(loaded["step"], torch.tensor(4.0))
    with pytest.raises(ValueError, match="missing"):
        state_io.ShardedState(tmp_path, saved_ranks + 1)


def test_resume_refuses_a_changed_attention_pattern_or_chat_template(tmp_path, tiny_default):
    """The run's contract (train.build_contract) records the draft's attention pattern and the chat
    template kwargs the data was rendered with; a resume with others stops, naming each field."""
    from dflash2.config import load_run_config
    from dflash2.models import build_draft
    from dflash2.models.config import load_config_dict
    from dflash2.run_plan import build_contract
    from tests.run_helpers import TINY_CONFIG

    paths = [
        f"model.target={tiny_default.target_dir}",
        f"data.train={tiny_default.train_jsonl}",
        "output_dir=x",
    ]
    cfg = load_run_config(TINY_CONFIG, paths)
    raw = load_config_dict(cfg.model.draft_config)
    saved = build_contract(cfg, build_draft(raw).config.to_dict(), data_parallel_size=1)
    ckpt = save_checkpoint(
        FakeBackend(), tmp_path, 1, draft_config=raw, contract=saved, train_state={}, keep_last=1
    )

    changed_cfg = load_run_config(TINY_CONFIG, [*paths, "data.chat_template_kwargs={enable_thinking: false}"])
    changed_draft = build_draft(
        {**raw, "sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"]}
    )
    # a causal draft is refused by the draft config check today; the contract still guards the field
    new = build_contract(
        changed_cfg, {**changed_draft.config.to_dict(), "is_causal": True}, data_parallel_size=1
    )
    backend = FakeBackend(weight=0.0)
    with pytest.raises(ValueError) as err:
        load_checkpoint(backend, ckpt, contract=new)
    message = str(err.value)
    assert "  sliding_window: saved 2048, new 64" in message
    assert (
        "  layer_types: saved ['sliding_attention', 'sliding_attention'], "
        "new ['full_attention', 'sliding_attention']" in message
    )
    assert "  is_causal: saved False, new True" in message
    assert "  chat_template_kwargs: saved {}, new {'enable_thinking': False}" in message
    assert len([line for line in message.splitlines() if line.startswith("  ")]) == 4  # nothing else differs
    assert backend.loaded_from is None  # refused before any state was restored
    load_checkpoint(FakeBackend(), ckpt, contract=build_contract(cfg, build_draft(raw).config.to_dict(), 1))


def test_resume_refuses_changed_loss_terms_or_position_weights(tmp_path, tiny_default):
    """The loss mix (ce / kl / tv weights, teacher temperature) and the position weighting are part of
    the contract: a resume with others stops, naming each field with both values."""
    from dflash2.config import load_run_config
    from dflash2.models import build_draft
    from dflash2.models.config import load_config_dict
    from dflash2.run_plan import build_contract
    from tests.run_helpers import TINY_CONFIG

    paths = [
        f"model.target={tiny_default.target_dir}",
        f"data.train={tiny_default.train_jsonl}",
        "output_dir=x",
    ]
    cfg = load_run_config(TINY_CONFIG, paths)
    draft_config = build_draft(load_config_dict(cfg.model.draft_config)).config.to_dict()
    saved = build_contract(cfg, draft_config, data_parallel_size=1)
    ckpt = save_checkpoint(
        FakeBackend(), tmp_path, 1, draft_config=draft_config, contract=saved, train_state={}, keep_last=1
    )
    changed = [
        "objective.ce_weight=0.1",
        "objective.kl_weight=0.5",
        "objective.tv_weight=0.9",
        "objective.distill_temperature=2.0",
        "objective.loss_gamma=null",
        "objective.position_weighting=exponential",
        "objective.position_decay=0.5",
    ]
    new = build_contract(load_run_config(TINY_CONFIG, [*paths, *changed]), draft_config, data_parallel_size=1)
    with pytest.raises(ValueError) as err:
        load_checkpoint(FakeBackend(weight=0.0), ckpt, contract=new)
    message = str(err.value)
    for line in (
        "  ce_weight: saved 1.0, new 0.1",
        "  kl_weight: saved 0.0, new 0.5",
        "  tv_weight: saved 0.0, new 0.9",
        "  distill_temperature: saved 1.0, new 2.0",
        "  loss_gamma: saved 7.0, new None",
        "  position_weighting: saved 'gamma', new 'exponential'",
        "  position_decay: saved 0.8, new 0.5",
    ):
        assert line in message
    assert len([line for line in message.splitlines() if line.startswith("  ")]) == 7


# ---- durability and failed writes ---------------------------------------------------------------------


class DiskLog:
    """Records, in order, every fsync (with the path of its file descriptor), rename and replace."""

    def __init__(self, monkeypatch) -> None:
        self.events: list[tuple[str, str]] = []
        fsync, rename, replace = os.fsync, os.rename, os.replace
        monkeypatch.setattr(
            os, "fsync", lambda fd: (self._log("fsync", os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))
        )
        monkeypatch.setattr(os, "rename", lambda a, b: (self._log("rename", f"{a} -> {b}"), rename(a, b)))
        monkeypatch.setattr(os, "replace", lambda a, b: (self._log("replace", f"{a} -> {b}"), replace(a, b)))

    def _log(self, kind: str, what: str) -> None:
        self.events.append((kind, str(what)))

    def index(self, kind: str, what: str) -> int:
        return self.events.index((kind, str(what)))


def test_every_file_and_directory_is_on_disk_before_complete_and_complete_before_latest(
    tmp_path, monkeypatch
):
    save(FakeBackend(), tmp_path, 1)
    disk = DiskLog(monkeypatch)
    final = save(FakeBackend(), tmp_path, 2)
    root, tmp = tmp_path / "checkpoints", tmp_path / "checkpoints" / ".tmp-step_00000002"
    complete = disk.index("fsync", tmp / "COMPLETE")
    for path in final.rglob("*"):  # every file and directory of the checkpoint, by its name while written
        if path.name != "COMPLETE":
            assert disk.index("fsync", tmp / path.relative_to(final)) < complete, path
    assert disk.index("fsync", tmp) < complete  # the directory holding them
    renamed = disk.index("rename", f"{tmp} -> {final}")
    assert complete < renamed
    moved = disk.index("replace", f"{root / '.tmp-latest'} -> {root / 'latest'}")
    assert renamed < disk.events.index(("fsync", str(root)), renamed) < moved  # the rename is on disk first
    assert disk.index("fsync", root / ".tmp-latest") < moved
    assert ("fsync", str(root)) in disk.events[moved:]  # and the new pointer


def test_deletion_removes_complete_first(tmp_path, monkeypatch):
    import dflash2.checkpoint as checkpoint

    old = save(FakeBackend(), tmp_path, 1)
    removed_while_complete = []
    rmtree = shutil.rmtree
    monkeypatch.setattr(
        checkpoint.shutil,
        "rmtree",
        lambda path, **kw: (
            removed_while_complete.append((Path(path) / "COMPLETE").exists()),
            rmtree(path, **kw),
        ),
    )
    save(FakeBackend(), tmp_path, 2, keep_last=1)  # rotation deletes step 1
    assert not old.exists() and removed_while_complete == [False]


@pytest.mark.parametrize(
    "failing,error",
    [
        (  # safetensors' own writer, under dflash2.safetensors_io
            "dflash2.safetensors_io:save_file",
            SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
        ),
        ("dflash2.checkpoint:_write_json", OSError(errno.ENOSPC, "No space left on device")),
        ("dflash2.checkpoint:_write_latest", OSError(errno.EIO, "Input/output error")),
    ],
)
def test_a_failed_write_names_the_path_and_free_space_and_leaves_latest(
    tmp_path, monkeypatch, failing, error
):
    import importlib

    module, name = failing.split(":")
    previous = save(FakeBackend(weight=1.0), tmp_path, 1)
    monkeypatch.setattr(
        importlib.import_module(module), name, lambda *args, **kwargs: (_ for _ in ()).throw(error)
    )
    with pytest.raises(CheckpointWriteError) as raised:
        save(FakeBackend(weight=2.0), tmp_path, 2)
    message = str(raised.value)
    root = tmp_path / "checkpoints"
    assert f"writing checkpoint {root / 'step_00000002'} failed" in message
    assert re.search(r"\d+\.\d [GM]iB free on its file system", message)
    assert f"the latest checkpoint is still {previous}" in message
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]  # nothing half-written
    assert (root / "latest").read_text().strip() == "step_00000001" and find_latest(tmp_path) == previous


def test_a_failed_write_is_reported_by_the_cli_without_traceback(tmp_path, monkeypatch, capsys):
    import dflash2.checkpoint as checkpoint
    from dflash2.errors import EXIT_FAILED, run_main

    error = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(checkpoint, "_write_json", lambda *args: (_ for _ in ()).throw(error))
    assert run_main(lambda argv: save(FakeBackend(), tmp_path, 1), []) == EXIT_FAILED
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: rank 0: writing checkpoint") and "Traceback" not in stderr


def test_resume_accepts_any_directory_name_and_refuses_incomplete_ones(tmp_path):
    ckpt = save(FakeBackend(weight=3.0), tmp_path, 4)
    copy = tmp_path / "best-so-far"
    shutil.copytree(ckpt, copy)
    assert resume_point(str(copy), tmp_path / "other") == copy
    backend = FakeBackend(weight=0.0)
    assert load_checkpoint(backend, copy, contract=CONTRACT)["step"] == 4 and backend.weight == 3.0
    (copy / "COMPLETE").unlink()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        check_resume(copy, CONTRACT)
    # train.resume=<a directory that is no checkpoint>: a user error before anything reads it (a run
    # directory, its checkpoints/, a partial write), not a missing train-state file's traceback
    for directory in (copy, tmp_path, tmp_path / "checkpoints"):
        with pytest.raises(ValueError, match=r"is not a complete checkpoint \(no COMPLETE marker\)"):
            resume_point(str(directory), tmp_path / "other")
    (tmp_path / "checkpoints" / "step_not_a_number").mkdir()  # never taken for a step directory
    assert find_latest(tmp_path) == ckpt


def test_contract_mismatch_names_the_overrides_that_resume():
    """A requeue onto fewer GPUs without train.global_batch_size: the refusal gives the exact override."""
    saved = {**CONTRACT, "global_batch_size": 16, "chat_template_kwargs": {}, "num_anchors": 8}
    new = {
        **saved,
        "global_batch_size": 8,
        "chat_template_kwargs": {"enable_thinking": False},
        "block_size": 8,
    }
    with pytest.raises(ValueError) as err:
        validate_contract(saved, new)
    lines = str(err.value).splitlines()
    assert "  global_batch_size: saved 16, new 8" in lines
    # block_size comes from the draft config, not from one override: it is listed, not suggested
    assert (
        "To resume, add these overrides: 'data.chat_template_kwargs={}' train.global_batch_size=16" in lines
    )


def test_a_contract_from_before_a_field_joined_it_reads_as_its_default():
    """A checkpoint written before the loss weights were in the contract resumes under their defaults
    and is refused, with the override that restores it, otherwise; a field whose key predates its
    place in the contract (objective.labels, ...) is unknown in such a checkpoint and not compared."""
    from dflash2.checkpoint import CONTRACT_FIELDS_ADDED, CONTRACT_FIELDS_UNRECORDED, RUN_CONTRACT_KEYS
    from dflash2.config import ObjectiveSection

    for field, before in CONTRACT_FIELDS_ADDED.items():
        section, key = RUN_CONTRACT_KEYS[field].split(".")
        assert section == "objective"
        assert getattr(ObjectiveSection(), key) == before, field  # the default today is what older code did
    unrecorded = {"supervised_tokens": "all", "labels": "target", "loss_vocab_size": 4096}
    unrecorded |= {"max_length": 512, "duplicates": "drop"}
    assert set(unrecorded) == set(CONTRACT_FIELDS_UNRECORDED) <= set(RUN_CONTRACT_KEYS)
    new = {**CONTRACT, **CONTRACT_FIELDS_ADDED, **unrecorded}
    old = CONTRACT
    validate_contract(old, new)  # whatever the unrecorded fields say
    with pytest.raises(ValueError) as err:
        validate_contract(old, {**new, "kl_weight": 1.0, "ce_weight": 0.0})
    lines = str(err.value).splitlines()
    assert "  kl_weight: saved 0.0, new 1.0" in lines
    assert "To resume, add these overrides: objective.ce_weight=1.0 objective.kl_weight=0.0" in lines
    assert not any("labels" in line for line in lines)
    # once recorded, they are compared like any other field
    with pytest.raises(ValueError, match="labels: saved 'target', new 'data'"):
        validate_contract(new, {**new, "labels": "data"})
    # which conversations a run keeps: another max_length or duplicates setting shifts every sample's
    # index, and with it the data order and the anchors of the steps a resume takes
    with pytest.raises(ValueError) as err:
        validate_contract(new, {**new, "max_length": 256, "duplicates": "keep"})
    assert "To resume, add these overrides: data.duplicates=drop data.max_length=512" in str(err.value)


def test_a_damaged_checkpoints_json_is_named_with_the_way_on(tmp_path):
    """A checkpoint whose train state or contract is missing or torn (a copy cut short, an edit):
    one message naming the checkpoint and the file, where a raw JSON or FileNotFound error came."""
    from dflash2.checkpoint import read_contract, read_train_state

    ckpt = tmp_path / "step_00000004"
    ckpt.mkdir()
    way_on = "resume from an earlier checkpoint (train.resume=<its directory>), or start over with train.resume=none"
    with pytest.raises(
        ValueError, match=f"checkpoint {ckpt} is damaged: it has no train_state.json; .*"
    ) as missing:
        read_train_state(ckpt)
    assert str(missing.value).endswith(way_on)
    (ckpt / "train_state.json").write_text('{"step": 4,')
    with pytest.raises(
        ValueError, match=r"damaged: its train_state.json is not valid JSON \(.*\); resume from"
    ):
        read_train_state(ckpt)
    (ckpt / "contract.json").write_text("[1]")
    with pytest.raises(
        ValueError, match="damaged: its contract.json: expected a JSON object, found list; resume from"
    ):
        read_contract(ckpt)


def test_a_damaged_state_file_is_named_before_anything_loads(tmp_path):
    """A file a resume reads, cut short, torn or missing (a copy cut short, a file system that lost
    a write after COMPLETE): one message naming the checkpoint and the file, before the backend or
    any RNG is touched, where safetensors' or json's own error (a traceback) came at load time."""
    from dflash2.checkpoint import read_draft

    good = save(FakeBackend(weight=4.0), tmp_path / "run", 1)
    check_resume(good, CONTRACT)

    def cut(path: Path) -> None:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    damages = {
        "its backend/rank00000.safetensors is not a whole safetensors file": lambda c: cut(c / "backend/rank00000.safetensors"),
        "its rng_rank00000.safetensors is not a whole safetensors file": lambda c: cut(c / "rng_rank00000.safetensors"),
        r"its rng_rank00000.json is not valid JSON \(": lambda c: cut(c / "rng_rank00000.json"),
        "its backend/rank00000.json is not valid JSON": lambda c: cut(c / "backend/rank00000.json"),
        "it has no backend/rank00000.safetensors": lambda c: (c / "backend/rank00000.safetensors").unlink(),
        "it has no rng_rank00000.safetensors": lambda c: (c / "rng_rank00000.safetensors").unlink(),
        "its backend/backend.json has no number of ranks": lambda c: (c / "backend/backend.json").write_text('{"backend": "fake"}'),
    }  # fmt: skip
    for i, (message, damage) in enumerate(damages.items()):
        ckpt = tmp_path / f"copy{i}" / good.name
        shutil.copytree(good, ckpt)
        damage(ckpt)
        backend = FakeBackend(weight=0.0)
        torch.manual_seed(5)
        expected_draw = torch.rand(3)
        torch.manual_seed(5)
        with pytest.raises(ValueError, match=f"checkpoint {ckpt} is damaged: {message}") as refused:
            load_checkpoint(backend, ckpt, contract=dict(CONTRACT))
        assert str(refused.value).endswith("or start over with train.resume=none")
        assert backend.loaded_from is None and torch.equal(torch.rand(3), expected_draw)
    # found intact once, a checkpoint is not read again in this process, unless written again at
    # its path (a new COMPLETE marker)
    cut(good / "backend/rank00000.json")
    check_resume(good, CONTRACT)
    (good / "COMPLETE").unlink()
    (good / "COMPLETE").write_text("")
    with pytest.raises(ValueError, match="its backend/rank00000.json is not valid JSON"):
        check_resume(good, CONTRACT)
    shutil.rmtree(good)
    good = save(FakeBackend(weight=4.0), tmp_path / "run", 1)
    # each rank reads its own RNG state, and only on as many ranks as saved it: rank 1 of 2 resuming
    # this 1-rank checkpoint (the state re-cut) reads none; the pre-flight (no reader) checks them all
    ckpt = tmp_path / "elastic" / good.name
    shutil.copytree(good, ckpt)
    cut(ckpt / "rng_rank00000.safetensors")
    check_resume(ckpt, CONTRACT, (1, 2))
    with pytest.raises(ValueError, match="its rng_rank00000.safetensors is not a whole"):
        check_resume(ckpt, CONTRACT)
    # the full draft weights are export's: a resume (which never reads them) goes on; export refuses
    ckpt = tmp_path / "draft-cut" / good.name
    shutil.copytree(good, ckpt)
    cut(ckpt / "draft.safetensors")
    check_resume(ckpt, CONTRACT)
    with pytest.raises(
        ValueError, match="its draft.safetensors is not a whole safetensors file .*; export an earlier"
    ):
        read_draft(ckpt)
    shutil.copy(good / "draft.safetensors", ckpt / "draft.safetensors")
    (ckpt / "draft_config.json").write_text('{"hidden_size": 8')
    with pytest.raises(ValueError, match="its draft_config.json is not valid JSON .*; export an earlier"):
        read_draft(ckpt)
