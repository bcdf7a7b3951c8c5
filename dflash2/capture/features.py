"""From the target's decoder layers to the draft's context features.

The hooks that catch the decoder layers' outputs live in `dflash2.target.hooks`. The target's
final-normed last hidden state (the input of its LM head, what `hidden_states[L]` is) is the teacher
of the KL / TV loss terms: with `last_hidden=True` a hook on the decoder's final norm catches it too,
and it travels as H more columns after the K*H feature columns, [b, S, (K+1)*H], through every
feature source (online, offline, the disaggregated wire); `split_last_hidden` splits it off again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from dflash2.data.loader import collate
from dflash2.distributed.base import Backend
from dflash2.target.hooks import capture_layer_outputs


class FeatureSource(Protocol):
    """Where the loop gets features when it does not run the target itself: OfflineFeatures (disk)
    or FeatureReceiver (capture ranks)."""

    def batch(self, indices: list[int], seq_len: int) -> torch.Tensor:
        """[b, seq_len, K*H] features of dataset samples `indices` ([b, seq_len, (K+1)*H] when the
        run needs the target's last hidden state)."""
        ...


def split_last_hidden(
    features: torch.Tensor, hidden_size: int, last_hidden: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, S, K*H (+H)] -> (features [b, S, K*H], the last hidden state [b, S, H] or None)."""
    if not last_hidden:
        return features, None
    assert features.shape[-1] > hidden_size, "the features carry no last hidden state"
    return features[..., :-hidden_size], features[..., -hidden_size:]


@torch.no_grad()
def target_features(
    backend: Backend, target: nn.Module, batch: dict, layer_ids: Sequence[int], last_hidden: bool = False
) -> torch.Tensor:
    """One forward of the frozen target over a collated batch -> features [b, S, K*H] (collective
    over the target's group); with `last_hidden`, [b, S, (K+1)*H] (the final-normed state last)."""
    with capture_layer_outputs(backend.unwrap(target), layer_ids, last_hidden) as captured:
        backend.target_forward(target, batch["input_ids"], batch["attention_mask"])
    return captured.features()


def capture_samples(
    backend: Backend,
    target: nn.Module,
    dataset,
    indices: list[int],
    layer_ids: Sequence[int],
    pad_token_id: int,
    last_hidden: bool = False,
) -> torch.Tensor:
    """Collate `dataset[indices]` and capture their features [b, S, K*H] (+H with `last_hidden`). A
    rank with no samples in this round still joins the collective forward, on a one-token padding batch."""
    samples = [dataset[i] for i in indices] or [{"input_ids": [pad_token_id], "loss_mask": [0]}]
    return target_features(backend, target, collate(samples, pad_token_id), layer_ids, last_hidden)
