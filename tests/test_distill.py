"""The KL / TV terms against the target's distribution and the position weights, against float64 loops."""

from __future__ import annotations

import math

import pytest
import torch

from dflash2.config import ObjectiveSection
from dflash2.objective import (
    LossTerms,
    ObjectiveConfig,
    compute_objective,
    distill_loss,
    sample_anchors,
    slot_weights,
    summarize_metrics,
)
from tests.draft_helpers import HIDDEN, VOCAB, random_draft, random_features, random_head
from tests.run_helpers import check_ok, launch_train, metrics, short_tiny_run, tiny_subset
from tests.test_objective import block_outputs, check_logged_losses, grads, make_batch, slow_reference

SEQ = 18


def slow_terms(hidden, head, labels, weights, states, index, terms: LossTerms) -> dict:
    """float64, one row at a time: sum_r w_r CE_r, KL(p_r || q_r), TV(p_r, q_r) and the weighted loss."""
    sums = dict.fromkeys(("ce", "kl", "tv"), torch.zeros((), dtype=torch.float64))
    rows = []
    for r in range(hidden.shape[0]):
        u = head.logits(hidden[r].double()[None])[0].double() * terms.multiplier
        if terms.cap:
            u = terms.cap * torch.tanh(u / terms.cap)
        log_q = torch.log_softmax(u, 0)
        t = (states[int(index[r])].double() @ head.lm_head_weight.double().T) / terms.temperature
        log_p = torch.log_softmax(t, 0)
        p, q = log_p.exp(), log_q.exp()
        row = {
            "ce": -log_q[int(labels[r])],
            "kl": (p * (log_p - log_q)).sum(),
            "tv": 0.5 * (p - q).abs().sum(),
        }
        rows.append(row)
        for name in sums:
            sums[name] = sums[name] + float(weights[r]) * row[name]
    loss = terms.ce_weight * sums["ce"] + terms.kl_weight * sums["kl"] + terms.tv_weight * sums["tv"]
    return {**sums, "loss": loss, "rows": rows}


def random_rows(num_rows=9, num_positions=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_rows, HIDDEN, generator=gen)
    labels = torch.randint(0, VOCAB, (num_rows,), generator=gen)
    weights = torch.rand(num_rows, generator=gen) + 0.1
    states = torch.randn(num_positions, HIDDEN, generator=gen)
    index = torch.randint(0, num_positions, (num_rows,), generator=gen)  # positions shared by rows
    return hidden, labels, weights, states, index


@pytest.mark.parametrize(
    "ce,kl,tv,multiplier,cap,temperature",
    [
        (0.0, 1.0, 0.0, 1.0, None, 1.0),
        (0.0, 0.0, 1.0, 0.8, 5.0, 1.0),
        (0.1, 0.0, 0.9, 1.0, None, 2.0),
        (1.0, 0.5, 0.3, 0.8, 5.0, 0.7),
    ],
)
@pytest.mark.parametrize("chunk_rows", [3, 10_000])  # 1 row per chunk, and all rows in one
def test_each_term_and_its_gradient_match_a_float64_loop(
    ce, kl, tv, multiplier, cap, temperature, chunk_rows
):
    head = random_head()
    hidden, labels, weights, states, index = random_rows()
    terms = LossTerms(ce, kl, tv, temperature, multiplier, cap)
    leaf = hidden.clone().requires_grad_(True)
    got = distill_loss(leaf, head, labels, weights, states, index, terms, chunk_rows, top_k=4)
    got.loss.backward()
    ref_leaf = hidden.double().clone().requires_grad_(True)
    want = slow_terms(ref_leaf, head, labels, weights, states, index, terms)
    want["loss"].backward()
    computed = ("loss", "ce", "kl", "tv") if kl else ("loss", "ce", "tv")  # KL's value: only when weighted
    for name in computed:
        assert float(getattr(got, name).detach()) == pytest.approx(
            float(want[name].detach()), rel=1e-5, abs=1e-6
        )
    if not kl:
        assert float(got.kl) == 0.0
    scale = float(ref_leaf.grad.abs().max())
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, rtol=1e-4, atol=1e-5 * scale)
    assert float(got.tv) > 0 and float(want["kl"].detach()) > 0  # a real difference between the distributions
    want_tv = torch.stack([row["tv"] for row in want["rows"]]).float()
    torch.testing.assert_close(got.tv_rows, want_tv, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.topk_ids[:, 0], torch.stack([head.logits(h[None])[0].argmax() for h in hidden]))


