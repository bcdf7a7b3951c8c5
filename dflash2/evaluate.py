"""Evaluation of an exported draft against its target: the measured acceptance length tau and the
wall-clock speedup over the target's own greedy decoding.

Every prompt is decoded in this process by speculative decoding (`dflash2.decode`) and by the
target alone (greedy, KV-cached, one forward per token), prompt by prompt, the decodes taking turns
at going first (so the machine's load weighs on all alike). Several drafts of one target are
evaluated together: each prompt is decoded by the target alone once and by every draft, and every
draft's speedup is over that one decode. The summary holds tau and its histogram,
both speeds (`spec_tokens_per_s`, `target_tokens_per_s`) and their ratio (`speedup`), and for
reference the tau of a draft-free prompt-lookup proposer on the target's outputs
(`prompt_lookup_tau`); it goes to a JSON file, TensorBoard, a PNG and a printed table.

CLI: python -m dflash2.evaluate --draft <export> [<export> ...] --target <dir> --data <jsonl> [options]
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from dflash2.checkpoint import holds_draft
from dflash2.config import PRECISIONS, json_object_arg, load_tokenizer, require_path, torch_dtype
from dflash2.data.jsonl import SampleError, iter_lines, parse_sample, prompt_turns
from dflash2.data.render import encode_prompt, stop_token_ids
from dflash2.decode import (
    Clock,
    GenerationResult,
    TargetResult,
    speculative_generate,
    target_generate,
    timed_target_generate,
)
from dflash2.errors import add_debug_flag, exit_process, run_main
from dflash2.export import TRAINING_RUN_NAME, read_training_run
from dflash2.hardware import check_device, warn_if_slow_bf16
from dflash2.models import TargetHead, load_draft
from dflash2.models.config import load_config_dict, validate_draft_config
from dflash2.models.draft import DFlashDraftModel
from dflash2.models.registry import check_export_config
from dflash2.target.load import load_full_target
from dflash2.target.state import use_decoding_layout

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


# ------------------------------------------------------------------ a draft-free reference

PROMPT_LOOKUP_NGRAM = (4, 1)  # longest, shortest suffix the lookup matches
WARM_UP_TOKENS = 16  # new tokens of the untimed decodes before the timed ones (warm_up)


def prompt_lookup_proposal(
    sequence: Sequence[int], num_tokens: int, max_ngram: int, min_ngram: int
) -> list[int]:
    """Prompt lookup: the `num_tokens` tokens that followed the most recent earlier occurrence of the
    longest suffix of `sequence` (`max_ngram` down to `min_ngram` tokens), copied on past the end
    of `sequence` as far as needed (a copy of a repeating span repeats); [] when no suffix recurs."""
    seq = list(sequence)
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                copied: list[int] = []
                for source in range(start + n, start + n + num_tokens):
                    copied.append(seq[source] if source < len(seq) else copied[source - len(seq)])
                return copied
    return []


def prompt_lookup_acceptance(
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    block_size: int,
    ngram: tuple[int, int] = PROMPT_LOOKUP_NGRAM,
) -> list[int]:
    """The tokens each verify step would commit if a draft-free n-gram proposer (prompt lookup,
    `prompt_lookup_proposal`) proposed the B-1 tokens of every block, verified greedily against a
    target whose greedy continuation of `prompt_ids` is `output_ids`: the step's matched prefix
    plus the target's own token, cut at the end of the output. Exact for greedy verification,
    from the tokens alone (the target's first token comes from the prefill, as in
    `dflash2.decode.speculative_generate`)."""
    output, committed, lengths = list(output_ids), 1, []
    while committed < len(output):
        proposal = prompt_lookup_proposal([*prompt_ids, *output[:committed]], block_size - 1, *ngram)
        pairs = list(zip(proposal, output[committed:]))
        matched = next((i for i, (p, t) in enumerate(pairs) if p != t), len(pairs))
        kept = min(matched + 1, len(output) - committed)
        lengths.append(kept)
        committed += kept
    return lengths


# ------------------------------------------------------------------ summary


def summarize(results: list[GenerationResult], block_size: int) -> dict:
    """Pooled statistics over prompts (each verify step and each token weighs the same)."""
    taus = [t for r in results for t in r.acceptance_lengths]
    generated = sum(len(r.output_ids) for r in results)
    forwards = sum(r.num_target_forwards for r in results)
    rollbacks = sum(r.num_rollback_forwards for r in results)
    wall = sum(r.wall_s for r in results)
    histogram = {str(k): sum(1 for t in taus if t == k) for k in range(1, block_size + 1)}
    # Slot k's proposal was accepted in a step iff the verifier accepted at least k proposals (a step
    # cut by a stop token or the length limit keeps fewer tokens than it accepted).
    accepted = [n for r in results for n in r.accepted_proposals]
    position_rate = {
        str(k): (sum(1 for n in accepted if n >= k) / len(accepted) if accepted else 0.0)
        for k in range(1, block_size)
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
        # recurrent targets only: re-feeding the kept tokens of partly rejected blocks (target/state.py)
        "rollback_forwards_per_token": rollbacks / generated if generated else 0.0,
        "tokens_per_s": generated / wall if wall > 0 else 0.0,
        "wall_s": wall,
    }


def speed_summary(
    results: list[GenerationResult], target_results: list[TargetResult], greedy: bool = True
) -> dict:
    """Speculative decoding vs the target alone on the same prompts: tokens/s of each, their ratio
    (`speedup` > 1: speculative decoding is faster), and, when both decoded greedily, how many
    outputs are the same (sampled ones differ by chance)."""
    spec_tokens, spec_wall = sum(len(r.output_ids) for r in results), sum(r.wall_s for r in results)
    target_tokens = sum(len(r.output_ids) for r in target_results)
    target_wall = sum(r.wall_s for r in target_results)
    spec_speed = spec_tokens / spec_wall if spec_wall > 0 else 0.0
    target_speed = target_tokens / target_wall if target_wall > 0 else 0.0
    summary = {
        "spec_tokens_per_s": spec_speed,
        "target_tokens_per_s": target_speed,
        "speedup": spec_speed / target_speed if target_speed > 0 else 0.0,
        "target_generated_tokens": target_tokens,
        "target_wall_s": target_wall,
    }
    if greedy:
        summary["outputs_equal_target"] = sum(
            r.output_ids == t.output_ids for r, t in zip(results, target_results)
        )
    return summary


def prompt_lookup_summary(
    prompts: Sequence[Sequence[int]], target_results: list[TargetResult], block_size: int
) -> dict:
    """`prompt_lookup_tau`: the mean acceptance length (pooled like tau) a draft-free prompt-lookup
    proposer of the same block size reaches on the target's greedy outputs; a draft that does not
    beat it has learned less than copying from the context gives for free."""
    lengths = [
        t
        for ids, result in zip(prompts, target_results)
        for t in prompt_lookup_acceptance(ids, result.output_ids, block_size)
    ]
    return {"prompt_lookup_tau": sum(lengths) / len(lengths) if lengths else 0.0}


SPEED_KEYS = ("spec_tokens_per_s", "target_tokens_per_s", "speedup")


def write_tensorboard(summary: dict, tb_dir: str | Path, step: int) -> None:
    """eval/... scalars at `step`, the training step of the evaluated export."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tb_dir))
    keys = (
        "mean_acceptance_length",
        "prompt_lookup_tau",
        "target_forwards_per_token",
        "tokens_per_s",
        "wall_s",
    )
    for key in (*keys, *SPEED_KEYS):
        if key in summary:
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
    if "speedup" in summary:
        rows += speed_rows(summary)
    if "prompt_lookup_tau" in summary:
        longest, shortest = PROMPT_LOOKUP_NGRAM
        copying = f"{shortest}-{longest}-gram copying on the target's greedy outputs"
        rows.append(("prompt lookup tau (no draft)", f"{summary['prompt_lookup_tau']:.3f}: {copying}"))
    rows += [(f"  tau = {k}", str(v)) for k, v in summary["acceptance_histogram"].items()]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def speed_rows(summary: dict) -> list[tuple[str, str]]:
    """The table's rows comparing speculative decoding with the target alone."""
    speedup = summary["speedup"]
    verdict = "faster than" if speedup > 1 else "as fast as" if speedup == 1 else "slower than"
    return [
        ("target alone tokens/s", f"{summary['target_tokens_per_s']:.1f} (greedy, KV cache)"),
        ("speculative tokens/s", f"{summary['spec_tokens_per_s']:.1f}"),
        ("speedup", f"{speedup:.2f}x: speculative decoding is {verdict} the target alone"),
    ]


