"""Export and `--check`: exact tensor names, shapes and config layout (contract sections 3 and 4).

Independent references: the reference package `dflash` loading our exports (no missing or unexpected
keys, equal weights), and hand-written broken export directories.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dflash import model as reference
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash2.export import check_export, export_config, export_draft, main, read_training_run
from dflash2.models import TargetHead, build_draft, load_draft
from dflash2.models.config import load_config_dict, to_qwen3_config
from dflash2.models.registry import expected_tensor_shapes

REPO = Path(__file__).resolve().parents[1]
TINY_V2 = REPO / "configs/draft/tiny-dflash2.json"
TINY_V1 = REPO / "configs/draft/tiny-dflash.json"
QWEN36_27B = REPO / "configs/qwen3.6-27b-dflash2.json"


def synthetic_tensors(cfg: dict, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(shape, generator=generator).to(dtype)
        for name, shape in expected_tensor_shapes(cfg).items()
    }


def write_dir(
    path: Path,
    cfg: dict,
    tensors: dict[str, torch.Tensor],
    *,
    config_name="config.json",
    weights_name="model.safetensors",
) -> Path:
    """An export directory written by hand, the way another tool might write one."""
    path.mkdir(parents=True, exist_ok=True)
    (path / config_name).write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(path / weights_name))
    return path


def good_export(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = export_config(load_config_dict(TINY_V2), torch.bfloat16)
    tensors = synthetic_tensors(cfg)
    write_dir(path, cfg, tensors)
    return cfg, tensors


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflash2.export", *map(str, args)], capture_output=True, text=True, cwd=REPO
    )


# ---------------------------------------------------------------------------------------------------------
# --check on hand-written directories
# ---------------------------------------------------------------------------------------------------------


def test_check_cli_accepts_a_good_directory(tmp_path):
    good_export(tmp_path / "good")
    result = run_cli("--check", tmp_path / "good")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "DFlash2DraftModel, 2 layers" in result.stdout and "block size 8, bfloat16" in result.stdout


def rename(old: str, new: str):
    def mutate(cfg, tensors):
        tensors[new] = tensors.pop(old)

    return mutate


def drop(name: str):
    def mutate(cfg, tensors):
        del tensors[name]

    return mutate


def reshape(name: str, shape: tuple[int, ...]):
    def mutate(cfg, tensors):
        tensors[name] = torch.zeros(shape, dtype=tensors[name].dtype)

    return mutate


def add(name: str, shape: tuple[int, ...]):
    def mutate(cfg, tensors):
        tensors[name] = torch.zeros(shape, dtype=torch.bfloat16)

    return mutate


def top_level_conv(cfg, tensors):
    for key in ("conv_kernel_size", "conv_group_size"):
        cfg[key] = cfg["dflash_config"].pop(key)


def block_size_conflict(cfg, tensors):
    cfg["block_size"] = 16


def bad_layer_id(cfg, tensors):
    cfg["dflash_config"]["target_layer_ids"] = [1, 3, 6]


def no_use_sliding_window(cfg, tensors):
    del cfg["use_sliding_window"]


def config_says_fp32(cfg, tensors):
    cfg["torch_dtype"] = cfg["dtype"] = "float32"


def mixed_dtypes(cfg, tensors):
    tensors["norm.weight"] = tensors["norm.weight"].float()


CODEBOOK = "candidate_selector.predecessor_codebook"
BROKEN_CASES = {
    "codebook saved as .weight": (
        rename(CODEBOOK, CODEBOOK + ".weight"),
        [f"tensor {CODEBOOK}.weight [1024, 32]: must be saved as {CODEBOOK}", f"missing tensor {CODEBOOK}"],
    ),
    "missing tensor": (
        drop("layers.1.mlp.down_proj.weight"),
        ["missing tensor layers.1.mlp.down_proj.weight: expected shape [128, 384]"],
    ),
    "missing conv": (
        drop("layers.0.mlp_conv.base_kernel"),
        ["missing tensor layers.0.mlp_conv.base_kernel: expected shape [2, 2, 128]"],
    ),
    "wrong shape": (
        reshape("fc.weight", (128, 256)),
        ["tensor fc.weight: expected shape [128, 384], found [128, 256]"],
    ),
    "extra tensor": (
        add("layers.0.self_attn.rotary_emb.inv_freq", (16,)),
        ["unexpected tensor layers.0.self_attn.rotary_emb.inv_freq [16]"],
    ),
    "embedding saved": (add("embed_tokens.weight", (1024, 128)), ["tensor embed_tokens.weight [1024, 128]"]),
    "lm head saved": (add("lm_head.weight", (1024, 128)), ["tensor lm_head.weight [1024, 128]"]),
    "top-level-only conv fields": (
        top_level_conv,
        ["top-level conv_kernel_size=2: servers read", "DFlash2DraftModel needs both > 0"],
    ),
    "block_size conflict": (block_size_conflict, ["block_size conflict: dflash_config.block_size=8"]),
    "bad target layer id": (bad_layer_id, ["target_layer_ids[2]=6: out of range [0, 6)"]),
    "sliding window dropped": (no_use_sliding_window, ["use_sliding_window=None"]),
    "dtype mismatch": (config_says_fp32, ["torch_dtype='float32' but the tensors are bfloat16"]),
    "mixed dtypes": (mixed_dtypes, ["tensors are saved in several dtypes ['bfloat16', 'float32']"]),
}


def broken_export(path: Path, name: str) -> list[str]:
    cfg, tensors = good_export(path)
    mutate, messages = BROKEN_CASES[name]
    mutate(cfg, tensors)
    write_dir(path, cfg, tensors)
    return messages


@pytest.mark.parametrize("name", list(BROKEN_CASES))
def test_check_reports_broken_directory(tmp_path, capsys, name):
    messages = broken_export(tmp_path / "broken", name)
    assert main(["--check", str(tmp_path / "broken")]) == 1
    lines = capsys.readouterr().out.splitlines()
    for message in messages:
        assert any(message in line for line in lines), (message, lines)


def test_check_cli_exits_1_on_broken_directory(tmp_path):
    # one subprocess run (each costs seconds of imports); every case runs in-process above
    messages = broken_export(tmp_path / "broken", "codebook saved as .weight")
    result = run_cli("--check", tmp_path / "broken")
    assert result.returncode == 1
    for message in messages:
        assert message in result.stdout, result.stdout


def test_check_tolerates_model_prefix(tmp_path):
    cfg, tensors = good_export(tmp_path / "good")
    write_dir(tmp_path / "prefixed", cfg, {"model." + name: t for name, t in tensors.items()})
    assert check_export(tmp_path / "prefixed") == []


def test_check_reports_missing_files(tmp_path):
    assert "no config.json" in check_export(tmp_path)[0]
    (tmp_path / "config.json").write_text(
        json.dumps(export_config(load_config_dict(TINY_V1), torch.bfloat16))
    )
    assert any("no model.safetensors" in p for p in check_export(tmp_path))


def test_check_flags_reference_save_pretrained(tmp_path):
    """The reference package keeps its codebooks as nn.Embedding, so its own save_pretrained writes
    `...codebook.weight`, which SGLang would drop (selector silently off): --check must catch it."""
    model = reference.DFlash2DraftModel(to_qwen3_config(load_config_dict(TINY_V2)))
    model.save_pretrained(tmp_path)
    problems = check_export(tmp_path)
    assert f"missing tensor {CODEBOOK}: expected shape [1024, 32]" in problems


# ---------------------------------------------------------------------------------------------------------
# export_draft and the export CLI
# ---------------------------------------------------------------------------------------------------------


def test_export_refuses_and_leaves_old_export(tmp_path):
    cfg = load_config_dict(TINY_V2)
    out = export_draft(synthetic_tensors(cfg), tmp_path / "out", config=cfg)
    before = load_file(out / "model.safetensors")
    for broken, message in [
        (dict(synthetic_tensors(cfg), **{"embed_tokens.weight": torch.zeros(1024, 128)}), "embed_tokens"),
        (
            {k: v for k, v in synthetic_tensors(cfg).items() if k != "norm.weight"},
            "missing tensor norm.weight",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            export_draft(broken, out, config=cfg)
    bad_cfg = dict(cfg, dflash_config=dict(cfg["dflash_config"], selector_top_k=12))
    with pytest.raises(ValueError, match="selector_top_k=12"):
        export_draft(synthetic_tensors(cfg), out, config=bad_cfg)
    with pytest.raises(ValueError, match="needs config="):
        export_draft(synthetic_tensors(cfg), out)
    after = load_file(out / "model.safetensors")
    # the config may be given as its file (as build_draft and load_draft take it)
    from_file = export_draft(synthetic_tensors(cfg), tmp_path / "from-file", config=TINY_V2)
    assert (from_file / "config.json").read_text() == (out / "config.json").read_text()
    shutil.rmtree(from_file)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directories left


def test_export_writes_contract_config(tmp_path):
    cfg = load_config_dict(TINY_V2)
    flat = {k: v for k, v in cfg.items() if k != "dflash_config"}
    flat.update(cfg["dflash_config"])  # every DFlash field at the top level
    flat["torch_dtype"] = "float32"
    # with sliding layers, leaving out either changes the model the loaders read: refused, not filled
    without_causal = {k: v for k, v in flat.items() if k != "is_causal"}
    for config, field in (
        (without_causal, "is_causal"),
        ({**flat, "use_sliding_window": None}, "use_sliding_window"),
    ):
        with pytest.raises(ValueError, match=field):
            export_draft(synthetic_tensors(cfg, torch.float32), tmp_path / "refused", config=config)
    out = export_draft(synthetic_tensors(cfg, torch.float32), tmp_path / "out", config=flat)
    written = json.loads((out / "config.json").read_text())
    assert written["dflash_config"] == cfg["dflash_config"]
    assert written["is_causal"] is False and written["use_sliding_window"] is True
    assert written["torch_dtype"] == written["dtype"] == "bfloat16"
    assert "quantization_config" not in written and "input_embedding_scale" not in written
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}


def test_export_cli_from_training_checkpoint(tmp_path):
    cfg = load_config_dict(TINY_V2)
    state = synthetic_tensors(cfg, torch.float32)
    write_dir(
        tmp_path / "ckpt", cfg, state, config_name="draft_config.json", weights_name="draft.safetensors"
    )
    (tmp_path / "ckpt" / "train_state.json").write_text(json.dumps({"step": 1200, "epoch": 3}))
    result = run_cli(tmp_path / "ckpt", tmp_path / "out")
    assert result.returncode == 0, result.stdout + result.stderr  # its --check passed, record and all
    assert "bfloat16" in result.stdout.splitlines()[-1]
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(exported[name], state[name].to(torch.bfloat16)) for name in state)
    # the checkpoint's step, for evaluation's TensorBoard (no contract.json here: no chat template arguments)
    assert read_training_run(tmp_path / "out") == {"step": 1200}
    # an export of that export keeps the record
    assert main([str(tmp_path / "out"), str(tmp_path / "again")]) == 0
    assert read_training_run(tmp_path / "again") == {"step": 1200}


@pytest.mark.parametrize("path", [TINY_V1, TINY_V2])
def test_every_export_path_writes_the_same_config(tmp_path, path):
    """A module (its config), a training run's export (the config's to_dict(), which training keeps) and
    a checkpoint (its draft_config.json) write one config.json, without transformers' generic fields."""
    draft = random_draft(path, seed=0)
    from_module = export_draft(draft, tmp_path / "module")
    from_run = export_draft(draft.state_dict(), tmp_path / "run", config=draft.config.to_dict())
    write_dir(
        tmp_path / "ckpt",
        draft.config.to_dict(),
        draft.state_dict(),
        config_name="draft_config.json",
        weights_name="draft.safetensors",
    )
    (tmp_path / "ckpt" / "train_state.json").write_text(json.dumps({"step": 3}))
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "ckpt-export")]) == 0
    written = [
        json.loads((out / "config.json").read_text())
        for out in (from_module, from_run, tmp_path / "ckpt-export")
    ]
    assert written[0] == written[1] == written[2]
    for generic in ("id2label", "label2id", "return_dict", "output_hidden_states", "problem_type"):
        assert generic not in written[0]
    assert written[0]["dflash_config"] == load_config_dict(path)["dflash_config"]


