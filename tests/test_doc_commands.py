"""Every command line the docs show runs past its CLI's own argument parser: no unknown flag, no
missing required flag, no dotted override the run config's validation refuses, no config file that
does not exist. The commands are read from the fenced blocks of README.md, docs/*.md and
launch/slurm/README.md (backslash continuations joined, `&&` / `;` / `|` split, env assignments and
`$ ` prompts dropped); each is checked against the argparse parser its entry point builds, captured
by calling the entry point with parsing intercepted (nothing runs)."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dflash2.config import load_run_config
from tests.run_helpers import load_script

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "launch" / "slurm" / "README.md"]
PYTHONS = re.compile(r"^(\S*/)?python3?$")
LAUNCHERS = re.compile(r"^(\S*/)?(torchrun|deepspeed)$")
NOT_SHELL = {"python", "py", "yaml", "yml", "json", "text", "toml", "diff"}
OVERRIDE = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*=")
PLACEHOLDER = re.compile(r"<[^<>]+>")


# ------------------------------------------------------------------ reading the docs


def fenced_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, body) of every fenced block not tagged with a non-shell language."""
    blocks, inside, language, start, lines = [], False, "", 0, []
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if not inside:
                inside, language, start, lines = True, line.strip().strip("`").strip().lower(), number, []
            else:
                inside = False
                if language not in NOT_SHELL:
                    blocks.append((start + 1, "\n".join(lines)))
            continue
        if inside:
            lines.append(line)
    return blocks


def logical_lines(body: str) -> list[tuple[int, str]]:
    """Lines with backslash continuations joined, each with the offset of its first line."""
    out, pending, first = [], "", 0
    for offset, line in enumerate(body.splitlines()):
        if not pending:
            first = offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((first, pending + line))
        pending = ""
    if pending:
        out.append((first, pending))
    return out


def split_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line, as tokens (comments dropped, env assignments removed)."""
    line = line.strip()
    if line.startswith("$ "):
        line = line[2:]
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
    except ValueError:
        return []
    commands, current = [], []
    for token in tokens:
        if token and set(token) <= set(";&|"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    return [drop_assignments(c) for c in commands if c]


def drop_assignments(tokens: list[str]) -> list[str]:
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        tokens = tokens[1:]
    return tokens


# ------------------------------------------------------------------ which CLI a command invokes


def entry_point(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(entry point, its arguments) of a command that invokes one of the project's CLIs: a module
    name (`dflash2.plan`), a script path (`launch/train.py`), or `sbatch:<file>`; None otherwise."""
    if not tokens:
        return None
    head, rest = tokens[0], tokens[1:]
    if PYTHONS.match(head):
        rest = [t for t in rest if t not in ("-u", "-O")]
        if rest[:1] == ["-m"] and len(rest) > 1:
            if rest[1] == "torch.distributed.run":
                return script_after_options(rest[2:])
            return (rest[1], rest[2:]) if rest[1].startswith("dflash2.") else None
        return (rest[0], rest[1:]) if rest and is_script(rest[0]) else None
    if LAUNCHERS.match(head):
        return script_after_options(rest)
    if head == "sbatch":
        return script_after_options(rest, suffix=".sbatch")
    if head.endswith("multinode_torchrun.sh") or head.endswith("multinode_deepspeed.sh"):
        return "launch/train.py", rest
    if is_script(head):
        return head, rest
    return None


def is_script(token: str) -> bool:
    return token.endswith(".py") and (REPO / token).is_file()


def script_after_options(tokens: list[str], suffix: str = ".py") -> tuple[str, list[str]] | None:
    """A launcher's script: the first token naming a file of the repository (launcher options before)."""
    for i, token in enumerate(tokens):
        if token.endswith(suffix):
            return (f"sbatch:{token}" if suffix == ".sbatch" else token), tokens[i + 1 :]
    return None


# ------------------------------------------------------------------ the parser an entry point builds


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser, method: str):
        self.parser, self.method = parser, method


def _load_main(target: str) -> Callable[..., Any]:
    if target.endswith(".py"):
        module = load_script(target)
    else:
        module = importlib.import_module(target)
    return module.main


_PARSERS: dict[str, tuple[argparse.ArgumentParser, str]] = {}


def parser_of(target: str, monkeypatch: pytest.MonkeyPatch) -> tuple[argparse.ArgumentParser, str]:
    """The parser `target`'s main() builds and the parse method it calls (nothing past it runs)."""
    if target not in _PARSERS:
        with monkeypatch.context() as patch:
            for method in ("parse_args", "parse_intermixed_args", "parse_known_args"):

                def capture(self, *args, _method=method, **kwargs):
                    raise _Captured(self, _method)

                patch.setattr(argparse.ArgumentParser, method, capture)
            patch.setattr(sys, "argv", [target])
            with pytest.raises(_Captured) as captured:
                _load_main(target)()
        _PARSERS[target] = captured.value.parser, captured.value.method
    return _PARSERS[target]


# ------------------------------------------------------------------ checking one command


def override_problems(overrides: list[str]) -> list[str]:
    """What the run config's own validation says of `overrides` (unknown keys with their nearest
    valid key, bad values), leaving out the keys the overrides alone cannot give (required fields)."""
    try:
        load_run_config(None, overrides)
    except ValueError as error:
        lines = [line.strip() for line in str(error).splitlines()[1:]]
        return [line for line in lines if not line.endswith("Field required")] or []
    return []