# ------------------------------------------------------------------ evaluate


def evaluate_prompts(
    draft: DFlashDraftModel, target: nn.Module, head: TargetHead, prompts: list[list[int]], **options
) -> tuple[dict, list[GenerationResult]]:
    """Decode every prompt (token ids) and summarise; usable with in-memory models (e.g. in training).
    `options`: those of `compare_drafts` (max_new_tokens, temperature, stop_token_ids, seed,
    compare_target, clock), of which this is the one-draft case: with `compare_target` every prompt
    is also decoded by the target alone, the two decodes taking turns at going first."""
    (evaluated,) = compare_drafts([draft], target, head, prompts, **options)
    return evaluated


def compare_drafts(
    drafts: Sequence[DFlashDraftModel],
    target: nn.Module,
    head: TargetHead,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_token_ids: Sequence[int] = (),
    seed: int = 0,
    compare_target: bool = True,
    clock: Clock = time.perf_counter,
) -> list[tuple[dict, list[GenerationResult]]]:
    """Decode every prompt (token ids) with each draft and summarise: (summary, results) per draft,
    each as that draft evaluated alone would give it (every draft samples from its own generator
    seeded with `seed`). `compare_target`: every prompt is also decoded once by the target alone
    (greedy, or sampled at the temperature from a generator of its own), and each summary gets
    `speed_summary` (every draft's speedup over the same target decodes) and, greedy,
    `prompt_lookup_summary`. The decodes of prompt i run in turn starting from the (i mod n)-th of
    [target alone, drafts...] (n decodes a prompt), so each goes first as often as the others and
    the machine's load weighs on all alike. `clock`: what the wall times are read from."""
    if not drafts:
        raise ValueError("compare_drafts needs at least one draft")
    warm_up(
        drafts, target, head, prompts[0], compare_target, min(max_new_tokens, WARM_UP_TOKENS), temperature
    )
    common = dict(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, clock=clock)
    results, target_results = _decode_in_turns(
        drafts, target, head, prompts, compare_target, temperature, seed, common
    )
    evaluated = []
    for draft, draft_results in zip(drafts, results):
        summary = summarize(draft_results, draft.block_size)
        if compare_target:
            summary.update(speed_summary(draft_results, target_results, greedy=temperature == 0))
            if temperature == 0:  # a greedy verification of the target's greedy outputs
                summary.update(prompt_lookup_summary(prompts, target_results, draft.block_size))
        evaluated.append((summary, draft_results))
    return evaluated