def test_export_cli_from_model_dir_with_prefix_and_top_level_fields(tmp_path, capsys):
    cfg = load_config_dict(TINY_V1)
    flat = {k: v for k, v in cfg.items() if k != "dflash_config"} | cfg["dflash_config"]
    state = synthetic_tensors(cfg, torch.float32)
    write_dir(tmp_path / "hf", flat, {"model." + name: t for name, t in state.items()})
    assert main([str(tmp_path / "hf"), str(tmp_path / "out"), "--dtype", "fp32"]) == 0
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert exported.keys() == state.keys() and all(torch.equal(exported[n], state[n]) for n in state)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dflash_config"] == cfg["dflash_config"]
    assert not (tmp_path / "out" / "training_run.json").exists()  # nothing known of a training run


def test_export_cli_checks_target(tmp_path, capsys):
    cfg = load_config_dict(TINY_V2)
    write_dir(tmp_path / "hf", cfg, synthetic_tensors(cfg))
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(
        json.dumps({"hidden_size": 128, "vocab_size": 1024, "num_hidden_layers": 8})
    )
    assert main([str(tmp_path / "hf"), str(tmp_path / "out"), "--target", str(tmp_path / "target")]) == 1
    assert "num_target_layers=6 but the target has num_hidden_layers=8" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------
