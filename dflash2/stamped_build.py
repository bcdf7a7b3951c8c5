"""A directory built once and reused while its stamp matches: the embedded targets' cache.

`build_once(root, stamp, build)` calls `build(staging)` only when `root/stamp.json` does not hold
`stamp`; the build writes into a sibling staging directory that is swapped in whole, so a crash never
leaves a half build, and a file lock beside `root` keeps concurrent callers from building twice.
`code_stamp(files, params)` is the usual stamp: the builder's code and its parameters.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

STAMP_FILE = "stamp.json"


def code_stamp(module_files: Iterable[str | Path], params: dict) -> str:
    """Hash of the modules' code and the parameters. The code enters as its syntax tree, so
    reformatting or editing comments does not force a rebuild."""
    digest = hashlib.sha256()
    for module_file in module_files:
        digest.update(ast.dump(ast.parse(Path(module_file).read_text())).encode())
    digest.update(json.dumps(params, sort_keys=True).encode())
    return digest.hexdigest()


def read_stamp(root: Path) -> str | None:
    stamp_file = Path(root) / STAMP_FILE
    if not stamp_file.is_file():
        return None
    return json.loads(stamp_file.read_text()).get("stamp")


def check_build_root(root: Path) -> None:
    """A build replaces `root` whole: refuse a file, or a directory with files but no stamp (not an
    earlier build: `--out runs` would have lost the runs)."""
    if root.exists() and not root.is_dir():
        raise ValueError(f"{root} is a file: give a directory for the build")
    if root.is_dir() and any(root.iterdir()) and not (root / STAMP_FILE).is_file():
        raise ValueError(
            f"{root} holds files and is not an earlier build (no {STAMP_FILE}), and a build replaces its "
            "directory whole: give a new directory"
        )


def build_once(root: str | Path, stamp: str, build: Callable[[Path], None], force: bool = False) -> Path:
    """`root`, built by `build(staging)` unless its stamp already is `stamp` (or `force`); refused
    where `root` is not an earlier build (check_build_root)."""
    root = Path(root).resolve()
    check_build_root(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until the with-block closes the file
        if force or read_stamp(root) != stamp:
            staging = root.with_name(root.name + ".building")
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            build(staging)
            (staging / STAMP_FILE).write_text(json.dumps({"stamp": stamp}) + "\n")  # written last
            shutil.rmtree(root, ignore_errors=True)
            staging.rename(root)
    return root