def _decode_in_turns(
    drafts, target, head, prompts, compare_target: bool, temperature: float, seed: int, common: dict
) -> tuple[list[list[GenerationResult]], list[TargetResult]]:
    """The timed decodes of `compare_drafts`: each draft's results, and the target alone's."""
    device = next(target.parameters()).device
    generators = [torch.Generator(device=device).manual_seed(seed) for _ in drafts]
    # at a temperature the target alone samples too: the same distribution of outputs (and lengths)
    # that lossless speculative sampling draws from, so that the speeds compare like with like
    target_generator = torch.Generator(device=device).manual_seed(seed)
    results: list[list[GenerationResult]] = [[] for _ in drafts]
    target_results: list[TargetResult] = []
    decoders = ([None] if compare_target else []) + list(range(len(drafts)))  # None: the target alone
    for index, ids in enumerate(prompts):
        turn = index % len(decoders)
        for which in decoders[turn:] + decoders[:turn]:
            if which is None:
                sampling = dict(temperature=temperature, generator=target_generator)
                target_results.append(timed_target_generate(target, ids, **sampling, **common))
                continue
            results[which].append(
                speculative_generate(
                    drafts[which],
                    target,
                    head,
                    ids,
                    temperature=temperature,
                    generator=generators[which],
                    **common,
                )
            )
    return results, target_results