# Real drafts: round trip through our loader and the reference loader
# ---------------------------------------------------------------------------------------------------------


def random_draft(path: Path, seed: int):
    """A draft with random non-identity weights (conv kernels and successor codebook non-zero)."""
    torch.manual_seed(seed)
    draft = build_draft(path)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return draft.eval()


@pytest.mark.parametrize("path", [TINY_V1, TINY_V2])
def test_export_round_trip_same_outputs(tmp_path, path):
    draft = random_draft(path, seed=1)
    out = export_draft(draft, tmp_path / "out", dtype=torch.float32)
    assert check_export(out) == []
    loaded = load_draft(out)
    assert type(loaded) is type(draft)
    b, num_blocks, block_size, hidden, seq = 2, 3, 8, 128, 24
    block_embeds = torch.randn(b, num_blocks, block_size, hidden)
    context = torch.randn(b, seq, 3 * hidden)
    anchors = torch.tensor([[4, 11, 20], [2, 9, 24]])
    with torch.no_grad():
        expected = draft(block_embeds, context, anchors)
        actual = loaded(block_embeds, context, anchors)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    head = TargetHead(torch.randn(1024, hidden), torch.randn(1024, hidden))
    anchor_ids = torch.tensor([5, 7])
    tokens, _, _ = draft.propose(expected[:, 0, 1:], anchor_ids, head)
    loaded_tokens, _, _ = loaded.propose(actual[:, 0, 1:], anchor_ids, head)
    assert torch.equal(tokens, loaded_tokens)