def test_kl_to_a_one_hot_target_equals_the_cross_entropy():
    head = random_head()
    hidden, _, weights, states, index = random_rows(seed=3)
    # A temperature near 0 makes the teacher one-hot at its argmax; that token is the label.
    labels = (states @ head.lm_head_weight.T).argmax(-1)[index]
    kl_only = LossTerms(0.0, 1.0, 0.0, 1e-6, 1.0, None)
    ce_only = LossTerms(1.0, 0.0, 0.0, 1e-6, 1.0, None)
    results = []
    for terms in (kl_only, ce_only):
        leaf = hidden.clone().requires_grad_(True)
        out = distill_loss(leaf, head, labels, weights, states, index, terms, 4, top_k=4)
        out.loss.backward()
        results.append((out, leaf.grad))
    (kl, kl_grad), (ce, ce_grad) = results
    assert float(kl.kl) == pytest.approx(float(ce.ce), rel=1e-5)
    assert float(kl.loss.detach()) == pytest.approx(float(ce.loss.detach()), rel=1e-5)
    torch.testing.assert_close(kl_grad, ce_grad, rtol=1e-5, atol=1e-6)


def test_tv_is_in_zero_one_and_zero_for_equal_distributions():
    head = random_head()
    hidden, labels, weights, _, _ = random_rows(seed=5)
    terms = LossTerms(0.0, 1.0, 1.0, 1.0, 1.0, None)
    # the teacher's state is the draft's own row, and no transform: p == q
    same = distill_loss(hidden, head, labels, weights, hidden, torch.arange(len(hidden)), terms, 4, top_k=4)
    torch.testing.assert_close(same.tv_rows, torch.zeros(len(hidden)), rtol=0, atol=1e-6)
    assert abs(float(same.kl)) < 1e-5
    far = distill_loss(hidden * 30, head, labels, weights, -hidden * 30, torch.arange(9), terms, 4, top_k=4)
    assert bool(((far.tv_rows >= 0) & (far.tv_rows <= 1)).all()) and float(far.tv_rows.max()) > 0.9


def slow_objective(draft, head, batch, cfg, anchors, valid):
    """Each block alone; slot k of the block at anchor a against the teacher at a + k - 1."""
    ids, mask, last = batch["input_ids"], batch["loss_mask"], batch["target_last_hidden"]
    terms = cfg.loss_terms
    loss, weight, accept = torch.zeros((), dtype=torch.float64), 0.0, []
    for b, a, out in block_outputs(draft, head, batch, cfg, anchors, valid):
        run, prod = 1.0, 1.0
        for k in range(1, cfg.block_size):
            if a + k >= SEQ or not mask[b, a + k]:
                prod = 0.0  # acceptance stops at the first unsupervised slot
                continue
            w = cfg.position_decay ** (k - 1)
            row = slow_terms(out[k][None], head, ids[b, a + k][None], [w], last[b], [a + k - 1], terms)
            loss, weight = loss + row["loss"], weight + w
            prod *= 1 - float(row["rows"][0]["tv"].detach())
            run += prod
        accept.append(run)
    return loss, weight, sum(accept) / len(accept)


def test_objective_with_kl_and_tv_matches_a_per_block_loop():
    draft = random_draft(seed=4, output_multiplier=0.8, final_logit_softcapping=5.0)
    head, batch = random_head(), make_batch(1)
    batch["target_last_hidden"] = random_features(SEQ, batch=2, seed=7, num_layers=1)
    settings = dict(kl_weight=0.7, tv_weight=0.5, ce_weight=0.2, position_weighting="exponential")
    cfg = ObjectiveConfig.for_draft(
        draft, num_anchors=4, logits_chunk_rows=5, selector_loss_alpha=0.0, **settings
    )
    anchors, valid = sample_anchors(batch["loss_mask"], 4, torch.Generator().manual_seed(0))
    out = compute_objective(draft, head, batch, cfg, torch.Generator().manual_seed(0))
    out.loss_sum.backward()
    got = grads(draft)
    draft.zero_grad()
    loss, weight, accept = slow_objective(draft, head, batch, cfg, anchors, valid)
    loss.backward()
    assert float(out.loss_sum.detach()) == pytest.approx(float(loss.detach()), rel=1e-5)
    assert float(out.weight_sum) == pytest.approx(weight, rel=1e-6)
    logged = summarize_metrics(out.metrics, cfg.selector_loss_alpha)
    assert logged["insample_accept_len_sampled"] == pytest.approx(accept, rel=1e-5)
    recombined = 0.2 * logged["ce_loss"] + 0.7 * logged["kl_loss"] + 0.5 * logged["tv_loss"]
    assert logged["loss"] == pytest.approx(recombined, rel=1e-6)
    for name, want in grads(draft).items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=2e-5 * float(want.abs().max()), msg=name)


