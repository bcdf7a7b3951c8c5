"""objective.loss_vocab_size: the loss over the most frequent training tokens only, against float64 loops."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer

from dflash2.data.prepare import prepare_dataset
from dflash2.objective import ObjectiveConfig, compute_objective, plan_blocks, summarize_metrics
from dflash2.target.head import loss_vocabulary
from tests.draft_helpers import VOCAB, random_draft, random_features, random_head
from tests.run_helpers import short_tiny_run
from tests.test_objective import block_outputs, grads, make_batch

SEQ = 18


def test_the_vocabulary_is_the_most_frequent_labels_ties_to_the_lower_id():
    labels = [torch.tensor([5, 5, 9, 2, 2, 7]), torch.tensor([9, 5, 7, 3])]
    # counts: 5 x3, 2 x2, 7 x2, 9 x2, 3 x1 -> top 3: 5, then 2 and 7 (lower ids among the three 2s)
    assert loss_vocabulary(labels, 12, 3).tolist() == [2, 5, 7]
    assert loss_vocabulary(labels, 12, 100).tolist() == [2, 3, 5, 7, 9]  # only the tokens that occur


def vocab_head(ids):
    head = random_head()
    head.restrict_loss_vocab(torch.as_tensor(ids))
    return head


def test_slots_whose_label_is_outside_the_vocabulary_are_not_supervised():
    draft, batch = random_draft(seed=4), make_batch(1)
    ids = list(range(0, VOCAB, 2))  # the even tokens
    cfg = ObjectiveConfig.for_draft(draft, num_anchors=4, loss_vocab_size=len(ids))
    plain = plan_blocks(batch["input_ids"], batch["loss_mask"], cfg, torch.Generator().manual_seed(0))
    restricted = plan_blocks(
        batch["input_ids"],
        batch["loss_mask"],
        cfg,
        torch.Generator().manual_seed(0),
        vocab_head(ids).loss_vocab,
    )
    assert torch.equal(restricted.weights, plain.weights * (plain.labels % 2 == 0))
    assert bool((plain.weights * (plain.labels % 2 == 1)).sum() > 0)  # some slots were dropped


def slow_vocab_objective(draft, head, ids, batch, cfg, anchors, valid):
    """Each block alone, each supervised slot's CE and KL over the vocabulary's rows only: the draft's
    softmax and the teacher's over them, the label's index among them (the data's token, or with
    objective.labels=target the teacher's argmax over those rows). Also, per slot, whether the label
    is the draft's argmax, whether it is in its top-k and whether it is not the data's token."""
    sub = head.lm_head_weight[ids].double()
    local = {int(t): i for i, t in enumerate(ids)}
    tokens, mask, last = batch["input_ids"], batch["loss_mask"], batch["target_last_hidden"]
    loss, weight, picks = torch.zeros((), dtype=torch.float64), 0.0, []
    for b, a, out in block_outputs(draft, head, batch, cfg, anchors, valid):
        for k in range(1, cfg.block_size):
            if a + k >= SEQ or not mask[b, a + k] or int(tokens[b, a + k]) not in local:
                continue
            label, w = int(tokens[b, a + k]), math.exp(-(k - 1) / cfg.loss_gamma)
            log_q = torch.log_softmax(out[k].double() @ sub.T, 0)
            log_p = torch.log_softmax(last[b, a + k - 1].double() @ sub.T, 0)
            if cfg.labels == "target":
                label = int(ids[log_p.argmax()])
            kl = (log_p.exp() * (log_p - log_q)).sum()
            loss = loss + w * (cfg.ce_weight * -log_q[local[label]] + cfg.kl_weight * kl)
            weight += w
            top = ids[log_q.topk(cfg.top_k).indices]  # as ids of the whole vocabulary
            picks.append((k, int(top[0]) == label, label in top.tolist(), label != int(tokens[b, a + k])))
    return loss, weight, picks


@pytest.mark.parametrize("labels", ["data", "target"])
def test_the_objective_over_a_vocabulary_matches_a_per_block_loop(labels):
    draft, batch = random_draft(seed=4), make_batch(1)
    batch["target_last_hidden"] = random_features(SEQ, batch=2, seed=7, num_layers=1)
    ids = torch.randperm(200, generator=torch.Generator().manual_seed(3))[:150].sort().values  # labels < 200
    head = vocab_head(ids)
    settings = dict(ce_weight=0.4, kl_weight=1.0, loss_gamma=3.0, selector_loss_alpha=0.0, labels=labels)
    cfg = ObjectiveConfig.for_draft(
        draft, num_anchors=4, logits_chunk_rows=5, loss_vocab_size=150, **settings
    )
    blocks = plan_blocks(
        batch["input_ids"], batch["loss_mask"], cfg, torch.Generator().manual_seed(0), head.loss_vocab
    )
    out = compute_objective(draft, head, batch, cfg, blocks=blocks)
    out.loss_sum.backward()
    got = grads(draft)
    draft.zero_grad()
    loss, weight, picks = slow_vocab_objective(draft, head, ids, batch, cfg, blocks.anchors, blocks.valid)
    loss.backward()
    assert len(picks) > 10 and float(out.weight_sum) == pytest.approx(weight, rel=1e-6)
    assert float(out.loss_sum.detach()) == pytest.approx(float(loss.detach()), rel=1e-5)
    for name, want in grads(draft).items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=2e-5 * float(want.abs().max()), msg=name)
    # the logged accuracy and coverage are of the top-k over the vocabulary, as ids of the whole one
    for metric, column in (("slot_correct", 1), ("slot_topk_hit", 2)):
        per_slot = [sum(p[column] for p in picks if p[0] == slot) for slot in range(1, cfg.block_size)]
        assert out.metrics[metric].tolist() == per_slot, metric
    assert sum(p[2 if labels == "data" else 3] for p in picks) > 0  # some hits; some labels not the data's
    assert summarize_metrics(out.metrics, 0.0)["loss"] == pytest.approx(
        float(loss.detach()) / weight, rel=1e-5
    )


def test_a_vocabulary_smaller_than_the_top_k_names_the_fix():
    draft = random_draft(seed=4)  # DFlash 2: the selector's top-k
    top_k = draft.spec.selector.top_k
    with pytest.raises(ValueError, match=f"set loss_vocab_size >= {top_k}"):
        ObjectiveConfig.for_draft(draft, loss_vocab_size=top_k - 1)


def test_a_run_with_a_loss_vocabulary_trains_and_reports_its_coverage(tiny_default, tmp_path):
    result, steps = short_tiny_run(
        tiny_default, tmp_path, "objective.loss_vocab_size=48", "objective.kl_weight=1.0"
    )
    assert "[dflash2] loss vocabulary: the 48 most frequent of" in result.stdout
    assert all(math.isfinite(m["loss"]) for m in steps)
    assert sum(m["loss"] for m in steps[-2:]) < sum(m["loss"] for m in steps[:2])


def test_supervising_every_token_counts_the_prompts_in_the_loss_vocabulary(tiny_default, tmp_path):
    overrides = ("objective.loss_vocab_size=48", "objective.kl_weight=1.0", "objective.ce_weight=0")
    replies, _ = short_tiny_run(tiny_default, tmp_path / "replies", *overrides, steps=2)
    every, steps = short_tiny_run(
        tiny_default, tmp_path / "all", *overrides, "objective.supervised_tokens=all", steps=2
    )

    def supervised(result) -> int:  # "... 48 most frequent of V tokens, P% of the N supervised tokens"
        line = next(line for line in result.stdout.splitlines() if "loss vocabulary" in line)
        return int(line.split(" of the ")[1].split()[0])

    data = tmp_path / "replies" / "train.jsonl"  # the lines both runs trained on
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_default.target_dir))
    dataset, _ = prepare_dataset(data, tokenizer, max_length=96, quiet=True)
    assert supervised(every) == sum(map(len, dataset["input_ids"]))  # every token, prompts included
    assert supervised(replies) == sum(map(sum, dataset["loss_mask"])) < supervised(every)
    assert all(math.isfinite(m["loss"]) for m in steps)