@pytest.mark.parametrize(
    "path, reference_class",
    [(TINY_V1, reference.DFlashDraftModel), (TINY_V2, reference.DFlash2DraftModel)],
)
def test_reference_package_loads_our_export(tmp_path, path, reference_class):
    draft = random_draft(path, seed=2)
    out = export_draft(draft, tmp_path / "out")  # bf16
    loaded, info = reference_class.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours = {name: t.to(torch.bfloat16) for name, t in draft.state_dict().items()}
    theirs = {
        name.removesuffix(".weight") if "_codebook." in name else name: t
        for name, t in loaded.state_dict().items()
    }
    assert theirs.keys() == ours.keys()
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name
    assert loaded.block_size == 8 and loaded.mask_token_id == 3 and loaded.target_layer_ids == [1, 3, 4]
    assert loaded.layers[0].self_attn.sliding_window == 2048 and loaded.layers[0].self_attn.is_causal is False


def test_qwen36_27b_builds_on_meta():
    with torch.device("meta"):
        draft = build_draft(QWEN36_27B)
    num_params = sum(p.numel() for p in draft.parameters())
    print(f"Qwen3.6-27B DFlash 2 draft: {num_params / 1e9:.3f} B parameters")
    expected = expected_tensor_shapes(load_config_dict(QWEN36_27B))
    assert num_params == sum(math.prod(shape) for shape in expected.values())
    assert {name: tuple(t.shape) for name, t in draft.state_dict().items()} == expected
    assert 1.90e9 < num_params < 1.95e9