def cleaned(arguments: list[str]) -> list[str]:
    """The arguments with the docs' notation removed: `[optional ...]` groups and `...`; a
    placeholder `<x>` stands for a value, so it is replaced by one argparse accepts for any type."""
    out, depth = [], 0
    for token in arguments:
        if token.startswith("["):
            depth += 1
        if depth == 0 and token not in ("...", "…"):
            out.append(PLACEHOLDER.sub("1", token) if PLACEHOLDER.fullmatch(token) else token)
        if token.endswith("]") and depth:
            depth -= 1
    return out


def check_overrides(arguments: list[str]) -> list[str]:
    problems = override_problems([t for t in arguments if OVERRIDE.match(t)])
    for token in arguments:
        config = token if token.endswith((".yaml", ".yml")) and token.startswith("configs/") else None
        if config and not (REPO / config).is_file():
            problems.append(f"{config} does not exist")
    return [p for p in problems if p]


def command_problems(target: str, arguments: list[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What is wrong with `target arguments` as the docs show it; [] when nothing."""
    arguments = cleaned(arguments)
    if target.startswith("sbatch:"):
        script = target.removeprefix("sbatch:")
        missing = [] if (REPO / script).is_file() else [f"{script} does not exist"]
        return missing + check_overrides(arguments)
    parser, method = parser_of(target, monkeypatch)
    messages: list[str] = []

    def error(message: str):
        raise _Refused(message)

    with monkeypatch.context() as patch:
        patch.setattr(parser, "error", error)
        patch.setattr(parser, "exit", lambda status=0, message=None: error(message or f"exit {status}"))
        try:
            getattr(parser, method)(arguments)
        except _Refused as refused:
            messages.append(str(refused))
    takes_overrides = any(action.dest == "overrides" for action in parser._actions)
    return messages + (check_overrides(arguments) if takes_overrides else [])


class _Refused(Exception):
    pass


# ------------------------------------------------------------------ the docs


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(where, entry point, arguments) of every command in the docs that invokes a project CLI."""
    found = []
    for doc in DOCS:
        for start, body in fenced_blocks(doc.read_text()):
            for offset, line in logical_lines(body):
                for tokens in split_commands(line):
                    invoked = entry_point(tokens)
                    if invoked:
                        found.append((f"{doc.relative_to(REPO)}:{start + offset}", *invoked))
    return found


COMMANDS = documented_commands()


def test_the_docs_show_commands_of_every_kind():
    """The reader finds what it should: a guard against a parser that silently finds nothing."""
    targets = {target for _, target, _ in COMMANDS}
    assert len(COMMANDS) >= 40
    assert {"launch/train.py", "dflash2.plan", "dflash2.export", "dflash2.evaluate"} <= targets
    assert {"data_prep/prepare.py", "benchmarks/pipeline.py"} <= targets
    assert any(t.startswith("sbatch:") for t in targets)


@pytest.mark.parametrize("where, target, arguments", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_documented_command_matches_its_parser_and_the_config_schema(where, target, arguments, monkeypatch):
    problems = command_problems(target, arguments, monkeypatch)
    assert not problems, f"{where}: {target} {' '.join(arguments)}\n" + "\n".join(problems)


SYNTHETIC = """
Some prose, then commands as a doc would show them:

```bash
.venv/bin/python -m dflash2.plan configs/tiny-dflash2.yaml --world-sizes 8
.venv/bin/python data_prep/prepare.py --input data.jsonl --tokenizer <dir> \\
    --out prepared/
OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 2 launch/train.py \\
    --config configs/tiny-dflash2.yaml train.max_step=3
.venv/bin/deepspeed --num_gpus 2 launch/train.py --config configs/tiny-dflash2.yaml objective.num_anchors=8
sbatch --nodes=2 launch/slurm/fsdp.sbatch configs/no-such.yaml trian.lr=1e-3 && echo submitted
python -m dflash2.export <checkpoint> <out> --dtype bf16   # a placeholder pair
```
"""


def test_a_doc_with_a_wrong_flag_fails(tmp_path, monkeypatch):
    """The checker on a synthetic doc: the wrong flag, the missing required one, the override typo
    and the missing config are each found; the correct commands pass."""
    (tmp_path / "doc.md").write_text(SYNTHETIC)
    found = []
    for start, body in fenced_blocks((tmp_path / "doc.md").read_text()):
        for offset, line in logical_lines(body):
            for tokens in split_commands(line):
                invoked = entry_point(tokens)
                if invoked:
                    found.append((start + offset, *invoked))
    assert [(line, target) for line, target, _ in found] == [
        (5, "dflash2.plan"),
        (6, "data_prep/prepare.py"),
        (8, "launch/train.py"),
        (10, "launch/train.py"),
        (11, "sbatch:launch/slurm/fsdp.sbatch"),
        (12, "dflash2.export"),
    ]
    problems = [command_problems(target, arguments, monkeypatch) for _, target, arguments in found]
    assert "unrecognized arguments: --world-sizes 8" in problems[0][0]
    assert "the following arguments are required: --max-length" in problems[1][0]
    assert problems[2] == ["train.max_step: Extra inputs are not permitted; did you mean train.max_steps?"]
    assert problems[3] == []
    assert problems[4] == [
        "trian: Extra inputs are not permitted; did you mean train?",
        "configs/no-such.yaml does not exist",
    ]
    assert problems[5] == []
