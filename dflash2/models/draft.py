"""DFlash (v1) and DFlash 2 draft models: pure math, no distributed code.

A draft reads the target's hidden states at `target_layer_ids` (the context) and predicts a whole
block of future tokens in one non-causal forward. It owns no embedding table and no LM head: both
are the target's (see `TargetHead`). See docs/architecture.md for the tensor conventions.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import initialization as init
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Config,
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from dflash2.models.attention import ContextKV, DFlashAttention
from dflash2.models.config import DFLASH, DFLASH2, Architecture
from dflash2.models.context_cache import DraftContextCache
from dflash2.models.conv import AFTER, BEFORE, GroupedDynamicConv
from dflash2.models.selector import CandidateSelector
from dflash2.models.spec import ConvSpec, DraftSpec
from dflash2.target.head import TargetHead
from dflash2.timing import region


def transform_logits(logits: torch.Tensor, multiplier: float, softcap: float | None) -> torch.Tensor:
    """The unary logit transforms of DFlash 2 (contract section 2.2): multiply by output_multiplier, then
    softcap. The identity for v1 defaults (multiplier 1, no cap)."""
    if multiplier != 1.0:
        logits = logits * multiplier
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 layer whose attention reads the context; optional DFlash 2 convs around
    the attention and MLP sublayers (the residual wraps the whole conv-sublayer-conv chain)."""

    def __init__(self, config: Qwen3Config, layer_idx: int, conv: ConvSpec | None) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if conv is not None:
            self.attention_conv = GroupedDynamicConv(config.hidden_size, conv.kernel_size, conv.group_size)
            self.mlp_conv = GroupedDynamicConv(config.hidden_size, conv.kernel_size, conv.group_size)
        else:
            self.attention_conv = self.mlp_conv = None

    def forward(
        self,
        h: torch.Tensor,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        anchor_positions: torch.Tensor,
        context: torch.Tensor | None = None,
        context_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        context_kv: ContextKV | None = None,
    ) -> torch.Tensor:
        """h [b, N, B, H] block states. The context is either the projected target features
        `context` [b, S, H] (positions 0..S-1, with their rope) or this layer's cached `context_kv`.
        The context keys are computed here, inside the layer, where a sharded layer's weights live."""
        if context_kv is None:
            context_kv = self.self_attn.context_kv(context, context_rope)
        x = self.input_layernorm(h)
        if self.attention_conv is None:
            h = h + self.self_attn(x, context_kv, block_rope, anchor_positions)
        else:
            c = self.attention_conv.dynamic_kernels(x)  # both sides from the sublayer input
            a = self.self_attn(self.attention_conv(x, c, BEFORE), context_kv, block_rope, anchor_positions)
            h = h + self.attention_conv(a, c, AFTER)

        y = self.post_attention_layernorm(h)
        if self.mlp_conv is None:
            return h + self.mlp(y)
        c = self.mlp_conv.dynamic_kernels(y)
        return h + self.mlp_conv(self.mlp(self.mlp_conv(y, c, BEFORE)), c, AFTER)


