"""Speculative decoding of a draft against its target, and the target's own greedy decoding.

One request at a time (batch size 1), as a server runs it:

    prefill the prompt with the target          -> first token, features of the prompt
    repeat:
        draft a block from the anchor (the last committed token), given the target features of
        every committed position before it (the draft's context cache) -> B-1 proposals
        verify [anchor, proposals] with ONE target forward (its cached state, layer outputs)
        accept the longest correct prefix + one bonus token from the target
        append the committed positions' features to the draft's context cache; roll the target's
        state back to them (attention KV, conv and recurrent states: dflash2.target.state)

Greedy (temperature 0): a proposal is accepted while it equals the target's argmax, so the output
is exactly the target's own greedy decoding. Temperature > 0: lossless rejection sampling (accept x
with probability min(1, p(x) / q(x)); on rejection sample from normalize(max(p - q, 0)); bonus from
p), so the output is distributed exactly as the target's own sampling. For DFlash 2, q is the
selector walk's sampling row over its k candidates (zero outside them).

tau of a verify step = tokens it commits (accepted proposals + the bonus, 1 <= tau <= B); a step
that reaches a stop token or max_new_tokens counts only the tokens it keeps, so that
sum(tau) + 1 (the prefill token) == number of generated tokens.

Each verify step can be timed by a `dflash2.timing.StepTimer` with `breakdown=True` (one step per
verify step; regions `draft_block` (its `forward` and `propose`, in which the draft's `head` and
DFlash 2's `selector`), `verify`, `accept`, `draft_context` (the committed features into the
draft's context cache) and `rollback`); without a timer no clock is read but at the start and the
end of a generation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash2.models import TargetHead
from dflash2.models.context_cache import DraftContextCache
from dflash2.models.draft import DFlashDraftModel
from dflash2.target.cache import new_cache
from dflash2.target.state import TargetState
from dflash2.timing import StepTimer, region

Clock = Callable[[], float]


@dataclass
class GenerationResult:
    output_ids: list[int]  # generated tokens (the prompt excluded; a stop token included)
    acceptance_lengths: list[int]  # tau of every verify step: the tokens it kept
    # the proposals each verify step accepted, before a stop token or the length limit cut the step
    # (its tau is at most this + 1)
    accepted_proposals: list[int]
    num_target_forwards: int  # prefill + verify forwards
    num_rollback_forwards: int  # extra forwards re-feeding the kept tokens of partly rejected blocks
    clean_block_tokens: int  # tokens committed by steps in which every proposal was accepted
    block_size: int
    stop_reason: str  # "stop_token" | "max_new_tokens"
    wall_s: float = 0.0

    @property
    def mean_acceptance_length(self) -> float:
        steps = self.acceptance_lengths
        return sum(steps) / len(steps) if steps else 0.0


@dataclass
class TargetResult:
    """The target's own greedy decoding of one prompt, timed."""

    output_ids: list[int]
    wall_s: float


@dataclass
class _Context:
    """What the decoder carries between verify steps."""

    state: TargetState  # the target's state over the committed positions (before the anchor)
    draft_context: DraftContextCache  # the draft's K/V of the committed positions before the anchor
    anchor: int  # the last committed token, at position p
    stop_ids: set[int]
    max_new_tokens: int
    temperature: float
    generator: torch.Generator | None
    timer: StepTimer | None
    output: list[int] = field(default_factory=list)

    def region(self, name: str):
        return _NOT_TIMED if self.timer is None else self.timer.region(name)


_NOT_TIMED = nullcontext()


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The target's own choice of the next token from logits [V]."""
    if temperature > 0:
        return _sample(torch.softmax(logits.float() / temperature, dim=-1), generator)
    return int(logits.argmax())


