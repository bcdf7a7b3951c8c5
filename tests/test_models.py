"""Draft models against slow, independent references (Python loops over the contract's formulas)."""

from __future__ import annotations

import pytest
import torch

from dflash2.models import DFlash2DraftModel, DFlashDraftModel, build_draft, draft_class
from dflash2.models.attention import layer_masks
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
        ctx, blk = layer_masks(anchors, 10, 4, causal=causal, sliding_window=window)
        for n, p in enumerate(anchors[0].tolist()):
            for i in range(4):
                for j in range(10):
                    want = j < p and (window is None or (p + i) - j < window)
                    assert bool(ctx[0, n, i, j]) == want
                for j in range(4):
                    want = (not causal or j <= i) and (window is None or abs(i - j) < window)
                    assert bool(blk[i, j]) == want


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
