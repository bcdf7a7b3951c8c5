"""Draft models against slow, independent references (Python loops over the contract's formulas)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import rotate_half

from dflash2.models import DFlash2DraftModel, DFlashDraftModel, attention, build_draft, draft_class
from dflash2.models.attention import context_key_span, joint_attention, layer_masks
from dflash2.models.conv import GroupedDynamicConv
from dflash2.models.selector import CandidateSelector
from tests.draft_helpers import (
    HIDDEN,
    VOCAB,
    random_draft,
    random_features,
    random_head,
    randomize_,
    tiny_draft_config,
)


def test_registry_builds_both_architectures():
    assert isinstance(build_draft(tiny_draft_config("DFlashDraftModel")), DFlashDraftModel)
    v2 = build_draft(tiny_draft_config("DFlash2DraftModel"))
    assert isinstance(v2, DFlash2DraftModel)
    assert v2.layers[0].attention_conv is not None and hasattr(v2, "candidate_selector")


def test_unknown_architecture_lists_known_ones():
    with pytest.raises(ValueError, match="DFlash2DraftModel.*DFlashDraftModel"):
        draft_class("EagleDraftModel")


# ---------------------------------------------------------------- convolution


def slow_conv(z, c, base, side, group_size):
    """Contract 2.1 formula, one scalar at a time. z [N, B, H]; c [N, B, 2, T, G]; base [2, T, H]."""
    num_blocks, block_size, hidden = z.shape
    out = torch.zeros_like(z)
    for n in range(num_blocks):
        for i in range(block_size):
            for ch in range(hidden):
                acc = 0.0
                for t in range(base.shape[1]):
                    if i - t < 0:  # before the start of i's block: zero padding
                        continue
                    w = base[side, t, ch] + c[n, i, side, t, ch // group_size]
                    acc += w * z[n, i - t, ch]
                out[n, i, ch] = acc
    return out


def test_conv_identity_at_init():
    draft = build_draft(tiny_draft_config())
    conv = draft.layers[0].attention_conv
    z = torch.randn(3, 4, HIDDEN)
    c = conv.dynamic_kernels(torch.randn(3, 4, HIDDEN))
    for side in (0, 1):
        torch.testing.assert_close(conv(z, c, side), z, rtol=0, atol=0)


@pytest.mark.parametrize("kernel_size", [1, 2, 3])
def test_conv_matches_slow_loop(kernel_size):
    conv = randomize_(GroupedDynamicConv(32, kernel_size, 8), seed=kernel_size, scale=0.5).double()
    x = torch.randn(3, 4, 32, dtype=torch.float64)
    z = torch.randn(3, 4, 32, dtype=torch.float64)
    c = conv.dynamic_kernels(x)
    for side in (0, 1):
        ref = slow_conv(z, c.detach(), conv.base_kernel.detach(), side, 8)
        torch.testing.assert_close(conv(z, c, side), ref, rtol=1e-10, atol=1e-10)


def test_conv_never_crosses_a_block_boundary():
    conv = randomize_(GroupedDynamicConv(32, 3, 8), seed=3, scale=0.5)
    x, z = torch.randn(4, 5, 32), torch.randn(4, 5, 32)
    out = conv(z, conv.dynamic_kernels(x), 0)
    z2, x2 = z.clone(), x.clone()
    z2[2] += 10.0
    x2[2] -= 3.0
    out2 = conv(z2, conv.dynamic_kernels(x2), 0)
    changed = (out2 - out).abs().amax(dim=(1, 2)) > 0
    assert changed.tolist() == [False, False, True, False]


def test_conv_gradients_reach_both_kernels():
    conv = GroupedDynamicConv(32, 2, 8)  # identity init: kernel_projection starts at zero
    x = torch.randn(2, 4, 32)
    c = conv.dynamic_kernels(x)
    (conv(conv(x, c, 0).tanh(), c, 1) ** 2).sum().backward()
    assert conv.base_kernel.grad.abs().sum() > 0
    assert conv.kernel_projection.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------- selector


def test_lattice_matches_slow_loop():
    torch.manual_seed(0)
    sel = randomize_(CandidateSelector(VOCAB, HIDDEN, rank=8, top_k=4), seed=5, scale=0.5).double()
    hidden = torch.randn(2, 3, HIDDEN, dtype=torch.float64)
    logits = torch.randn(2, 3, VOCAB, dtype=torch.float64)
    anchors = torch.tensor([7, 100])
    lattice, cand = sel.lattice(hidden, logits, anchors)
    assert lattice.shape == (2, 3, 4, 4)
    A, Bc, W = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
    for b in range(2):
        orders = [sorted(range(VOCAB), key=lambda v, e=e: -float(logits[b, e, v]))[:4] for e in range(3)]
        for e in range(3):
            assert cand[b, e].tolist() == orders[e]
            g = W @ hidden[b, e]
            for p_idx in range(4):
                pred = int(anchors[b]) if e == 0 else orders[e - 1][p_idx]
                for c_idx, c in enumerate(orders[e]):
                    ref = logits[b, e, c] + sum(A[pred, r] * g[r] * Bc[c, r] for r in range(8))
                    torch.testing.assert_close(lattice[b, e, p_idx, c_idx], ref)


def slow_greedy_walk(lattice, cand):
    row, tokens = 0, []
    for e in range(lattice.shape[0]):
        scores = lattice[e, row].tolist()
        best = max(range(len(scores)), key=lambda i: (scores[i], -i))  # first max
        tokens.append(int(cand[e, best]))
        row = best
    return tokens


def test_greedy_walk_matches_slow_loop_and_fresh_selector_is_unary_argmax():
    torch.manual_seed(1)
    lattice = torch.randn(3, 5, 4, 4)
    cand = torch.randint(0, VOCAB, (3, 5, 4))
    tokens, _, q = CandidateSelector.walk(lattice, cand)
    assert q is None
    for b in range(3):
        assert tokens[b].tolist() == slow_greedy_walk(lattice[b], cand[b])
    # Fresh selector (successor codebook zero): the walk returns each slot's unary argmax.
    fresh = build_draft(tiny_draft_config()).candidate_selector
    logits = torch.randn(2, 3, VOCAB)
    lat, cands = fresh.lattice(torch.randn(2, 3, HIDDEN), logits, torch.tensor([1, 2]))
    assert torch.equal(CandidateSelector.walk(lat, cands)[0], logits.argmax(-1))


def test_sampled_walk_rows_are_distributions_of_the_visited_rows():
    torch.manual_seed(2)
    lattice, cand = torch.randn(2, 5, 4, 4), torch.randint(0, VOCAB, (2, 5, 4))
    gen = torch.Generator().manual_seed(0)
    tokens, index, q = CandidateSelector.walk(lattice, cand, temperature=0.7, generator=gen)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 5))
    for b in range(2):
        row = 0
        for e in range(5):
            torch.testing.assert_close(q[b, e], torch.softmax(lattice[b, e, row] / 0.7, -1))
            row = int(index[b, e])
            assert int(tokens[b, e]) == int(cand[b, e, row])


# ---------------------------------------------------------------- unary transforms


def test_unary_transforms_multiply_then_softcap_and_keep_candidates():
    draft = build_draft(tiny_draft_config(output_multiplier=2.5, final_logit_softcapping=3.0))
    logits = torch.randn(4, VOCAB, dtype=torch.float64) * 2
    out = draft.transform_logits(logits)
    torch.testing.assert_close(out, 3.0 * torch.tanh(logits * 2.5 / 3.0))
    assert not torch.allclose(out, 3.0 * torch.tanh(logits / 3.0) * 2.5)  # the order matters
    k = 8  # monotone: same candidate set, same order (fp64 keeps the tanh from saturating into ties)
    assert torch.equal(torch.topk(out, k).indices, torch.topk(logits, k).indices)
    v1 = build_draft(tiny_draft_config("DFlashDraftModel"))
    assert torch.equal(v1.transform_logits(logits), logits)


# ---------------------------------------------------------------- forward forms


def test_fresh_dflash2_equals_dflash_v1():
    v1 = randomize_(build_draft(tiny_draft_config("DFlashDraftModel")), seed=4)
    v2 = build_draft(tiny_draft_config("DFlash2DraftModel"))
    missing, _ = v2.load_state_dict(v1.state_dict(), strict=False)
    assert all("conv" in k or "candidate_selector" in k for k in missing)
    emb = torch.randn(1, 3, 4, HIDDEN)
    feats, anchors = random_features(12), torch.tensor([[3, 7, 11]])
    torch.testing.assert_close(v2(emb, feats, anchors), v1(emb, feats, anchors), rtol=0, atol=0)


@pytest.mark.parametrize("architecture", ["DFlashDraftModel", "DFlash2DraftModel"])
def test_training_form_equals_single_block_inference_form(architecture):
    draft = random_draft(architecture, seed=6).double()
    seq_len, anchors = 14, torch.tensor([[0, 2, 5, 9, 13], [1, 4, 4, 8, 12]])
    feats = random_features(seq_len, batch=2).double()
    emb = torch.randn(2, 5, 4, HIDDEN, dtype=torch.float64)
    many = draft(emb, feats, anchors)
    for b in range(2):
        for n in range(5):
            p = int(anchors[b, n])
            # Inference: the verified context is exactly positions < p; the block sits at p.
            one = draft(emb[b : b + 1, n : n + 1], feats[b : b + 1, :p], torch.tensor([[p]]))
            torch.testing.assert_close(many[b, n], one[0, 0], rtol=1e-9, atol=1e-9)


def test_blocks_see_only_their_prefix_and_their_own_block():
    draft = random_draft(seed=7)
    feats, emb = random_features(16), torch.randn(1, 3, 4, HIDDEN)
    anchors = torch.tensor([[4, 8, 12]])
    base = draft(emb, feats, anchors)
    feats2 = feats.clone()
    feats2[:, 8:] += 5.0  # context at or after the second anchor
    out = draft(emb, feats2, anchors)
    assert torch.equal(out[0, :2], base[0, :2]) and not torch.allclose(out[0, 2], base[0, 2])
    emb2 = emb.clone()
    emb2[:, 1] += 1.0  # another block's inputs
    out = draft(emb2, feats, anchors)
    assert torch.equal(out[0, 0], base[0, 0]) and torch.equal(out[0, 2], base[0, 2])


def test_layer_masks_match_python_loop():
    anchors = torch.tensor([[0, 3, 9]])
    for causal, window in [(False, None), (True, None), (False, 4), (True, 3)]:
        ctx, blk = layer_masks(anchors, torch.arange(10), 4, causal=causal, sliding_window=window)
        for n, p in enumerate(anchors[0].tolist()):
            for i in range(4):
                for j in range(10):
                    want = j < p and (window is None or (p + i) - j < window)
                    assert bool(ctx[0, n, i, j]) == want
                for j in range(4):
                    want = (not causal or j <= i) and (window is None or abs(i - j) < window)
                    assert bool(blk[i, j]) == want


# ---------------------------------------------------------------- block attention and windows


def sliding_draft(
    architecture: str = "DFlash2DraftModel", window: int = 6, causal: bool = False, seed: int = 0
):
    """Both layers sliding (one window), random weights, fp64. The contract's drafts are non-causal;
    `causal` switches the attention's in-block causal mask on directly, to cover that branch too."""
    overrides = {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": window}
    draft = random_draft(architecture, seed=seed, config_overrides=overrides).double()
    for layer in draft.layers:
        layer.self_attn.causal = causal
    return draft


def slow_block_attention(attn, rotary, x, context, anchors, causal: bool, window: int | None):
    """The block-attention formula one (block, slot, head) at a time: slot i of the block at p attends
    to context keys j < p with (p + i) - j < window and to slots j' of its own block (j' <= i when
    causal, |i - j'| < window). x [b, N, B, H]; context [b, S, H]; anchors [b, N]."""

    def project(states, positions, proj, norm, heads):  # states [L, H] -> [L, heads, d] with RoPE
        y = proj(states).unflatten(-1, (heads, attn.head_dim))
        y = y if norm is None else norm(y)
        cos, sin = (t[0, :, None] for t in rotary(states, positions[None]))
        return y if norm is None else y * cos + rotate_half(y) * sin

    b, num_blocks, block_size, _ = x.shape
    groups = attn.num_heads // attn.num_kv_heads
    out = torch.zeros(b, num_blocks, block_size, attn.num_heads * attn.head_dim, dtype=x.dtype)
    for r in range(b):
        ctx_pos = torch.arange(context.shape[1])
        k_ctx = project(context[r], ctx_pos, attn.k_proj, attn.k_norm, attn.num_kv_heads)
        v_ctx = project(context[r], ctx_pos, attn.v_proj, None, attn.num_kv_heads)
        for n in range(num_blocks):
            p = int(anchors[r, n])
            blk_pos = torch.arange(p, p + block_size)
            q = project(x[r, n], blk_pos, attn.q_proj, attn.q_norm, attn.num_heads)
            k_blk = project(x[r, n], blk_pos, attn.k_proj, attn.k_norm, attn.num_kv_heads)
            v_blk = project(x[r, n], blk_pos, attn.v_proj, None, attn.num_kv_heads)
            for i in range(block_size):
                ctx_keys = [
                    j for j in range(context.shape[1]) if j < p and (window is None or p + i - j < window)
                ]
                blk_keys = [
                    j
                    for j in range(block_size)
                    if (not causal or j <= i) and (window is None or abs(i - j) < window)
                ]
                for h in range(attn.num_heads):
                    kv = h // groups
                    keys = torch.stack([k_ctx[j, kv] for j in ctx_keys] + [k_blk[j, kv] for j in blk_keys])
                    values = torch.stack([v_ctx[j, kv] for j in ctx_keys] + [v_blk[j, kv] for j in blk_keys])
                    weights = torch.softmax(keys @ q[i, h] * attn.scaling, dim=0)
                    out[r, n, i, h * attn.head_dim : (h + 1) * attn.head_dim] = weights @ values
    return attn.o_proj(out)


@pytest.mark.parametrize(
    "window,causal", [(5, False), (5, True), (12, False), (64, False)], ids=["w5", "w5-causal", "w12", "w>=S"]
)
def test_block_attention_matches_slow_loop_with_and_without_window_bound(window, causal):
    """Windows shorter than the context take the window-bounded path (tiles of the context), a window
    at least as long as it the full-context path: both equal the formula computed one key at a time.
    Anchors unsorted, repeated, at 0 and at S (the inference form)."""
    draft = sliding_draft(window=window, causal=causal, seed=window)
    attn = draft.layers[0].self_attn
    seq_len = 30
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 4, HIDDEN, generator=gen, dtype=torch.float64)
    context = torch.randn(2, seq_len, HIDDEN, generator=gen, dtype=torch.float64)
    anchors = torch.tensor([[17, 0, 9, 29, 9], [30, 3, 22, 11, 6]])
    rope = draft.rotary_emb(context, torch.arange(seq_len).expand(2, -1))
    block_rope = draft._block_rope(x, anchors)
    with torch.no_grad():
        got = attn(x, attn.context_kv(context, rope), block_rope, anchors)
        want = slow_block_attention(attn, draft.rotary_emb, x, context, anchors, causal, window)
    assert (context_key_span(seq_len, window) < seq_len) == (window < 30)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_window_bounded_attention_scores_only_the_window(monkeypatch):
    """S = 200, window 16: every block scores at most window + tile - 2 = 16 context keys (not 200),
    and the result equals the masked scores over the whole context (the formulation it replaces)."""
    draft = sliding_draft(window=16, seed=3)
    attn = draft.layers[0].self_attn
    seq_len, num_blocks, block_size = 200, 24, 4
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, num_blocks, block_size, HIDDEN, generator=gen, dtype=torch.float64)
    context = torch.randn(1, seq_len, HIDDEN, generator=gen, dtype=torch.float64)
    anchors = torch.randperm(seq_len, generator=gen)[:num_blocks][None]
    context_kv = attn.context_kv(context, draft.rotary_emb(context, torch.arange(seq_len)[None]))
    block_rope = draft._block_rope(x, anchors)
    key_counts = []

    def counting(q, k_ctx, *args):
        key_counts.append(k_ctx.shape[2])
        return joint_attention(q, k_ctx, *args)

    monkeypatch.setattr(attention, "joint_attention", counting)
    with torch.no_grad():
        got = attn(x, context_kv, block_rope, anchors)
    assert key_counts and max(key_counts) <= context_key_span(seq_len, 16) == 16
    # the full-context masked scores, as computed before the window bound
    groups = attn.num_heads // attn.num_kv_heads
    q = attn.q_norm(attn.q_proj(x).unflatten(-1, (attn.num_heads, attn.head_dim)))
    q = attention._rope(q, *block_rope).unflatten(-2, (attn.num_kv_heads, groups)).permute(0, 3, 4, 1, 2, 5)
    k_blk, v_blk = (t.permute(0, 3, 1, 2, 4) for t in attn._keys_values(x, *block_rope))
    context_visible, block_visible = layer_masks(
        anchors, torch.arange(seq_len), block_size, causal=False, sliding_window=16
    )
    with torch.no_grad():
        full = joint_attention(
            q, context_kv.keys, context_kv.values, context_visible, k_blk, v_blk, block_visible, attn.scaling
        )
        want = attn.o_proj(full.permute(0, 3, 4, 1, 2, 5).flatten(-3))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("architecture", ["DFlashDraftModel", "DFlash2DraftModel"])