@torch.no_grad()
def draft_block(
    draft: DFlashDraftModel,
    head: TargetHead,
    context: DraftContextCache,
    anchor: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Propose B-1 tokens after `anchor` (at position p = context.length).

    Returns (tokens [B-1], candidates [B-1, k] or None, q [B-1, V] (v1) or [B-1, k] (v2)).
    """
    device = next(draft.parameters()).device
    block_ids = torch.tensor([[anchor] + [draft.mask_token_id] * (draft.block_size - 1)], device=device)
    block_embeds = head.embed(block_ids)[:, None].to(next(draft.parameters()).dtype)  # [1, 1, B, H]
    with region("forward"):
        hidden = draft.decode_block(block_embeds, context)  # [1, 1, B, H]
    with region("propose"):
        tokens, candidates, q = draft.propose(
            hidden[:, 0, 1:], torch.tensor([anchor], device=device), head, temperature, generator
        )
    return tokens[0], None if candidates is None else candidates[0], q[0]


def _full_vocab_q(q: torch.Tensor, candidates: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Draft probabilities over the whole vocabulary [B-1, V] (zero outside the v2 candidates)."""
    if candidates is None:
        return q.float()
    full = torch.zeros(q.shape[0], vocab_size, device=q.device)
    return full.scatter_(1, candidates, q.float())


def verify_greedy(proposals: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """target_logits [B, V]: row i is the target's prediction after [anchor, proposals[:i]].
    Returns (number of accepted proposals n, bonus token = the target's argmax after them)."""
    choice = target_logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(proposals) and proposals[n] == choice[n]:
        n += 1
    return n, choice[n]


def verify_sampling(
    proposals: list[int],
    q: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Lossless rejection sampling. q [B-1, V] the draft's distribution of each proposal (given the
    previous ones); target_logits [B, V]. Returns (accepted proposals n, the token after them)."""
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    for i, token in enumerate(proposals):
        ratio = p[i, token] / q[i, token]
        u = torch.rand((), generator=generator, device=p.device)
        if u >= ratio:  # rejected with probability 1 - min(1, p/q)
            residual = torch.clamp(p[i] - q[i], min=0.0)
            mass = residual.sum()
            # p and q equal to rounding (u within an ulp of 1 rejected): no residual mass, and p is
            # then what the residual stands for
            return i, _sample(residual / mass if mass > 0 else p[i], generator)
    return len(proposals), _sample(p[len(proposals)], generator)


def _commit(ctx: _Context, tokens: list[int]) -> tuple[int, bool]:
    """Append tokens up to a stop token or the length limit. Returns (kept, finished)."""
    kept = 0
    for token in tokens:
        ctx.output.append(token)
        kept += 1
        if token in ctx.stop_ids or len(ctx.output) >= ctx.max_new_tokens:
            return kept, True
    return kept, False


def _prompt_ids(
    input_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, temperature: float
) -> list[int]:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    prompt = [int(t) for t in (input_ids.flatten().tolist() if torch.is_tensor(input_ids) else input_ids)]
    if not prompt:
        raise ValueError("the prompt is empty: speculative decoding needs at least one prompt token")
    return prompt


def _verify_step(draft: DFlashDraftModel, head: TargetHead, ctx: _Context) -> tuple[int, int, bool]:
    """Draft a block, verify it, commit. Returns (tokens kept, proposals accepted, finished)."""
    with ctx.region("draft_block"):
        proposals, candidates, q = draft_block(
            draft, head, ctx.draft_context, ctx.anchor, ctx.temperature, ctx.generator
        )
        proposals = proposals.tolist()
    with ctx.region("verify"):
        logits, block_features = ctx.state.verify([ctx.anchor] + proposals)
    with ctx.region("accept"):
        if ctx.temperature > 0:
            q_full = _full_vocab_q(q, candidates, logits.shape[-1])
            n, bonus = verify_sampling(proposals, q_full, logits, ctx.temperature, ctx.generator)
        else:
            n, bonus = verify_greedy(proposals, logits)
    # The anchor and the accepted proposals are now committed positions with valid features;
    # the rejected proposals leave the target's state; the bonus becomes the next anchor.
    with ctx.region("draft_context"):
        draft.extend_context(ctx.draft_context, block_features[:, : n + 1])
    with ctx.region("rollback"):
        ctx.state.keep(n + 1)
    ctx.anchor = bonus
    kept, finished = _commit(ctx, proposals[:n] + [bonus])
    return kept, n, finished


@torch.no_grad()
def speculative_generate(
    draft: DFlashDraftModel,
    target: nn.Module,
    head: TargetHead,
    input_ids: Sequence[int] | torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_token_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    timer: StepTimer | None = None,
    clock: Clock = time.perf_counter,
) -> GenerationResult:
    """Decode one prompt (token ids, batch size 1) with draft + target; see the module docstring.
    `timer`: times every verify step (module docstring); `clock`: what `wall_s` is read from."""
    prompt = _prompt_ids(input_ids, max_new_tokens, temperature)
    start = clock()
    # room for every new token and a last verify block past them, as target_generate reserves its own
    state = TargetState(target, draft.target_layer_ids, room=max_new_tokens + draft.block_size)
    logits, features = state.prefill(prompt)
    ctx = _Context(
        state=state,
        draft_context=draft.new_context_cache(),
        anchor=_pick(logits[-1], temperature, generator),
        stop_ids={int(t) for t in stop_token_ids},
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        generator=generator,
        timer=timer,
    )
    draft.extend_context(ctx.draft_context, features)
    _, finished = _commit(ctx, [ctx.anchor])
    taus: list[int] = []
    accepted: list[int] = []
    clean_tokens = 0
    while not finished:
        if timer is not None:
            timer.start_step()
        kept, n, finished = _verify_step(draft, head, ctx)
        taus.append(kept)
        accepted.append(n)
        clean_tokens += kept if n == draft.block_size - 1 else 0
    if timer is not None:
        timer.finish()
    return GenerationResult(
        output_ids=ctx.output,
        acceptance_lengths=taus,
        accepted_proposals=accepted,
        num_target_forwards=1 + len(taus),
        num_rollback_forwards=state.num_rollback_forwards,
        clean_block_tokens=clean_tokens,
        block_size=draft.block_size,
        stop_reason="stop_token" if ctx.output[-1] in ctx.stop_ids else "max_new_tokens",
        wall_s=clock() - start,
    )


@torch.no_grad()
def target_generate(
    target: nn.Module,
    input_ids: Sequence[int],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The target's own decoding (one forward per token, KV-cached): greedy, what speculative
    decoding must reproduce, or sampled at `temperature` (from `generator`), what lossless
    speculative sampling draws from; the plain decoding its speed is compared with."""
    device = next(target.parameters()).device
    cache, output, ids = new_cache(target, room=max_new_tokens), [], [int(t) for t in input_ids]
    while len(output) < max_new_tokens:
        input_ids = torch.tensor([ids], device=device)  # the LM head on the last position only
        logits = target(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        if temperature > 0:
            ids = [_sample(torch.softmax(logits[0, -1].float() / temperature, dim=-1), generator)]
        else:
            ids = [int(logits[0, -1].argmax())]
        output += ids
        if ids[0] in stop_token_ids:
            break
    return output


def timed_target_generate(
    target: nn.Module,
    input_ids: Sequence[int],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    clock: Clock = time.perf_counter,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> TargetResult:
    """`target_generate`, with its wall time read from `clock` (as `speculative_generate` reads its own)."""
    start = clock()
    output = target_generate(
        target,
        input_ids,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        temperature=temperature,
        generator=generator,
    )
    return TargetResult(output, clock() - start)
