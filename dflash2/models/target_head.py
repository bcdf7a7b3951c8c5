"""The target's embedding table and LM head, borrowed (frozen) by the draft."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class TargetHead(nn.Module):
    """Frozen copies of the target's input embedding [V, H] and LM head [V, H] (+ optional bias).

    Held as buffers so that no optimizer or sharding wrapper ever treats them as trainable.
    """

    def __init__(
        self,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        lm_head_bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if embed_weight.shape[1] != lm_head_weight.shape[1]:
            raise ValueError(
                f"target embedding width {embed_weight.shape[1]} != LM head width {lm_head_weight.shape[1]}"
            )
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)
        bias = None if lm_head_bias is None else lm_head_bias.detach()
        self.register_buffer("lm_head_bias", bias, persistent=False)

    @property
    def vocab_size(self) -> int:
        return self.lm_head_weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.lm_head_weight.shape[1]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight.to(hidden.dtype), self.lm_head_bias)

    @classmethod
    def from_target(cls, target: nn.Module, dtype: torch.dtype | None = None) -> TargetHead:
        """Copy the embedding and LM head out of an unsharded Hugging Face causal LM."""
        embed = target.get_input_embeddings().weight
        head = target.get_output_embeddings()
        if head is None:
            raise ValueError("the target has no output embeddings (LM head); pass a *ForCausalLM model")
        bias = getattr(head, "bias", None)
        cast = (lambda t: t.detach().clone().to(dtype)) if dtype else (lambda t: t.detach().clone())
        return cls(cast(embed), cast(head.weight), None if bias is None else cast(bias))
