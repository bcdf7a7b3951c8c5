"""The objective against a slow per-block reference: each block built alone, run alone, scored alone."""

from __future__ import annotations

import math

import pytest
import torch

from dflash2.objective import (
    ObjectiveConfig,
    anchor_candidates,
    compute_objective,
    estimated_acceptance_length,
    sample_anchors,
    summarize_metrics,
)
from tests.draft_helpers import random_draft, random_features, random_head

SEQ = 18


def make_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 200, (2, SEQ), generator=gen)
    loss_mask = torch.zeros(2, SEQ, dtype=torch.long)
    loss_mask[0, 4:11] = 1
    loss_mask[0, 13:17] = 1
    loss_mask[1, 2:18] = 1
    return {"input_ids": input_ids, "loss_mask": loss_mask, "features": random_features(SEQ, batch=2)}


def slow_reference(draft, head, batch, cfg, anchors, valid):
    """Python loop: one block at a time, each against exactly its own prefix of the context."""
    ids, mask, feats = batch["input_ids"], batch["loss_mask"], batch["features"]
    B = cfg.block_size
    mult = draft.config.dflash_config.get("output_multiplier") or 1.0
    cap = draft.config.dflash_config.get("final_logit_softcapping")
    selector = getattr(draft, "candidate_selector", None)
    base = sel = torch.zeros((), dtype=torch.float64)
    wsum = 0.0
    for b in range(ids.shape[0]):
        for n in range(anchors.shape[1]):
            if not valid[b, n]:
                continue
            a = int(anchors[b, n])
            block = torch.tensor([[int(ids[b, a])] + [cfg.mask_token_id] * (B - 1)])
            out = draft(head.embed(block)[:, None], feats[b : b + 1, :a], torch.tensor([[a]]))[0, 0]
            for k in range(1, B):
                if a + k >= SEQ or not mask[b, a + k]:
                    continue
                w = 1.0 if cfg.loss_gamma is None else math.exp(-(k - 1) / cfg.loss_gamma)
                wsum += w
                u = head.logits(out[k]).double() * mult
                if cap:
                    u = cap * torch.tanh(u / cap)
                gold = int(ids[b, a + k])
                base = base + w * (torch.logsumexp(u, 0) - u[gold])
                if selector is None:
                    continue
                cand = torch.topk(u, selector.top_k).indices.tolist()
                if gold not in cand:
                    if cfg.selector_mode == "strict":
                        continue
                    cand[-1] = gold  # the weakest candidate makes room
                pred = int(ids[b, a + k - 1])
                g = selector.hidden_projection(out[k]).double()
                A, Bc = selector.predecessor_codebook.double(), selector.successor_codebook.double()
                scores = torch.stack([u[c] + (A[pred] * g * Bc[c]).sum() for c in cand])
                sel = sel + w * (torch.logsumexp(scores, 0) - scores[cand.index(gold)])
    return base + cfg.selector_loss_alpha * sel, wsum


def grads(draft):
    return {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "architecture,mode,gamma",
    [
        ("DFlashDraftModel", "insert", None),
        ("DFlash2DraftModel", "insert", 4.0),
        ("DFlash2DraftModel", "strict", None),
    ],
)
def test_objective_matches_slow_per_block_reference(architecture, mode, gamma):
    draft = random_draft(architecture, seed=3, output_multiplier=1.3, final_logit_softcapping=8.0)
    if architecture == "DFlashDraftModel":
        draft.config.dflash_config.update(output_multiplier=1.0, final_logit_softcapping=None)
    head = random_head()
    batch = make_batch()
    cfg = ObjectiveConfig.for_draft(
        draft,
        num_anchors=5,
        loss_gamma=gamma,
        selector_loss_alpha=0.7,
        selector_mode=mode,
        logits_chunk_rows=3,
    )
    out = compute_objective(draft, head, batch, cfg, torch.Generator().manual_seed(5))
    out.loss_sum.backward()
    got = grads(draft)
    draft.zero_grad()
    anchors, valid = sample_anchors(batch["loss_mask"], 5, torch.Generator().manual_seed(5))
    ref_loss, ref_w = slow_reference(draft, head, batch, cfg, anchors, valid)
    ref_loss.backward()
    want = grads(draft)
    torch.testing.assert_close(out.loss_sum.double(), ref_loss, rtol=1e-5, atol=1e-5)
    assert float(out.weight_sum) == pytest.approx(ref_w)
    assert set(got) == set(want)
    for name in want:  # fp32 vs a float64 loop: tolerance relative to the gradient's scale
        scale = float(want[name].abs().max())
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=2e-5 * scale, msg=name)


