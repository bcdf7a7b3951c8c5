"""The draft's context cache for decoding one request.

Every draft layer attends to the same projected target context through its own k/v projections, so
the keys and values of a committed position never change. The cache keeps them per layer and grows
by the positions each verify step commits: a speculative step projects only its new positions and
never the prefix, as the reference decoder and SGLang do.

A sliding-window layer keeps only its last `window - 1` positions: the next block's anchor p is the
cache length, and slot i of a block at p sees key j only if (p + i) - j < window, so nothing before
p - window + 1 is ever visible again. Storage is reallocated to twice what it must hold when it is
full (full layers) or compacted to the window (sliding layers), so an append costs amortised
O(new positions), not O(context).
"""

from __future__ import annotations

from dflash2.models.attention import ContextKV


class _LayerBuffer:
    """Keys and values `[b, nkv, capacity, d]`; storage index 0 holds absolute position `start`."""

    def __init__(self, keep: int | None) -> None:
        self.keep = keep  # positions a block can still see (window - 1); None: all
        self.keys = self.values = None
        self.start = 0
        self.used = 0

    def append(self, kv: ContextKV) -> None:
        if self.keep is not None and kv.keys.shape[2] > self.keep:  # older positions are never seen
            cut = kv.keys.shape[2] - self.keep
            kv = ContextKV(kv.keys[:, :, cut:], kv.values[:, :, cut:], kv.start + cut)
            self.keys, self.used = None, 0
        num_new = kv.keys.shape[2]
        if self.keys is None or self.used + num_new > self.keys.shape[2]:
            self._reallocate(kv, num_new)
        assert self.start + self.used == kv.start, "positions must be appended in order, without gaps"
        self.keys[:, :, self.used : self.used + num_new] = kv.keys
        self.values[:, :, self.used : self.used + num_new] = kv.values
        self.used += num_new

    def _reallocate(self, kv: ContextKV, num_new: int) -> None:
        """New storage for the positions still needed plus `num_new`, with as much room again."""
        kept = self.used if self.keep is None else min(self.used, max(self.keep - num_new, 0))
        b, heads, _, dim = kv.keys.shape
        shape = (b, heads, 2 * (kept + num_new), dim)
        keys = kv.keys.new_empty(shape)
        values = kv.values.new_empty(shape)
        if kept:
            keys[:, :, :kept] = self.keys[:, :, self.used - kept : self.used]
            values[:, :, :kept] = self.values[:, :, self.used - kept : self.used]
        self.start = kv.start - kept
        self.keys, self.values, self.used = keys, values, kept

    def visible(self) -> ContextKV:
        first = self.used if self.keep is None else min(self.used, self.keep)
        lo = self.used - first
        return ContextKV(self.keys[:, :, lo : self.used], self.values[:, :, lo : self.used], self.start + lo)


class DraftContextCache:
    """Per-layer context keys and values of the positions 0 .. length - 1 read so far.

    Made by `draft.new_context_cache()`, filled by `draft.extend_context(cache, features)`, read by
    `draft.decode_block(block_embeds, cache)`.
    """

    def __init__(self, sliding_windows: list[int | None]) -> None:
        self._buffers = [_LayerBuffer(None if w is None else w - 1) for w in sliding_windows]
        self.length = 0

    def append(self, layers: list[ContextKV]) -> None:
        """One ContextKV per draft layer, all for the positions length .. length + n - 1."""
        assert len(layers) == len(self._buffers)
        assert all(kv.start == self.length for kv in layers), "append the next positions, in order"
        for buffer, kv in zip(self._buffers, layers):
            buffer.append(kv)
        self.length += layers[0].keys.shape[2]

    def layers(self) -> list[ContextKV]:
        """What each layer's next block can see (a view, no copy)."""
        assert self.length > 0, "extend the cache with the prompt's features before drafting"
        return [buffer.visible() for buffer in self._buffers]
