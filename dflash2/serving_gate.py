"""The serving gate: overfit a few samples, export, reload the export, decode — an end-to-end smoke
test of the whole pipeline (data -> features -> objective -> training -> export -> serving loop).

    python -m dflash2.serving_gate --config <run yaml> --data <training_jsonl> \
        [--num-samples N] [--steps N] [--out result.json] [key=value ...]

1. take the first N (1..10) conversations of the data, each up to its first reply (the exchange
   decoded in 3), and regenerate their assistant replies with
   the target's own greedy decoding, keeping the ids it generated: training uses those ids, so the
   labels are exactly what the target generates even where the reply's text would re-tokenise
   differently (a random-initialised target);
2. train on them with the real training code (`dflash2.run.run`) until they are memorised;
3. load the draft back from `<gate dir>/export` (what a server would load) and decode the first
   sample's prompt with speculative decoding (greedy).

A draft that memorised its data proposes the target's reply block after block, so every verify
step commits the whole block: the gate passes iff spec_accept_length >= block_size and
target_prefix_match_tokens >= block_size. The decode covers the whole blocks that fit in the
target's reply: positions after the end-of-turn token are never supervised, so a final partial
block would say nothing about the pipeline.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from dflash2.config import RunConfig, check_model_paths, load_run_config, require_path
from dflash2.data.jsonl import SampleError, iter_lines, parse_sample, prompt_turns
from dflash2.data.regenerate import LocalTargetGenerator, regenerate_conversations
from dflash2.data.render import encode_prompt, render_with_token_ids, stop_token_ids
from dflash2.decode import speculative_generate, target_generate
from dflash2.errors import OverridesParser, add_debug_flag, exit_process, run_main
from dflash2.export import read_training_run
from dflash2.models import TargetHead, load_draft
from dflash2.run import run
from dflash2.target.load import load_full_target
from dflash2.target.recorded_generate import common_prefix

GATE_DIR_NAME = "serving_gate"
DATA_NAME = "gate_data.jsonl"
RESULT_NAME = "serving_gate.json"
MAX_SAMPLES = 10
# Memorising a handful of samples: every anchor of every sample in each step, a high learning rate,
# and the loss over the whole vocabulary (a loss over the samples' few tokens never ranks the others
# below them, and the served draft scores all of them), from a random start (a draft started from
# the target's layers, model.init_from_target, learns its samples more slowly: on SmolLM2 its
# 60 steps served the sample at tau 3.33 / 4).
DEFAULT_STEPS = 60
GATE_OVERRIDES = (
    "objective.num_anchors=256",
    "objective.loss_gamma=null",
    "objective.loss_vocab_size=null",
    # the replies it then decodes, not the prompts too (a recipe's supervised_tokens=all spent the 60
    # steps on SmolLM2's 101 prompt tokens as well: in-sample acceptance 3.76 of 3.98, tau 3.33 / 4)
    "objective.supervised_tokens=replies",
    "model.init_from_target=false",
    "model.init_target_layers=null",
    "train.lr=3e-3",
    "train.schedule=cosine",
    "train.min_lr_ratio=0.1",
    "train.grad_accum_steps=1",
    "train.log_every=50",
    "train.progress_bar=false",
)


def select_samples(data_jsonl: str | Path, num_samples: int) -> list[dict]:
    """The first `num_samples` valid conversations (as {"id", "conversations"} records), each up to
    its first reply: the exchange the gate decodes, which a later turn would make history (a chat
    template may render that reply otherwise there, e.g. without its thinking, and then it would not
    be trained)."""
    if not 1 <= num_samples <= MAX_SAMPLES:
        raise ValueError(f"--num-samples must be between 1 and {MAX_SAMPLES}, got {num_samples}")
    samples = []
    for line_number, line in iter_lines(data_jsonl):
        try:
            sample = parse_sample(line, line_number)
            prompt = prompt_turns(sample.messages)  # the gate decodes a sample's prompt
        except SampleError as error:
            raise ValueError(f"{data_jsonl}:{line_number}: {error}") from None
        samples.append({"id": sample.id, "conversations": sample.messages[: len(prompt) + 1]})
        if len(samples) == num_samples:
            return samples
    raise ValueError(
        f"{data_jsonl}: has {len(samples)} conversations, fewer than --num-samples {num_samples}"
    )


def regenerate_samples(
    samples: list[dict], target, tokenizer, max_new_tokens: int, template_kwargs
) -> list[dict]:
    """Replace every assistant turn by the target's own greedy reply."""
    generator = LocalTargetGenerator(target, tokenizer, max_new_tokens, template_kwargs)
    conversations = regenerate_conversations([s["conversations"] for s in samples], generator)
    return [{"id": s["id"], "conversations": c} for s, c in zip(samples, conversations, strict=True)]