@pytest.mark.parametrize("window", [5, 1000], ids=["window5", "full-window"])
def test_context_cache_decoding_equals_full_forward(architecture, window):
    """Appending features in uneven chunks (a long prompt, then 1..B positions per step), the cached
    block equals the full forward over every feature so far, and sliding layers keep window - 1
    positions."""
    draft = sliding_draft(architecture, window=window, seed=5)
    feats = random_features(60).double()
    emb = torch.randn(1, 1, 4, HIDDEN, dtype=torch.float64)
    cache = draft.new_context_cache()
    length = 0
    for chunk in [17, 1, 4, 2, 1, 3, 4, 4, 1, 2, 4, 4, 3, 1, 4, 4, 1]:
        draft.extend_context(cache, feats[:, length : length + chunk])
        length += chunk
        got = draft.decode_block(emb, cache)
        want = draft(emb, feats[:, :length], torch.tensor([[length]]))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        assert [kv.keys.shape[2] for kv in cache.layers()] == [min(length, window - 1)] * 2
    assert cache.length == length == 60


def test_propose_v1_is_greedy_argmax_and_v2_walks_the_lattice():
    head = random_head()
    hidden = torch.randn(2, 3, HIDDEN)
    v1 = random_draft("DFlashDraftModel")
    tokens, cands, _ = v1.propose(hidden, torch.tensor([1, 2]), head)
    assert cands is None and torch.equal(tokens, head.logits(hidden).argmax(-1))
    v2 = random_draft("DFlash2DraftModel")
    tokens, cands, q = v2.propose(hidden, torch.tensor([1, 2]), head)
    lattice, c2 = v2.candidate_selector.lattice(hidden, v2.compute_logits(hidden, head), torch.tensor([1, 2]))
    for b in range(2):
        assert tokens[b].tolist() == slow_greedy_walk(lattice[b], c2[b])
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 3))
