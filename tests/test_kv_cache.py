"""The target's cache (`dflash2.target.cache.new_cache`) against transformers' own `DynamicCache`:
the same logits and keys through a prefill, decoding steps, a verify block and its rollback, and
the same batched greedy generation; while it has room, a step writes into the buffer it has."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from dflash2.target.cache import RoomyLayer, new_cache

# (tokens fed, positions cropped after the forward): a prefill, steps, a verify block partly rejected
SCRIPT = [(list(range(5, 17)), 0), ([30], 0), ([31], 0), ([40, 41, 42, 43], 2), ([50], 0), ([51], 0)]


@pytest.fixture(scope="module")
def target(tiny_default):
    return AutoModelForCausalLM.from_pretrained(tiny_default.target_dir, dtype=torch.float32).eval()


def run_script(target, cache) -> list[torch.Tensor]:
    logits = []
    with torch.no_grad():
        for ids, cropped in SCRIPT:
            out = target(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
            logits.append(out.logits[0])
            cache.crop(-cropped)
    return logits


@pytest.mark.parametrize("room", [0, 2, 64])  # doubling, outgrown twice, never outgrown
def test_same_logits_and_keys_as_transformers_cache(target, room):
    reference = DynamicCache(config=target.config)
    cache = new_cache(target, room=room)
    assert all(isinstance(layer, RoomyLayer) for layer in cache.layers)
    for got, expected in zip(run_script(target, cache), run_script(target, reference)):
        assert torch.equal(got, expected)
    for layer, reference_layer in zip(cache.layers, reference.layers):
        assert torch.equal(layer.keys, reference_layer.keys)
        assert torch.equal(layer.values, reference_layer.values)


def test_a_step_with_room_writes_into_the_same_buffer(target):
    cache = new_cache(target, room=16)
    buffers = []
    with torch.no_grad():
        for ids, cropped in SCRIPT:
            target(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
            cache.crop(-cropped)
            buffers.append([layer.key_buffer.data_ptr() for layer in cache.layers])
            assert all(layer.keys.data_ptr() == layer.key_buffer.data_ptr() for layer in cache.layers)
    assert all(step == buffers[0] for step in buffers)  # 12 prompt positions + 16 of room: no growth


def test_batched_greedy_generation_is_unchanged(target, tiny_default):
    tokenizer = AutoTokenizer.from_pretrained(tiny_default.target_dir)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19]]
    length = max(map(len, prompts))
    input_ids = torch.full((len(prompts), length), tokenizer.pad_token_id)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):  # left-padded, as regeneration batches them
        input_ids[row, length - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, length - len(prompt) :] = 1
    settings = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=24,
        min_new_tokens=24,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.no_grad():
        expected = target.generate(**settings)
        cache = new_cache(target, room=8)
        got = target.generate(**settings, cache=cache)  # outgrown mid-generation
    assert torch.equal(got, expected)
    assert cache.get_seq_length() == got.shape[1] - 1  # generate decoded with this cache, not its own