def prepare_gate_dir(gate_dir: Path) -> None:
    """The gate owns `gate_dir`: a previous gate run there is removed, anything else is refused."""
    if gate_dir.exists() and any(gate_dir.iterdir()):
        if not (gate_dir / DATA_NAME).exists():
            raise ValueError(
                f"{gate_dir} exists and is not a serving-gate directory; choose another output_dir"
            )
        shutil.rmtree(gate_dir)
    gate_dir.mkdir(parents=True, exist_ok=True)


def train_overrides(
    gate_dir: Path,
    data_path: Path,
    steps: int,
    num_samples: int,
    user: Sequence[str],
) -> list[str]:
    """Gate defaults, then the user's overrides, then what the gate must control. The gate trains in
    one process, with `backend=local`."""
    forced = [
        f"output_dir={gate_dir}",
        f"data.train={data_path}",
        f"train.max_steps={steps}",
        f"train.micro_batch_size={num_samples}",
        "train.global_batch_size=null",  # one micro-batch of every sample per step (train.grad_accum_steps=1)
        "train.save_every=0",
        "train.resume=none",
        "train.export=true",
        "data.features_dir=null",
        "topology=colocated",
        "capture_ranks=0",
    ]
    return ["backend=local", *GATE_OVERRIDES, f"train.warmup_steps={min(10, steps)}", *user, *forced]


def decode_check(
    export_dir: Path,
    target,
    tokenizer,
    sample: dict,
    max_new_tokens: int,
    template_kwargs,
    max_length: int | None = None,
) -> dict:
    """Reload the export, decode the sample's prompt with speculative decoding, compare with the
    target's own greedy reply. Returns the decode fields of the result, `errors` and `warnings`.
    The prompt is rendered with the chat template arguments the export's training run recorded."""
    template_kwargs = read_training_run(export_dir).get("chat_template_kwargs", template_kwargs)
    draft = load_draft(export_dir, dtype=torch.float32)
    head = TargetHead.from_target(target, dtype=torch.float32)
    block_size = draft.block_size
    prompt = encode_prompt(prompt_turns(sample["conversations"]), tokenizer, template_kwargs)
    stop_ids = stop_token_ids(tokenizer, target)
    reference = target_generate(target, prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids)
    ids = render_with_token_ids(sample["conversations"], tokenizer, template_kwargs).input_ids
    result = {
        "block_size": block_size,
        "target_tokens": len(reference),
        "errors": [],
        "warnings": label_check(ids, prompt, reference),
    }
    rendered = len(ids)
    if max_length is not None and rendered > max_length:  # its end was never trained: say so first
        result["errors"].append(
            f"the gate's sample renders to {rendered} tokens, more than data.max_length={max_length}: the "
            f"reply past the cut was never trained; rerun with data.max_length={rendered} (or --max-new-tokens lower)"
        )
    # The prefill gives one token, each fully accepted verify step one block.
    num_blocks = (len(reference) - 1) // block_size
    if num_blocks == 0:
        result["errors"].append(
            f"the target's reply has {len(reference)} tokens, fewer than 1 + block_size ({1 + block_size}); "
            "pick a sample with a longer reply"
        )
        return result
    spec = speculative_generate(
        draft, target, head, prompt, max_new_tokens=1 + num_blocks * block_size, stop_token_ids=stop_ids
    )
    result.update(
        spec_accept_length=spec.mean_acceptance_length,
        acceptance_lengths=spec.acceptance_lengths,
        target_prefix_match_tokens=common_prefix(spec.output_ids, reference),
        generated_tokens=len(spec.output_ids),
        clean_block_tokens=spec.clean_block_tokens,
    )
    return result


