"""Speculative decoding of an exported draft against its target: the measured acceptance length tau.

One request at a time (batch size 1), as a server runs it:

    prefill the prompt with the target          -> first token, features of the prompt
    repeat:
        draft a block from the anchor (the last committed token), given the target features of
        every committed position before it (the draft's context cache) -> B-1 proposals
        verify [anchor, proposals] with ONE target forward (its cached state, layer outputs)
        accept the longest correct prefix + one bonus token from the target
        append the committed positions' features to the draft's context cache; roll the target's
        state back to them (attention KV, conv and recurrent states: dflash2.target_state)

Greedy (temperature 0): a proposal is accepted while it equals the target's argmax, so the output
is exactly the target's own greedy decoding. Temperature > 0: lossless rejection sampling (accept x
with probability min(1, p(x) / q(x)); on rejection sample from normalize(max(p - q, 0)); bonus from
p), so the output is distributed exactly as the target's own sampling. For DFlash 2, q is the
selector walk's sampling row over its k candidates (zero outside them).

tau of a verify step = tokens it commits (accepted proposals + the bonus, 1 <= tau <= B); a step
that reaches a stop token or max_new_tokens counts only the tokens it keeps, so that
sum(tau) + 1 (the prefill token) == number of generated tokens.

CLI: python -m dflash2.evaluate --draft <export> --target <dir> --data <jsonl> [options]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dflash2.config import require_path, torch_dtype
from dflash2.data.jsonl import SampleError, iter_lines, parse_sample, prompt_turns
from dflash2.data.render import encode_prompt, stop_token_ids
from dflash2.errors import add_debug_flag, run_main
from dflash2.export import TRAINING_RUN_NAME, read_training_run
from dflash2.models import TargetHead, load_draft
from dflash2.models.context_cache import DraftContextCache
from dflash2.models.draft import DFlashDraftModel
from dflash2.target_state import TargetState, new_cache

# ------------------------------------------------------------------ decoding


@dataclass
class GenerationResult:
    output_ids: list[int]  # generated tokens (the prompt excluded; a stop token included)
    acceptance_lengths: list[int]  # tau of every verify step
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
class _Context:
    """What the decoder carries between verify steps."""

    state: TargetState  # the target's state over the committed positions (before the anchor)
    draft_context: DraftContextCache  # the draft's K/V of the committed positions before the anchor
    anchor: int  # the last committed token, at position p
    output: list[int] = field(default_factory=list)


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
    hidden = draft.decode_block(block_embeds, context)  # [1, 1, B, H]
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
            assert residual.sum() > 0, "rejection happens only where p(x) < q(x), so p - q has mass"
            return i, _sample(residual / residual.sum(), generator)
    return len(proposals), _sample(p[len(proposals)], generator)


def _commit(ctx: _Context, tokens: list[int], stop_ids: set[int], max_new_tokens: int) -> tuple[int, bool]:
    """Append tokens up to a stop token or the length limit. Returns (kept, finished)."""
    kept = 0
    for token in tokens:
        ctx.output.append(token)
        kept += 1
        if token in stop_ids or len(ctx.output) >= max_new_tokens:
            return kept, True
    return kept, False


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
) -> GenerationResult:
    """Decode one prompt (token ids, batch size 1) with draft + target; see the module docstring."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    prompt = [int(t) for t in (input_ids.flatten().tolist() if torch.is_tensor(input_ids) else input_ids)]
    if not prompt:
        raise ValueError("the prompt is empty: speculative decoding needs at least one prompt token")
    start = time.perf_counter()
    stop_ids = {int(t) for t in stop_token_ids}

    state = TargetState(target, draft.target_layer_ids)
    logits, features = state.prefill(prompt)
    draft_context = draft.new_context_cache()
    draft.extend_context(draft_context, features)
    ctx = _Context(state=state, draft_context=draft_context, anchor=_pick(logits[-1], temperature, generator))
    _, finished = _commit(ctx, [ctx.anchor], stop_ids, max_new_tokens)
    taus: list[int] = []
    num_forwards, clean_tokens = 1, 0
    while not finished:
        proposals, candidates, q = draft_block(
            draft, head, ctx.draft_context, ctx.anchor, temperature, generator
        )
        proposals = proposals.tolist()
        logits, block_features = ctx.state.verify([ctx.anchor] + proposals)
        num_forwards += 1
        if temperature > 0:
            q_full = _full_vocab_q(q, candidates, logits.shape[-1])
            n, bonus = verify_sampling(proposals, q_full, logits, temperature, generator)
        else:
            n, bonus = verify_greedy(proposals, logits)
        # The anchor and the accepted proposals are now committed positions with valid features;
        # the rejected proposals leave the target's state; the bonus becomes the next anchor.
        draft.extend_context(ctx.draft_context, block_features[:, : n + 1])
        ctx.state.keep(n + 1)
        ctx.anchor = bonus
        kept, finished = _commit(ctx, proposals[:n] + [bonus], stop_ids, max_new_tokens)
        taus.append(kept)
        if n == len(proposals):
            clean_tokens += kept
    return GenerationResult(
        output_ids=ctx.output,
        acceptance_lengths=taus,
        num_target_forwards=num_forwards,
        num_rollback_forwards=state.num_rollback_forwards,
        clean_block_tokens=clean_tokens,
        block_size=draft.block_size,
        stop_reason="stop_token" if ctx.output[-1] in stop_ids else "max_new_tokens",
        wall_s=time.perf_counter() - start,
    )


