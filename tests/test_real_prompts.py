"""Real prompts from the Python install: counts, held-out sources never in training, determinism."""

from __future__ import annotations

import ast
import json
import sysconfig
from pathlib import Path

import pytest

from dflash2.data.jsonl import iter_lines, parse_sample, prompt_turns
from dflash2.data.real_prompts import INSTRUCTIONS, build_real_prompts
from tests.run_helpers import run_script_main

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _records(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("prompts")
    return out, build_real_prompts(out, num_train=1000, num_heldout=64, seed=0)


def test_counts_and_every_record_is_a_prompt(built):
    out, summary = built
    assert summary["num_train"] == 1000 and summary["num_heldout"] == summary["num_heldout_topics"] == 64
    for name, count in (("train", 1000), ("heldout", 64), ("heldout_topics", 64)):
        samples = [parse_sample(line, n) for n, line in iter_lines(out / f"{name}.jsonl")]
        assert len(samples) == count and len({s.id for s in samples}) == count
        for sample in samples:
            (turn,) = prompt_turns(sample.messages)
            assert turn["role"] == "user" and any(
                turn["content"].startswith(i.split("`")[0]) for i in INSTRUCTIONS
            )


@pytest.mark.parametrize("heldout_file", ["heldout.jsonl", "heldout_topics.jsonl"])
def test_heldout_sources_never_occur_in_training(built, heldout_file):
    out, _ = built
    train, heldout = _records(out / "train.jsonl"), _records(out / heldout_file)
    train_sources = {r["source"] for r in train}
    assert train_sources.isdisjoint({r["source"] for r in heldout})
    assert len(train_sources) > 100  # many documents, not a few long ones
    # Independently of the sources' names: no held-out passage occurs in any training prompt, and
    # each training passage starts with a docstring of the stdlib file it names.
    train_text = "\n".join(r["conversations"][0]["content"] for r in train)
    for record in heldout:
        passage = record["conversations"][0]["content"].split("\n\n", 1)[1]
        assert passage not in train_text
    if heldout_file == "heldout.jsonl":  # other modules' docstrings: several whole module files
        assert len({r["source"] for r in heldout}) >= 5
        assert all(r["source"].endswith(".py") for r in heldout)
    for record in train[:50]:
        tree = ast.parse((STDLIB / record["source"]).read_text())
        docstrings = [
            ast.get_docstring(n)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        passage = record["conversations"][0]["content"].split("\n\n", 1)[1]
        assert any(d and d.startswith(passage[:200]) for d in docstrings), record["source"]


def test_the_same_seed_writes_the_same_files_and_another_seed_others(built, tmp_path, monkeypatch):
    out, _ = built
    run_script_main(
        monkeypatch,
        "data_prep/real_prompts.py",
        ["--out", str(tmp_path / "a"), "--num-train", "1000", "--num-heldout", "64"],
    )
    for name in ("train.jsonl", "heldout.jsonl", "heldout_topics.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (out / name).read_bytes()
    build_real_prompts(tmp_path / "b", num_train=1000, num_heldout=64, seed=1)
    assert (tmp_path / "b" / "train.jsonl").read_bytes() != (out / "train.jsonl").read_bytes()


def test_more_prompts_than_passages_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="asked for 100000 train prompts, but only"):
        build_real_prompts(tmp_path, num_train=100000, num_heldout=1)


def test_a_docstring_copied_into_a_heldout_module_is_left_out_of_training():
    # the same text in two module files (bz2's and lzma's share docstrings): holding one module out
    # must keep the text out of training, whichever file training would have read it from
    from dflash2.data.real_prompts import Passage, split_modules

    passages = [Passage(f"m{i}.py", f"f{j}", f"text {i}.{j}") for i in range(6) for j in range(3)]
    passages += [Passage(f"m{i}.py", "shared", "the shared docstring") for i in range(6)]
    for seed in range(5):
        train, heldout = split_modules(passages, num_heldout=4, seed=seed)
        held_sources = {p.source for p in heldout}
        assert "the shared docstring" in {p.text for p in heldout}
        assert "the shared docstring" not in {p.text for p in train}
        assert {p.text for p in train} == {
            p.text for p in passages if p.source not in held_sources and p.text != "the shared docstring"
        }
