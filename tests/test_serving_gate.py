"""The serving gate on the tiny default: overfit -> export -> reload -> decode, through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash2.serving_gate import run_gate, select_samples

REPO_ROOT = Path(__file__).resolve().parent.parent
REQUIRED_KEYS = {
    "passed",
    "input_format",
    "spec_accept_length",
    "target_prefix_match_tokens",
    "generated_tokens",
    "target_tokens",
    "clean_block_tokens",
    "errors",
    "result_path",
}


def run_gate_cli(tiny_default, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "result.json"
    command = [
        sys.executable,
        "-m",
        "dflash2.serving_gate",
        "--config",
        str(REPO_ROOT / "configs" / "tiny-dflash2.yaml"),
        "--data",
        str(tiny_default.train_jsonl),
        "--out",
        str(out),
        *args,
        f"output_dir={tmp_path / 'run'}",
        f"model.target={tiny_default.target_dir}",
        f"model.draft_config={REPO_ROOT / 'configs' / 'draft' / 'tiny-dflash2.json'}",
    ]
    # One thread: these models are tiny, and the run must not crawl next to other jobs.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def target_greedy_reply(tiny_default, messages) -> list[int]:
    """Reference: Hugging Face generate on the first sample's prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_default.target_dir)
    target = AutoModelForCausalLM.from_pretrained(tiny_default.target_dir, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = target.generate(
        ids, do_sample=False, max_new_tokens=256, eos_token_id=[im_end], pad_token_id=tokenizer.pad_token_id
    )
    return out[0, ids.shape[1] :].tolist()


def test_gate_passes_on_tiny_default(tiny_default, tmp_path):
    proc, result = run_gate_cli(tiny_default, tmp_path, "--num-samples", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert REQUIRED_KEYS <= set(result)
    assert result["passed"] is True and result["errors"] == []
    assert result["input_format"] == "training_jsonl"
    assert result["result_path"] == str(tmp_path / "result.json")
    block = 8
    assert result["spec_accept_length"] == block
    # The decode covers whole blocks of the target's reply, and every token is the target's own.
    reference = target_greedy_reply(
        tiny_default, select_samples(tiny_default.train_jsonl, 1)[0]["conversations"][:1]
    )
    assert result["target_tokens"] == len(reference)
    assert result["generated_tokens"] == 1 + block * ((len(reference) - 1) // block) >= 1 + block
    assert result["target_prefix_match_tokens"] == result["generated_tokens"]
    assert result["clean_block_tokens"] == result["generated_tokens"] - 1
    assert (tmp_path / "run" / "serving_gate" / "export" / "model.safetensors").is_file()


def test_gate_fails_when_nothing_is_learned(tiny_default, tmp_path):
    proc, result = run_gate_cli(tiny_default, tmp_path, "--steps", "1", "train.lr=1e-6")
    assert proc.returncode == 1
    assert result["passed"] is False
    assert result["spec_accept_length"] < 8
    assert any("spec_accept_length" in error for error in result["errors"])


def test_gate_samples_end_with_their_first_reply(tmp_path):
    """The gate decodes the first reply's prompt, so it trains on that exchange alone: a later turn
    could make the reply history, which a chat template may render otherwise (Qwen3's drop its
    thinking) and training then keeps unsupervised."""
    system = {"role": "system", "content": "Be brief."}
    user, reply = (
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello"},
    )
    later = [{"role": "user", "content": "Again?"}, {"role": "assistant", "content": "Hello again"}]
    lines = [
        {"id": "a", "conversations": [system, user, reply, *later]},
        {"id": "b", "conversations": [user]},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert select_samples(path, 2) == [
        {"id": "a", "conversations": [system, user, reply]},
        {"id": "b", "conversations": [user]},
    ]


@pytest.mark.parametrize("num_samples", [0, 11])
def test_gate_refuses_bad_sample_counts(tiny_default, num_samples):
    with pytest.raises(ValueError, match="--num-samples must be between 1 and 10"):
        select_samples(tiny_default.train_jsonl, num_samples)


def test_gate_passes_on_a_random_initialised_hybrid_vlm(tiny_default, tmp_path):
    """A random Qwen3_5ForConditionalGeneration's greedy reply is not the canonical tokenisation of
    its own text; the gate trains on the ids the target generated, so it still passes."""
    from transformers import AutoTokenizer

    from dflash2.data.regenerate import LocalTargetGenerator
    from dflash2.data.render import encode_prompt
    from tests.target_families import family_draft_config, save_family

    target_dir = save_family("qwen3_5_vlm", tmp_path / "target", tiny_default.target_dir)
    draft_config = tmp_path / "draft.json"
    draft_config.write_text(json.dumps(family_draft_config()))
    sample = select_samples(tiny_default.train_jsonl, 1)[0]
    # The premise: the reply text of this target does not re-tokenise to the ids it generated.
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    reply = LocalTargetGenerator(target, tokenizer, max_new_tokens=48).generate(
        [sample["conversations"][:1]]
    )[0]
    assert tokenizer(reply.text, add_special_tokens=False)["input_ids"] != reply.token_ids
    assert reply.token_ids == target_greedy_ids(
        target, encode_prompt(sample["conversations"][:1], tokenizer), 48
    )

    out = tmp_path / "result.json"
    command = [
        sys.executable,
        "-m",
        "dflash2.serving_gate",
        "--config",
        str(REPO_ROOT / "configs/tiny-dflash2.yaml"),
    ]
    command += ["--data", str(tiny_default.train_jsonl), "--out", str(out), "--max-new-tokens", "48"]
    command += [
        f"output_dir={tmp_path / 'run'}",
        f"model.target={target_dir}",
        f"model.draft_config={draft_config}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    result = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["passed"] is True and result["errors"] == [] and result["warnings"] == []
    assert result["spec_accept_length"] == 8
    assert result["target_prefix_match_tokens"] == result["generated_tokens"] == 1 + 8 * ((48 - 1) // 8)


def target_greedy_ids(target, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference: a plain greedy loop, one full forward per token, no cache, up to the eos (2)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            if token == 2:
                break
            ids.append(token)
    return ids[len(prompt_ids) :]


def test_the_gate_trains_from_a_random_start_over_the_whole_vocabulary_whatever_the_config_says(tmp_path):
    """A loss over a few tokens (objective.loss_vocab_size) never ranks the others below them: the
    overfit draft would not serve its sample (seen on SmolLM2: tau 3.33 / 4 with 21 tokens)."""
    from dflash2.config import load_run_config
    from dflash2.serving_gate import train_overrides

    config = REPO_ROOT / "configs" / "smollm2-dflash2.yaml"
    assert load_run_config(config, []).objective.loss_vocab_size == 4096
    overrides = train_overrides(tmp_path / "gate", tmp_path / "data.jsonl", 60, 1, [])
    assert load_run_config(config, overrides).objective.loss_vocab_size is None
    # and from a random start: the SmolLM2 configs start from the target's layers, which learn
    # one sample more slowly (seen: tau 3.33 / 4 after the gate's 60 steps)
    assert load_run_config(config, []).model.init_from_target
    assert not load_run_config(config, overrides).model.init_from_target
    # and on the replies it decodes: the recipe supervises the prompts too, which on SmolLM2 left the
    # overfit short of its sample (in-sample acceptance 3.76 of 3.98, tau 3.33 / 4, in make demo-real)
    assert load_run_config(config, []).objective.supervised_tokens == "all"
    assert load_run_config(config, overrides).objective.supervised_tokens == "replies"


def test_the_gate_trains_in_one_process_with_the_local_backend_unless_told_otherwise(tmp_path):
    from dflash2.config import load_run_config
    from dflash2.serving_gate import train_overrides

    config = REPO_ROOT / "configs" / "smollm2-dflash2.yaml"
    for precision in ("fp32", "bf16"):
        overrides = train_overrides(
            tmp_path / "gate", tmp_path / "d.jsonl", 60, 1, [f"precision={precision}"]
        )
        assert load_run_config(config, overrides).backend == "local"
    # the user's choice stands
    overrides = train_overrides(tmp_path / "gate", tmp_path / "d.jsonl", 60, 1, ["backend=deepspeed"])
    assert load_run_config(config, overrides).backend == "deepspeed"


def test_a_gate_that_failed_because_its_overfit_fell_short_says_so():
    # seen on SmolLM2: 60 steps left one sample at in-sample acceptance 3.36 of 3.98 (loss 1.07);
    # the decode then accepted 3.00 of 4: the gate fails, naming the steps rather than serving
    from dflash2.serving_gate import judge

    def result(insample: float) -> dict:
        metrics = {"insample_accept_len_selector": insample, "insample_accept_len_max": 3.983, "loss": 1.066}
        return {
            "block_size": 4, "acceptance_lengths": [4, 3], "spec_accept_length": 3.0, "steps": 60,
            "target_prefix_match_tokens": 8, "generated_tokens": 8, "errors": [], "train_final_metrics": metrics,
        }  # fmt: skip

    short = result(3.362)
    judge(short)
    assert not short["passed"] and short["errors"][0] == "spec_accept_length 3.000 < block_size 4"
    assert short["errors"][1].startswith(
        "the overfit did not memorise its sample: in-sample acceptance 3.36 of a possible 3.98 after 60 steps"
    )
    assert short["errors"][1].endswith("rerun with --steps 120")
    memorised = result(3.983)  # trained to its sample: a serving failure, nothing added
    judge(memorised)
    assert memorised["errors"] == ["spec_accept_length 3.000 < block_size 4"]


def test_the_gate_fails_an_output_that_leaves_the_targets_reply_even_at_full_acceptance():
    """Before: a decode that accepted every block but committed other tokens after the first block
    passed (it asked for block_size matching tokens, not all of them)."""
    from dflash2.serving_gate import judge

    result = {
        "block_size": 8, "acceptance_lengths": [8, 8, 8], "spec_accept_length": 8.0,
        "target_prefix_match_tokens": 9, "generated_tokens": 25, "errors": [],
    }  # fmt: skip
    judge(result)
    assert not result["passed"]
    assert result["errors"] == ["the output differs from the target's own reply after 9 of 25 tokens"]


def test_a_gate_sample_cut_by_max_length_names_it(tiny_default, tmp_path):
    """The reply past data.max_length is never trained: the failure says so, not 'look at the serving
    path'."""
    result = run_gate(
        REPO_ROOT / "configs" / "tiny-dflash2.yaml",
        tiny_default.train_jsonl,
        steps=5,
        overrides=[f"model.target={tiny_default.target_dir}", f"output_dir={tmp_path}", "data.max_length=30"],
    )
    assert not result["passed"]
    assert result["errors"][0].startswith("the gate's sample renders to ")
    assert "more than data.max_length=30" in result["errors"][0]
