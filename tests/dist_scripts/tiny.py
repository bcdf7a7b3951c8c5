"""Tiny fixtures shared by the distributed tests and the scripts they launch."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

NUM_FEATURES = 12
NUM_CLASSES = 7


def save_tiny_target(target_dir: str, num_layers: int = 2, seed: int = 0, tied: bool = False) -> None:
    """A random Qwen3ForCausalLM (hidden 64, vocab 256) saved as safetensors."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    Qwen3ForCausalLM(config).save_pretrained(target_dir)


class Block(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(torch.tanh(self.linear(x)))


class StandInDraft(nn.Module):
    """A small trainable stand-in for the draft; blocks are sharded one by one (`_no_split_modules`)."""

    _no_split_modules = ["Block"]

    def __init__(self, width: int = 32, num_blocks: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.proj_in = nn.Linear(NUM_FEATURES, width)
        self.blocks = nn.ModuleList(Block(width, dropout) for _ in range(num_blocks))
        self.proj_out = nn.Linear(width, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj_in(x)
        for block in self.blocks:
            h = block(h)
        return self.proj_out(h)


def micro_batch(step: int, micro: int, rank: int, size: int = 3) -> tuple[torch.Tensor, ...]:
    """Deterministic data for (optimizer step, micro-step, rank): inputs, labels, per-sample weights."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(size, NUM_FEATURES, generator=gen)
    labels = torch.randint(0, NUM_CLASSES, (size,), generator=gen)
    # uneven weights (some zero) so that per-rank means would differ from the global mean
    weights = torch.randint(0, 3, (size,), generator=gen).float()
    return x, labels, weights


def weighted_loss_sum(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (F.cross_entropy(logits.float(), labels, reduction="none") * weights).sum()
