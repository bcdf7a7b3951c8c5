"""DFlash block attention.

Every block (an anchor plus B-1 mask slots) attends to the projected target context at positions
before its anchor and to its own block, never to another block. The two key sets are scored apart
and merged exactly with one joint softmax, so the work is N x B x (S + B) — linear in the number of
blocks N — instead of the quadratic cost of one dense [N*B, S + N*B] mask. Plain tensor ops: it
runs forward and backward on any device (FlexAttention has no CPU backward).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3Config, Qwen3RMSNorm, rotate_half


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., L, heads, d]; cos/sin [..., L, d]."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


def layer_masks(
    anchor_positions: torch.Tensor,
    context_length: int,
    block_size: int,
    *,
    causal: bool,
    sliding_window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Visibility masks (True = visible).

    Returns `context_visible [b, N, B, S]` (key j visible to slot i of block n iff j < p_n and,
    for sliding layers, (p_n + i) - j < window) and `block_visible [B, B]` (in-block).
    """
    device = anchor_positions.device
    slot = torch.arange(block_size, device=device)
    key = torch.arange(context_length, device=device)
    anchor = anchor_positions[..., None, None]  # [b, N, 1, 1]
    context_visible = key < anchor  # [b, N, 1, S]
    if sliding_window is not None:
        query_pos = anchor + slot[:, None]  # [b, N, B, 1]
        context_visible = context_visible & (query_pos - key < sliding_window)
    context_visible = context_visible.expand(*anchor_positions.shape, block_size, context_length)
    block_visible = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    if causal:
        block_visible = block_visible & (slot[None, :] <= slot[:, None])
    if sliding_window is not None:
        block_visible = block_visible & ((slot[:, None] - slot[None, :]).abs() < sliding_window)
    return context_visible, block_visible


class DFlashAttention(nn.Module):
    """Qwen3-style attention (q/k norms, GQA, RoPE) with queries from the block only and keys/values
    from `[k_proj(context) ; k_proj(block)]` — the same projections for both."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None)
        layer_type = layer_types[layer_idx] if layer_types else "full_attention"
        is_causal = getattr(config, "is_causal", None)
        # An explicit is_causal applies to every layer; unset, sliding layers are causal in-block.
        self.causal = (layer_type == "sliding_attention") if is_causal is None else bool(is_causal)
        self.sliding_window = config.sliding_window if layer_type == "sliding_attention" else None
        if layer_type == "sliding_attention" and not self.sliding_window:
            raise ValueError(
                f"layer {layer_idx} is sliding_attention but sliding_window is unset; set sliding_window "
                "and use_sliding_window: true in the draft config"
            )

    def _keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return _rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_rope: tuple[torch.Tensor, torch.Tensor],
        anchor_positions: torch.Tensor,
    ) -> torch.Tensor:
        """x [b, N, B, H] block states; context [b, S, H]; rope pairs [b, N, B, d] and [b, S, d]."""
        b, num_blocks, block_size, _ = x.shape
        context_length = context.shape[1]
        groups = self.num_heads // self.num_kv_heads

        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)))
        q = _rope(q, *block_rope)  # [b, N, B, nh, d]
        k_blk, v_blk = self._keys_values(x, *block_rope)  # [b, N, B, nkv, d]
        k_ctx, v_ctx = self._keys_values(context, *context_rope)  # [b, S, nkv, d]

        # Queries grouped by their kv head: [b, nkv, g, N, B, d]
        q = q.unflatten(-2, (self.num_kv_heads, groups)).permute(0, 3, 4, 1, 2, 5)
        k_ctx, v_ctx = k_ctx.transpose(1, 2), v_ctx.transpose(1, 2)  # [b, nkv, S, d]
        k_blk, v_blk = k_blk.permute(0, 3, 1, 2, 4), v_blk.permute(0, 3, 1, 2, 4)  # [b, nkv, N, B, d]

        scores_ctx = torch.einsum("bhgnid,bhsd->bhgnis", q, k_ctx) * self.scaling
        scores_blk = torch.einsum("bhgnid,bhnjd->bhgnij", q, k_blk) * self.scaling
        # Masks are built per layer: sliding-window layers see a window of the context and (by
        # default) only earlier slots of their block, full-attention layers see everything before the
        # anchor and the whole block. They are cheap boolean tensors, rebuilt from the anchors.
        context_visible, block_visible = layer_masks(
            anchor_positions,
            context_length,
            block_size,
            causal=self.causal,
            sliding_window=self.sliding_window,
        )
        # The most negative finite value, not -inf: a row masked everywhere would be NaN after a softmax
        # of -inf (and so would its gradient); with finfo.min it stays finite. Every slot sees at least
        # itself, so exp(min - row max) underflows to exactly 0 and no masked key gets any weight.
        neg = torch.finfo(scores_ctx.dtype).min
        scores_ctx = scores_ctx.masked_fill(~context_visible[:, None, None], neg)
        scores_blk = scores_blk.masked_fill(~block_visible, neg)

        # One softmax over [context ; block] keys, in at least fp32 for stability.
        scores = torch.cat([scores_ctx, scores_blk], dim=-1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        probs = probs.to(q.dtype)
        probs_ctx, probs_blk = probs.split([context_length, block_size], dim=-1)
        out = torch.einsum("bhgnis,bhsd->bhgnid", probs_ctx, v_ctx)
        out = out + torch.einsum("bhgnij,bhnjd->bhgnid", probs_blk, v_blk)
        out = out.permute(0, 3, 4, 1, 2, 5).reshape(b, num_blocks, block_size, -1)  # [b, N, B, nh*d]
        return self.o_proj(out)