def target_greedy(batch, head) -> torch.Tensor:
    """[b, S]: at position j the target's argmax after position j - 1 (float64; position 0: -1)."""
    logits = batch["target_last_hidden"].double() @ head.lm_head_weight.double().T
    greedy = torch.full_like(batch["input_ids"], -1)
    greedy[:, 1:] = logits[:, :-1].argmax(-1)
    return greedy


@pytest.mark.parametrize("architecture", ["DFlashDraftModel", "DFlash2DraftModel"])
def test_target_labels_are_the_targets_greedy_tokens(architecture):
    # objective.labels=target: the cross-entropy, the selector's gold candidate and the accuracy read the
    # target's argmax at each position instead of the data's token; the predecessors stay the data's
    v2 = architecture == "DFlash2DraftModel"
    transforms = dict(output_multiplier=1.3, final_logit_softcapping=8.0) if v2 else {}
    draft, head, batch = random_draft(architecture, seed=3, **transforms), random_head(), make_batch()
    batch["target_last_hidden"] = random_features(SEQ, batch=2, seed=7, num_layers=1)
    cfg = ObjectiveConfig.for_draft(
        draft, num_anchors=5, selector_loss_alpha=0.7, logits_chunk_rows=3, labels="target"
    )
    assert cfg.needs_teacher and cfg.kl_weight == 0  # the labels alone need the target's last hidden state
    out = compute_objective(draft, head, batch, cfg, torch.Generator().manual_seed(5))
    out.loss_sum.backward()
    got = grads(draft)
    draft.zero_grad()
    anchors, valid = sample_anchors(batch["loss_mask"], 5, torch.Generator().manual_seed(5))
    greedy = target_greedy(batch, head)
    supervised = batch["loss_mask"].bool()
    assert not torch.equal(greedy[supervised], batch["input_ids"][supervised])  # they differ: a real test
    ref = slow_reference(draft, head, batch, cfg, anchors, valid, labels=greedy)
    ref["loss"].backward()
    torch.testing.assert_close(out.loss_sum.double(), ref["loss"], rtol=1e-5, atol=1e-5)
    check_logged_losses(summarize_metrics(out.metrics, cfg.selector_loss_alpha), ref, cfg)
    for name, want in grads(draft).items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=2e-5 * float(want.abs().max()), msg=name)
    # the accuracy counts the draft's argmax against the target's greedy token
    correct = [
        int(head.logits(out_k[None])[0].argmax() == greedy[b, a + k])
        for b, a, block in block_outputs(draft, head, batch, cfg, anchors, valid)
        for k, out_k in enumerate(block)
        if 0 < k and a + k < SEQ and batch["loss_mask"][b, a + k]
    ]
    assert float(out.metrics["slot_correct"].sum()) == sum(correct)
    data_labels = compute_objective(
        draft,
        head,
        batch,
        ObjectiveConfig.for_draft(draft, num_anchors=5, selector_loss_alpha=0.7),
        torch.Generator().manual_seed(5),
    )
    assert float(data_labels.loss_sum.detach()) != pytest.approx(float(out.loss_sum.detach()), rel=1e-3)