def label_check(ids: list[int], prompt_ids: list[int], reference: list[int]) -> list[str]:
    """Warn when the training labels of the first reply are not the target's own tokens (data without
    the target's ids whose text re-tokenizes differently); the gate can still pass, but such data
    trains the wrong thing."""
    labels = ids[len(prompt_ids) : len(prompt_ids) + len(reference)]
    if ids[: len(prompt_ids)] != prompt_ids or labels != reference:
        return ["the rendered training sample does not contain the target's greedy tokens after the prompt"]
    return []


def judge(result: dict) -> None:
    """Set `passed` and explain a failure in `errors`."""
    block_size = result.get("block_size", 0)
    if "acceptance_lengths" not in result:  # no decode happened; errors already say why
        result["passed"] = False
        return
    if result["spec_accept_length"] < block_size:
        result["errors"].append(
            f"spec_accept_length {result['spec_accept_length']:.3f} < block_size {block_size}"
        )
    if result["target_prefix_match_tokens"] < result["generated_tokens"]:
        result["errors"].append(
            f"the output differs from the target's own reply after {result['target_prefix_match_tokens']} of "
            f"{result['generated_tokens']} tokens"
        )
    result["passed"] = not result["errors"]
    if not result["passed"]:
        underfit = overfit_shortfall(result.get("train_final_metrics") or {}, result.get("steps"))
        result["errors"] += [underfit] if underfit else []


def overfit_shortfall(metrics: dict, steps: int | None) -> str | None:
    """Why a gate failed when training, not serving, fell short: the draft's own in-sample acceptance
    (the selector's walk for DFlash 2) at the last step was below what its sample allows."""
    reached = metrics.get("insample_accept_len_selector", metrics.get("insample_accept_len"))
    possible = metrics.get("insample_accept_len_max")
    if reached is None or possible is None or reached >= possible - 1e-3:
        return None
    return (
        f"the overfit did not memorise its sample: in-sample acceptance {reached:.2f} of a possible "
        f"{possible:.2f} after {steps} steps (loss {metrics.get('loss', float('nan')):.3f}), so the decode "
        f"could not reach the block either; this says nothing of the serving path: rerun with --steps {2 * (steps or 60)}"
    )


def _timed(result: dict, stage: str, fn, *args):
    clock = time.perf_counter()
    value = fn(*args)
    result["timings_s"][stage] = round(time.perf_counter() - clock, 2)
    return value


def run_gate(
    config_path: str | Path,
    data_jsonl: str | Path,
    *,
    num_samples: int = 1,
    steps: int = DEFAULT_STEPS,
    overrides: Sequence[str] = (),
    out_json: str | Path | None = None,
    max_new_tokens: int = 256,
) -> dict:
    """Overfit -> export -> reload -> decode. Returns the result dict (also written as JSON).

    The gate directory is `<output_dir>/serving_gate` (output_dir from the config and overrides);
    the result goes to `out_json`, default `<gate dir>/serving_gate.json`.
    """
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    base = load_run_config(config_path, list(overrides))
    gate_dir = Path(base.output_dir) / GATE_DIR_NAME
    result_path = Path(out_json) if out_json is not None else gate_dir / RESULT_NAME
    samples = select_samples(data_jsonl, num_samples)
    prepare_gate_dir(gate_dir)
    result = new_result(result_path, num_samples, steps)
    try:
        run_stages(result, config_path, overrides, base, samples, steps, max_new_tokens)
    except Exception as error:  # recorded in the result (a gate must always report), then re-raised
        result["errors"].append(f"{type(error).__name__}: {error}")
        write_result(result, result_path)
        raise
    judge(result)
    write_result(result, result_path)
    return result