def warm_up(
    drafts: Sequence[DFlashDraftModel],
    target: nn.Module,
    head: TargetHead,
    ids: list[int],
    compare_target: bool,
    max_new_tokens: int,
    temperature: float,
) -> None:
    """One short untimed decode by the target alone and by each draft, so that one-time costs (a GPU's
    library handles and kernel loading, the allocator's first growth) fall on no timed decode; their
    own generator, so the timed decodes sample as they would without it."""
    generator = torch.Generator(device=next(target.parameters()).device).manual_seed(0)
    if compare_target:
        target_generate(target, ids, max_new_tokens=max_new_tokens)
    for draft in drafts:
        speculative_generate(
            draft,
            target,
            head,
            ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            generator=generator,
        )


def greedy_mismatch_note(num_differing: int, num_prompts: int) -> str:
    return (
        f"{num_differing} of {num_prompts} greedy outputs differ from the target's own greedy decoding: "
        "in bf16 near-ties round differently in a block and a one-token forward (docs/evaluation.md); "
        "in fp32 this is a bug"
    )


def load_models(
    draft_dir: str | Path,
    target_dir: str | Path,
    device: str = "cpu",
    dtype=torch.float32,
    decoding_layout: bool = True,
):
    """(draft, target, head, tokenizer) in eval mode, their weights laid out for decoding
    (`dflash2.target.state.use_decoding_layout`) unless `decoding_layout` is False."""
    target, head, tokenizer = load_target(target_dir, device, dtype, [draft_dir])
    draft = load_draft_for(target, draft_dir, device, dtype, tokenizer)
    if decoding_layout:
        use_decoding_layout(target, draft, head)
    return draft, target, head, tokenizer


def load_target(
    target_dir: str | Path, device: str = "cpu", dtype=torch.float32, drafts: Sequence[str | Path] = ()
):
    """(target, head, tokenizer): the target in eval mode and its LM head, in `dtype`. Each export
    directory of `drafts` is refused before the target's weights load (minutes for a large target)
    unless its config fits the target and its tokenizer."""
    tokenizer = load_tokenizer(target_dir, "--target")
    for draft in drafts:
        check_export_config(draft)
        draft_fits_target(draft, Path(target_dir) / "config.json", tokenizer)
    target = load_full_target(target_dir, dtype, device)
    return target, TargetHead.from_target(target, dtype=dtype), tokenizer


def load_draft_for(
    target: nn.Module, draft_dir: str | Path, device: str = "cpu", dtype=torch.float32, tokenizer=None
) -> DFlashDraftModel:
    """The export at `draft_dir`, in `dtype` on `device`, refused when built for another target (its
    hidden size, vocabulary or depth, the mask token of `tokenizer`) or for a family whose head the
    draft cannot borrow."""
    draft = load_draft(draft_dir, dtype=dtype).to(device)
    draft_fits_target(draft_dir, target.config, tokenizer)
    return draft


def draft_fits_target(draft_dir: str | Path, target_config, tokenizer=None) -> None:
    """A ValueError naming each way the export at `draft_dir` was built for another target (or
    tokenizer); its config alone is load_draft's to check."""
    source = Path(draft_dir) / "config.json"
    problems = validate_draft_config(
        load_config_dict(draft_dir), tokenizer=tokenizer, target_config=target_config, source=source
    )
    if problems:
        raise ValueError(
            f"the draft {draft_dir} does not fit the target: {'; '.join(problems)}. A draft is evaluated "
            "with the target (and tokenizer) it was trained for"
        )


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
    out_json: str | Path | None = None,
    tb_dir: str | Path | None = None,
    plot_path: str | Path | None = None,
    **options,
) -> dict:
    """Load an export and its target, decode the first `num_prompts` prompts of `data_jsonl`,
    and return (and optionally write) the summary: `evaluate_drafts` for one draft, whose keyword
    `options` it takes (num_prompts, max_new_tokens, temperature, seed, device, precision,
    chat_template_kwargs)."""
    if not isinstance(draft_dir, (str, Path)):
        raise ValueError(
            f"evaluate takes one export directory, got {type(draft_dir).__name__}: for several drafts "
            "at once, over the same target decodes, call evaluate_drafts(draft_dirs, ...)"
        )
    paths = {"out_jsons": out_json, "tb_dirs": tb_dir, "plot_paths": plot_path}
    reports = {key: None if path is None else [path] for key, path in paths.items()}
    (summary,) = evaluate_drafts([draft_dir], target_dir, data_jsonl, **reports, **options)
    return summary


