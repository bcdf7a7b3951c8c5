"""Every relative link of README.md, docs/*.md and launch/slurm/README.md names a file that exists
and, with a `#fragment` into a Markdown file, one of its headings (GitHub's anchors: lower case,
punctuation dropped, spaces as hyphens, a repeated heading numbered)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "launch" / "slurm" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchor(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    inside_fence = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            inside_fence = not inside_fence
            continue
        heading = re.match(r"^#+\s+(.*)$", line)
        if heading and not inside_fence:
            anchor = heading_anchor(heading.group(1))
            seen[anchor] = seen.get(anchor, -1) + 1
            if seen[anchor]:
                seen[f"{anchor}-{seen[anchor]}"] = 0
    return set(seen)


def test_the_anchor_rule_on_known_headings():
    assert heading_anchor("### `make demo-real`, run by run".lstrip("# ")) == "make-demo-real-run-by-run"
    assert heading_anchor("The target's greedy token as the label") == "the-targets-greedy-token-as-the-label"
    assert heading_anchor("ZeRO-3 or FSDP2") == "zero-3-or-fsdp2"


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path):
    broken = []
    for match in LINK.finditer(doc.read_text()):
        target = match.group(1)
        if re.match(r"^[a-z]+:", target):  # http(s), mailto
            continue
        path, _, fragment = target.partition("#")
        destination = (doc.parent / path).resolve() if path else doc
        if not destination.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and destination.suffix == ".md" and fragment not in anchors(destination):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)
