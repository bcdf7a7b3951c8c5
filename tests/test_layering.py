"""The package's imports point down and form no cycle (docs/architecture.md, "Layers").

Every import counts, function-local ones included: a local import hides a cycle from Python's
import machinery, not from this test.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "dflash2"

# The layer of each part of the package, bottom (0) to top. A module may import modules of its own
# part and of parts in lower layers only: never sideways, never up.
LAYERS = {
    "dflash2.config": 0,
    "dflash2.identity": 0,
    "dflash2.schedule": 0,
    "dflash2.target": 0,
    "dflash2.timing": 0,
    "dflash2.hardware": 0,
    "dflash2.errors": 0,
    "dflash2.stamped_build": 0,
    "dflash2.safetensors_io": 0,
    "dflash2.faults": 1,
    "dflash2.models": 1,
    "dflash2.optim": 1,
    "dflash2.data": 1,
    "dflash2.fixtures": 1,
    "dflash2.distributed": 2,
    "dflash2.objective": 2,
    "dflash2.draft_config": 2,
    "dflash2.capture": 3,
    "dflash2.checkpoint": 3,
    "dflash2.export": 4,
    "dflash2.run_plan": 4,
    "dflash2.train_log": 4,
    "dflash2.train": 5,
    "dflash2.decode": 5,
    "dflash2.run": 6,
    "dflash2.evaluate": 6,
    "dflash2.plan": 6,
    "dflash2.serving_gate": 7,
    "dflash2.__main__": 8,  # python -m dflash2: the commands
}
DISTRIBUTED_PACKAGES = ("torch.distributed", "deepspeed")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def part_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def imported_names(path: Path) -> set[str]:
    """Absolute names of everything `path` imports, at any depth of its syntax tree."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    return names_in_source(path.read_text(), package)


def names_in_source(source: str, package: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from a import b` imports module a.b when there is one, else the name b of module a
            names.update(
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names
            )
    return names


def package_imports(module: str) -> set[str]:
    """The package modules `module` imports (a dotted name is resolved to its longest module prefix)."""
    out = set()
    for name in imported_names(MODULES[module]):
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in MODULES:
                out.add(".".join(parts[:end]))
                break
    out.discard(module)
    return out


GRAPH = {module: package_imports(module) for module in MODULES}


def find_cycle() -> list[str] | None:
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(GRAPH):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in MODULES if m != "dflash2" and part_of(m) not in LAYERS)
    assert not unplaced, f"place these modules in LAYERS (and in docs/architecture.md): {unplaced}"


def test_no_import_cycle():
    cycle = find_cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_point_down():
    wrong = [
        f"{module} (layer {LAYERS[part_of(module)]}) imports {target} (layer {LAYERS[part_of(target)]})"
        for module, targets in GRAPH.items()
        if module != "dflash2"
        for target in targets
        if part_of(target) != part_of(module) and LAYERS[part_of(target)] >= LAYERS[part_of(module)]
    ]
    assert not wrong, "imports that do not point down:\n" + "\n".join(sorted(wrong))


def reachable(start: set[str]) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(GRAPH[module])
    return seen


def test_models_never_import_distributed_code():
    models = reachable({m for m in MODULES if part_of(m) == "dflash2.models"})
    offending = sorted(
        f"{module} imports {name}"
        for module in models
        for name in imported_names(MODULES[module])
        if name.startswith(DISTRIBUTED_PACKAGES)
    )
    assert not offending, offending
    # and at run time: importing the models leaves deepspeed unloaded (torch itself loads torch.distributed)
    probe = "import sys, dflash2.models; assert 'deepspeed' not in sys.modules, 'deepspeed was imported'"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_imports_inside_functions_and_relative_imports_are_seen():
    """A function-local import is the usual way to hide a cycle: the walker must see it."""
    source = (
        "import json\n"
        "def f():\n"
        "    from dflash2.train import fit\n"
        "    if True:\n"
        "        import dflash2.run as r\n"
        "class C:\n"
        "    def g(self):\n"
        "        from . import base\n"
        "        from ..models import draft\n"
    )
    assert names_in_source(source, "dflash2.distributed") == {
        "json",
        "dflash2.train",
        "dflash2.run",
        "dflash2.distributed.base",
        "dflash2.models.draft",
    }