@torch.no_grad()
def target_generate(
    target: nn.Module,
    input_ids: Sequence[int],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
) -> list[int]:
    """The target's own greedy decoding (one forward per token): the reference speculative
    decoding must reproduce."""
    device = next(target.parameters()).device
    cache, output, ids = new_cache(target), [], [int(t) for t in input_ids]
    while len(output) < max_new_tokens:
        logits = target(input_ids=torch.tensor([ids], device=device), cache=cache, use_cache=True).logits
        ids = [int(logits[0, -1].argmax())]
        output += ids
        if ids[0] in stop_token_ids:
            break
    return output


# ------------------------------------------------------------------ prompts


def read_prompts(data_jsonl: str | Path, num_prompts: int) -> list[list[dict[str, str]]]:
    """The first `num_prompts` conversations of a training_jsonl file, each cut before its first
    assistant turn (the prompt a server would receive)."""
    prompts = []
    for line_number, line in iter_lines(data_jsonl):
        if len(prompts) == num_prompts:
            break
        try:
            prompts.append(prompt_turns(parse_sample(line, line_number).messages))
        except SampleError as error:
            raise ValueError(f"{data_jsonl}:{line_number}: {error}") from None
    if not prompts:
        raise ValueError(f"{data_jsonl}: no conversations found")
    return prompts


# ------------------------------------------------------------------ summary


def summarize(results: list[GenerationResult], block_size: int) -> dict:
    """Pooled statistics over prompts (each verify step and each token weighs the same)."""
    taus = [t for r in results for t in r.acceptance_lengths]
    generated = sum(len(r.output_ids) for r in results)
    forwards = sum(r.num_target_forwards for r in results)
    rollbacks = sum(r.num_rollback_forwards for r in results)
    wall = sum(r.wall_s for r in results)
    histogram = {str(k): sum(1 for t in taus if t == k) for k in range(1, block_size + 1)}
    # Slot k's proposal was accepted in a step iff that step committed more than k tokens.
    position_rate = {
        str(k): (sum(1 for t in taus if t > k) / len(taus) if taus else 0.0) for k in range(1, block_size)
    }
    return {
        "block_size": block_size,
        "num_prompts": len(results),
        "num_verify_steps": len(taus),
        "generated_tokens": generated,
        "mean_acceptance_length": sum(taus) / len(taus) if taus else 0.0,
        "acceptance_histogram": histogram,
        "position_acceptance_rate": position_rate,
        "target_forwards_per_token": forwards / generated if generated else 0.0,
        "plain_decoding_forwards_per_token": 1.0,
        # recurrent targets only: re-feeding the kept tokens of partly rejected blocks (target_state.py)
        "rollback_forwards_per_token": rollbacks / generated if generated else 0.0,
        "tokens_per_s": generated / wall if wall > 0 else 0.0,
        "wall_s": wall,
    }