class DFlashDraftModel(Qwen3PreTrainedModel):
    """DFlash v1: Qwen3-style layers over a projected multi-layer target context; greedy argmax proposal."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]
    architecture: ClassVar[Architecture] = DFLASH  # the parts this class builds (models.config)

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.spec = DraftSpec.from_config(config, self.architecture)  # what this draft is, read once
        hidden = self.spec.hidden_size
        self.fc = nn.Linear(len(self.spec.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(
            [DFlashDecoderLayer(config, i, self.spec.conv) for i in range(self.spec.num_layers)]
        )
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def mask_token_id(self) -> int:
        return self.spec.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.spec.target_layer_ids)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, GroupedDynamicConv):
            # Identity: a fresh DFlash 2 draft computes exactly what a v1 draft computes.
            init.zeros_(module.base_kernel)
            init.ones_(module.base_kernel[:, 0])
            init.zeros_(module.kernel_projection.weight)
        elif isinstance(module, CandidateSelector):
            init.normal_(module.predecessor_codebook, mean=0.0, std=self.config.initializer_range)
            init.zeros_(module.successor_codebook)

    def project_context(self, context_features: torch.Tensor) -> torch.Tensor:
        """[b, S, K*H] concatenated target hidden states -> [b, S, H]."""
        return self.hidden_norm(self.fc(context_features))

    def forward(
        self,
        block_embeds: torch.Tensor,
        context_features: torch.Tensor,
        anchor_positions: torch.Tensor,
    ) -> torch.Tensor:
        """block_embeds [b, N, B, H] (target embedding of [anchor, MASK x (B-1)]);
        context_features [b, S, K*H]; anchor_positions [b, N] absolute anchor positions.
        Returns the final-normed block states [b, N, B, H]. Block n sees context positions
        < anchor_positions[:, n] and its own block only."""
        b = block_embeds.shape[0]
        context = self.project_context(context_features.to(block_embeds.dtype))
        context_pos = torch.arange(context.shape[1], device=context.device).expand(b, -1)
        context_rope = self.rotary_emb(block_embeds, context_pos)
        block_rope = self._block_rope(block_embeds, anchor_positions)
        h = block_embeds
        for layer in self.layers:
            h = layer(h, block_rope, anchor_positions, context=context, context_rope=context_rope)
        return self.norm(h)

    def _block_rope(self, block_embeds: torch.Tensor, anchor_positions: torch.Tensor):
        """RoPE tables of the block slots, at positions anchor + slot: [b, N, B, d] each."""
        b, num_blocks, block_size, _ = block_embeds.shape
        slot = torch.arange(block_size, device=block_embeds.device)
        block_pos = anchor_positions[..., None] + slot  # [b, N, B]
        cos, sin = self.rotary_emb(block_embeds, block_pos.reshape(b, -1))
        return cos.view(b, num_blocks, block_size, -1), sin.view(b, num_blocks, block_size, -1)

    # ---------------------------------------------------------------- decoding with a context cache

    def new_context_cache(self) -> DraftContextCache:
        """An empty cache of this draft's per-layer context keys and values (one request)."""
        return DraftContextCache([layer.self_attn.sliding_window for layer in self.layers])

    @torch.no_grad()
    def extend_context(self, cache: DraftContextCache, context_features: torch.Tensor) -> None:
        """Append the target features [b, n, K*H] of the next n committed positions to `cache`:
        they are projected and turned into every layer's keys and values once, never again."""
        dtype = self.fc.weight.dtype
        context = self.project_context(context_features.to(dtype))
        b, n, _ = context.shape
        positions = torch.arange(cache.length, cache.length + n, device=context.device).expand(b, -1)
        rope = self.rotary_emb(context, positions)
        cache.append([layer.self_attn.context_kv(context, rope, start=cache.length) for layer in self.layers])

    @torch.no_grad()
    def decode_block(self, block_embeds: torch.Tensor, cache: DraftContextCache) -> torch.Tensor:
        """One block per sequence, anchored right after the cached context: block_embeds
        [b, 1, B, H] -> [b, 1, B, H]. Equal to `forward(block_embeds, all features so far, [[S]])`."""
        anchor_positions = torch.full((block_embeds.shape[0], 1), cache.length, device=block_embeds.device)
        block_rope = self._block_rope(block_embeds, anchor_positions)
        h = block_embeds
        for layer, context_kv in zip(self.layers, cache.layers()):
            h = layer(h, block_rope, anchor_positions, context_kv=context_kv)
        return self.norm(h)

    def transform_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This draft's unary transforms (module function `transform_logits`); none: `logits` itself."""
        transform = self.spec.logit_transform
        if transform is None:
            return logits
        return transform_logits(logits, transform.multiplier, transform.softcap)

    def compute_logits(self, hidden: torch.Tensor, head: TargetHead) -> torch.Tensor:
        return self.transform_logits(head.logits(hidden))

    @torch.no_grad()
    def propose(
        self,
        slot_hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        head: TargetHead,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """slot_hidden [b, B-1, H] (slots 1..B-1). Returns (tokens [b, B-1], candidate ids or None,
        draft probabilities: full-vocab [b, B-1, V] for v1, over the candidates [b, B-1, k] for v2)."""
        with region("head"):
            logits = self.compute_logits(slot_hidden, head)
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            tokens = torch.multinomial(probs.flatten(0, 1), 1, generator=generator).view(probs.shape[:-1])
            return tokens, None, probs
        return logits.argmax(dim=-1), None, torch.softmax(logits.float(), dim=-1)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash 2: conv around every sublayer, unary logit transforms, and the candidate selector."""

    # The objective calls the selector outside the draft's forward: it must be its own sharding unit.
    _no_split_modules = ["DFlashDecoderLayer", "CandidateSelector"]
    architecture: ClassVar[Architecture] = DFLASH2

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.candidate_selector = CandidateSelector(
            vocab_size=config.vocab_size,
            hidden_size=self.spec.hidden_size,
            rank=self.spec.selector.rank,
            top_k=self.spec.selector.top_k,
        )
        self.post_init()

    @torch.no_grad()
    def propose(self, slot_hidden, anchor_ids, head, temperature=0.0, generator=None):
        """Selector walk over the [B-1, k, k] lattice. Returns (tokens [b, B-1], candidates
        [b, B-1, k], q [b, B-1, k] — the walk's sampling rows, or one-hot of the greedy pick)."""
        with region("head"):
            logits = self.compute_logits(slot_hidden, head)
        with region("selector"):
            lattice, candidates = self.candidate_selector.lattice(slot_hidden, logits, anchor_ids)
            tokens, index, q = self.candidate_selector.walk(lattice, candidates, temperature, generator)
        if q is None:
            q = torch.nn.functional.one_hot(index, candidates.shape[-1]).float()
        return tokens, candidates, q
