"""The backend registry (config.BACKENDS): each entry resolves to its Backend subclass, imported only
when chosen, and the registry and the planner load no deepspeed (whose logger prints to stdout)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash2.config import BACKENDS
from dflash2.distributed import Backend, backend_class
from tests.run_helpers import REPO


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_each_registry_entry_resolves_to_its_backend_class(name):
    cls = backend_class(name)
    assert issubclass(cls, Backend) and cls.name == name
    # in dflash2.distributed, so test_layering's table covers it (the registry's importlib hides it)
    assert cls.__module__.startswith("dflash2.distributed.")
    assert f"{cls.__module__}:{cls.__name__}" == BACKENDS[name].cls
    assert not getattr(cls, "__abstractmethods__", None)


def test_an_unknown_backend_is_refused_naming_the_known_ones():
    with pytest.raises(
        ValueError, match=r"backend must be one of \('deepspeed', 'fsdp', 'local'\), got 'ddp'"
    ):
        backend_class("ddp")


def test_resolving_the_backends_and_importing_the_planner_load_no_deepspeed():
    code = (
        "import json, sys\n"
        "from dflash2.distributed import backend_class\n"
        f"classes = [backend_class(n).__name__ for n in {sorted(BACKENDS)!r}]\n"
        "import dflash2.plan\n"
        "print(json.dumps([classes, sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed')]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    classes, loaded = json.loads(result.stdout)
    assert classes == ["DeepSpeedBackend", "FSDPBackend", "LocalBackend"] and loaded == []