def test_check_on_a_training_checkpoint_names_the_export_command(tmp_path, capsys):
    cfg = load_config_dict(TINY_V2)
    ckpt = tmp_path / "step_00000300"
    write_dir(
        ckpt,
        cfg,
        synthetic_tensors(cfg, torch.float32),
        config_name="draft_config.json",
        weights_name="draft.safetensors",
    )
    assert main(["--check", str(ckpt)]) == 1
    assert (
        f"is a training checkpoint, not an export: write its export with `python -m dflash2.export {ckpt} <out>`"
        in (capsys.readouterr().out)
    )


def test_export_from_a_checkpoint_keeps_the_runs_chat_template_kwargs(tmp_path):
    """contract.json holds the run's data.chat_template_kwargs (the thinking mode): the export records
    them with the step, so evaluation renders prompts as the training data was."""
    cfg = load_config_dict(TINY_V2)
    ckpt = tmp_path / "ckpt"
    write_dir(
        ckpt,
        cfg,
        synthetic_tensors(cfg, torch.float32),
        config_name="draft_config.json",
        weights_name="draft.safetensors",
    )
    (ckpt / "train_state.json").write_text(json.dumps({"step": 40, "epoch": 1}))
    (ckpt / "contract.json").write_text(
        json.dumps({"chat_template_kwargs": {"enable_thinking": False}, "seed": 0})
    )
    assert main([str(ckpt), str(tmp_path / "out")]) == 0
    assert read_training_run(tmp_path / "out") == {
        "step": 40,
        "chat_template_kwargs": {"enable_thinking": False},
    }


def test_a_draft_target_mismatch_names_both_files(tmp_path, capsys):
    cfg = load_config_dict(TINY_V2)
    write_dir(tmp_path / "hf", cfg, synthetic_tensors(cfg))
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(
        json.dumps({"hidden_size": 256, "vocab_size": 1024, "num_hidden_layers": 6})
    )
    files = f"(draft {tmp_path / 'hf' / 'config.json'}, target {tmp_path / 'target' / 'config.json'})"
    assert main(["--check", str(tmp_path / "hf"), "--target", str(tmp_path / "target")]) == 1
    assert f"hidden_size=128 but the target's hidden_size is 256 {files}" in capsys.readouterr().out
    assert main([str(tmp_path / "hf"), str(tmp_path / "out"), "--target", str(tmp_path / "target")]) == 1
    assert files in capsys.readouterr().err
    # building the draft from its file against a transformers config read from the target directory
    from transformers import AutoConfig

    target_config = AutoConfig.for_model("qwen3", hidden_size=256, vocab_size=1024, num_hidden_layers=6)
    target_config.save_pretrained(tmp_path / "hf_target")
    with pytest.raises(ValueError) as err:
        build_draft(TINY_V2, target_config=AutoConfig.from_pretrained(tmp_path / "hf_target"))
    assert f"(draft {TINY_V2}, target {tmp_path / 'hf_target' / 'config.json'})" in str(err.value)