def write_tensorboard(summary: dict, tb_dir: str | Path, step: int) -> None:
    """eval/... scalars at `step`, the training step of the evaluated export."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tb_dir))
    for key in ("mean_acceptance_length", "target_forwards_per_token", "tokens_per_s", "wall_s"):
        writer.add_scalar(f"eval/{key}", summary[key], step)
    for tau, count in summary["acceptance_histogram"].items():
        writer.add_scalar(f"eval/acceptance_histogram/tau_{tau}", count, step)
    writer.close()


def plot_histogram(summary: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    taus = [int(k) for k in summary["acceptance_histogram"]]
    counts = list(summary["acceptance_histogram"].values())
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(taus, counts, color="tab:blue")
    ax.set_xticks(taus)
    ax.set_xlabel("tokens committed per verify step (tau)")
    ax.set_ylabel("verify steps")
    ax.set_title(
        f"acceptance length: mean {summary['mean_acceptance_length']:.2f} of {summary['block_size']}"
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_table(summary: dict) -> str:
    rows = [
        (
            "mean acceptance length (tau)",
            f"{summary['mean_acceptance_length']:.3f} / {summary['block_size']}",
        ),
        ("target forwards per token", f"{summary['target_forwards_per_token']:.3f} (plain decoding: 1)"),
        ("rollback forwards per token", f"{summary['rollback_forwards_per_token']:.3f}"),
        ("generated tokens", str(summary["generated_tokens"])),
        ("verify steps", str(summary["num_verify_steps"])),
        ("tokens/s", f"{summary['tokens_per_s']:.1f}"),
        ("wall time (s)", f"{summary['wall_s']:.2f}"),
    ]
    rows += [(f"  tau = {k}", str(v)) for k, v in summary["acceptance_histogram"].items()]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


# ------------------------------------------------------------------ evaluate


def evaluate_prompts(
    draft: DFlashDraftModel,
    target: nn.Module,
    head: TargetHead,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_token_ids: Sequence[int] = (),
    seed: int = 0,
) -> tuple[dict, list[GenerationResult]]:
    """Decode every prompt (token ids) and summarise; usable with in-memory models (e.g. in training)."""
    generator = torch.Generator(device=next(target.parameters()).device).manual_seed(seed)
    results = [
        speculative_generate(
            draft,
            target,
            head,
            ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            stop_token_ids=stop_token_ids,
            generator=generator,
        )
        for ids in prompts
    ]
    return summarize(results, draft.block_size), results


def load_models(draft_dir: str | Path, target_dir: str | Path, device: str = "cpu", dtype=torch.float32):
    """(draft, target, head, tokenizer) in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    draft = load_draft(draft_dir, dtype=dtype).to(device)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft vocab_size {draft.config.vocab_size} != target vocab_size {target.config.vocab_size}: "
            "the draft was built for another target"
        )
    head = TargetHead.from_target(target, dtype=dtype)
    return draft, target, head, tokenizer


