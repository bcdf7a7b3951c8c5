"""safetensors files get the mode of every other new file (dflash2.safetensors_io): safetensors itself
creates them 0600, which another account (a server, a job of a colleague) cannot read."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash2.capture.offline import ShardWriter
from dflash2.distributed import state_io
from dflash2.export import export_draft
from dflash2.models import build_draft
from dflash2.safetensors_io import file_mode, readable_like_other_files, save_tensors
from tests.conftest import REPO_ROOT
from tests.test_checkpoint import FakeBackend, save


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(params=[0o022, 0o002, 0o077])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def plain_file_mode(directory: Path) -> int:
    """The mode `open` gives a new file here: the reference every written file is held to."""
    probe = directory / "plain.txt"
    probe.write_text("x")
    try:
        return mode(probe)
    finally:
        probe.unlink()


def test_save_pretrained_style_files_are_0600_without_it(tmp_path, umask):
    """What the module exists for: safetensors alone ignores the umask."""
    save_file({"x": torch.zeros(2)}, str(tmp_path / "raw.safetensors"))
    assert mode(tmp_path / "raw.safetensors") == 0o600
    assert file_mode() == plain_file_mode(tmp_path) == 0o666 & ~umask
    readable_like_other_files(tmp_path)
    assert mode(tmp_path / "raw.safetensors") == 0o666 & ~umask


def test_save_tensors_writes_the_tensors_with_the_mode_of_other_files(tmp_path, umask):
    tensors = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    save_tensors(tensors, tmp_path / "t.safetensors", metadata={"k": "v"})
    assert mode(tmp_path / "t.safetensors") == plain_file_mode(tmp_path)
    loaded = load_file(str(tmp_path / "t.safetensors"))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_exports_checkpoints_and_feature_shards_are_readable_like_their_json(tmp_path, umask):
    """Every file of an export, a checkpoint (draft, RNG state, backend state) and an offline
    features shard has the mode a plain file gets: the safetensors files as their JSON neighbours."""
    torch.manual_seed(0)
    draft = build_draft(REPO_ROOT / "configs" / "draft" / "tiny-dflash2.json")
    export = export_draft(draft, tmp_path / "export", dtype=torch.float32)
    checkpoint = save(FakeBackend(), tmp_path / "run", 3)
    state_io.save_state({"w": torch.ones(3)}, checkpoint / "backend" / "rank00000")
    (tmp_path / "features").mkdir()
    writer = ShardWriter(tmp_path / "features", rank=0, shard_bytes=1)
    writer.add(0, torch.ones(4, 8), torch.ones(4, 2))
    expected = plain_file_mode(tmp_path)
    files = [
        p for root in (export, checkpoint, tmp_path / "features") for p in root.rglob("*") if p.is_file()
    ]
    tensor_files = [p for p in files if p.suffix == ".safetensors"]
    assert len(tensor_files) >= 4  # model, draft, rng, backend state, shard
    assert {p.name: mode(p) for p in files} == {p.name: expected for p in files}
