"""The target's decoding state during speculative decoding, and its exact rollback.

A verify forward appends B tokens (the anchor and B-1 proposals) to the target's state. When only
the first n proposals are accepted, the state must become exactly the state after the anchor and
those n proposals; the bonus token is the next anchor, fed first by the next verify forward. The
state holds three kinds of memory, rolled back differently:

- attention KV (full or sliding window) and the Gated DeltaNet conv states keep one entry per
  position: transformers' `crop` removes the rejected positions. Past recording is switched on, so
  sliding windows and conv states keep the verify forward's extra positions until `crop` decides
  which stay (without it a window that is already full has dropped them);
- recurrent states (Gated DeltaNet, Qwen3.5 / Qwen3.6) are one matrix per head summarising every
  position fed so far: no crop can take a position out of it. They are copied before each verify
  forward; when a block is partly rejected, the whole state goes back to where it was before the
  verify forward (KV and conv cropped by B, recurrent states restored) and the kept tokens are fed
  again in one forward. A fully accepted block needs nothing: its state is already right.

The cost, on recurrent targets only: one copy of the recurrent states per verify step, and one
extra target forward over the n + 1 kept tokens per partly rejected block (docs/evaluation.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dflash2.target.cache import new_cache
from dflash2.target.head import TargetHead
from dflash2.target.hooks import capture_layer_outputs
from dflash2.target.layout import DecodingLinear


def use_decoding_layout(*modules: nn.Module) -> None:
    """On CPU, lay out the fp32 linear products of `modules` for decoding (dflash2.target.layout):
    every `nn.Linear` becomes a `DecodingLinear` holding the same weight and a transposed copy, and
    a TargetHead gets a transposed copy of its LM head; the one-row products use the copies, the
    few-row ones (a verify block, the draft's block) the weights as loaded. A verify forward of
    SmolLM2 over 4 tokens then costs about what a one-token forward does (docs/benchmarks.md), at
    twice the memory of the linear weights. Same values and shapes, same state dict; the outputs
    are those of other GEMM kernels, equal within fp32 rounding, not bitwise. bf16 weights stay as
    loaded: their kernels (oneDNN) are faster on the usual layout (docs/benchmarks.md, "bf16 on a
    CPU"). Tied weights stay tied (one parameter); calling it twice changes nothing; other
    devices: no-op."""

    def laid_out(weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype == torch.float32

    for module in modules:
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and laid_out(child.weight):
                    setattr(parent, name, DecodingLinear(child))
            if (
                isinstance(parent, TargetHead)
                and laid_out(parent.lm_head_weight)
                and parent.lm_head_weight_t is None
            ):
                parent.transpose_lm_head()


def _linear_layers(cache) -> list:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def has_recurrent_state(cache) -> bool:
    """Whether the (already used) cache holds a recurrent state, which `crop` cannot roll back."""
    return any(any(layer.is_recurrent_states_initialized.values()) for layer in _linear_layers(cache))


class TargetState:
    """The target and its cache over the committed positions. Every forward but a rollback's also
    returns the features of decoder layers `layer_ids` (their outputs, read by hooks)."""

    def __init__(self, target: nn.Module, layer_ids: Sequence[int], room: int = 0) -> None:
        """`room`: the positions to reserve in the attention KV past the prompt (dflash2.target.cache)."""
        self.target = target
        self.layer_ids = list(layer_ids)
        self.device = next(target.parameters()).device
        self.cache = new_cache(target, room=room)
        self.cache.activate_past_recording()
        self.recurrent = False  # known after the prefill
        self.num_rollback_forwards = 0
        self._fed: list[int] = []  # tokens of the verify forward awaiting keep()
        self._saved_recurrent: list[tuple[torch.Tensor, torch.Tensor]] = []

    @torch.no_grad()
    def _forward(self, ids: Sequence[int], with_features: bool, logits_to_keep: int = 0):
        """logits_to_keep: the LM head on the last that many positions only (0: on all)."""
        input_ids = torch.tensor([list(ids)], device=self.device)
        if not with_features:  # logits_to_keep=1: the LM head on one position, its output unused
            self.target(input_ids=input_ids, cache=self.cache, use_cache=True, logits_to_keep=1)
            return None
        with capture_layer_outputs(self.target, self.layer_ids) as captured:
            out = self.target(
                input_ids=input_ids, cache=self.cache, use_cache=True, logits_to_keep=logits_to_keep
            )
        return out.logits[0], captured.features()

    def prefill(self, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the prompt -> (logits of its last position [1, V], features [1, n, K*H]). The LM
        head runs on the last position only: the other rows would cost n x V x H for nothing."""
        assert not self._fed, "prefill once, before any verify"
        logits, features = self._forward(ids, with_features=True, logits_to_keep=1)
        self.cache.crop(0)  # past recording kept every position; shrink windows and conv states back
        self.recurrent = has_recurrent_state(self.cache)
        return logits, features

    def verify(self, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed [anchor, proposals...] -> (logits [B, V], features [1, B, K*H]); call keep() next."""
        assert not self._fed, "keep() must follow every verify()"
        if self.recurrent:
            self._saved_recurrent = [
                (state, state.clone())
                for layer in _linear_layers(self.cache)
                for state in layer.recurrent_states.values()
                if state is not None
            ]
        self._fed = list(ids)
        return self._forward(ids, with_features=True)

    def keep(self, num_kept: int) -> None:
        """Keep the first `num_kept` tokens of the last verify forward in the state, drop the rest."""
        fed, self._fed = self._fed, []
        assert 1 <= num_kept <= len(fed), (num_kept, len(fed))
        num_rejected = len(fed) - num_kept
        if num_rejected == 0 or not self.recurrent:
            self.cache.crop(-num_rejected)  # crop(0) only shrinks windows and conv states back
            return
        self.cache.crop(-len(fed))  # KV and conv states as before the verify forward
        for state, saved in self._saved_recurrent:
            state.copy_(saved)  # in place: the cache's tensors keep their addresses
        self._forward(fed[:num_kept], with_features=False)
        self.cache.crop(0)
        self.num_rollback_forwards += 1
