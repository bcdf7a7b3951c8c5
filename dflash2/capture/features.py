"""From the target's hidden states to the draft's context features."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from dflash2.data.loader import collate
from dflash2.distributed.base import Backend


class FeatureSource(Protocol):
    """Where the loop gets features when it does not run the target itself: OfflineFeatures (disk)
    or FeatureReceiver (capture ranks)."""

    def batch(self, indices: list[int], seq_len: int) -> torch.Tensor:
        """[b, seq_len, K*H] features of dataset samples `indices`."""
        ...


def extract_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate the outputs of decoder layers `layer_ids` -> [b, S, K*H].

    `hidden_states` is Hugging Face's `output_hidden_states` tuple: index 0 is the embedding output,
    so the output of decoder layer k is `hidden_states[k + 1]`.
    """
    num_layers = len(hidden_states) - 1
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"target_layer_ids {list(bad)} out of range for a target with {num_layers} decoder layers "
            f"(valid ids: 0..{num_layers - 1}); fix dflash_config.target_layer_ids in the draft config"
        )
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def target_features(
    backend: Backend, target: nn.Module, batch: dict, layer_ids: Sequence[int]
) -> torch.Tensor:
    """One forward of the frozen target over a collated batch -> features [b, S, K*H] (collective
    over the target's group)."""
    hidden = backend.target_hidden_states(target, batch["input_ids"], batch["attention_mask"])
    return extract_features(hidden, layer_ids)


def capture_samples(
    backend: Backend,
    target: nn.Module,
    dataset,
    indices: list[int],
    layer_ids: Sequence[int],
    pad_token_id: int,
) -> torch.Tensor:
    """Collate `dataset[indices]` and capture their features [b, S, K*H]. A rank with no samples in
    this round still joins the collective forward, on a one-token padding batch."""
    samples = [dataset[i] for i in indices] or [{"input_ids": [pad_token_id], "loss_mask": [0]}]
    return target_features(backend, target, collate(samples, pad_token_id), layer_ids)
