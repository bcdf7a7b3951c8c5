"""The tiny default: exact target dims, fixed special tokens, data shape, a target that learned."""

from __future__ import annotations

import json

import torch

from dflash2.fixtures.tiny_default import BuildParams, build_tiny_default

EXPECTED_DIMS = {
    "hidden_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 384,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def _load_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_target_config_has_the_agreed_dims(tiny_default):
    config = json.loads((tiny_default.target_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert {key: config[key] for key in EXPECTED_DIMS} == EXPECTED_DIMS
    assert config["rope_parameters"]["rope_theta"] == 10000
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert tiny_default.mask_token_id == 3


def test_tokenizer_special_tokens_and_chat_template(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = {
        token: tok.convert_tokens_to_ids(token)
        for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
    }
    assert ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|mask|>": 3}
    assert (tok.pad_token_id, tok.eos_token_id, tok.mask_token_id) == (0, 2, 3)
    assert len(tok) < 1024
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level BPE round-trips


def test_data_is_training_jsonl_with_learnable_replies(tiny_default, tiny_tokenizer):
    train, heldout = _load_jsonl(tiny_default.train_jsonl), _load_jsonl(tiny_default.heldout_jsonl)
    assert 300 <= len(train) <= 2000 and len(heldout) == 32
    assert len({row["id"] for row in train + heldout}) == len(train) + len(heldout)
    first_prompt = lambda row: next(t["content"] for t in row["conversations"] if t["role"] == "user")  # noqa: E731
    assert not {first_prompt(row) for row in heldout} & {first_prompt(row) for row in train}
    reply_lengths = []
    for row in train + heldout:
        roles = [turn["role"] for turn in row["conversations"]]
        assert set(roles) <= {"system", "user", "assistant"} and roles[-1] == "assistant"
        text = tiny_tokenizer.apply_chat_template(row["conversations"], tokenize=False)
        assert tiny_default.mask_token_id not in tiny_tokenizer(text)["input_ids"]
        reply_lengths += [
            len(tiny_tokenizer(t["content"])["input_ids"])
            for t in row["conversations"]
            if t["role"] == "assistant"
        ]
    assert min(reply_lengths) >= 20 and max(reply_lengths) <= 80
    assert sum(reply_lengths) / len(reply_lengths) >= 25


def test_target_greedy_continuation_is_structured(tiny_default, tiny_tokenizer):
    """Greedy replies to held-out prompts are varied and agree with the references far above chance.

    Observed on these 8 prompts: 0.25 of reply positions equal the reference, the first 4.5 tokens
    on average match exactly, >= 10 distinct tokens per reply and 51 over all. A model that learned
    nothing matches ~0 (chance is 1/640); a degenerate one repeats one token.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_default.target_dir).eval()
    heldout = _load_jsonl(tiny_default.heldout_jsonl)[:8]
    num_matching = num_reference = num_prefix = 0
    all_tokens = set()
    for row in heldout:
        prompt = tiny_tokenizer.apply_chat_template(
            row["conversations"][:-1], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tiny_tokenizer(prompt)["input_ids"]
        reference = tiny_tokenizer(row["conversations"][-1]["content"] + "<|im_end|>")["input_ids"]
        with torch.no_grad():
            output = model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=len(reference), do_sample=False
            )
        generated = output[0, len(prompt_ids) :].tolist()
        assert len(set(generated)) >= 6, tiny_tokenizer.decode(generated)
        all_tokens |= set(generated)
        num_matching += sum(a == b for a, b in zip(generated, reference))
        num_prefix += next(
            (i for i, (a, b) in enumerate(zip(generated, reference)) if a != b), len(reference)
        )
        num_reference += len(reference)
    assert num_matching / num_reference >= 0.15
    assert num_prefix / len(heldout) >= 2.5
    assert len(all_tokens) >= 30


def test_build_is_cached_by_stamp_and_deterministic(tmp_path):
    small = BuildParams(
        num_train=40, num_heldout=4, bpe_vocab_size=300, train_steps=2, batch_size=4, sample_new_tokens=2
    )
    first = build_tiny_default(tmp_path / "a", params=small)
    weights = first.target_dir / "model.safetensors"
    built_at = weights.stat().st_mtime_ns
    assert build_tiny_default(tmp_path / "a", params=small).root == first.root
    assert weights.stat().st_mtime_ns == built_at  # stamp matched: nothing rebuilt

    second = build_tiny_default(tmp_path / "b", params=small)
    for name in (
        "target/model.safetensors",
        "target/tokenizer.json",
        "data/train.jsonl",
        "data/heldout.jsonl",
    ):
        assert (first.root / name).read_bytes() == (second.root / name).read_bytes(), name

    (first.root / "stamp.json").write_text('{"stamp": "from an older builder"}')
    build_tiny_default(tmp_path / "a", params=small)
    assert weights.stat().st_mtime_ns != built_at  # stamp differs: rebuilt
