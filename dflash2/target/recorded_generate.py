"""Greedy generation that keeps the run's features: the target's layer outputs of every token it read.

`generate` already runs the target over each prompt (the prefill) and over every generated token
but the last (one decode step each). With the hooks of `capture_layer_outputs` on, each of those
forwards leaves the outputs of the decoder layers `layer_ids` and the final-normed last hidden
state: the features offline capture would compute for those positions, from the target's
incremental forward (equal up to floating-point rounding). `RecordedGeneration.features` completes
them for a whole conversation with one more forward from the generation's KV cache over the tokens
it did not read (the last reply token, the end-of-turn marker, what the chat template appends),
with each row's generated tokens past the ones kept masked out.

Masking positions out of a KV cache is exact for full-attention layers only: a recurrent state
(linear attention, Gated DeltaNet) has already absorbed them, and a sliding window counts cache
slots (and its cache drops the oldest), so targets with such layers are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash2.target.hooks import capture_layer_outputs


def check_full_attention(model: nn.Module) -> None:
    """Refuse a target with layers other than full attention (their cache cannot skip positions)."""
    text_config = model.config.get_text_config()
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None and getattr(text_config, "sliding_window", None) is not None:
        layer_types = ["sliding_attention"]
    other = sorted(set(layer_types or []) - {"full_attention"})
    if other:
        raise ValueError(
            f"{type(model).__name__} has {', '.join(other)} layers, whose cache cannot skip the tokens that "
            "batched generation feeds after a finished reply, so its features cannot be kept while it "
            "regenerates; regenerate without --capture-config and capture with data_prep/capture.py"
        )


@dataclass
class RecordedGeneration:
    model: nn.Module
    layer_ids: list[int]
    input_ids: torch.Tensor  # [B, P] the left-padded prompts
    attention_mask: torch.Tensor  # [B, P]
    sequences: torch.Tensor  # [B, P + T] prompts and generated tokens
    read: torch.Tensor  # [B, P + T - 1, (K+1)*H] the features of every position the target read
    cache: Any  # the generation's KV cache, P + T - 1 positions
    pad_token_id: int

    @property
    def generated(self) -> torch.Tensor:
        return self.sequences[:, self.input_ids.shape[1] :]

    @torch.no_grad()
    def features(self, conversations: Sequence[Sequence[int] | None]) -> list[torch.Tensor | None]:
        """Features [len(ids), (K+1)*H] of each row's whole conversation `ids`; None for a row whose
        conversation is None or does not start with the row's prompt (its features are not the
        generation's). The tokens after the prompt and the generated ones it shares are read here.
        Call once: the forward appends to the cache."""
        assert len(conversations) == self.sequences.shape[0]
        prompt_width = self.input_ids.shape[1]
        num_read = self.read.shape[1] - prompt_width  # generated tokens the target read
        prompt_lengths = self.attention_mask.sum(dim=1).tolist()
        conversations = [
            ids
            if ids is not None and list(ids[:length]) == self.input_ids[row, prompt_width - length :].tolist()
            else None
            for row, (ids, length) in enumerate(zip(conversations, prompt_lengths))
        ]
        kept, rests = [], []
        for row, ids in enumerate(conversations):
            if ids is None:
                kept.append(0)
                rests.append([])
                continue
            reply = list(ids[prompt_lengths[row] :])
            same = common_prefix(reply, self.generated[row, :num_read].tolist())
            kept.append(same)
            rests.append(reply[same:])
        tail = self._read_rest(prompt_lengths, kept, rests)
        out = []
        for row, ids in enumerate(conversations):
            if ids is None:
                out.append(None)
                continue
            start = prompt_width - prompt_lengths[row]
            read = self.read[row, start : prompt_width + kept[row]]
            out.append(torch.cat([read, tail[row, : len(rests[row])]], dim=0))
        return out

    def _read_rest(self, prompt_lengths: list[int], kept: list[int], rests: list[list[int]]) -> torch.Tensor:
        """One forward over each row's tokens not yet read, continuing from its first `kept` generated
        tokens: the cache's other generated positions are masked out. [B, R, (K+1)*H]."""
        batch, width = self.sequences.shape[0], max(1, max(len(rest) for rest in rests))
        tokens = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        positions = torch.zeros((batch, width), dtype=torch.long)
        num_read = self.read.shape[1] - self.input_ids.shape[1]
        mask = torch.zeros((batch, self.read.shape[1] + width), dtype=self.attention_mask.dtype)
        mask[:, : self.input_ids.shape[1]] = self.attention_mask
        for row, rest in enumerate(rests):
            tokens[row, : len(rest)] = torch.tensor(rest, dtype=torch.long)
            positions[row] = prompt_lengths[row] + kept[row] + torch.arange(width)
            mask[row, self.input_ids.shape[1] : self.input_ids.shape[1] + kept[row]] = 1
            mask[row, self.input_ids.shape[1] + num_read : self.input_ids.shape[1] + num_read + len(rest)] = 1
        device = next(self.model.parameters()).device
        with capture_layer_outputs(self.model, self.layer_ids, last_hidden=True) as captured:
            self.model(
                input_ids=tokens.to(device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                cache=self.cache,
                use_cache=True,
            )
        return captured.features().cpu()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@torch.no_grad()
def generate_recording(
    model: nn.Module,
    layer_ids: Sequence[int],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pad_token_id: int,
    **generate_kwargs,
) -> RecordedGeneration:
    """`model.generate` (greedy kwargs as given) with the features of every position it read kept."""
    check_full_attention(model)
    decoder = model.get_decoder()
    forwards: list[torch.Tensor] = []
    with capture_layer_outputs(model, layer_ids, last_hidden=True) as captured:
        handle = decoder.register_forward_hook(lambda *_: forwards.append(captured.features().cpu()))
        try:
            device = next(model.parameters()).device
            output = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                pad_token_id=pad_token_id,
                return_dict_in_generate=True,
                **generate_kwargs,
            )
        finally:
            handle.remove()
    read = torch.cat(forwards, dim=1)
    assert read.shape[1] == output.cache.get_seq_length(), "a forward the recording did not see"
    return RecordedGeneration(
        model,
        list(layer_ids),
        input_ids.cpu(),
        attention_mask.cpu(),
        output.sequences.cpu(),
        read,
        output.cache,
        pad_token_id,
    )