def run_settings(
    draft_dir: str | Path, chat_template_kwargs: dict | None
) -> tuple[dict | None, int, list[str]]:
    """(chat template arguments, TensorBoard step, notes) for evaluating an export: by default those of
    the training run that wrote it (its training_run.json), so the prompts are rendered as in training."""
    recorded = read_training_run(draft_dir)
    notes = []
    if "step" not in recorded:
        notes.append(
            f"{draft_dir} has no {TRAINING_RUN_NAME} step: TensorBoard scalars are written at step 0"
        )
    if chat_template_kwargs is None:
        if "chat_template_kwargs" not in recorded:
            notes.append(
                f"{draft_dir} records no chat_template_kwargs of its training run: prompts use the template's "
                "defaults; pass --chat-template-kwargs to choose"
            )
        chat_template_kwargs = recorded.get("chat_template_kwargs")
    elif recorded.get("chat_template_kwargs", chat_template_kwargs) != chat_template_kwargs:
        notes.append(
            f"chat_template_kwargs {chat_template_kwargs} differ from the training run's "
            f"{recorded['chat_template_kwargs']}: prompts are rendered unlike the training data"
        )
    return chat_template_kwargs, int(recorded.get("step", 0)), notes


def evaluate(
    draft_dir: str | Path,
    target_dir: str | Path,
    data_jsonl: str | Path,
    *,
    num_prompts: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    out_json: str | Path | None = None,
    tb_dir: str | Path | None = None,
    plot_path: str | Path | None = None,
    device: str = "cpu",
    precision: str = "fp32",
    chat_template_kwargs: dict | None = None,
) -> dict:
    """Load an export and its target, decode the first `num_prompts` prompts of `data_jsonl`,
    and return (and optionally write) the summary. `chat_template_kwargs` None: the training run's.
    `precision` ("fp32" | "bf16"): the dtype of the target, the draft and the head."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    chat_template_kwargs, step, notes = run_settings(draft_dir, chat_template_kwargs)
    torch.manual_seed(seed)
    draft, target, head, tokenizer = load_models(draft_dir, target_dir, device, torch_dtype(precision))
    prompts = [
        encode_prompt(m, tokenizer, chat_template_kwargs) for m in read_prompts(data_jsonl, num_prompts)
    ]
    summary, _ = evaluate_prompts(
        draft,
        target,
        head,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        stop_token_ids=stop_token_ids(tokenizer, target),
        seed=seed,
    )
    summary.update(
        draft=str(draft_dir),
        target=str(target_dir),
        data=str(data_jsonl),
        temperature=temperature,
        seed=seed,
        precision=precision,
        step=step,
        chat_template_kwargs=chat_template_kwargs,
        notes=notes,
    )
    if out_json is not None:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(summary, indent=2) + "\n")
    if tb_dir is not None:
        write_tensorboard(summary, tb_dir, step)
    if plot_path is not None:
        plot_histogram(summary, plot_path)
    return summary


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", required=True, help="export directory (config.json + model.safetensors)")
    parser.add_argument("--target", required=True, help="Hugging Face target directory (with tokenizer)")
    parser.add_argument(
        "--data", required=True, help="training_jsonl file; prompts = turns before the first reply"
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="dtype of the target, the draft and the head (bf16: what a server runs, and half the memory "
        "of fp32 for a large target on a GPU)",
    )
    parser.add_argument("--out", help="write the summary JSON here")
    parser.add_argument("--tb-dir", help="write TensorBoard scalars (eval/...) here")
    parser.add_argument("--plot", help="write a PNG of the acceptance histogram here")
    parser.add_argument(
        "--chat-template-kwargs",
        type=json.loads,
        default=None,
        help="JSON for the prompt's chat template, e.g. '{\"enable_thinking\": false}' (match the server; "
        "default: what the training run used, from the export's training_run.json)",
    )
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    require_path(args.draft, "--draft", "dir", "an export directory (config.json + model.safetensors)")
    require_path(args.target, "--target", "dir", "the target's local model directory")
    require_path(args.data, "--data", "file", "a training_jsonl file")
    summary = evaluate(
        args.draft,
        args.target,
        args.data,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        out_json=args.out,
        tb_dir=args.tb_dir,
        plot_path=args.plot,
        device=args.device,
        precision=args.precision,
        chat_template_kwargs=args.chat_template_kwargs,
    )
    for note in summary["notes"]:
        print(f"note: {note}")
    print(format_table(summary))
    return summary


if __name__ == "__main__":
    sys.exit(run_main(main))
