"""From the target's hidden states to the draft's context features."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


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