def evaluate_drafts(
    draft_dirs: Sequence[str | Path],
    target_dir: str | Path,
    data_jsonl: str | Path,
    *,
    num_prompts: int = 16,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
    out_jsons: Sequence[str | Path] | None = None,
    tb_dirs: Sequence[str | Path] | None = None,
    plot_paths: Sequence[str | Path] | None = None,
    device: str = "cpu",
    precision: str = "fp32",
    chat_template_kwargs: dict | None = None,
) -> list[dict]:
    """`evaluate` for several exports of one target in one process (`compare_drafts`): the target
    loaded once, every prompt decoded by the target alone once and by each draft. One summary per
    draft, in order; `out_jsons`, `tb_dirs`, `plot_paths`: one path per draft each, or None. The
    drafts' prompts must render alike: their training runs' chat_template_kwargs (or the one given).
    Seeds torch's global RNG with `seed` (sampling at a temperature above 0)."""
    check_inputs(
        draft_dirs,
        target_dir,
        data_jsonl,
        num_prompts=num_prompts,
        max_new_tokens=max_new_tokens,
        device=device,
    )
    outputs = {"--out": out_jsons, "--tb-dir": tb_dirs, "--plot": plot_paths}
    settings = drafts_settings(draft_dirs, chat_template_kwargs, outputs)
    torch.manual_seed(seed)
    dtype = torch_dtype(precision)
    warn_if_slow_bf16(torch.device(device), dtype)
    target, head, tokenizer, drafts = load_for_evaluation(target_dir, draft_dirs, device, dtype)
    prompts = [encode_prompt(m, tokenizer, settings[0][0]) for m in read_prompts(data_jsonl, num_prompts)]
    stops = stop_token_ids(tokenizer, target)
    evaluated = compare_drafts(
        drafts,
        target,
        head,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        stop_token_ids=stops,
        seed=seed,
    )
    inputs = dict(target=str(target_dir), data=str(data_jsonl), temperature=temperature, seed=seed)
    inputs["precision"] = precision
    reports = [[_nth(paths, i) for paths in (out_jsons, tb_dirs, plot_paths)] for i in range(len(draft_dirs))]
    return [
        _finish_summary(summary, path, setting, inputs, len(prompts), report)
        for (summary, _), path, setting, report in zip(evaluated, draft_dirs, settings, reports)
    ]


def _finish_summary(
    summary: dict, draft_dir, setting: tuple, inputs: dict, num_prompts: int, reports: list
) -> dict:
    """A draft's summary with what it was evaluated on and its notes, written where asked."""
    kwargs, step, notes = setting
    notes = list(notes)
    if inputs["temperature"] == 0 and summary["outputs_equal_target"] < num_prompts:
        notes.append(greedy_mismatch_note(num_prompts - summary["outputs_equal_target"], num_prompts))
    summary.update(draft=str(draft_dir), **inputs, step=step, chat_template_kwargs=kwargs, notes=notes)
    write_reports(summary, *reports)
    return summary


def load_for_evaluation(
    target_dir: str | Path, draft_dirs: Sequence[str | Path], device: str, dtype: torch.dtype
) -> tuple[nn.Module, TargetHead, object, list[DFlashDraftModel]]:
    """(target, head, tokenizer, drafts): each draft refused unless it fits the target, all laid out
    for decoding."""
    target, head, tokenizer = load_target(target_dir, device, dtype, draft_dirs)
    drafts = [load_draft_for(target, d, device, dtype, tokenizer) for d in draft_dirs]
    use_decoding_layout(target, head, *drafts)
    return target, head, tokenizer, drafts


def drafts_settings(
    draft_dirs: Sequence[str | Path], chat_template_kwargs: dict | None, outputs: dict[str, Sequence | None]
) -> list[tuple[dict | None, int, list[str]]]:
    """Each draft's `run_settings`, checked: at least one draft, one path per draft in each of
    `outputs` (option name -> paths or None), and prompts that render alike for all."""
    if not draft_dirs:
        raise ValueError("give at least one draft to evaluate")
    for name, paths in outputs.items():
        if paths is not None and len(paths) != len(draft_dirs):
            raise ValueError(f"{name}: give one path per draft ({len(draft_dirs)}), got {len(paths)}")
    settings = [run_settings(d, chat_template_kwargs) for d in draft_dirs]
    # None (the template's defaults) renders as {} does
    rendered = {json.dumps(kwargs or {}, sort_keys=True) for kwargs, _, _ in settings}
    if len(rendered) > 1:
        raise ValueError(
            "the drafts' training runs rendered prompts with different chat_template_kwargs "
            f"({', '.join(sorted(rendered))}): evaluate them one at a time, or pass --chat-template-kwargs"
        )
    return settings