def test_a_draft_tokenizer_mask_token_mismatch_names_both(tmp_path, tiny_default, capsys):
    from transformers import AutoTokenizer

    cfg = load_config_dict(TINY_V2)
    cfg["dflash_config"]["mask_token_id"] = 5  # the tiny tokenizer's mask token <|mask|> is id 3
    write_dir(tmp_path / "hf", cfg, synthetic_tensors(cfg))
    target = str(tiny_default.target_dir)
    assert main(["--check", str(tmp_path / "hf"), "--tokenizer", target]) == 1
    out = capsys.readouterr().out
    assert (
        "mask_token_id=5 but the tokenizer maps mask_token '<|mask|>' to 3" in out
        and f"(draft {tmp_path / 'hf' / 'config.json'}, tokenizer {target})" in out
    )
    with pytest.raises(ValueError, match=r"tokenizer .*tiny/target\)"):
        build_draft(tmp_path / "hf" / "config.json", tokenizer=AutoTokenizer.from_pretrained(target))


def test_load_draft_reads_an_export_as_the_servers_do(tmp_path):
    # a DFlash 2 field at the top level is ignored by SGLang: load_draft moved it into dflash_config
    # and evaluated a model with those convolutions, which the server then served without them
    cfg, tensors = good_export(tmp_path / "good")
    flat = {k: v for k, v in cfg.items() if k != "dflash_config"}
    nested = dict(cfg["dflash_config"])
    flat["conv_kernel_size"], flat["conv_group_size"] = (
        nested.pop("conv_kernel_size"),
        nested.pop("conv_group_size"),
    )
    write_dir(tmp_path / "top-level", {**flat, "dflash_config": nested}, tensors)
    assert check_export(tmp_path / "top-level") != []
    with pytest.raises(
        ValueError, match=r"the servers would not load this draft as trained: .*conv_kernel_size"
    ):
        load_draft(tmp_path / "top-level")

    # a sharded export (an index and two files), which --check accepts, loads with the same weights
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / "config.json").write_text(json.dumps(cfg))
    for file, part in halves.items():
        save_file({name: tensors[name] for name in part}, str(tmp_path / "sharded" / file))
    weight_map = {name: file for file, part in halves.items() for name in part}
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert check_export(tmp_path / "sharded") == []
    loaded = load_draft(tmp_path / "sharded").state_dict()  # FileNotFoundError before
    assert all(torch.equal(loaded[name], tensors[name]) for name in tensors)


@pytest.mark.parametrize("value", [5, ["block_size"]])
def test_check_lists_a_dflash_config_that_is_not_an_object(tmp_path, value):
    cfg, tensors = good_export(tmp_path / "good")
    write_dir(tmp_path / "bad", {**cfg, "dflash_config": value}, tensors)
    result = run_cli("--check", tmp_path / "bad")  # a TypeError traceback before
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert "dflash_config" in result.stdout + result.stderr


def test_an_export_replaces_only_an_export_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    """Before: `python -m dflash2.export <ckpt> <run dir>` replaced the whole run directory
    (checkpoints, logs) with the export, and a failed write left its temporary directory."""
    import errno

    import dflash2.export as export_module

    draft = build_draft(load_config_dict(TINY_V2))
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=r"holds more than an export \(checkpoints, metrics.jsonl\)"):
        export_draft(draft, run, dtype=torch.float32)
    assert (run / "checkpoints" / "step_00000004").is_dir() and (run / "metrics.jsonl").is_file()
    first = export_draft(draft, run / "export", dtype=torch.float32)
    export_draft(draft, first, dtype=torch.float32)  # an earlier export is replaced

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export_module, "save_tensors", full_disk)
    with pytest.raises(OSError, match="No space left"):
        export_draft(draft, first, dtype=torch.float32)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "export", "metrics.jsonl"]
    assert load_draft(first) is not None  # the previous export, whole