def test_chunked_equals_naive_loss_and_grads():
    draft = random_draft(seed=4, output_multiplier=0.8, final_logit_softcapping=5.0)
    head, batch = random_head(), make_batch(1)
    results = []
    for naive, chunk in [(True, 0), (False, 1), (False, 4), (False, 10_000)]:
        cfg = ObjectiveConfig.for_draft(draft, num_anchors=6, logits_chunk_rows=chunk or 1)
        draft.zero_grad()
        out = compute_objective(draft, head, batch, cfg, torch.Generator().manual_seed(0), naive=naive)
        out.loss_sum.backward()
        results.append((out.loss_sum.detach(), grads(draft)))
    for loss, g in results[1:]:
        torch.testing.assert_close(loss, results[0][0])
        for name in g:
            want = results[0][1][name]
            torch.testing.assert_close(g[name], want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def test_anchor_sampling_uses_only_valid_candidates_without_replacement():
    mask = make_batch()["loss_mask"]
    cand = anchor_candidates(mask)
    assert cand[0].nonzero()[:, 0].tolist() == [4, 5, 6, 7, 8, 9, 13, 14, 15]
    for seed in range(20):
        anchors, valid = sample_anchors(mask, 12, torch.Generator().manual_seed(seed))
        for b in range(2):
            chosen = anchors[b][valid[b]].tolist()
            assert len(chosen) == min(12, int(cand[b].sum())) and len(set(chosen)) == len(chosen)
            assert all(cand[b, a] for a in chosen) and chosen == sorted(chosen)


def test_selector_supervision_inserts_gold_and_teacher_forces():
    from dflash2.objective import selector_scores

    draft = random_draft(seed=9)
    head = random_head()
    selector = draft.candidate_selector
    hidden = torch.randn(3, 64)
    u = head.logits(hidden)
    cands = torch.topk(u, 4).indices
    labels = torch.tensor([int(cands[0, 2]), int(torch.topk(u[1], 10).indices[7]), int(cands[2, 0])])
    preds = torch.tensor([5, 6, 7])
    scores, gold_index, in_topk = selector_scores(
        selector, hidden, head, cands, labels, preds, 1.0, None, "insert"
    )
    assert in_topk.tolist() == [True, False, True] and gold_index.tolist() == [2, 3, 0]
    # Row 1: gold took the weakest slot, scored with its own unary logit after predecessor 6.
    g = selector.hidden_projection(hidden[1])
    want = (
        u[1, labels[1]]
        + (selector.predecessor_codebook[6] * g * selector.successor_codebook[labels[1]]).sum()
    )
    torch.testing.assert_close(scores[1, 3], want)
    torch.testing.assert_close(
        scores[1, :3], selector(hidden[1], u[1, cands[1, :3]], cands[1, :3], preds[1:2])[0]
    )


def test_gradients_reach_codebooks_projection_and_layers():
    draft = random_draft(seed=2)
    out = compute_objective(
        draft, random_head(), make_batch(), ObjectiveConfig.for_draft(draft, num_anchors=4)
    )
    out.loss_sum.backward()
    for name in [
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.1.mlp_conv.kernel_projection.weight",
        "fc.weight",
    ]:
        assert dict(draft.named_parameters())[name].grad.abs().sum() > 0, name


def test_batch_without_valid_anchor_is_a_clear_error():
    batch = make_batch()
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    batch["loss_mask"][:, ::2] = 1  # never two consecutive supervised tokens
    draft = random_draft()
    with pytest.raises(ValueError, match="no valid anchor"):
        compute_objective(draft, random_head(), batch, ObjectiveConfig.for_draft(draft))


def test_metrics_summary_and_acceptance_estimate():
    assert estimated_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert estimated_acceptance_length([0.5, 0.5]) == pytest.approx(1.75)
    draft = random_draft(seed=1)
    out = compute_objective(
        draft, random_head(), make_batch(), ObjectiveConfig.for_draft(draft, num_anchors=8)
    )
    m = summarize_metrics(out.metrics, alpha=1.0)
    assert m["loss"] == pytest.approx(float(out.loss_sum.detach()) / float(out.weight_sum), rel=1e-5)
    assert 0 <= m["accuracy"] <= m["topk_coverage"] <= 1
    assert {"accuracy_pos_1", "accuracy_pos_3", "selector_accuracy", "est_accept_len_selector"} <= set(m)
    assert m["num_supervised_tokens"] == float(out.weight_sum)