def test_a_run_with_the_targets_labels_alone_captures_its_last_hidden_state(tiny_default, tmp_path):
    # objective.labels=target with the cross-entropy alone (no KL / TV): online capture still hooks the
    # target's final norm, whose output the labels come from, and the run learns them
    _, steps = short_tiny_run(tiny_default, tmp_path / "target", "objective.labels=target")
    assert all(math.isfinite(m["loss"]) for m in steps) and "kl_loss" not in steps[0]
    assert sum(m["loss"] for m in steps[-2:]) < sum(m["loss"] for m in steps[:2])
    _, data = short_tiny_run(tiny_default, tmp_path / "data", steps=1)  # the same first step, data labels
    assert steps[0]["ce_loss"] != pytest.approx(data[0]["ce_loss"], rel=1e-4)  # other labels were read


def test_the_default_objective_never_reads_a_teacher_and_logs_ce_loss():
    draft, head, batch = random_draft(seed=4), random_head(), make_batch(1)
    cfg = ObjectiveConfig.for_draft(draft, num_anchors=4)
    logged = summarize_metrics(compute_objective(draft, head, batch, cfg, torch.Generator()).metrics, 1.0)
    assert logged["ce_loss"] == logged["base_loss"]
    assert "kl_loss" not in logged and "insample_accept_len_sampled" not in logged


def test_position_weightings_follow_their_formulas():
    k = torch.arange(1, 8, dtype=torch.float64)
    gamma = slot_weights(ObjectiveSection(loss_gamma=3.0), 8)
    torch.testing.assert_close(gamma.double(), torch.exp(-(k - 1) / 3.0), rtol=1e-6, atol=0)
    assert torch.equal(slot_weights(ObjectiveSection(), 8), torch.ones(7))  # today's default: uniform
    exponential = slot_weights(ObjectiveSection(position_weighting="exponential", position_decay=0.6), 8)
    assert exponential.tolist() == pytest.approx([0.6**i for i in range(7)], rel=1e-6)
    assert torch.equal(slot_weights(ObjectiveSection(position_weighting="uniform"), 8), torch.ones(7))
    assert math.isclose(ObjectiveSection().position_decay, 0.8)


def test_conflicting_or_empty_loss_settings_name_the_fix():
    with pytest.raises(ValueError, match="loss_gamma=null or position_weighting=gamma"):
        ObjectiveSection(loss_gamma=2.0, position_weighting="uniform")
    with pytest.raises(ValueError, match="set at least one > 0"):
        ObjectiveSection(ce_weight=0.0)
    with pytest.raises(ValueError, match="set at least one > 0"):  # labels alone are no loss
        ObjectiveSection(ce_weight=0.0, labels="target")


# ---- real runs: both backends in 2 processes, and the disaggregated wire -------------------------

DISTILL_RUN = ["objective.kl_weight=0.5", "objective.tv_weight=0.5", "objective.ce_weight=0.1"]


@pytest.fixture(scope="module")
def run_overrides(tiny_default, tmp_path_factory) -> list[str]:
    data = tiny_subset(tiny_default, tmp_path_factory.mktemp("data"), 32)
    return [
        f"model.target={tiny_default.target_dir}",
        f"data.train={data}",
        "data.max_length=96",
        "objective.num_anchors=8",
        "train.micro_batch_size=2",
        "train.max_steps=8",
        "train.warmup_steps=0",
        "train.lr=3e-3",
        "train.log_every=1",
        "train.progress_bar=false",
        "train.export=false",
        *DISTILL_RUN,
    ]


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp"])
def test_two_processes_train_kl_and_tv_with_finite_falling_loss(run_overrides, backend, tmp_path):
    check_ok(launch_train(2, [*run_overrides, f"backend={backend}", f"output_dir={tmp_path}"]))
    steps = metrics(tmp_path)
    assert [m["step"] for m in steps] == list(range(1, 9))
    for m in steps:
        assert all(math.isfinite(m[name]) for name in ("loss", "ce_loss", "kl_loss", "tv_loss"))
        assert 0 <= m["tv_loss"] <= 1 and 1 <= m["insample_accept_len_sampled"] <= 8
        recombined = 0.1 * m["ce_loss"] + 0.5 * m["kl_loss"] + 0.5 * m["tv_loss"]
        assert m["base_loss"] == pytest.approx(recombined, rel=1e-5)
    first, last = steps[:2], steps[-2:]
    # (different batches each step: TV, near 1 for a random draft, moves too little in 8 steps to rank)
    for name in ("loss", "kl_loss"):
        assert sum(m[name] for m in last) < sum(m[name] for m in first), name
