"""The DFlash / DFlash 2 training objective: anchors, blocks, chunked unary CE, selector loss, metrics.

`compute_objective` returns a weighted loss *sum* and the weight sum; the loop divides by the
global weight sum over all ranks and accumulation steps (a token-weighted mean per optimizer step).
See training.md sections 3-5 for the definitions mirrored here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import ConfigDict, model_validator
from torch import nn
from torch.nn import functional as F

from dflash2.config import ObjectiveSection
from dflash2.models.draft import transform_logits
from dflash2.models.spec import DraftSpec
from dflash2.target.head import LossVocab, TargetHead
from dflash2.timing import region


class ObjectiveConfig(ObjectiveSection):
    """Everything the objective needs, built once per run: the run config's `objective` section
    (anchors, gamma, alpha, selector mode, chunk rows; validated there) plus what the draft fixes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_size: int
    mask_token_id: int
    output_multiplier: float  # unary logit transforms (contract section 2.2)
    softcap: float | None
    top_k: int  # candidates per slot: the selector's top-k (DFlash 2), else coverage_top_k

    @model_validator(mode="after")
    def _check_loss_vocab(self) -> ObjectiveConfig:
        if self.loss_vocab_size is not None and self.loss_vocab_size < self.top_k:
            raise ValueError(
                f"objective.loss_vocab_size={self.loss_vocab_size} is below the objective's top-k "
                f"({self.top_k}: the selector's top_k, else coverage_top_k); set loss_vocab_size >= {self.top_k}"
            )
        return self

    @model_validator(mode="after")
    def _check_slot_weights(self) -> ObjectiveConfig:
        # a slot whose weight rounds to 0 would drop out of the metrics as if it were not supervised
        # (a run flushes subnormals to zero): the weighting must leave every slot a normal fp32 weight
        last = float(slot_weights(self, self.block_size)[-1]) if self.block_size > 1 else 1.0
        if last < torch.finfo(torch.float32).tiny:
            key = "loss_gamma" if self.position_weighting == "gamma" else "position_decay"
            raise ValueError(
                f"objective.{key}={getattr(self, key)}: slot {self.block_size - 1} of a block of {self.block_size} "
                f"would weigh {last:.3g}, below the smallest normal fp32 ({torch.finfo(torch.float32).tiny:.3g}); "
                f"raise objective.{key}"
            )
        return self

    @property
    def loss_terms(self) -> LossTerms:
        return LossTerms(
            self.ce_weight,
            self.kl_weight,
            self.tv_weight,
            self.distill_temperature,
            self.output_multiplier,
            self.softcap,
            self.labels == "target",
        )

    @classmethod
    def for_spec(cls, spec: DraftSpec, **settings: Any) -> ObjectiveConfig:
        """Block size, mask id, logit transforms (the identity when the spec has none) and top-k (the
        selector's, else coverage_top_k) from a draft's spec. `settings`: keys of the objective section
        (defaults otherwise), and optionally overrides of what the spec gives."""
        keys = ObjectiveSection.model_fields
        section = ObjectiveSection(**{k: v for k, v in settings.items() if k in keys})
        transform = spec.logit_transform
        from_spec = {
            "block_size": spec.block_size,
            "mask_token_id": spec.mask_token_id,
            "output_multiplier": transform.multiplier if transform else 1.0,
            "softcap": transform.softcap if transform else None,
            "top_k": spec.selector.top_k if spec.selector else section.coverage_top_k,
        }
        overrides = {k: v for k, v in settings.items() if k not in keys}
        return cls(**section.model_dump(), **{**from_spec, **overrides})

    @classmethod
    def for_draft(cls, draft: nn.Module, **settings: Any) -> ObjectiveConfig:
        """`for_spec` of an (unwrapped) draft model's spec."""
        return cls.for_spec(draft.spec, **settings)

    def summarize(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """The logged scalars of a step's (globally reduced) metric sums (`summarize_metrics`)."""
        return summarize_metrics(sums, self.selector_loss_alpha)


@dataclass
class ObjectiveOutput:
    loss_sum: torch.Tensor  # scalar, differentiable: sum(w * CE) + alpha * sum(w_sel * CE_sel)
    weight_sum: torch.Tensor  # scalar: sum(w)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # sums and counts, all-reducible


# ------------------------------------------------------------------ anchors and blocks


def supervised_mask(batch: dict[str, torch.Tensor], cfg: ObjectiveSection) -> torch.Tensor:
    """[b, S] the tokens the loss supervises (objective.supervised_tokens): the batch's loss_mask (the
    replies), or with "all" every real token (its attention_mask: the prompts too, not the padding)."""
    return batch["attention_mask"] if cfg.supervised_tokens == "all" else batch["loss_mask"]


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """[b, S] -> bool [b, S]: a is a candidate iff loss_mask[a] = loss_mask[a + 1] = 1."""
    cand = torch.zeros_like(loss_mask, dtype=torch.bool)
    cand[:, :-1] = (loss_mask[:, :-1] > 0) & (loss_mask[:, 1:] > 0)
    return cand


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` anchors per sequence, uniformly without replacement, sorted.

    `generator` may be one generator per row, so that a sample's anchors do not depend on which
    rank or micro-batch it lands in. Returns (anchor_positions [b, N] long, valid [b, N] bool);
    padding blocks have valid = False and position 0.
    """
    cand = anchor_candidates(loss_mask)
    num = min(num_anchors, loss_mask.shape[1])
    if isinstance(generator, list):
        noise = torch.stack([torch.rand(cand.shape[1], generator=g) for g in generator])
    else:
        noise = torch.rand(cand.shape, generator=generator)
    noise = noise.to(cand.device)
    keys = torch.where(cand, noise, torch.full_like(noise, -1.0))
    top, idx = torch.topk(keys, num, dim=1)
    valid = top >= 0
    positions = torch.where(valid, idx, torch.zeros_like(idx))
    order = torch.argsort(torch.where(valid, positions, positions.new_full((), loss_mask.shape[1])), dim=1)
    return positions.gather(1, order), valid.gather(1, order)


def slot_weights(cfg: ObjectiveSection, block_size: int) -> torch.Tensor:
    """[B-1] weight of slots k = 1..B-1 under `cfg.position_weighting` (docs/training.md):
    gamma: exp(-(k - 1) / loss_gamma), or 1 when loss_gamma is unset; exponential:
    position_decay ** (k - 1); uniform: 1."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    if cfg.position_weighting == "gamma" and cfg.loss_gamma is not None:
        return torch.exp(-(k - 1) / cfg.loss_gamma)
    if cfg.position_weighting == "exponential":
        return torch.tensor(cfg.position_decay, dtype=torch.float64).pow(k.double() - 1).float()
    return torch.ones_like(k)


def block_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    gamma: float | None,
    decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Labels, predecessors and weights of slots 1..B-1 of every block.

    Slot k of the block at anchor a predicts input_ids[a + k] with weight
    valid * in_bounds * loss_mask[a + k] * decay[k - 1], where `decay` ([B-1], from slot_weights)
    defaults to exp(-(k - 1) / gamma) (1 when gamma is None); its teacher-forced predecessor is
    input_ids[a + k - 1] (the anchor for slot 1). Returns three [b, N, B-1] tensors.
    """
    seq_len = input_ids.shape[1]
    k = torch.arange(1, block_size, device=anchors.device)
    pos = anchors[..., None] + k  # [b, N, B-1]
    in_bounds = pos < seq_len
    pos_c = pos.clamp(max=seq_len - 1)
    flat = lambda t, p: t.gather(1, p.flatten(1)).view_as(p)  # noqa: E731
    labels = flat(input_ids, pos_c)
    predecessors = flat(input_ids, (pos - 1).clamp(max=seq_len - 1))
    if decay is None:
        decay = torch.ones_like(k, dtype=torch.float32) if gamma is None else torch.exp(-(k - 1) / gamma)
    decay = decay.to(anchors.device)
    weights = valid[..., None] * in_bounds * flat(loss_mask, pos_c).float() * decay
    return labels, predecessors, weights


# ------------------------------------------------------------------ chunked unary cross-entropy


class _ChunkedUnaryCE(torch.autograd.Function):
    """sum_r w_r * CE(transform(h_r @ W^T + b), y_r) without materialising [R, V] logits.

    Logits live one chunk at a time. The gradient w.r.t. the hidden rows is computed in the forward
    pass of each chunk (the LM head is frozen, so that is the only gradient needed), which costs the
    same matmuls as the naive path and never recomputes logits. Also returns each row's top-k ids.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, row_weights, multiplier, cap, chunk_rows, top_k):
        need_grad = hidden.requires_grad
        grad = torch.zeros_like(hidden) if need_grad else None
        loss = hidden.new_zeros((), dtype=torch.float32)
        topk_ids = []
        for start in range(0, hidden.shape[0], chunk_rows):
            sl = slice(start, start + chunk_rows)
            chunk_loss, ids = _chunk_ce(
                hidden[sl],
                weight,
                bias,
                labels[sl],
                row_weights[sl],
                multiplier,
                cap,
                top_k,
                grad[sl] if need_grad else None,
            )
            loss += chunk_loss
            topk_ids.append(ids)
        ids = torch.cat(topk_ids) if topk_ids else labels.new_zeros((0, top_k))
        ctx.mark_non_differentiable(ids)
        ctx.save_for_backward(grad)
        return loss, ids

    @staticmethod
    def backward(ctx, grad_loss, _grad_ids):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None, None, None, None, None, None, None


def _chunk_ce(hidden, weight, bias, labels, row_weights, multiplier, cap, top_k, grad_out):
    """One chunk of _ChunkedUnaryCE, in its own frame so its buffers die before the next chunk.

    Works in place on one [rows, V] fp32 buffer (two with a softcap), which the logits, then
    exp(u - max), then the gradient occupy in turn: no other [rows, V] buffer is allocated, and every
    pass over it other than the two head matmuls is a single elementwise or reduction pass. Writes
    d loss / d hidden into `grad_out` when given.
    """
    u, du_dz = _transformed_logits(hidden, weight, bias, multiplier, cap, grad_out is not None)
    # The gold logit and the top-k read the logits, so they come before the in-place ops below turn
    # the buffer into exp(u - max) and then the gradient.
    gold = u.gather(1, labels[:, None])[:, 0]
    values, ids = ranked_top_k(u, top_k)
    row_max = values[:, 0]  # the top-1 value is the row's max: no extra pass
    exp_u = u.sub_(row_max[:, None]).exp_()  # exp(u - max) in the logits buffer
    total = exp_u.sum(dim=-1)
    lse = row_max + total.log()  # logsumexp, as torch.logsumexp computes it
    loss = (row_weights * (lse - gold)).sum()
    if grad_out is not None:
        # CE = logsumexp(u) - u[y], so d CE / d u = softmax(u) - one_hot(y); scaled by the row's
        # weight: w exp(u - max) / total, then w subtracted at the gold column.
        d = exp_u.mul_((row_weights / total)[:, None])
        d.scatter_add_(1, labels[:, None], -row_weights[:, None])
        _grad_to_hidden(d, du_dz, multiplier, weight, grad_out)
    return loss, ids


def _transformed_logits(hidden, weight, bias, multiplier, cap, need_grad, out=None):
    """u = transform(h W^T + b) in one fp32 [rows, V] buffer (`out` when given), and d u / d z when a
    softcap needs it (else None). The transform is models.draft.transform_logits (multiply, then
    softcap), in place."""
    u = _head_logits(hidden, weight, bias, out)
    if multiplier != 1.0:
        u.mul_(multiplier)
    du_dz = None
    if cap is not None:
        u.div_(cap).tanh_()  # t = tanh(m z / cap)
        if need_grad:
            # d u / d z for u = cap * tanh(m z / cap): read from t now, before u is scaled back to logits
            du_dz = (u * u).neg_().add_(1).mul_(multiplier)  # m (1 - t^2)
        u.mul_(cap)
    return u, du_dz


def _head_logits(hidden, weight, bias, out=None) -> torch.Tensor:
    """z = h W^T + b in the head's dtype, then fp32 (logsumexp over V and the softmax need it); into
    `out` [rows, V] fp32 when given, which spares a fresh allocation (and its page faults) per chunk."""
    with region("head_matmul"):  # the objective's floor: timed when the loop breaks a step down
        if out is None:
            return F.linear(hidden, weight, bias).float()
        if weight.dtype != torch.float32:
            return out.copy_(F.linear(hidden, weight, bias))
        if bias is None:
            return torch.mm(hidden, weight.t(), out=out)
        return torch.addmm(bias, hidden, weight.t(), out=out)


def _grad_to_hidden(d, du_dz, multiplier, weight, grad_out) -> None:
    """grad_out = (d loss / d u, `d` [rows, V], overwritten) chained to z, then @ W: d loss / d h."""
    # Chain rule to z. With a cap, du_dz = m (1 - t^2) already holds the multiplier; without one,
    # u = m z and d u / d z is the multiplier alone (1: nothing to do).
    if du_dz is not None:
        d.mul_(du_dz)
    elif multiplier != 1.0:
        d.mul_(multiplier)
    # d loss / d h = (d loss / d z) @ W. d is cast to the head's dtype so that the matmul runs in it
    # (as the forward did) instead of promoting the whole [V, H] head to an fp32 copy.
    d = d.to(weight.dtype)
    with region("head_matmul"):
        grad_out.copy_(d @ weight)


def ranked_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk over the last dim with tied values ranked by token id, lowest first, as argmax
    ranks them (a v1 draft's greedy proposal): bf16 logits tie often, and topk's order among ties is
    unspecified. (values [..., k], ids [..., k])."""
    top = torch.topk(logits, k, dim=-1)
    ids, by_id = top.indices.sort(dim=-1)
    values, order = top.values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, order)


def unary_ce(hidden, head: TargetHead, labels, row_weights, multiplier, cap, chunk_rows, top_k):
    """Chunked weighted CE on transformed logits. hidden [R, H] -> (loss_sum, top-k ids [R, k])."""
    return _ChunkedUnaryCE.apply(
        hidden,
        head.lm_head_weight,
        head.lm_head_bias,
        labels,
        row_weights,
        multiplier,
        cap,
        chunk_rows,
        top_k,
    )


def unary_ce_naive(hidden, head: TargetHead, labels, row_weights, multiplier, cap, top_k):
    """Reference path: full [R, V] logits through autograd (benchmarks and tests only)."""
    u = transform_logits(head.logits(hidden).float(), multiplier, cap)
    loss = (row_weights * F.cross_entropy(u, labels, reduction="none")).sum()
    return loss, ranked_top_k(u.detach(), top_k)[1]


# ------------------------------------------------------------------ chunked distillation terms


@dataclass(frozen=True)
class LossTerms:
    """Weights of the block loss's terms, the teacher's temperature and the draft's logit transforms."""

    ce_weight: float
    kl_weight: float
    tv_weight: float
    temperature: float
    multiplier: float
    cap: float | None
    target_labels: bool = False  # each row's label is the teacher's argmax, not the one passed in


@dataclass
class DistillSums:
    """What distill_loss returns: the differentiable weighted loss sum and detached pieces."""

    loss: torch.Tensor  # sum_r w_r (ce_weight CE_r + kl_weight KL_r + tv_weight TV_r)
    ce: torch.Tensor  # sum_r w_r CE_r
    kl: torch.Tensor  # sum_r w_r KL(p_r || q_r); 0 (not computed) when kl_weight is 0
    tv: torch.Tensor  # sum_r w_r TV(p_r, q_r)
    topk_ids: torch.Tensor  # [R, k] the draft's top-k (of its transformed logits)
    tv_rows: torch.Tensor  # [R] TV(p_r, q_r): 1 - the chance that lossless sampling accepts slot r
    labels: torch.Tensor  # [R] the CE's labels: those passed in, or the teacher's argmax (target_labels)


class _ChunkedDistill(torch.autograd.Function):
    """The block loss with KL / TV terms against the target's distribution, chunked like _ChunkedUnaryCE.

    Row r's teacher is p_r = softmax(head(s_i) / T) for the target's final-normed last hidden state
    s_i = teacher_states[teacher_index[r]]; its draft distribution is q_r = softmax(u_r), u_r the
    transformed logits of hidden[r]. A chunk of `rows` rows works in three [rows, V] fp32 buffers,
    allocated once for all chunks (reused, they cost no fresh pages per chunk): the draft's logits,
    the teacher's logits (one row per distinct teacher position of the chunk) then its probabilities
    per row, and a work buffer (a softcap adds one for d u / d z). The gradient w.r.t. hidden is
    computed in the forward; the teacher side is frozen.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, labels, row_weights, teacher_states, teacher_index, terms, rows, top_k
    ):
        need_grad = hidden.requires_grad
        grad = torch.zeros_like(hidden) if need_grad else None
        sums = hidden.new_zeros(4, dtype=torch.float32)  # loss, ce, kl, tv
        topk_ids, tv_rows, label_rows = [], [], []
        buffers = hidden.new_empty((3, min(rows, hidden.shape[0]), weight.shape[0]), dtype=torch.float32)
        for start in range(0, hidden.shape[0], rows):
            sl = slice(start, start + rows)
            positions, inverse = torch.unique(teacher_index[sl], return_inverse=True)
            chunk_sums, ids, tv, chunk_labels = _chunk_distill(
                hidden[sl],
                weight,
                bias,
                labels[sl],
                row_weights[sl],
                (teacher_states[positions], inverse),
                terms,
                top_k,
                buffers[:, : len(inverse)],
                grad[sl] if need_grad else None,
            )
            sums += chunk_sums
            topk_ids.append(ids)
            tv_rows.append(tv)
            label_rows.append(chunk_labels)
        ids = torch.cat(topk_ids) if topk_ids else labels.new_zeros((0, top_k))
        tv = torch.cat(tv_rows) if tv_rows else row_weights.new_zeros(0)
        labels = torch.cat(label_rows) if label_rows else labels
        loss, parts = sums[0].clone(), sums[1:].clone()
        ctx.mark_non_differentiable(parts, ids, tv, labels)
        ctx.save_for_backward(grad)
        return loss, parts, ids, tv, labels

    @staticmethod
    def backward(ctx, grad_loss, _grad_parts, _grad_ids, _grad_tv, _grad_labels):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, *([None] * 9)


def _teacher_probs(teacher, weight, bias, temperature, neg_p_out, work, with_entropy, with_argmax):
    """-p = -softmax((s W^T + b) / T) of the chunk's distinct teacher states, gathered to its rows into
    `neg_p_out` [r, V] (negated: the caller adds q to it in one pass); returns (sum_j p_j log p_j per
    row [r] when `with_entropy`, else None; the argmax of p per row [r], the target's greedy token,
    when `with_argmax`, else None). `teacher` = (states [u, H], inverse [r]: each row's index among
    them); `work` [r, V] is scratch (u <= r)."""
    states, inverse = teacher
    t = _head_logits(states, weight, bias, out=neg_p_out[: len(states)])  # dead before neg_p_out is written
    greedy = t.argmax(dim=-1)[inverse] if with_argmax else None
    if temperature != 1.0:
        t.div_(temperature)
    t.sub_(t.amax(dim=-1, keepdim=True))  # t - max: log p + log total
    e = torch.exp(t, out=work[: len(states)])
    total = e.sum(dim=-1)
    neg_entropy = None
    if with_entropy:  # sum p log p = sum p (t - max) - log total
        neg_entropy = (t.mul_(e).sum(dim=-1) / total - total.log())[inverse]
    del t
    torch.index_select(e.div_(total.neg()[:, None]), 0, inverse, out=neg_p_out)
    return neg_entropy, greedy


def _chunk_distill(
    hidden, weight, bias, labels, row_weights, teacher, terms: LossTerms, top_k, buffers, grad_out
):
    """One chunk of _ChunkedDistill: (sums [4] = loss, ce, kl, tv; top-k ids; TV per row; labels).

    KL(p || q) = sum p log p - sum p u + logsumexp(u); d/du: q - p. TV = 0.5 sum |p - q|;
    d/du_i = q_i (s_i - sum_j q_j s_j) with s = 0.5 sign(q - p). CE: d/du = q - one_hot(y).
    """
    ce_w, kl_w, tv_w = terms.ce_weight, terms.kl_weight, terms.tv_weight
    logits, neg_p, work = buffers
    u, du_dz = _transformed_logits(
        hidden, weight, bias, terms.multiplier, terms.cap, grad_out is not None, out=logits
    )
    values, ids = ranked_top_k(u, top_k)
    row_max = values[:, 0]
    neg_entropy, greedy = _teacher_probs(
        teacher, weight, bias, terms.temperature, neg_p, work, kl_w > 0, terms.target_labels
    )
    labels = labels if greedy is None else greedy
    gold = u.gather(1, labels[:, None])[:, 0]
    if kl_w:  # KL's value costs two passes over [r, V]: only when it is in the loss
        p_dot_u = -torch.mul(neg_p, u, out=work).sum(dim=-1)  # before u turns into exp(u - max)
    exp_u = u.sub_(row_max[:, None]).exp_()  # q = exp_u / total, never written out
    total = exp_u.sum(dim=-1)
    lse, inv_total = row_max + total.log(), total.reciprocal()
    diff = neg_p.addcmul_(exp_u, inv_total[:, None])  # q - p, in p's buffer
    ce, kl = lse - gold, (neg_entropy - p_dot_u + lse) if kl_w else torch.zeros_like(lse)
    tv = (0.5 * torch.linalg.vector_norm(diff, ord=1, dim=-1)).clamp_(max=1.0)  # rounding can pass 1
    w = row_weights
    parts = torch.stack([(w * ce).sum(), (w * kl).sum(), (w * tv).sum()])
    loss = ce_w * parts[0] + kl_w * parts[1] + tv_w * parts[2]
    if grad_out is not None:
        d = exp_u  # the gradient d loss / d u takes the logits' buffer
        if tv_w:
            # exp_u_j sign(q_j - p_j) (a tie takes either sign: both are subgradients of |.|)
            signed = torch.copysign(exp_u, diff, out=work)
            c = signed.sum(dim=-1) * inv_total  # sum_j q_j sign_j = 2 sum_j q_j s_j
            # w ce_w q + w tv_w q (0.5 sign - 0.5 c): CE's and TV's terms, both proportional to q
            d.mul_((w * (ce_w - 0.5 * tv_w * c) * inv_total)[:, None])
            d.addcmul_(signed, (0.5 * tv_w * w * inv_total)[:, None])
        else:
            d.mul_((w * ce_w * inv_total)[:, None])
        if kl_w:
            d.addcmul_(diff, (w * kl_w)[:, None])
        if ce_w:
            d.scatter_add_(1, labels[:, None], -(w * ce_w)[:, None])
        _grad_to_hidden(d, du_dz, terms.multiplier, weight, grad_out)
    return torch.cat([loss[None], parts]), ids, tv, labels


def distill_loss(
    hidden, head: TargetHead, labels, row_weights, teacher_states, teacher_index, terms, chunk_rows, top_k
):
    """hidden [R, H] draft rows, teacher_states [P, H] the target's final-normed last hidden states,
    teacher_index [R] each row's teacher position in them -> DistillSums. A chunk holds a third of
    `chunk_rows` rows: its three [rows, V] buffers take what one cross-entropy chunk does."""
    loss, parts, ids, tv, labels = _ChunkedDistill.apply(
        hidden,
        head.lm_head_weight,
        head.lm_head_bias,
        labels,
        row_weights,
        teacher_states.to(head.lm_head_weight.dtype),
        teacher_index,
        terms,
        max(1, chunk_rows // 3),
        top_k,
    )
    return DistillSums(loss, parts[0], parts[1], parts[2], ids, tv, labels)


# ------------------------------------------------------------------ selector loss


def selector_scores(
    selector: nn.Module,
    hidden: torch.Tensor,
    head: TargetHead,
    candidates: torch.Tensor,
    labels: torch.Tensor,
    predecessors: torch.Tensor,
    multiplier: float,
    cap: float | None,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced selector scores over each row's candidates.

    candidates [R, k] are the original unary top-k. With mode "insert" a gold token missing from
    them replaces the weakest (last) candidate, with its own transformed logit. Returns
    (scores [R, k], gold_index [R], gold_in_topk [R] bool).
    """
    in_topk = (candidates == labels[:, None]).any(-1)
    top_k = candidates.shape[1]
    gold_index = torch.where(in_topk, (candidates == labels[:, None]).int().argmax(-1), top_k - 1)
    if mode == "insert":
        candidates = candidates.clone()
        candidates[~in_topk, -1] = labels[~in_topk]
    # Unary scores of just the k candidates, differentiable w.r.t. the draft hidden states.
    z = torch.einsum("rh,rkh->rk", hidden, head.lm_head_weight[candidates].to(hidden.dtype))
    if head.lm_head_bias is not None:
        z = z + head.lm_head_bias[candidates]
    unary = transform_logits(z.float(), multiplier, cap)
    scores = selector(hidden, unary, candidates, predecessors[:, None])[:, 0]  # [R, k]
    return scores.float(), gold_index, in_topk


# ------------------------------------------------------------------ the objective


@dataclass
class Blocks:
    """Where the blocks of a micro-batch sit and what they must predict (all [b, N] or [b, N, B-1])."""

    anchors: torch.Tensor
    valid: torch.Tensor
    labels: torch.Tensor
    predecessors: torch.Tensor
    weights: torch.Tensor


def plan_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: ObjectiveConfig,
    generator: torch.Generator | list[torch.Generator] | None = None,
    loss_vocab: LossVocab | None = None,
) -> Blocks:
    """Sample anchors and derive labels and weights. Cheap (no model): the loop plans every
    micro-batch of an optimizer step first, to know the global weight sum before any backward.
    With a `loss_vocab` (the head's, objective.loss_vocab_size), a slot whose label lies outside it
    is not supervised (weight 0)."""
    anchors, valid = sample_anchors(loss_mask, cfg.num_anchors, generator)
    if not bool(valid.any()):
        raise ValueError(
            "batch has no valid anchor (no two consecutive supervised tokens in any sample); "
            "prepare the data with data_prep/prepare.py, which drops such samples"
        )
    decay = slot_weights(cfg, cfg.block_size)
    labels, predecessors, weights = block_targets(
        input_ids, loss_mask, anchors, valid, cfg.block_size, cfg.loss_gamma, decay
    )
    if loss_vocab is not None:
        weights = weights * loss_vocab.contains(labels)
    return Blocks(anchors, valid, labels, predecessors, weights)


def compute_objective(
    draft: nn.Module,
    head: TargetHead,
    batch: dict[str, torch.Tensor],
    cfg: ObjectiveConfig,
    generator: torch.Generator | None = None,
    *,
    blocks: Blocks | None = None,
    naive: bool = False,
    selector: nn.Module | None = None,
) -> ObjectiveOutput:
    """batch: input_ids [b, S], loss_mask and attention_mask [b, S], features [b, S, K*H] (target
    hidden states), and target_last_hidden [b, S, H] (the target's final-normed last hidden state)
    when the objective needs the teacher (`cfg.needs_teacher`: a KL or TV weight, or `labels:
    target`); `dflash2.capture.features.split_last_hidden` cuts a capture into the last two.

    `draft` is called like the draft (a sharding wrapper may stand for it); `selector`: its candidate
    selector (default: `draft.candidate_selector`, none for v1). Everything else the objective needs is
    in `cfg`. `blocks` (from plan_blocks) is sampled here with `generator` when not given.
    """
    if cfg.needs_teacher and "target_last_hidden" not in batch:
        raise ValueError(
            "this objective needs the teacher (a KL or TV weight, or labels: target): put the target's "
            "last hidden state in batch['target_last_hidden'] (dflash2.capture.features.split_last_hidden "
            "cuts it from a capture with last_hidden=True)"
        )
    input_ids = batch["input_ids"]
    if blocks is None:
        blocks = plan_blocks(input_ids, supervised_mask(batch, cfg), cfg, generator, head.loss_vocab)
    selector = selector if selector is not None else getattr(draft, "candidate_selector", None)
    block_ids = torch.full(
        (*blocks.anchors.shape, cfg.block_size), cfg.mask_token_id, device=input_ids.device
    )
    block_ids[..., 0] = input_ids.gather(1, blocks.anchors)
    embeds = head.embed(block_ids).to(batch["features"].dtype)
    hidden = draft(embeds, batch["features"], blocks.anchors)[:, :, 1:]  # [b, N, B-1, H] slots 1..B-1

    rows, slot = _slot_rows(blocks.weights, cfg.block_size)
    h, y, w = hidden[rows], blocks.labels[rows], blocks.weights[rows]
    # y: the data's next tokens, or (objective.labels=target) the target's greedy tokens from here on
    base_sum, topk_ids, y, metrics = _block_loss(h, y, w, rows, blocks, batch, head, cfg, naive)
    unary_correct = topk_ids[:, 0] == y
    metrics.update(_slot_metrics(slot, cfg.block_size, topk_ids, y, w))
    metrics["base_loss_sum"] = base_sum.detach()
    metrics["num_anchors"] = blocks.valid.sum().float()
    metrics["accept_len_sum"] = acceptance_length_sum(rows, unary_correct, blocks.valid)
    metrics["accept_len_max_sum"] = acceptance_length_sum(rows, torch.ones_like(unary_correct), blocks.valid)
    sel_sum = None
    if selector is not None:
        sel_sum, sel_metrics = _selector_term(selector, h, head, topk_ids, y, blocks, rows, slot, cfg)
        metrics.update(sel_metrics)
    loss_sum = total_loss(base_sum, sel_sum, cfg.selector_loss_alpha)
    return ObjectiveOutput(loss_sum=loss_sum, weight_sum=blocks.weights.sum(), metrics=metrics)


def _slot_rows(weights: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The supervised slots (only they reach the LM head): rows [b, N, B-1] bool, and the 0-based slot
    index k - 1 of each of the R rows."""
    rows = weights > 0
    slot = torch.arange(1, block_size, device=rows.device).expand_as(rows)[rows] - 1  # [R]
    return rows, slot


def _selector_term(
    selector, h, head: TargetHead, topk_ids, y, blocks: Blocks, rows, slot, cfg: ObjectiveConfig
):
    """The selector's weighted CE sum over the supervised rows (labels y [R]) and its metric sums. The
    predecessors are the data's tokens (teacher forcing), whatever the labels."""
    w, pred = blocks.weights[rows], blocks.predecessors[rows]
    if cfg.selector_grad == "selector":
        h = h.detach()  # the slot states and the unary logits made from them: constants of this term
    scores, gold_index, in_topk = selector_scores(
        selector, h, head, topk_ids, y, pred, cfg.output_multiplier, cfg.softcap, cfg.selector_mode
    )
    sel_w = w if cfg.selector_mode == "insert" else w * in_topk
    sel_sum = (sel_w * F.cross_entropy(scores, gold_index, reduction="none")).sum()
    # The greedy walk's pick under the teacher-forced predecessor, over the original top-k.
    correct = in_topk & (scores.argmax(-1) == gold_index)
    metrics = {
        "selector_loss_sum": sel_sum.detach(),
        "selector_weight_sum": sel_w.sum().detach(),
        "slot_selector_correct": _per_slot(slot, correct, cfg.block_size),
        "accept_len_selector_sum": acceptance_length_sum(rows, correct, blocks.valid),
    }
    return sel_sum, metrics


def total_loss(base, selector, alpha: float, weight_sum: float | None = None):
    """What is optimised: base + alpha * selector (no selector: base). Sums (tensors) for the step;
    with `weight_sum`, the mean the loop logs as `loss` (floats), computed as base / w + alpha *
    selector / w so that it keeps its bits."""
    if weight_sum is None:
        return base if selector is None else base + alpha * selector
    loss = base / weight_sum
    if selector is not None:
        loss += alpha * selector / weight_sum
    return loss


def _block_loss(h, y, w, rows, blocks: Blocks, batch, head: TargetHead, cfg: ObjectiveConfig, naive: bool):
    """The weighted loss sum before the selector term over the supervised rows (h [R, H], labels y,
    weights w), the draft's top-k ids [R, k], the labels it used [R] (y, or the target's greedy
    tokens with objective.labels=target) and the metric sums of its terms. Without a teacher it is
    the chunked CE alone (the teacher is neither needed nor read). With the head's loss vocabulary
    every term (the teacher's softmax and argmax included) runs over its K tokens only: the labels
    (all inside it, plan_blocks) and the top-k ids are mapped to and from its indices."""
    vocab = head.loss_vocab
    if vocab is not None:
        head, y = vocab.head, vocab.index[y]
    base_sum, topk_ids, y, metrics = _vocab_block_loss(h, y, w, rows, blocks, batch, head, cfg, naive)
    if vocab is None:
        return base_sum, topk_ids, y, metrics
    return base_sum, vocab.token_ids[topk_ids], vocab.token_ids[y], metrics


def _vocab_block_loss(h, y, w, rows, blocks: Blocks, batch, head: TargetHead, cfg: ObjectiveConfig, naive):
    """_block_loss over the vocabulary of `head` (labels and top-k ids are its row indices)."""
    anchors, valid, block_size = blocks.anchors, blocks.valid, cfg.block_size
    multiplier, cap, top_k = cfg.output_multiplier, cfg.softcap, cfg.top_k
    metrics: dict[str, torch.Tensor] = {}
    if cfg.needs_teacher:
        assert not naive, "the naive reference path has the cross-entropy only"
        teacher = distill_loss(
            h,
            head,
            y,
            w,
            batch["target_last_hidden"].flatten(0, 1),
            teacher_positions(anchors, block_size, batch["input_ids"].shape[1])[rows],
            cfg.loss_terms,
            cfg.logits_chunk_rows,
            top_k,
        )
        base_sum, topk_ids, y = teacher.loss, teacher.topk_ids, teacher.labels
        metrics.update(ce_loss_sum=teacher.ce, tv_loss_sum=teacher.tv)
        if cfg.kl_weight > 0:
            metrics["kl_loss_sum"] = teacher.kl
        if cfg.distill_temperature == 1.0:  # the sampling acceptance is at temperature 1
            metrics["accept_len_sampled_sum"] = acceptance_length_sum(rows, 1 - teacher.tv_rows, valid)
    else:
        if naive:
            ce_sum, topk_ids = unary_ce_naive(h, head, y, w, multiplier, cap, top_k)
        else:
            ce_sum, topk_ids = unary_ce(h, head, y, w, multiplier, cap, cfg.logits_chunk_rows, top_k)
        base_sum = ce_sum if cfg.ce_weight == 1.0 else cfg.ce_weight * ce_sum
        metrics["ce_loss_sum"] = ce_sum.detach()

    return base_sum, topk_ids, y, metrics


def acceptance_length_sum(rows: torch.Tensor, correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Sum over valid blocks of 1 + the leading run of correct slots (exact in-sample acceptance).

    rows [b, N, B-1] bool: the supervised slots (the rows `correct` [R] belongs to, in order); valid
    [b, N]. The run stops at the first wrong slot and at the first slot without supervision (past the
    sequence end or outside the reply): serving cannot commit tokens past the end of the reply either.
    Under teacher forcing a slot's predecessor is the data token; along a leading run of correct slots
    that is also what the serving walk chose, so for the selector this run is the walk's own. (With
    `labels: target` that holds where the data token is the target's greedy one, as on replies the
    target regenerated; elsewhere the run follows the data's tokens rather than the walk's.)
    `correct` may also be a float chance of acceptance per slot (1 - TV under lossless sampling): the
    sum is then 1 + sum_k prod_{j<=k} chance_j per block, the expected committed tokens.
    """
    if correct.dtype == torch.bool:
        per_slot = torch.zeros_like(rows)
        per_slot[rows] = correct
        run = per_slot.long().cumprod(dim=-1).sum(dim=-1)  # [b, N]
        return (run + 1)[valid].sum().float()
    per_slot = torch.zeros(rows.shape, dtype=correct.dtype, device=correct.device)
    per_slot[rows] = correct.clamp(0.0, 1.0)
    return (per_slot.cumprod(dim=-1).sum(dim=-1) + 1)[valid].sum().float()


def teacher_positions(anchors: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """[b, N, B-1]: row of the teacher of each slot in the flattened [b * S] positions. Slot k of the
    block at anchor a predicts the token at a + k, so its teacher is the target's next-token
    distribution at a + k - 1 (clamped for the unsupervised slots past the end)."""
    k = torch.arange(1, block_size, device=anchors.device)
    pos = (anchors[..., None] + k - 1).clamp(max=seq_len - 1)
    return pos + seq_len * torch.arange(anchors.shape[0], device=anchors.device)[:, None, None]


def _per_slot(slot: torch.Tensor, values: torch.Tensor, block_size: int) -> torch.Tensor:
    return torch.zeros(block_size - 1, device=values.device).index_add_(0, slot, values.float())


def _slot_metrics(slot, block_size, topk_ids, labels, weights) -> dict[str, torch.Tensor]:
    return {
        "weight_sum": weights.sum().detach(),
        "slot_count": _per_slot(slot, torch.ones_like(labels, dtype=torch.float32), block_size),
        "slot_correct": _per_slot(slot, (topk_ids[:, 0] == labels).float(), block_size),
        "slot_topk_hit": _per_slot(slot, (topk_ids == labels[:, None]).any(-1).float(), block_size),
    }


def estimated_acceptance_length(per_slot_accuracy: list[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: the expected committed tokens per verify step if slots were
    independent; computed from teacher-forced accuracies, so it is an estimate."""
    total, prod = 1.0, 1.0
    for acc in per_slot_accuracy:
        prod *= acc
        total += prod
    return total


def summarize_metrics(sums: dict[str, torch.Tensor], alpha: float) -> dict[str, float]:
    """Turn (globally reduced) sums and counts into the logged scalars.

    `loss` is what is optimised: (base + alpha * selector) / the global weight sum, where base is
    ce_weight * CE + kl_weight * KL + tv_weight * TV (`ce_loss`, `kl_loss`, `tv_loss`: each term's
    weighted mean). `insample_accept_len_sampled`: 1 + sum_k prod_{j<=k} (1 - TV_j) per block, the
    in-sample acceptance of lossless sampling at temperature 1 (needs the teacher). `selector_loss`
    is the mean over the weight of the slots that carry a selector term (all supervised slots in
    insert mode, those whose gold token is in the top-k in strict mode), so that strict and insert
    curves read alike; `selector_weight_fraction` is that weight over the global weight sum, hence
    loss = base_loss + alpha * selector_weight_fraction * selector_loss.
    """
    w = max(float(sums["weight_sum"]), 1e-12)
    count = sums["slot_count"].double().clamp_min(1.0)
    acc = (sums["slot_correct"].double() / count).tolist()
    blocks = max(float(sums["num_anchors"]), 1.0)
    out = {
        "base_loss": float(sums["base_loss_sum"]) / w,
        "accuracy": float(sums["slot_correct"].sum()) / max(float(sums["slot_count"].sum()), 1.0),
        "topk_coverage": float(sums["slot_topk_hit"].sum()) / max(float(sums["slot_count"].sum()), 1.0),
        "est_accept_len": estimated_acceptance_length(acc),
        "insample_accept_len": float(sums["accept_len_sum"]) / blocks,
        "insample_accept_len_max": float(sums["accept_len_max_sum"]) / blocks,
        "num_anchors": float(sums["num_anchors"]),
        "num_supervised_tokens": float(sums["slot_count"].sum()),
    }
    out.update({f"accuracy_pos_{k + 1}": a for k, a in enumerate(acc)})
    # each term of the block loss, a mean over the weight (kl and tv only when the teacher is captured)
    for term in ("ce", "kl", "tv"):
        if f"{term}_loss_sum" in sums:
            out[f"{term}_loss"] = float(sums[f"{term}_loss_sum"]) / w
    if "accept_len_sampled_sum" in sums:
        out["insample_accept_len_sampled"] = float(sums["accept_len_sampled_sum"]) / blocks
    selector = None
    if "selector_loss_sum" in sums:
        sel_acc = (sums["slot_selector_correct"].double() / count).tolist()
        sel_weight = float(sums["selector_weight_sum"])
        # a mean over no slot (strict mode, no gold token in any top-k) is undefined: NaN, not 0
        out["selector_loss"] = float(sums["selector_loss_sum"]) / sel_weight if sel_weight > 0 else math.nan
        out["selector_weight_fraction"] = sel_weight / w
        out["selector_accuracy"] = float(sums["slot_selector_correct"].sum()) / max(
            float(sums["slot_count"].sum()), 1.0
        )
        out["est_accept_len_selector"] = estimated_acceptance_length(sel_acc)
        out["insample_accept_len_selector"] = float(sums["accept_len_selector_sum"]) / blocks
        selector = float(sums["selector_loss_sum"])
    out["loss"] = total_loss(float(sums["base_loss_sum"]), selector, alpha, w)
    return out
