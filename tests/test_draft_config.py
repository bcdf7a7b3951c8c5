"""`python -m dflash2.draft_config`: a draft config made from the target.

- the configs it writes for SmolLM2 and every family of the target matrix pass check_draft_config
  against the target and its tokenizer and train two steps with the real training code;
- every shipped draft config is what the command written next to it (in the recipe that uses it, or
  in docs/targets.md) produces, byte for byte;
- the mask token it chooses is never a stop, bos, pad or unk token, nor one the chat template renders;
  without one it refuses with a message naming --mask-token, and every refusal is exit 2.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import sys

import pytest
from transformers import AutoTokenizer

from dflash2 import draft_config
from dflash2.errors import run_main
from dflash2.export import check_export
from dflash2.models.config import check_draft_config, load_config_dict
from tests.run_helpers import REPO, metrics, run, tiny_subset
from tests.target_families import FAMILY_NAMES, save_family

COMMAND = re.compile(r"(python -m dflash2\.draft_config [^`\n]*)")
COMMAND_SOURCES = (*sorted((REPO / "configs").glob("**/*.yaml")), REPO / "docs" / "targets.md")
SHIPPED = (
    *sorted((REPO / "configs" / "draft").glob("*.json")),
    REPO / "configs" / "qwen3.6-27b-dflash2.json",
)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def generate(capsys, target, architecture: str, out, *flags: str) -> tuple[dict, str]:
    argv = ["--target", str(target), "--arch", architecture, "--out", str(out), *flags]
    assert run_main(draft_config.main, argv) == 0, capsys.readouterr().err
    return json.loads(out.read_text()), capsys.readouterr().out


def refusal(capsys, *argv: str) -> str:
    assert run_main(draft_config.main, list(argv)) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.err.count("error:") == 1, captured.err
    return captured.err


# ------------------------------------------------------------------ the configs it writes train


@pytest.mark.slow
def test_generated_configs_pass_the_check_and_train_two_steps(smollm2, tiny_default, tmp_path, capsys):
    """One plain python process trains every pair two steps (tests/dist_scripts/train_draft_configs.py)."""
    pairs = {}
    for family in FAMILY_NAMES:
        target = save_family(family, tmp_path / "targets" / family, tiny_default.target_dir)
        pairs[family] = (target, "DFlash2DraftModel", ["--num-layers", "1"])
    pairs["qwen3_dflash"] = (pairs["qwen3"][0], "DFlashDraftModel", ["--num-layers", "1"])
    for architecture in ("DFlash2DraftModel", "DFlashDraftModel"):
        pairs[f"smollm2_{architecture}"] = (smollm2.target_dir, architecture, ["--num-layers", "1"])
    runs = []
    capsys.readouterr()  # what saving the checkpoints printed
    for name, (target, architecture, flags) in pairs.items():
        cfg, out = generate(capsys, target, architecture, tmp_path / f"{name}.json", *flags)
        tokenizer = AutoTokenizer.from_pretrained(target)
        check_draft_config(cfg, tokenizer=tokenizer, target_config=target)
        text = load_config_dict(target).get("text_config") or load_config_dict(target)
        assert (cfg["hidden_size"], cfg["vocab_size"]) == (text["hidden_size"], text["vocab_size"])
        assert (
            cfg["num_target_layers"] == cfg["dflash_config"]["num_target_layers"] == text["num_hidden_layers"]
        )
        assert cfg["dflash_config"]["mask_token_id"] not in draft_config.reserved_ids(target, tokenizer)
        assert out.splitlines()[-2:][0].startswith(f"{architecture} config for {target}")
        assert out.splitlines()[-1].startswith("mask token")
        runs.append(f"{name}={target}={tmp_path / f'{name}.json'}")

    data = tiny_subset(tiny_default, tmp_path, 4)
    script = REPO / "tests" / "dist_scripts" / "train_draft_configs.py"
    command = [sys.executable, str(script), "--runs", ",".join(runs), "--data", str(data)]
    proc = run([*command, "--out", str(tmp_path / "runs")], timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for name, (target, _, _) in pairs.items():
        run_dir = tmp_path / "runs" / name / "run"
        losses = [record["loss"] for record in metrics(run_dir)]
        assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), name
        tokenizer = AutoTokenizer.from_pretrained(target)
        assert check_export(run_dir / "export", tokenizer=tokenizer, target_config=target) == [], name


def test_smollm2_config_sizes_and_mask_token(smollm2, tmp_path, capsys):
    cfg, out = generate(capsys, smollm2.target_dir, "DFlash2DraftModel", tmp_path / "draft.json")
    sizes = {key: cfg[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads")}
    assert sizes == {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9}
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (3, 64, 49152)
    dflash = cfg["dflash_config"]
    assert dflash["num_target_layers"] == 30 and dflash["target_layer_ids"] == [1, 8, 14, 20, 27]
    assert (dflash["selector_rank"], dflash["conv_group_size"]) == (144, 16)  # min(256, 576 / 4)
    # the tokenizer has no mask token; ids 0-2 are <|endoftext|> (unk), <|im_start|> (bos, in the
    # template) and <|im_end|> (eos, pad): the first free added special token is <repo_name>
    assert (dflash["mask_token"], dflash["mask_token_id"]) == ("<repo_name>", 3)
    assert out.splitlines()[1].startswith("mask token '<repo_name>' (id 3): the tokenizer's first added")


# ------------------------------------------------------------------ the shipped configs are its output


def shipped_commands() -> dict[str, list[str]]:
    """--out file -> argv of every draft_config command that writes a file under configs/, as a recipe
    or docs/targets.md shows it."""
    commands: dict[str, list[str]] = {}
    for source in COMMAND_SOURCES:
        for command in COMMAND.findall(source.read_text()):
            argv = shlex.split(command)[3:]
            out = argv[argv.index("--out") + 1]
            if not out.startswith("configs/"):
                continue  # a usage line (--out FILE)
            assert commands.setdefault(out, argv) == argv, f"{out}: two different commands ({source})"
    return commands


def test_every_shipped_draft_config_is_the_generators_output(smollm2, tiny_default, tmp_path, capsys):
    qwen_27b = tmp_path / "Qwen3.6-27B"  # its config.json in the published (vision-language) form
    qwen_27b.mkdir()
    text = json.loads((REPO / "configs" / "target" / "qwen3.6-27b.json").read_text())
    composite = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"}
    composite["text_config"] = {**text, "model_type": "qwen3_5_text"}
    (qwen_27b / "config.json").write_text(json.dumps(composite))
    targets = {
        "artifacts/tiny/target": tiny_default.target_dir,
        "artifacts/smollm2/target": smollm2.target_dir,
        "/path/to/Qwen3.6-27B": qwen_27b,
    }
    commands = shipped_commands()
    assert sorted(commands) == sorted(str(path.relative_to(REPO)) for path in SHIPPED)
    for out, argv in commands.items():
        argv = list(argv)
        argv[argv.index("--target") + 1] = str(targets[argv[argv.index("--target") + 1]])
        argv[argv.index("--out") + 1] = str(tmp_path / "out.json")
        assert run_main(draft_config.main, argv) == 0, capsys.readouterr().err
        assert (tmp_path / "out.json").read_text() == (REPO / out).read_text(), out


# ------------------------------------------------------------------ the mask token, refusals


def without_mask_token(tiny_default, directory):
    """The tiny target whose tokenizer has no mask token and whose chat template renders <|mask|>: no
    special token is left that a reply could never contain."""
    shutil.copytree(tiny_default.target_dir, directory)
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config.pop("mask_token")
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    template = directory / "chat_template.jinja"
    template.write_text("{#- <|mask|> -#}" + template.read_text())
    return directory


def test_no_unused_special_token_is_refused_naming_mask_token(tiny_default, tmp_path, capsys):
    target = without_mask_token(tiny_default, tmp_path / "target")
    out = tmp_path / "draft.json"
    err = refusal(capsys, "--target", str(target), "--arch", "DFlash2DraftModel", "--out", str(out))
    assert "no mask token and no unused special token; pass --mask-token TOKEN" in err
    assert not out.exists()
    # a token the user names is taken, written into the config and checked against the tokenizer
    cfg, _ = generate(capsys, target, "DFlash2DraftModel", out, "--mask-token", "<|mask|>")
    assert (cfg["dflash_config"]["mask_token"], cfg["dflash_config"]["mask_token_id"]) == ("<|mask|>", 3)


def test_the_mask_token_is_written_by_name_wherever_the_tokenizer_has_it(tiny_default, tmp_path, capsys):
    """Servers that look the mask up by token (by default '<|MASK|>', which the tiny tokenizer lacks)
    then find the id the draft was trained with."""
    tokenizer = draft_config.tokenizer_if_any(tiny_default.target_dir)
    own, _ = generate(capsys, tiny_default.target_dir, "DFlash2DraftModel", tmp_path / "own.json")
    assert (own["dflash_config"]["mask_token"], own["dflash_config"]["mask_token_id"]) == ("<|mask|>", 3)
    by_id, _ = generate(
        capsys, tiny_default.target_dir, "DFlashDraftModel", tmp_path / "id.json", "--mask-token-id", "5"
    )
    assert by_id["dflash_config"]["mask_token"] == tokenizer.convert_ids_to_tokens(5)
    check_draft_config(by_id, tokenizer=tokenizer, target_config=tiny_default.target_dir)


def test_a_tokenizer_mask_token_the_target_stops_on_is_passed_over(tiny_default, tmp_path, capsys):
    target = tmp_path / "target"
    shutil.copytree(tiny_default.target_dir, target)
    tokenizer_config = json.loads((target / "tokenizer_config.json").read_text())
    tokenizer_config["mask_token"] = tokenizer_config["eos_token"]
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    cfg, _ = generate(capsys, target, "DFlash2DraftModel", tmp_path / "draft.json")
    tokenizer = draft_config.tokenizer_if_any(target)
    assert cfg["dflash_config"]["mask_token_id"] != tokenizer.eos_token_id
    assert cfg["dflash_config"]["mask_token_id"] not in draft_config.reserved_ids(target, tokenizer)


def test_refusals_are_one_message_exit_2(smollm2, tiny_default, tmp_path, capsys):
    base = ["--target", str(smollm2.target_dir), "--out", str(tmp_path / "x.json")]
    v2, v1 = [*base, "--arch", "DFlash2DraftModel"], [*base, "--arch", "DFlashDraftModel"]
    err = refusal(capsys, *v2, "--conv-group-size", "7")
    assert "--conv-group-size 7 does not divide the target's hidden size 576" in err
    assert "DFlashDraftModel has no convolution or selector: drop --selector-rank" in refusal(
        capsys, *v1, "--selector-rank", "8"
    )
    assert "--mask-token-id 2 is a stop, bos, pad or unk token" in refusal(
        capsys, *v2, "--mask-token-id", "2"
    )
    assert "--mask-token '<nope>' is not a token" in refusal(capsys, *v2, "--mask-token", "<nope>")
    assert "--mask-token '<|im_end|>' is a stop, bos, pad or unk token of the target (id 2)" in refusal(
        capsys, *v2, "--mask-token", "<|im_end|>"
    )
    # what check_draft_config refuses comes through as one message too
    err = refusal(capsys, *v2, "--conv-kernel-size", "9")
    assert err.startswith("error: invalid draft config:\n  dflash_config.conv_kernel_size=9"), err
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(tiny_default.target_dir / "config.json", config_only / "config.json")
    only = ["--target", str(config_only), "--arch", "DFlashDraftModel", "--out", str(tmp_path / "x.json")]
    err = refusal(capsys, *only)
    assert "has no tokenizer: pass --mask-token-id" in err
    assert "--sliding-window -5: give a window of tokens, or 0 for full attention" in refusal(
        capsys, *v2, "--sliding-window", "-5"
    )  # before: written as full attention
    for flags, message in [
        (["--mask-token-id", "-1"], "--mask-token-id -1: give a token id >= 0"),  # before: OverflowError
        (
            ["--mask-token", "<|im_start|>", "--mask-token-id", "4"],
            "give --mask-token or --mask-token-id, not both",
        ),
        (["--rope-theta", "-1"], "--rope-theta -1.0: must be > 0"),  # before: a NaN loss at step 1
        (["--max-position-embeddings", "0"], "--max-position-embeddings 0: must be > 0"),
    ]:
        assert message in refusal(capsys, *v2, *flags), flags
    # explicit ids must increase; the default spread of 5 draft layers over the tiny target's 6 repeats
    # ids ([1, 2, 2, 2, 3]), which a server collects once each: written once each
    tiny = [
        "--target",
        str(tiny_default.target_dir),
        "--arch",
        "DFlash2DraftModel",
        "--out",
        str(tmp_path / "t.json"),
    ]
    assert "must be strictly increasing" in refusal(capsys, *tiny, "--target-layer-ids", "3,1")
    assert run_main(draft_config.main, [*tiny, "--num-layers", "5"]) == 0
    assert json.loads((tmp_path / "t.json").read_text())["dflash_config"]["target_layer_ids"] == [1, 2, 3]
    a_dir = tmp_path / "a-dir"
    a_dir.mkdir()
    v2_into_dir = ["--target", str(smollm2.target_dir), "--arch", "DFlash2DraftModel", "--out", str(a_dir)]
    assert f"--out {a_dir} is a directory: give the file to write" in refusal(capsys, *v2_into_dir)
    assert not (tmp_path / "x.json").exists()


def test_a_flag_stands_in_for_a_field_the_targets_config_lacks(tiny_default, tmp_path, capsys):
    # a MoE text config (Qwen3.5-MoE) has no dense intermediate_size: --intermediate-size gives it
    target = tmp_path / "no-intermediate"
    target.mkdir()
    config = json.loads((tiny_default.target_dir / "config.json").read_text())
    del config["intermediate_size"], config["max_position_embeddings"]
    (target / "config.json").write_text(json.dumps(config))
    base = ["--target", str(target), "--arch", "DFlash2DraftModel", "--out", str(tmp_path / "x.json")]
    base += ["--mask-token-id", "5"]
    assert "the target's config has no intermediate_size; pass --intermediate-size" in refusal(capsys, *base)
    written, _ = generate(
        capsys, target, "DFlash2DraftModel", tmp_path / "x.json", "--mask-token-id", "5",
        "--intermediate-size", "96", "--max-position-embeddings", "512",
    )  # fmt: skip
    assert written["intermediate_size"] == 96 and written["max_position_embeddings"] == 512


def test_the_module_command_exits_2_with_one_line(smollm2, tmp_path):
    command = [sys.executable, "-m", "dflash2.draft_config", "--target", str(smollm2.target_dir)]
    command += ["--arch", "DFlash2DraftModel", "--out", str(tmp_path / "x.json"), "--conv-group-size", "7"]
    proc = run(command)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --conv-group-size 7"), proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "x.json").exists()