def new_result(result_path: Path, num_samples: int, steps: int) -> dict:
    """The result of a gate that has not decoded anything yet."""
    return {
        "passed": False,
        "input_format": "training_jsonl",
        "spec_accept_length": 0.0,
        "target_prefix_match_tokens": 0,
        "generated_tokens": 0,
        "target_tokens": 0,
        "clean_block_tokens": 0,
        "errors": [],
        "result_path": str(result_path),
        "num_samples": num_samples,
        "steps": steps,
        "timings_s": {},
    }


def run_stages(
    result: dict,
    config_path: str | Path,
    overrides: Sequence[str],
    base: RunConfig,
    samples: list[dict],
    steps: int,
    max_new_tokens: int,
) -> None:
    """Regenerate -> train -> decode, each stage timed into `result`, the decode fields merged in.
    `base` is the user's run config; the gate trains with its own overrides on top (train_overrides)."""
    from transformers import AutoTokenizer

    gate_dir = Path(base.output_dir) / GATE_DIR_NAME
    template_kwargs = base.data.chat_template_kwargs
    tokenizer = AutoTokenizer.from_pretrained(base.model.target)
    target = load_full_target(base.model.target, torch.float32, "cpu")
    regenerate = (samples, target, tokenizer, max_new_tokens, template_kwargs)
    samples = _timed(result, "regenerate", regenerate_samples, *regenerate)
    data_path = gate_dir / DATA_NAME
    data_path.write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples))
    gate_overrides = train_overrides(gate_dir, data_path, steps, len(samples), overrides)
    cfg = load_run_config(config_path, gate_overrides)
    metrics = _timed(result, "train", run, cfg)
    result["train_final_metrics"] = {k: float(v) for k, v in (metrics or {}).items()}
    decode = (gate_dir / "export", target, tokenizer, samples[0], max_new_tokens, template_kwargs)
    decoded = _timed(result, "decode", decode_check, *decode, cfg.data.max_length)
    result["errors"] += decoded.pop("errors")
    result.update(decoded)


def write_result(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = OverridesParser(
        prog="python -m dflash2.serving_gate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="run config YAML (target, draft config, precision)")
    parser.add_argument(
        "--data", required=True, help="training_jsonl; the first --num-samples conversations are used"
    )
    parser.add_argument("--num-samples", type=int, default=1, help=f"1..{MAX_SAMPLES}")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps of the overfit")
    parser.add_argument(
        "--max-new-tokens", type=int, default=256, help="length limit of the regenerated replies"
    )
    parser.add_argument("--out", help=f"result JSON (default <output_dir>/{GATE_DIR_NAME}/{RESULT_NAME})")
    parser.add_argument("overrides", nargs="*", help="dotted key=value run-config overrides")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    check_model_paths(load_run_config(args.config, args.overrides))
    require_path(args.data, "--data", "file", "a training_jsonl file")
    result = run_gate(
        args.config,
        args.data,
        num_samples=args.num_samples,
        steps=args.steps,
        overrides=args.overrides,
        out_json=args.out,
        max_new_tokens=args.max_new_tokens,
    )
    verdict = "PASSED" if result["passed"] else "FAILED"
    print(
        f"serving gate {verdict}: tau {result['spec_accept_length']:.2f} / {result.get('block_size')}, "
        f"target prefix match {result['target_prefix_match_tokens']} of {result['generated_tokens']} generated "
        f"({result['target_tokens']} in the target's reply); result {result['result_path']}"
    )
    for error in result["errors"]:
        print(f"  error: {error}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    exit_process(run_main(main))
