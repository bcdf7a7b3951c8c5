"""The target's KV cache for decoding and regeneration: transformers' `DynamicCache`, whose full
attention layers keep their keys and values in a buffer with room to grow.

transformers' `DynamicLayer` appends a step's keys and values with `torch.cat`, so every decoding
step copies the whole cache of every layer; without that copy a batch-32 regeneration of SmolLM2
in fp32 takes 14-17% less time (docs/data.md). `RoomyLayer` writes the new positions into spare
room of a preallocated buffer and returns views of the filled part: the same values, no copy. Room
runs out only when a sequence outgrows it; the buffer then grows to the need plus `room` (or twice
the need without a hint), copying once. Sliding-window, linear-attention and hybrid layers stay
transformers' own (their update and rollback are theirs).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class RoomyLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values are views of a buffer with room."""

    def __init__(self, room: int = 0) -> None:
        super().__init__()
        self.room = room
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.shape[-2]
        if not self._writable(length + new):
            self._grow(key_states, value_states, length, length + new)
        self.key_buffer[..., length : length + new, :] = key_states
        self.value_buffer[..., length : length + new, :] = value_states
        self.keys = self.key_buffer[..., : length + new, :]
        self.values = self.value_buffer[..., : length + new, :]
        return self.keys, self.values

    def _writable(self, needed: int) -> bool:
        """Whether the buffer holds today's keys (a crop keeps a view of it; a batch reorder or a
        reset makes new tensors) and has room for `needed` positions."""
        buffer = self.key_buffer
        return buffer is not None and self.keys.data_ptr() == buffer.data_ptr() and buffer.shape[-2] >= needed

    def _grow(self, key_states, value_states, length: int, needed: int) -> None:
        capacity = needed + (self.room if self.room > 0 else needed)
        shape = (*key_states.shape[:2], capacity, key_states.shape[-1])
        keys, values = key_states.new_empty(shape), value_states.new_empty(shape)
        if length:
            keys[..., :length, :] = self.keys
            values[..., :length, :] = self.values
        self.key_buffer, self.value_buffer = keys, values


def new_cache(target: nn.Module, room: int = 0):
    """An empty cache laid out for `target` (one layer kind per decoder layer: attention, sliding
    window, linear attention; a cache built without the config fails on hybrid targets), its full
    attention layers `RoomyLayer`s. `room`: the positions to reserve past the first forward (the new
    tokens a generation may add); 0: grow by doubling."""
    cache = DynamicCache(config=target.config)
    cache.layers = [RoomyLayer(room) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
