"""Real prompts from text every Python install has: no download, deterministic for a seed.

- training prompts: the docstrings (module, class, function) of the Python standard library's own
  source files, read with `ast` (nothing is imported); a source document is one module file;
- held-out prompts (`heldout.jsonl`): the docstrings of standard-library modules drawn with the
  seed and kept out of training (the same kind of text, other documents);
- out-of-domain held-out prompts (`heldout_topics.jsonl`): the Python language and library
  reference topics that `pydoc` shows (`pydoc_data.topics`, e.g. "for", "string-methods"), a
  different kind of text from documents that never occur in training (the topics module itself is
  not a training source).

Each passage becomes one user turn: an instruction (explain, summarise, rewrite, answer a question,
write an example, ...) drawn with the seed, and the passage. The records are prompt-only
training_jsonl lines; regeneration appends the target's replies.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# Directories of the standard library that are not its documentation (tests, bundled tools, packages
# installed later) or that hold the held-out source.
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idlelib", "site-packages", "dist-packages", "pydoc_data", "lib2to3", "turtledemo"}
)
EXCLUDED_DIRS |= frozenset({"ensurepip", "__pycache__", "tkinter", "config-3.11-x86_64-linux-gnu"})
MIN_CHARS, MAX_CHARS = 200, 1500  # a passage long enough to say something, short enough for a prompt

INSTRUCTIONS = (
    "Explain in plain words what the following passage from the documentation of `{name}` describes, "
    "and give a short example of when it is useful.",
    "Summarise this passage from the documentation of `{name}` in a few sentences.",
    "Rewrite the following documentation of `{name}` as a short tutorial for someone new to Python.",
    "Read the passage below about `{name}`. What problem does it solve, and when would you use it?",
    "List the key points of this passage about `{name}` as bullet points, then explain the most "
    "important one.",
    "Write a short Python example that uses `{name}` as described below, and explain what each line does.",
    "Explain the passage below about `{name}` to a colleague who knows another programming language "
    "but not Python.",
    "What are the common mistakes someone could make with `{name}`, given the documentation below? "
    "Explain how to avoid them.",
)


@dataclass(frozen=True)
class Passage:
    source: str  # the source document: a stdlib module path, or `pydoc_data.topics:<topic>`
    name: str  # what the passage documents, as the instruction names it
    text: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def docstring_passages(root: Path | None = None) -> list[Passage]:
    """Module, class and function docstrings of the stdlib sources, in path order."""
    root = root or stdlib_dir()
    passages = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if EXCLUDED_DIRS & set(relative.parts[:-1]) or relative.name.startswith("test_"):
            continue
        module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        passages += _file_passages(path, str(relative), module)
    return passages


def _file_passages(path: Path, source: str, module: str) -> list[Passage]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []  # a file this Python cannot parse (a template, a Python 2 leftover) has no passages
    nodes = [(module, tree)]
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if not node.name.startswith("_"):
                nodes.append((f"{module}.{node.name}", node))
    passages = []
    for name, node in nodes:
        text = _fit(ast.get_docstring(node) or "")
        if text:
            passages.append(Passage(source, name, text))
    return passages


def topic_passages() -> list[Passage]:
    """Paragraph groups of each pydoc topic (the language reference), in topic order."""
    from pydoc_data.topics import topics

    passages = []
    for topic in sorted(topics):
        chunk = ""
        for paragraph in topics[topic].split("\n\n"):
            if len(chunk) + len(paragraph) > MAX_CHARS and len(chunk) >= MIN_CHARS:
                passages.append(Passage(f"pydoc_data.topics:{topic}", topic, chunk.strip()))
                chunk = ""
            chunk += paragraph + "\n\n"
        if text := _fit(chunk):
            passages.append(Passage(f"pydoc_data.topics:{topic}", topic, text))
    return passages


def _fit(text: str) -> str:
    """The text cut to MAX_CHARS at a paragraph (or line) break; '' when shorter than MIN_CHARS."""
    text = text.strip()
    if len(text) > MAX_CHARS:
        cut = text.rfind("\n\n", 0, MAX_CHARS)
        cut = cut if cut >= MIN_CHARS else text.rfind("\n", 0, MAX_CHARS)
        text = text[: cut if cut >= MIN_CHARS else MAX_CHARS].rstrip()
    return text if len(text) >= MIN_CHARS else ""


def to_prompts(passages: list[Passage], count: int, seed: int, prefix: str) -> list[dict]:
    """`count` prompt-only records drawn from `passages` with `seed`: an instruction and a passage."""
    if count > len(passages):
        raise ValueError(f"asked for {count} {prefix} prompts, but only {len(passages)} passages exist")
    rng = random.Random(seed)
    chosen = rng.sample(passages, count)
    records = []
    for number, passage in enumerate(chosen):
        instruction = rng.choice(INSTRUCTIONS).format(name=passage.name)
        content = f"{instruction}\n\n{passage.text}"
        records.append(
            {
                "id": f"{prefix}-{number:05d}",
                "source": passage.source,
                "conversations": [{"role": "user", "content": content}],
            }
        )
    return records


def split_modules(passages: list[Passage], num_heldout: int, seed: int) -> tuple[list, list]:
    """(training passages, held-out passages): whole module files drawn with `seed` until they hold
    at least `num_heldout` passages are held out, so no held-out document occurs in training; a
    training passage whose text a held-out module also holds (a docstring copied between modules,
    such as bz2's and lzma's) is left out of training too."""
    per_source = Counter(p.source for p in passages)
    sources = sorted(per_source)
    random.Random(seed).shuffle(sources)
    held, count = set(), 0
    for source in sources:
        if count >= num_heldout:
            break
        held.add(source)
        count += per_source[source]
    heldout = [p for p in passages if p.source in held]
    heldout_texts = {p.text for p in heldout}
    return [p for p in passages if p.source not in held and p.text not in heldout_texts], heldout


def build_real_prompts(out_dir: str | Path, num_train: int, num_heldout: int, seed: int = 0) -> dict:
    """Write `train.jsonl` (stdlib docstrings), `heldout.jsonl` (docstrings of other modules) and
    `heldout_topics.jsonl` (pydoc topics) under out_dir; returns the counts and paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_passages, heldout_passages = split_modules(docstring_passages(), num_heldout, seed)
    files = {
        "train": to_prompts(train_passages, num_train, seed, "train"),
        "heldout": to_prompts(heldout_passages, num_heldout, seed + 1, "heldout"),
        "heldout_topics": to_prompts(topic_passages(), num_heldout, seed + 1, "heldout-topics"),
    }
    summary = {}
    for name, records in files.items():
        path = out_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        summary[name] = str(path)
        summary[f"num_{name}"] = len(records)
        summary[f"num_{name}_sources"] = len({r["source"] for r in records})
    return summary
