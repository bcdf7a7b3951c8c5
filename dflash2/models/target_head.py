"""The target's embedding table and LM head, borrowed (frozen) by the draft."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def head_modules(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(input embedding, LM head) modules of a Hugging Face causal LM (sharded or not)."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(
            f"{type(model).__name__} has no output embeddings (LM head); model.target must be a causal LM "
            "(a *ForCausalLM or *ForConditionalGeneration checkpoint)"
        )
    return model.get_input_embeddings(), head


def head_tensors(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(embedding weight [V, H], LM head weight [V, H], LM head bias [V] or None) of a causal LM."""
    embed, head = head_modules(model)
    return embed.weight, head.weight, getattr(head, "bias", None)


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
        embed, weight, bias = head_tensors(target)
        cast = (lambda t: t.detach().clone().to(dtype)) if dtype else (lambda t: t.detach().clone())
        return cls(cast(embed), cast(weight), None if bias is None else cast(bias))
