"""training_jsonl -> tokenized dataset with loss masks (`input_ids`, `loss_mask`, `id`).

Malformed lines are reported with their line number and reason and either skipped
(`on_error="skip"`) or raised (`on_error="fail"`). Samples whose (truncated) loss mask has no two
consecutive supervised tokens cannot form a single training block; they are dropped and counted.
The summary counts kept and dropped samples and why.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets

from dflash2.config import DataConfig
from dflash2.data.jsonl import Sample, SampleError, iter_lines, parse_sample
from dflash2.data.render import has_trainable_block, render_with_loss_mask

logger = logging.getLogger(__name__)
SUMMARY_FILE = "summary.json"
MAX_REPORTED_ERRORS = 100


FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
    }
)


@dataclass
class _Tally:
    """What happened to the lines of a file: the summary's counts."""

    num_lines: int = 0
    num_truncated: int = 0
    drops: Counter = field(default_factory=Counter)
    errors: list[dict[str, Any]] = field(default_factory=list)

    def drop(self, error: SampleError, line_number: int) -> None:
        self.drops[error.code] += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append({"line": line_number, "code": error.code, "reason": str(error)})


def prepare_dataset(
    jsonl_path: str | Path,
    tokenizer: Any,
    max_length: int,
    on_error: str = "skip",
    chat_template_kwargs: dict[str, Any] | None = None,
    end_of_turn: str | None = None,
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """Tokenize a training_jsonl file with the tokenizer's chat template.

    Returns the dataset (columns `id` str, `input_ids` list[int], `loss_mask` list[int]) and a
    summary dict. `end_of_turn` defaults to the tokenizer's eos token.
    """
    if on_error not in ("skip", "fail"):
        raise ValueError(f"on_error must be 'skip' or 'fail', got {on_error!r}")
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 (one anchor and one label), got {max_length}")
    rows: dict[str, list] = {"id": [], "input_ids": [], "loss_mask": []}
    tally = _Tally()
    first_line_of_id: dict[str, int] = {}
    for line_number, line in iter_lines(jsonl_path):
        tally.num_lines += 1
        try:
            sample = _parse_unique(line, line_number, first_line_of_id)
            input_ids, loss_mask = render_with_loss_mask(
                sample.messages, tokenizer, chat_template_kwargs, end_of_turn
            )
        except SampleError as error:
            if on_error == "fail":
                raise ValueError(
                    f"{jsonl_path}:{line_number}: {error} (use on_error='skip' to drop such lines)"
                ) from None
            logger.warning("%s:%d: %s (skipped)", jsonl_path, line_number, error)
            tally.drop(error, line_number)
            continue
        tally.num_truncated += len(input_ids) > max_length
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
        if not has_trainable_block(loss_mask):
            tally.drops["no_trainable_block"] += 1
            continue
        rows["id"].append(sample.id)
        rows["input_ids"].append(input_ids)
        rows["loss_mask"].append(loss_mask)
    summary = _summary(jsonl_path, max_length, chat_template_kwargs, rows, tally)
    return datasets.Dataset.from_dict(rows, features=FEATURES), summary


def _parse_unique(line: str, line_number: int, first_line_of_id: dict[str, int]) -> Sample:
    """parse_sample, and a SampleError for an id seen on an earlier line."""
    sample = parse_sample(line, line_number)
    if sample.id in first_line_of_id:
        raise SampleError(
            "duplicate_id", f"duplicate id {sample.id!r} (first on line {first_line_of_id[sample.id]})"
        )
    first_line_of_id[sample.id] = line_number
    return sample


def _summary(jsonl_path, max_length: int, chat_template_kwargs, rows: dict, tally: _Tally) -> dict[str, Any]:
    return {
        "source": str(jsonl_path),
        "source_sha256": _sha256(jsonl_path),
        "max_length": max_length,
        "chat_template_kwargs": chat_template_kwargs or {},
        "num_lines": tally.num_lines,
        "num_kept": len(rows["id"]),
        "num_dropped": sum(tally.drops.values()),
        "dropped_by_reason": dict(sorted(tally.drops.items())),
        "num_truncated": tally.num_truncated,
        "num_tokens": sum(map(len, rows["input_ids"])),
        "num_supervised_tokens": sum(map(sum, rows["loss_mask"])),
        "errors": tally.errors,
    }


def save_prepared(dataset: datasets.Dataset, summary: dict[str, Any], out_dir: str | Path) -> Path:
    """`dataset.save_to_disk(out_dir)` plus `out_dir/summary.json`."""
    out_dir = Path(out_dir)
    dataset.save_to_disk(str(out_dir))
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return out_dir


def load_prepared(path: str | Path) -> datasets.Dataset:
    """Load a dataset written by `save_prepared` (or `prepare.py`)."""
    path = Path(path)
    if not (path / "dataset_info.json").is_file():
        raise ValueError(
            f"{path} is not a prepared dataset (no dataset_info.json); run data_prep/prepare.py first"
        )
    dataset = datasets.load_from_disk(str(path))
    missing = {"id", "input_ids", "loss_mask"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"{path} lacks columns {sorted(missing)}; re-run data_prep/prepare.py")
    return dataset


def _sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build_dataset(data: DataConfig, tokenizer: Any, is_main: bool) -> datasets.Dataset:
    """The run's dataset: a prepared dataset directory is loaded as is; a training_jsonl file is
    prepared on the fly (rank 0 prints what was kept and dropped)."""
    source = Path(data.train)
    if source.is_dir():
        return load_prepared(source)
    dataset, summary = prepare_dataset(
        source,
        tokenizer,
        data.max_length,
        on_error=data.on_error,
        chat_template_kwargs=data.chat_template_kwargs,
    )
    if is_main:
        dropped = summary["num_dropped"]
        reasons = ", ".join(f"{k}: {v}" for k, v in summary["dropped_by_reason"].items()) or "none"
        print(
            f"[dflash2] data {source}: kept {summary['num_kept']}, dropped {dropped} ({reasons}), "
            f"{summary['num_tokens']} tokens, {summary['num_supervised_tokens']} supervised"
        )
    return dataset
