"""The objective against a slow per-block reference: each block built alone, run alone, scored alone."""

from __future__ import annotations

import math

import pytest
import torch

from dflash2.objective import (
    Blocks,
    ObjectiveConfig,
    anchor_candidates,
    block_targets,
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


def block_outputs(draft, head, batch, cfg, anchors, valid):
    """(row b, anchor a, draft output [B, H]) of every valid block, each block's forward alone against
    exactly its own prefix of the context: the slow loops' shared first half."""
    ids, feats = batch["input_ids"], batch["features"]
    for b in range(ids.shape[0]):
        for n in range(anchors.shape[1]):
            if not valid[b, n]:
                continue
            a = int(anchors[b, n])
            block = torch.tensor([[int(ids[b, a])] + [cfg.mask_token_id] * (cfg.block_size - 1)])
            yield b, a, draft(head.embed(block)[:, None], feats[b : b + 1, :a], torch.tensor([[a]]))[0, 0]


def slow_reference(draft, head, batch, cfg, anchors, valid, labels=None):
    """Python loop: one block at a time, each against exactly its own prefix of the context. `labels`
    [b, S]: the token each position counts as right (default: the data's own, input_ids)."""
    ids, mask = batch["input_ids"], batch["loss_mask"]
    labels = ids if labels is None else labels
    B = cfg.block_size
    mult = draft.config.dflash_config.get("output_multiplier") or 1.0
    cap = draft.config.dflash_config.get("final_logit_softcapping")
    selector = getattr(draft, "candidate_selector", None)
    base = sel = torch.zeros((), dtype=torch.float64)
    wsum = sel_wsum = 0.0
    for b, a, out in block_outputs(draft, head, batch, cfg, anchors, valid):
        for k in range(1, B):
            if a + k >= SEQ or not mask[b, a + k]:
                continue
            w = 1.0 if cfg.loss_gamma is None else math.exp(-(k - 1) / cfg.loss_gamma)
            wsum += w
            u = head.logits(out[k]).double() * mult
            if cap:
                u = cap * torch.tanh(u / cap)
            gold = int(labels[b, a + k])
            base = base + w * (torch.logsumexp(u, 0) - u[gold])
            if selector is None:
                continue
            cand = torch.topk(u, selector.top_k).indices.tolist()
            if gold not in cand:
                if cfg.selector_mode == "strict":
                    continue
                cand[-1] = gold  # the weakest candidate makes room
            sel_wsum += w
            pred = int(ids[b, a + k - 1])
            g = selector.hidden_projection(out[k]).double()
            A, Bc = selector.predecessor_codebook.double(), selector.successor_codebook.double()
            scores = torch.stack([u[c] + (A[pred] * g * Bc[c]).sum() for c in cand])
            sel = sel + w * (torch.logsumexp(scores, 0) - scores[cand.index(gold)])
    return {
        "loss": base + cfg.selector_loss_alpha * sel,
        "base": base,
        "selector": sel,
        "weight": wsum,
        "selector_weight": sel_wsum,
    }


def check_logged_losses(logged: dict, ref: dict, cfg: ObjectiveConfig) -> None:
    """`loss` is the optimised ratio (everything over the global weight sum); `selector_loss` is the
    mean over the slots that carry a selector term (in strict mode fewer than the supervised ones)."""
    weight, alpha = ref["weight"], cfg.selector_loss_alpha
    assert logged["loss"] == pytest.approx(float(ref["loss"].detach()) / weight, rel=1e-5)
    assert logged["base_loss"] == pytest.approx(float(ref["base"].detach()) / weight, rel=1e-5)
    if "selector_loss" not in logged:
        assert ref["selector_weight"] == 0.0
        return
    if cfg.selector_mode == "strict":
        assert 0 < ref["selector_weight"] < weight  # some gold tokens outside the top-k: a real test
    else:
        assert ref["selector_weight"] == pytest.approx(weight)
    assert logged["selector_loss"] == pytest.approx(
        float(ref["selector"].detach()) / ref["selector_weight"], rel=1e-5
    )
    assert logged["selector_weight_fraction"] == pytest.approx(ref["selector_weight"] / weight, rel=1e-6)
    recombined = logged["base_loss"] + alpha * logged["selector_weight_fraction"] * logged["selector_loss"]
    assert logged["loss"] == pytest.approx(recombined, rel=1e-6)


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
    # the logit transforms are DFlash 2's (a draft reads them once, when built); v1 keeps the identity
    transforms = (
        dict(output_multiplier=1.3, final_logit_softcapping=8.0)
        if architecture == "DFlash2DraftModel"
        else {}
    )
    draft = random_draft(architecture, seed=3, **transforms)
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
    ref = slow_reference(draft, head, batch, cfg, anchors, valid)
    ref["loss"].backward()
    want = grads(draft)
    torch.testing.assert_close(out.loss_sum.double(), ref["loss"], rtol=1e-5, atol=1e-5)
    assert float(out.weight_sum) == pytest.approx(ref["weight"])
    check_logged_losses(summarize_metrics(out.metrics, cfg.selector_loss_alpha), ref, cfg)
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


def test_selector_grad_selector_trains_the_layers_on_the_block_loss_alone():
    """objective.selector_grad=selector: the draft's layers get the gradient of the block loss alone
    (what alpha 0 gives them) and the selector the same gradient as with the default, at the same loss."""
    draft, head, batch = random_draft(seed=6), random_head(), make_batch(2)

    def run(**settings):
        cfg = ObjectiveConfig.for_draft(draft, num_anchors=5, logits_chunk_rows=3, **settings)
        draft.zero_grad()
        out = compute_objective(draft, head, batch, cfg, torch.Generator().manual_seed(1))
        out.loss_sum.backward()
        return out.loss_sum.detach(), grads(draft)

    loss_coupled, coupled = run(selector_loss_alpha=0.5)
    loss_alone, alone = run(selector_loss_alpha=0.5, selector_grad="selector")
    _, block_only = run(selector_loss_alpha=0.0)
    torch.testing.assert_close(loss_alone, loss_coupled)
    assert set(alone) == set(coupled)
    for name, got in alone.items():
        want = coupled[name] if name.startswith("candidate_selector.") else block_only[name]
        torch.testing.assert_close(got, want, msg=name)
    # the default does send the selector's gradient into the layers
    assert not torch.allclose(
        coupled["layers.0.self_attn.q_proj.weight"], alone["layers.0.self_attn.q_proj.weight"]
    )


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


# ------------------------------------------------------------------ exact in-sample acceptance

ACCEPT_SEQ = 40


@torch.no_grad()
def serving_proposal(draft, head, batch, row: int, anchor: int) -> tuple[list[int], list[int]]:
    """One block alone, as the serving loop drafts it: (draft.propose's tokens — the unary argmax
    for v1, the selector's greedy walk on its own previous picks for v2 —, the unary argmax)."""
    block_size = draft.block_size
    block = torch.tensor([[int(batch["input_ids"][row, anchor])] + [draft.mask_token_id] * (block_size - 1)])
    context = batch["features"][row : row + 1, :anchor]
    slot_hidden = draft(head.embed(block)[:, None], context, torch.tensor([[anchor]]))[0, 0, 1:][None]
    tokens = draft.propose(slot_hidden, block[:, 0], head)[0][0].tolist()
    unary = draft.compute_logits(slot_hidden, head).argmax(-1)[0].tolist()
    return tokens, unary


def slow_acceptance(draft, head, batch, anchors, valid) -> dict[str, list[int]]:
    """Per valid block: 1 + the number of leading proposed tokens equal to the data, counted only
    over the block's leading supervised slots (in bounds and in the reply)."""
    ids, mask = batch["input_ids"], batch["loss_mask"]
    out = {"proposal": [], "unary": [], "max": []}
    for row in range(ids.shape[0]):
        for n in range(anchors.shape[1]):
            if not valid[row, n]:
                continue
            a = int(anchors[row, n])
            supervised = 0
            while supervised < draft.block_size - 1:
                position = a + supervised + 1
                if position >= ids.shape[1] or not mask[row, position]:
                    break
                supervised += 1
            for name, tokens in zip(("proposal", "unary"), serving_proposal(draft, head, batch, row, a)):
                run = 0
                while run < supervised and tokens[run] == int(ids[row, a + run + 1]):
                    run += 1
                out[name].append(1 + run)
            out["max"].append(1 + supervised)
    return out


def acceptance_batch(draft, head):
    """Blocks that do not overlap, whose data continues the serving proposal for 0..B-1 tokens and
    then differs; some blocks cut short by the reply's end (a hole in the loss mask) or the sequence end."""
    gen = torch.Generator().manual_seed(11)
    batch = {
        "input_ids": torch.randint(0, 200, (2, ACCEPT_SEQ), generator=gen),
        "loss_mask": torch.ones(2, ACCEPT_SEQ, dtype=torch.long),
        "features": random_features(ACCEPT_SEQ, batch=2),
    }
    batch["loss_mask"][0, [8, 11, 30]] = 0
    block_size = draft.block_size
    anchors = torch.arange(1, ACCEPT_SEQ, block_size).repeat(2, 1)  # the last block runs past the end
    valid = torch.ones_like(anchors, dtype=torch.bool)
    valid[1, -3:] = False
    anchors[1, -3:] = 0
    for row, n in valid.nonzero().tolist():
        a = int(anchors[row, n])
        tokens, _ = serving_proposal(draft, head, batch, row, a)
        matched = (3 * row + n) % block_size  # 0 .. B-1 leading tokens as proposed
        for k in range(1, block_size):
            if a + k >= ACCEPT_SEQ:
                break
            proposed = tokens[k - 1]
            batch["input_ids"][row, a + k] = proposed if k <= matched else (proposed + 1 + k) % 200
    return batch, anchors, valid


@pytest.mark.parametrize(
    "architecture,mode",
    [("DFlashDraftModel", "insert"), ("DFlash2DraftModel", "insert"), ("DFlash2DraftModel", "strict")],
)
def test_insample_acceptance_equals_the_serving_proposal_per_block(architecture, mode):
    draft = random_draft(architecture, seed=6)
    if architecture == "DFlash2DraftModel":
        with torch.no_grad():  # a selector strong enough that its walk departs from the unary argmax
            draft.candidate_selector.successor_codebook.mul_(10.0)
    head = random_head()
    batch, anchors, valid = acceptance_batch(draft, head)
    cfg = ObjectiveConfig.for_draft(draft, num_anchors=anchors.shape[1], loss_gamma=2.0, selector_mode=mode)
    targets = block_targets(
        batch["input_ids"], batch["loss_mask"], anchors, valid, cfg.block_size, cfg.loss_gamma
    )
    with torch.no_grad():
        out = compute_objective(draft, head, batch, cfg, blocks=Blocks(anchors, valid, *targets))
    logged = summarize_metrics(out.metrics, alpha=1.0)

    ref = slow_acceptance(draft, head, batch, anchors, valid)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    assert set(ref["proposal"]) == {1, 2, 3, 4}  # every run length occurs: the test can tell them apart
    assert min(ref["max"]) < draft.block_size  # some blocks are cut short by the reply or the sequence
    assert logged["insample_accept_len_max"] == pytest.approx(mean(ref["max"]), rel=1e-12)
    if architecture == "DFlashDraftModel":
        assert ref["proposal"] == ref["unary"]
        assert logged["insample_accept_len"] == pytest.approx(mean(ref["proposal"]), rel=1e-12)
        assert "insample_accept_len_selector" not in logged
    else:
        assert ref["proposal"] != ref["unary"]  # the walk is not the argmax here
        assert logged["insample_accept_len_selector"] == pytest.approx(mean(ref["proposal"]), rel=1e-12)
        assert logged["insample_accept_len"] == pytest.approx(mean(ref["unary"]), rel=1e-12)


@pytest.mark.parametrize("architecture", ["DFlashDraftModel", "DFlash2DraftModel"])
def test_supervising_every_token_is_the_slow_reference_over_the_attention_mask(architecture):
    # objective.supervised_tokens=all: the prompts are supervised too, the padding never; the reference
    # is the slow per-block loop over a batch whose loss_mask is its attention_mask
    draft, head, batch = random_draft(architecture, seed=6), random_head(), make_batch(2)
    batch["attention_mask"] = torch.ones_like(batch["loss_mask"])
    batch["attention_mask"][0, 15:] = 0  # padding at the end of row 0
    cfg = ObjectiveConfig.for_draft(draft, num_anchors=6, loss_gamma=4.0, supervised_tokens="all")
    out = compute_objective(draft, head, batch, cfg, torch.Generator().manual_seed(7))
    every_token = {**batch, "loss_mask": batch["attention_mask"]}
    anchors, valid = sample_anchors(every_token["loss_mask"], 6, torch.Generator().manual_seed(7))
    assert int(anchors[valid].min()) < 2  # an anchor before either row's reply (they start at 4 and 2)
    ref = slow_reference(draft, head, every_token, cfg, anchors, valid)
    torch.testing.assert_close(out.loss_sum.double(), ref["loss"], rtol=1e-5, atol=1e-5)
    assert float(out.weight_sum) == pytest.approx(ref["weight"])
    replies = compute_objective(
        draft, head, batch, ObjectiveConfig.for_draft(draft, num_anchors=6, loss_gamma=4.0)
    )
    assert float(replies.weight_sum) < float(out.weight_sum)


@pytest.mark.parametrize("distill", [False, True])
def test_the_top_1_of_tied_logits_is_the_token_argmax_and_greedy_serving_take(distill):
    """Tied top logits (bf16 makes them common; here every token has a twin row in the head) rank
    by token id, lowest first, as `argmax` (a v1 draft's greedy proposal) does, so the logged
    accuracy and in-sample acceptance count what serving would accept."""
    import torch.nn.functional as F

    from dflash2.models import TargetHead
    from dflash2.objective import LossTerms, distill_loss, unary_ce

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 16, generator=gen).repeat(2, 1)  # token i and token i + 32 tie
    head, hidden = TargetHead(weight, weight), torch.randn(400, 16, generator=gen)
    argmax = F.linear(hidden, weight).argmax(-1)
    labels, weights = argmax, torch.ones(400)
    if distill:
        terms = LossTerms(0.0, 1.0, 0.0, 1.0, 1.0, None)
        ids = distill_loss(hidden, head, labels, weights, hidden, torch.arange(400), terms, 64, 4).topk_ids
    else:
        ids = unary_ce(hidden, head, labels, weights, 1.0, None, 64, 4)[1]
    assert torch.equal(ids[:, 0], argmax)
    assert torch.equal(ids[:, 1], argmax + 32)  # its twin, the next-ranked