def _nth(paths: Sequence[str | Path] | None, i: int) -> str | Path | None:
    """The i-th draft's path of a per-draft option, None where the option was not given."""
    return None if paths is None else paths[i]


def write_reports(
    summary: dict, out_json: str | Path | None, tb_dir: str | Path | None, plot: str | Path | None
) -> None:
    """The summary JSON, TensorBoard scalars (at the export's training step) and the histogram PNG,
    each where a path is given."""
    if out_json is not None:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(summary, indent=2) + "\n")
    if tb_dir is not None:
        write_tensorboard(summary, tb_dir, summary["step"])
    if plot is not None:
        plot_histogram(summary, plot)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dflash2.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--draft",
        required=True,
        nargs="+",
        help="export directory (config.json + model.safetensors); several: compared on the same prompts, "
        "the target alone decoding each prompt once",
    )
    parser.add_argument("--target", required=True, help="Hugging Face target directory (with tokenizer)")
    parser.add_argument(
        "--data", required=True, help="training_jsonl file; prompts = turns before the first reply"
    )
    defaults = inspect.signature(evaluate_drafts).parameters  # one set of defaults, Python's and the CLI's
    for name, kind in (("max_new_tokens", int), ("num_prompts", int), ("temperature", float), ("seed", int)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=defaults[name].default)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="dtype of the target, the draft and the head (bf16: what a server runs, and half the memory "
        "of fp32 for a large target on a GPU)",
    )
    parser.add_argument("--out", nargs="+", help="write the summary JSON here (one path per draft)")
    parser.add_argument(
        "--tb-dir", nargs="+", help="write TensorBoard scalars (eval/...) here (one per draft)"
    )
    parser.add_argument(
        "--plot", nargs="+", help="write a PNG of the acceptance histogram here (one per draft)"
    )
    parser.add_argument(
        "--chat-template-kwargs",
        type=json_object_arg,
        default=None,
        help="JSON for the prompt's chat template, e.g. '{\"enable_thinking\": false}' (match the server; "
        "default: what the training run used, from the export's training_run.json)",
    )
    add_debug_flag(parser)
    return parser


def check_inputs(
    draft_dirs: Sequence[str | Path],
    target_dir: str | Path,
    data_jsonl: str | Path,
    *,
    num_prompts: int = 1,
    max_new_tokens: int = 1,
    device: str = "cpu",
) -> None:
    """Every path evaluation reads and its settings, before anything loads (named as the command
    line's options)."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_device(device)
    if isinstance(draft_dirs, (str, Path)):
        raise ValueError(f"draft_dirs: give a list of export directories, e.g. [{str(draft_dirs)!r}]")
    for draft in draft_dirs:
        require_path(draft, "--draft", "dir", "an export directory (config.json + model.safetensors)")
        if holds_draft(Path(draft)):
            raise ValueError(
                f"--draft {draft} is a training checkpoint, not an export: write its export with "
                f"`python -m dflash2.export {draft} <out>` and evaluate <out>"
            )
    require_path(target_dir, "--target", "dir", "the target's local model directory")
    require_path(data_jsonl, "--data", "file", "a training_jsonl file")


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    summaries = evaluate_drafts(
        args.draft,
        args.target,
        args.data,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        out_jsons=args.out,
        tb_dirs=args.tb_dir,
        plot_paths=args.plot,
        device=args.device,
        precision=args.precision,
        chat_template_kwargs=args.chat_template_kwargs,
    )
    for summary in summaries:
        if len(summaries) > 1:
            print(f"\n{summary['draft']}")
        for note in summary["notes"]:
            print(f"note: {note}")
        print(format_table(summary))
    return summaries


if __name__ == "__main__":
    exit_process(run_main(main))
