"""Every package names its public API in ``__all__``, and importing a package imports no
training framework or W&B: the names load their modules when first used."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.deadline import deadline

PACKAGES = (
    "alerts",
    "analysis",
    "devices",
    "integrations",
    "metrics",
    "sinks",
    "steps",
    "sweep",
    "telemetry",
    "train",
)
HEAVY = ("torch", "megatron", "lightning", "wandb", "hydra", "nemo", "duckdb", "matplotlib")

# Names whose module needs an optional framework that may not be installed here.
NEEDS = {("integrations", "PowerThermalCallback"): "lightning"}


def _run(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=deadline(120))
    assert proc.returncode == 0, proc.stderr
    out: dict = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_importing_a_package_imports_no_framework_and_names_its_api(package):
    code = (
        "import json, sys\n"
        f"import charllm_nemo.{package} as p\n"
        f"heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
        "names = list(getattr(p, '__all__', []))\n"
        "print(json.dumps({'heavy': heavy, 'all': names, 'doc': p.__doc__ or ''}))\n"
    )
    r = _run(code)
    assert r["heavy"] == [], f"import charllm_nemo.{package} imported {r['heavy']}"
    assert r["all"], f"charllm_nemo.{package} has no __all__"
    assert len(r["doc"]) > 100  # says what the package is for and what to import


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_resolves_to_an_object_of_the_package(package):
    skip = [n for (pkg, n), dep in NEEDS.items() if pkg == package and importlib.util.find_spec(dep) is None]
    code = (
        "import inspect, json\n"
        f"import charllm_nemo.{package} as p\n"
        "where = {}\n"
        f"for name in p.__all__:\n"
        f"    if name in {skip!r}:\n"
        "        continue\n"
        "    obj = getattr(p, name)\n"
        "    assert not inspect.ismodule(obj), name\n"
        "    where[name] = obj.__module__ if inspect.isclass(obj) or inspect.isfunction(obj) else 'value'\n"
        "    assert getattr(p, name) is obj  # a second look gives the same object, not a module\n"
        "print(json.dumps(where))\n"
    )
    where = _run(code)
    for name, module in where.items():
        assert module == "value" or module.startswith(f"charllm_nemo.{package}."), (name, module)


def test_an_unknown_name_is_an_attribute_error():
    import charllm_nemo.metrics as m

    with pytest.raises(AttributeError, match=r"charllm_nemo\.metrics.*no_such_name"):
        m.no_such_name  # noqa: B018
