"""training_jsonl -> tokenized dataset with loss masks (`input_ids`, `loss_mask`, `id`).

Every conversation that is not kept is reported with its line and reason. Malformed lines (invalid
JSON or UTF-8, a bad turn, a duplicate id, ...) are skipped (`on_error="skip"`) or stop the
preparation (`on_error="fail"`). A conversation whose prompt alone fills `max_length`, or whose
(truncated) loss mask has no two consecutive supervised tokens, cannot form a single training block:
it is dropped. A conversation equal to an earlier one (same turns, whatever its id) is a duplicate:
reported, and kept (`duplicates="keep"`, the default) or dropped. An input without a single
conversation, or without one that can be trained on, is an error. The summary counts kept, dropped by reason, and duplicates.

A reply that carries `token_ids` (written by regeneration with a local target) trains on those ids,
not on its re-tokenised text; a sample whose text does not re-tokenise to its ids is kept, counted
(`num_token_ids_mismatch`) and its line reported.

A reply that the chat template renders otherwise once a later turn follows it (Qwen3's templates
drop the thinking of earlier replies) is kept in the conversation as the template renders it there,
unsupervised: it is what the target was given when it wrote the later replies, which are trained on
(`num_history_replies`). Any other reply not found verbatim in the rendered text drops its sample
(`template_mismatch`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import multiprocessing
import numbers
import pickle
import shlex
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy

from dflash2.config import DataConfig
from dflash2.data.jsonl import Sample, SampleError, iter_lines, parse_sample
from dflash2.data.render import Rendered, has_trainable_block, render_with_token_ids

logger = logging.getLogger(__name__)
SUMMARY_FILE = "summary.json"
MAX_REPORTED_ERRORS = 100
# Replies whose text does not re-tokenise to their token_ids are logged one line each up to this many,
# then counted in one line: they are expected (a target's greedy ids are often not the canonical
# tokenisation of their text) and trained on their ids, so the console does not list them all.
MAX_LOGGED_MISMATCHES = 5
SLOW_PREPARE_S = 60.0  # a run that tokenises its JSONL for longer is told to prepare it once


FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
    }
)


@dataclass
class _Tally:
    """What happened to the lines of a file: the summary's counts and first MAX_REPORTED_ERRORS
    entries; every entry is also logged (unless quiet) as `<file>:<line>: <reason> (<what was done>)`,
    but for the token_ids mismatches past the first MAX_LOGGED_MISMATCHES (counted in one line)."""

    path: Path
    quiet: bool = False
    num_lines: int = 0
    num_truncated: int = 0
    drops: Counter = field(default_factory=Counter)
    errors: list[dict[str, Any]] = field(default_factory=list)
    num_duplicates: int = 0
    duplicates: list[dict[str, int]] = field(default_factory=list)
    num_with_token_ids: int = 0
    token_ids_mismatches: list[int] = field(default_factory=list)  # line numbers, all of them
    num_history_replies: int = 0
    history_reply_lines: list[int] = field(default_factory=list)

    def history(self, line_number: int, count: int) -> None:
        """Replies the template rewrites once a later turn follows them: kept as context."""
        self.num_history_replies += count
        if count and len(self.history_reply_lines) < MAX_REPORTED_ERRORS:
            self.history_reply_lines.append(line_number)

    def token_ids(self, line_number: int, matches_text: bool) -> None:
        self.num_with_token_ids += 1
        if not matches_text:
            self.token_ids_mismatches.append(line_number)
            if len(self.token_ids_mismatches) <= MAX_LOGGED_MISMATCHES:
                self.log(
                    line_number, "the reply text does not re-tokenise to its token_ids (trained on the ids)"
                )

    def finish(self) -> None:
        """One line for the mismatches not logged one by one."""
        more = len(self.token_ids_mismatches) - MAX_LOGGED_MISMATCHES
        if more > 0 and not self.quiet:
            logger.warning(
                "%s: %d more samples do not re-tokenise to their token_ids (trained on the ids; "
                "the first %d lines are in the summary's token_ids_mismatch_lines)",
                self.path,
                more,
                MAX_REPORTED_ERRORS,
            )

    def drop(self, error: SampleError, line_number: int) -> None:
        self.drops[error.code] += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append({"line": line_number, "code": error.code, "reason": str(error)})
        self.log(line_number, f"{error} (dropped)")

    def duplicate(self, line_number: int, first_line: int, kept: bool) -> None:
        self.num_duplicates += 1
        if len(self.duplicates) < MAX_REPORTED_ERRORS:
            self.duplicates.append({"line": line_number, "first_line": first_line})
        if kept:
            self.log(line_number, f"duplicate of line {first_line} (kept)")
        else:
            self.drop(SampleError("duplicate", f"duplicate of line {first_line}"), line_number)

    def log(self, line_number: int, message: str) -> None:
        if not self.quiet:
            logger.warning("%s:%d: %s", self.path, line_number, message)


def prepare_dataset(
    jsonl_path: str | Path,
    tokenizer: Any,
    max_length: int,
    on_error: str = "skip",
    chat_template_kwargs: dict[str, Any] | None = None,
    end_of_turn: str | None = None,
    duplicates: str = "keep",
    quiet: bool = False,
    num_proc: int = 1,
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """Tokenize a training_jsonl file with the tokenizer's chat template.

    Returns the dataset (columns `id` str, `input_ids` list[int], `loss_mask` list[int]) and a
    summary dict. `end_of_turn` defaults to the tokenizer's eos token. `quiet`: log nothing per line.
    `num_proc`: worker processes that parse and render the lines (the same result in the same order
    as one process; the checks across lines, duplicates and the counts, stay in this one).
    """
    _check_options(on_error, duplicates, max_length, num_proc)
    rows: dict[str, list] = {"id": [], "input_ids": [], "loss_mask": []}
    tally = _Tally(Path(jsonl_path), quiet)
    first_line_of_id: dict[str, int] = {}
    first_line_of_turns: dict[str, int] = {}
    rendering = (tokenizer, chat_template_kwargs, end_of_turn)
    for line_number, parsed, rendered in _rendered_lines(jsonl_path, rendering, num_proc):
        tally.num_lines += 1
        try:
            sample = _unique(parsed, rendered, line_number, first_line_of_id)
        except SampleError as error:
            if on_error == "fail":
                raise ValueError(
                    f"{jsonl_path}:{line_number}: {error} (data.on_error=skip in a run config, --on-error skip for data_prep/prepare.py, drops such lines)"
                ) from None
            tally.drop(error, line_number)
            continue
        truncated = len(rendered.input_ids) > max_length
        try:
            input_ids, loss_mask = _fit(rendered.input_ids, rendered.loss_mask, max_length)
        except SampleError as error:
            tally.drop(error, line_number)
            continue
        # duplicates of kept lines only (a line dropped above is no first occurrence)
        turns = hashlib.sha256(json.dumps(sample.messages).encode()).hexdigest()
        if turns in first_line_of_turns:
            tally.duplicate(line_number, first_line_of_turns[turns], kept=duplicates == "keep")
            if duplicates == "drop":
                continue
        first_line_of_turns.setdefault(turns, line_number)
        if any("token_ids" in turn for turn in sample.messages):  # of the kept samples
            tally.token_ids(line_number, rendered.matches_text)
        tally.history(line_number, rendered.history_replies)
        tally.num_truncated += truncated
        rows["id"].append(sample.id)
        rows["input_ids"].append(input_ids)
        rows["loss_mask"].append(loss_mask)
    _check_kept(jsonl_path, tally, len(rows["id"]))
    summary = _summary(jsonl_path, max_length, chat_template_kwargs, rows, tally)
    summary.update(duplicates_policy=duplicates)
    return datasets.Dataset.from_dict(rows, features=FEATURES), summary


# A line's number, the line parsed (or why not: a SampleError, or what a worker raised) and rendered
# (or why not; None when it did not parse).
Outcome = tuple[int, Sample | Exception, Rendered | SampleError | None]
LINES_PER_TASK = 256  # lines a worker process renders at a time
TASKS_AHEAD = 4  # tasks per worker in flight: bounds the lines held in memory


def _render_line(line_number: int, line: Any, rendering: tuple) -> Outcome:
    """What one line gives on its own: the checks that need other lines come after."""
    try:
        sample = parse_sample(line, line_number, require_reply=True)
    except SampleError as error:
        return line_number, error, None
    try:
        return line_number, sample, render_with_token_ids(sample.messages, *rendering)
    except SampleError as error:
        return line_number, sample, error


def _rendered_lines(jsonl_path, rendering: tuple, num_proc: int) -> Iterator[Outcome]:
    """Every line's outcome, in the file's order; rendered by `num_proc` worker processes when more
    than one (started fresh, `spawn`: a fork of a process with torch's threads may hang)."""
    if num_proc == 1:
        yield from (_render_line(number, line, rendering) for number, line in iter_lines(jsonl_path))
        return
    _refuse_in_bootstrapping_worker(num_proc)
    with tempfile.TemporaryDirectory(prefix="dflash2-prepare-") as scratch:
        # The tokenizer reaches the workers through a file: a start-up argument of megabytes fills
        # the pipe to a worker that ends before reading it, and the parent then waits on it forever.
        rendering_file = Path(scratch, "rendering.pickle")
        rendering_file.write_bytes(pickle.dumps(rendering))
        yield from _pooled_outcomes(_chunks(iter_lines(jsonl_path), LINES_PER_TASK), rendering_file, num_proc)


def _pooled_outcomes(tasks: Iterator[list], rendering_file: Path, num_proc: int) -> Iterator[Outcome]:
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(num_proc, context, initializer=_start_worker, initargs=(str(rendering_file),))
    try:
        pending = deque(
            pool.submit(_render_task, task) for task in itertools.islice(tasks, num_proc * TASKS_AHEAD)
        )
        while pending:
            outcomes = pending.popleft().result()
            pending.extend(pool.submit(_render_task, task) for task in itertools.islice(tasks, 1))
            yield from outcomes
    except (BrokenProcessPool, BrokenPipeError) as error:
        raise RuntimeError(
            f"a worker process of prepare_dataset(num_proc={num_proc}) ended before it rendered its "
            f"lines ({type(error).__name__}; its own message, if any, is above): a script that calls "
            'it needs the `if __name__ == "__main__":` guard, and a worker killed for memory needs a '
            "lower num_proc (or 1, no workers)"
        ) from None
    finally:
        pool.shutdown(cancel_futures=True)


def _refuse_in_bootstrapping_worker(num_proc: int) -> None:
    """`spawn` workers run the main script again. One without the `__main__` guard would start
    workers of its own while it starts (Python refuses that, and the pool then hangs): such a worker
    ends at once with this line, and its parent reports the fix. A script read from stdin cannot be
    run again: refused before any worker starts."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise SystemExit(
            f"[dflash2] prepare_dataset(num_proc={num_proc}) ran while a worker process started: put "
            'the script\'s call under `if __name__ == "__main__":`'
        )
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file is not None and not Path(main_file).is_file():
        raise ValueError(
            f"prepare_dataset(num_proc={num_proc}) starts worker processes that run the main script "
            f"again, and {main_file!r} is not a file it can run (a script read from stdin, a zip "
            "archive?): save the script to a file, or use num_proc=1"
        )


def _chunks(items: Iterator, size: int) -> Iterator[list]:
    while chunk := list(itertools.islice(items, size)):
        yield chunk


_worker_rendering: tuple = ()  # a worker process's tokenizer, chat template arguments and end of turn


def _start_worker(rendering_file: str) -> None:
    global _worker_rendering
    _worker_rendering = pickle.loads(Path(rendering_file).read_bytes())


def _render_task(lines: list[tuple[int, Any]]) -> list[Outcome]:
    """The task's outcomes up to a line that raised something other than a SampleError, which is
    handed back as that line's outcome: one process would raise it there, after the lines before."""
    outcomes = []
    for line_number, line in lines:
        try:
            outcomes.append(_render_line(line_number, line, _worker_rendering))
        except Exception as error:  # noqa: BLE001 - re-raised by the main process, in the file's order
            outcomes.append((line_number, _picklable(error), None))
            break
    return outcomes


def _picklable(error: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as its text
        return RuntimeError(f"{type(error).__name__}: {error}")


def _check_options(on_error: str, duplicates: str, max_length: int, num_proc: int = 1) -> None:
    if on_error not in ("skip", "fail"):
        raise ValueError(f"on_error must be 'skip' or 'fail', got {on_error!r}")
    if duplicates not in ("keep", "drop"):
        raise ValueError(f"duplicates must be 'keep' or 'drop', got {duplicates!r}")
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 (one anchor and one label), got {max_length}")
    if (
        isinstance(num_proc, (bool, numpy.bool_))
        or not isinstance(num_proc, numbers.Integral)
        or num_proc < 1
    ):
        raise ValueError(f"num_proc must be a whole number of processes, at least 1, got {num_proc!r}")


def _check_kept(jsonl_path, tally: _Tally, num_kept: int) -> None:
    """An empty file, or one none of whose conversations can be trained on, is an error."""
    if tally.num_lines == 0:
        raise ValueError(f"{jsonl_path} holds no conversation (it is empty): give a training_jsonl file")
    tally.finish()
    if not num_kept:
        reasons = ", ".join(f"{reason} x{count}" for reason, count in sorted(tally.drops.items()))
        raise ValueError(
            f"no conversation of {jsonl_path} can be trained on ({reasons}; each line's reason is "
            "logged above): fix the data or the settings those reasons name"
        )


def _fit(input_ids: list[int], loss_mask: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """Truncate to max_length; a SampleError when no training block is left."""
    if 1 in loss_mask and loss_mask.index(1) >= max_length:
        raise SampleError(
            "prompt_too_long",
            f"prompt longer than max_length ({loss_mask.index(1)} tokens before the first reply, "
            f"max_length {max_length})",
        )
    input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    if not has_trainable_block(loss_mask):
        raise SampleError(
            "no_trainable_block",
            f"no two consecutive reply tokens within max_length {max_length} (nothing to train on)",
        )
    return input_ids, loss_mask


def _unique(
    parsed: Sample | Exception, rendered: Any, line_number: int, first_line_of_id: dict[str, int]
) -> Sample:
    """The parsed sample; else the error of its parsing, of its id (seen on an earlier line) or of
    its rendering, in that order."""
    if isinstance(parsed, Exception):
        raise parsed
    if parsed.id in first_line_of_id:
        raise SampleError(
            "duplicate_id", f"duplicate id {parsed.id!r} (first on line {first_line_of_id[parsed.id]})"
        )
    first_line_of_id[parsed.id] = line_number
    if isinstance(rendered, SampleError):
        raise rendered
    return parsed


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
        "num_duplicates": tally.num_duplicates,
        "num_truncated": tally.num_truncated,
        "num_with_token_ids": tally.num_with_token_ids,
        "num_token_ids_mismatch": len(tally.token_ids_mismatches),
        "token_ids_mismatch_lines": tally.token_ids_mismatches[:MAX_REPORTED_ERRORS],
        "num_history_replies": tally.num_history_replies,
        "history_reply_lines": tally.history_reply_lines,
        "num_tokens": sum(map(len, rows["input_ids"])),
        "num_supervised_tokens": sum(map(sum, rows["loss_mask"])),
        "errors": tally.errors,
        "duplicates": tally.duplicates,
    }


def describe(summary: dict[str, Any]) -> str:
    """One line: what was kept, dropped (by reason) and duplicated."""
    reasons = ", ".join(f"{k}: {v}" for k, v in summary["dropped_by_reason"].items()) or "none"
    policy = "dropped" if summary["duplicates_policy"] == "drop" else "kept"
    return (
        f"kept {summary['num_kept']} of {summary['num_lines']} conversations, dropped "
        f"{summary['num_dropped']} ({reasons}), duplicates {summary['num_duplicates']} ({policy}), "
        f"truncated {summary['num_truncated']}; {summary['num_supervised_tokens']} supervised of "
        f"{summary['num_tokens']} tokens; {summary['num_with_token_ids']} with the target's token ids "
        f"({summary['num_token_ids_mismatch']} of them do not re-tokenise from their text)"
        + _history_clause(summary["num_history_replies"])
    )


def _history_clause(count: int) -> str:
    if not count:
        return ""
    return (
        f"; {count} earlier replies kept as unsupervised context (the chat template renders them otherwise "
        "once a later turn follows, e.g. without their thinking: the later turns' prompt as the target saw it)"
    )


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


def check_token_ids_in_vocab(dataset: datasets.Dataset, vocab_size: int) -> None:
    """Every token id of the dataset lies in the target's vocabulary [0, vocab_size): an id past it
    (a `token_ids` list from another model, or edited by hand) would fail deep in the target's or the
    draft's embedding, mid-run. One vectorised pass; the offending sample is named."""
    import pyarrow.compute as pc

    flat = pc.list_flatten(dataset.with_format("arrow")["input_ids"])
    if len(flat) == 0 or pc.max(flat).as_py() < vocab_size:
        return
    row, bad = next(
        (row, max(ids)) for row, ids in enumerate(dataset["input_ids"]) if ids and max(ids) >= vocab_size
    )
    raise ValueError(
        f"sample {dataset[row]['id']!r} holds token id {bad}, outside the target's vocabulary of {vocab_size}: "
        "its 'token_ids' were not generated by this target (or the tokenizer is not the target's); "
        "regenerate that sample with this target or remove its 'token_ids'"
    )


def check_prepared(path: Path, data: DataConfig) -> None:
    """A prepared directory's samples were rendered with the chat template arguments of its
    summary.json; the run's own (data.chat_template_kwargs) are what its export records and what
    evaluation and serving render prompts with, so the two must agree. Its samples were cut at its
    own max_length, which must not exceed the run's data.max_length (which the memory plan, the
    batches and the capture are sized by)."""
    summary_path = path / SUMMARY_FILE
    if not summary_path.is_file():
        return
    summary = json.loads(summary_path.read_text())
    prepared = summary.get("chat_template_kwargs") or {}
    if prepared != dict(data.chat_template_kwargs):
        raise ValueError(
            f"{path} was prepared with chat_template_kwargs {prepared}, but this run's "
            f"data.chat_template_kwargs is {dict(data.chat_template_kwargs)} (recorded in the export: evaluation and "
            f"serving render prompts with it); set data.chat_template_kwargs to {prepared}, or prepare the data "
            "again with --chat-template-kwargs"
        )
    prepared_length = summary.get("max_length")
    if isinstance(prepared_length, int) and prepared_length > data.max_length:
        raise ValueError(
            f"{path} was prepared with max_length {prepared_length}, longer than this run's data.max_length "
            f"{data.max_length}, which the run is sized by (a prepared directory is loaded as it is); set "
            f"data.max_length={prepared_length}, or prepare the data again with --max-length {data.max_length}"
        )


def _sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def prepare_command(data: DataConfig) -> str:
    """The data_prep/prepare.py command that prepares the run's JSONL as the run itself would."""
    command = (
        f"python data_prep/prepare.py --input {shlex.quote(str(data.train))} --tokenizer <the target's directory> "
        f"--max-length {data.max_length} --on-error {data.on_error} --duplicates {data.duplicates}"
    )
    if data.chat_template_kwargs:
        command += f" --chat-template-kwargs {shlex.quote(json.dumps(dict(data.chat_template_kwargs)))}"
    return command + " --num-proc <cores> --out <dir>"


def build_dataset(data: DataConfig, tokenizer: Any, is_main: bool) -> datasets.Dataset:
    """The run's dataset: a prepared dataset directory is loaded as is; a training_jsonl file is
    prepared on the fly (rank 0 reports every dropped line and what was kept)."""
    source = Path(data.train)
    if source.is_dir():
        check_prepared(source, data)
        return load_prepared(source)
    start = time.perf_counter()
    dataset, summary = prepare_dataset(
        source,
        tokenizer,
        data.max_length,
        on_error=data.on_error,
        chat_template_kwargs=data.chat_template_kwargs,
        duplicates=data.duplicates,
        quiet=not is_main,
    )
    took = time.perf_counter() - start
    if is_main:
        print(f"[dflash2] data {source}: {describe(summary)}", flush=True)
        if took > SLOW_PREPARE_S:
            print(
                f"[dflash2] tokenising {source} took {took:.0f} s, on every rank and at every launch (a resume or "
                f"a requeue included): prepare it once, in parallel ({prepare_command(data)}), and set "
                "data.train to that directory",
                flush=True,
            )
    return dataset
