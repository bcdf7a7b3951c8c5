"""DFlash block attention.

Every block (an anchor plus B-1 mask slots) attends to the projected target context at positions
before its anchor and to its own block, never to another block. The two key sets are scored apart
and merged exactly with one joint softmax, so the work is N x B x (S + B) — linear in the number of
blocks N — instead of the quadratic cost of one dense [N*B, S + N*B] mask. In sliding-window layers
a block scores only the context keys of its window: the context is cut into tiles and the blocks
whose anchors fall in one tile score the contiguous key range their windows cover, so the work is
N x B x (window + tile) when that is shorter than the context. Plain tensor ops: it runs forward
and backward on any device (FlexAttention has no CPU backward).

Scores and softmax are computed in at least fp32 (a bf16 draft casts q and k up), the way fused
attention kernels accumulate; the softmax output is cast back for the product with the values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3Config, Qwen3RMSNorm, rotate_half

# A sliding layer's context is cut into tiles of ceil(window / WINDOW_TILES) positions; the blocks
# of one tile score window + tile - 2 keys: at most 1/WINDOW_TILES more than the window itself.
WINDOW_TILES = 8


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., L, heads, d]; cos/sin [..., L, d]."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


def window_tile(sliding_window: int) -> int:
    return -(-sliding_window // WINDOW_TILES)


def context_key_span(context_length: int, sliding_window: int | None) -> int:
    """How many context keys each block scores in one layer: the whole context for full layers and
    short contexts; window + tile - 2 (the key range of one tile's blocks) for long sliding ones."""
    if sliding_window is None:
        return context_length
    return min(context_length, sliding_window + window_tile(sliding_window) - 2)


def layer_masks(
    anchor_positions: torch.Tensor,
    context_positions: torch.Tensor,
    block_size: int,
    *,
    causal: bool,
    sliding_window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Visibility masks (True = visible) for context keys at absolute `context_positions` [L].

    Returns `context_visible [..., B, L]` (anchor_positions [...]; key j visible to slot i of the
    block at p iff j < p and, for sliding layers, (p + i) - j < window) and `block_visible [B, B]`.
    """
    slot = torch.arange(block_size, device=anchor_positions.device)
    anchor = anchor_positions[..., None, None]  # [..., 1, 1]
    context_visible = context_positions < anchor  # [..., 1, L]
    if sliding_window is not None:
        query_pos = anchor + slot[:, None]  # [..., B, 1]
        context_visible = context_visible & (query_pos - context_positions < sliding_window)
    context_visible = context_visible.expand(*anchor_positions.shape, block_size, len(context_positions))
    block_visible = torch.ones(block_size, block_size, dtype=torch.bool, device=slot.device)
    if causal:
        block_visible = block_visible & (slot[None, :] <= slot[:, None])
    if sliding_window is not None:
        block_visible = block_visible & ((slot[:, None] - slot[None, :]).abs() < sliding_window)
    return context_visible, block_visible


@dataclass
class ContextKV:
    """One layer's keys and values of the projected context, `[b, nkv, L, d]` each (k_norm and RoPE
    applied), for the absolute positions start .. start + L - 1."""

    keys: torch.Tensor
    values: torch.Tensor
    start: int = 0

    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.start + self.keys.shape[2], device=self.keys.device)


def joint_attention(q, k_ctx, v_ctx, context_visible, k_blk, v_blk, block_visible, scaling: float):
    """One softmax over [context ; own block] keys.

    q [b, nkv, g, N, B, d]; k_ctx, v_ctx [b, nkv, L, d]; context_visible [b, N, B, L];
    k_blk, v_blk [b, nkv, N, B, d]; block_visible [B, B]. Returns [b, nkv, g, N, B, d].
    """
    score_dtype = torch.promote_types(q.dtype, torch.float32)
    q_s = q.to(score_dtype)
    scores_ctx = torch.einsum("bhgnid,bhsd->bhgnis", q_s, k_ctx.to(score_dtype)) * scaling
    scores_blk = torch.einsum("bhgnid,bhnjd->bhgnij", q_s, k_blk.to(score_dtype)) * scaling
    # The most negative finite value, not -inf: a row masked everywhere would be NaN after a softmax
    # of -inf (and so would its gradient); with finfo.min it stays finite. Every slot sees at least
    # itself, so exp(min - row max) underflows to exactly 0 and no masked key gets any weight.
    neg = torch.finfo(score_dtype).min
    scores_ctx = scores_ctx.masked_fill(~context_visible[:, None, None], neg)
    scores_blk = scores_blk.masked_fill(~block_visible, neg)
    probs = torch.softmax(torch.cat([scores_ctx, scores_blk], dim=-1), dim=-1).to(v_ctx.dtype)
    probs_ctx, probs_blk = probs.split([k_ctx.shape[2], k_blk.shape[-2]], dim=-1)
    out = torch.einsum("bhgnis,bhsd->bhgnid", probs_ctx, v_ctx)
    return out + torch.einsum("bhgnij,bhnjd->bhgnid", probs_blk, v_blk)


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

    def context_kv(
        self, context: torch.Tensor, context_rope: tuple[torch.Tensor, torch.Tensor], start: int = 0
    ) -> ContextKV:
        """context [b, L, H] projected target states at positions start..start+L-1; rope [b, L, d]."""
        k, v = self._keys_values(context, *context_rope)  # [b, L, nkv, d]
        return ContextKV(k.transpose(1, 2), v.transpose(1, 2), start)

    def forward(
        self,
        x: torch.Tensor,
        context: ContextKV,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        anchor_positions: torch.Tensor,
    ) -> torch.Tensor:
        """x [b, N, B, H] block states; block rope [b, N, B, d]; anchor_positions [b, N]."""
        b, num_blocks, block_size, _ = x.shape
        groups = self.num_heads // self.num_kv_heads
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)))
        q = _rope(q, *block_rope)  # [b, N, B, nh, d]
        k_blk, v_blk = self._keys_values(x, *block_rope)  # [b, N, B, nkv, d]
        # Queries grouped by their kv head: [b, nkv, g, N, B, d]
        q = q.unflatten(-2, (self.num_kv_heads, groups)).permute(0, 3, 4, 1, 2, 5)
        k_blk, v_blk = k_blk.permute(0, 3, 1, 2, 4), v_blk.permute(0, 3, 1, 2, 4)  # [b, nkv, N, B, d]

        # Masks are built per layer: sliding-window layers see a window of the context, full-attention
        # layers everything before the anchor; within the block every slot sees every slot, unless
        # the layer is causal (self.causal: is_causal true, or unset on a sliding layer; the configs
        # this project writes set it false). They are cheap boolean tensors, rebuilt from the anchors.
        context_length = context.keys.shape[2]
        if context_key_span(context_length, self.sliding_window) < context_length:
            out = self._windowed(q, context, k_blk, v_blk, anchor_positions)
        else:
            context_visible, block_visible = layer_masks(
                anchor_positions, context.positions(), block_size, causal=self.causal,
                sliding_window=self.sliding_window,
            )  # fmt: skip
            out = joint_attention(
                q, context.keys, context.values, context_visible, k_blk, v_blk, block_visible, self.scaling
            )
        out = out.permute(0, 3, 4, 1, 2, 5).reshape(b, num_blocks, block_size, -1)  # [b, N, B, nh*d]
        return self.o_proj(out)

    def _windowed(self, q, context: ContextKV, k_blk, v_blk, anchor_positions) -> torch.Tensor:
        """Sliding layer, context longer than a window: the blocks whose anchors fall in one tile of
        the context score only the contiguous key range [tile start - window + 1, tile end - 1)
        (a view of the context keys, no copy). Same result as the masked full-context scores."""
        window, tile = self.sliding_window, window_tile(self.sliding_window)
        context_positions = context.positions()
        rows = []
        for row in range(q.shape[0]):
            tile_ids = torch.div(anchor_positions[row] - context.start, tile, rounding_mode="floor")
            order = torch.argsort(tile_ids, stable=True)
            tile_of_group, counts = torch.unique_consecutive(tile_ids[order], return_counts=True)
            outputs = []
            for tile_id, blocks in zip(tile_of_group.tolist(), order.split(counts.tolist())):
                lo = max(0, tile_id * tile - window + 1)
                hi = max(lo, min(context_positions.shape[0], (tile_id + 1) * tile - 1))
                context_visible, block_visible = layer_masks(
                    anchor_positions[row, blocks][None], context_positions[lo:hi], q.shape[-2],
                    causal=self.causal, sliding_window=window,
                )  # fmt: skip
                outputs.append(
                    joint_attention(
                        q[row : row + 1, :, :, blocks],
                        context.keys[row : row + 1, :, lo:hi],
                        context.values[row : row + 1, :, lo:hi],
                        context_visible,
                        k_blk[row : row + 1, :, blocks],
                        v_blk[row : row + 1, :, blocks],
                        block_visible,
                        self.scaling,
                    )
                )
            # Blocks back in their original order: [1, nkv, g, N, B, d]
            rows.append(torch.cat(outputs, dim=3).index_select(3, torch.argsort(order)))
        return torch.cat(rows, dim=0)
