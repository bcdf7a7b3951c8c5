"""dflash2.stamped_build: a directory built once, reused while its stamp matches, swapped in whole."""

from __future__ import annotations

import pytest

from dflash2.stamped_build import build_once, code_stamp, read_stamp


def counting_build(calls: list, content: str = "built"):
    def build(staging):
        calls.append(staging)
        (staging / "out.txt").write_text(content)

    return build


def test_built_once_then_reused_while_the_stamp_matches(tmp_path):
    calls: list = []
    root = build_once(tmp_path / "thing", "stamp-1", counting_build(calls))
    assert (root / "out.txt").read_text() == "built" and read_stamp(root) == "stamp-1"
    assert build_once(tmp_path / "thing", "stamp-1", counting_build(calls)) == root
    assert len(calls) == 1
    build_once(tmp_path / "thing", "stamp-2", counting_build(calls, "rebuilt"))
    assert len(calls) == 2 and (root / "out.txt").read_text() == "rebuilt" and read_stamp(root) == "stamp-2"
    build_once(tmp_path / "thing", "stamp-2", counting_build(calls), force=True)
    assert len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [".thing.lock", "thing"]  # no staging left


def test_a_failed_build_leaves_the_previous_build(tmp_path):
    root = build_once(tmp_path / "thing", "stamp-1", counting_build([]))

    def failing(staging):
        (staging / "out.txt").write_text("half")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        build_once(tmp_path / "thing", "stamp-2", failing)
    assert (root / "out.txt").read_text() == "built" and read_stamp(root) == "stamp-1"
    calls: list = []
    build_once(tmp_path / "thing", "stamp-2", counting_build(calls))  # the next call builds again
    assert len(calls) == 1 and read_stamp(root) == "stamp-2"


def test_code_stamp_follows_the_code_not_its_formatting(tmp_path):
    module = tmp_path / "builder.py"
    module.write_text("x = 1\n")
    stamp = code_stamp([module], {"seed": 0})
    module.write_text("# a comment\nx  =  1\n")
    assert code_stamp([module], {"seed": 0}) == stamp
    assert code_stamp([module], {"seed": 1}) != stamp
    module.write_text("x = 2\n")
    assert code_stamp([module], {"seed": 0}) != stamp
