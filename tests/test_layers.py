"""The one-way import order of docs/architecture.md ("Layers"), enforced over src/ by reading
every module's imports (module level and inside functions alike: a lazy import is still a
dependency), and no import cycle between modules. An import by name at run time
(``importlib.import_module``, ``__import__``) is allowed only in the modules DYNAMIC_IMPORTS lists;
with a constant name it counts as an import. The checker is itself tested on small trees."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "charllm_nemo"

LAYERS: dict[str, int] = {
    "errors": 0,
    "redact": 0,
    "_exports": 0,
    "progress": 0,
    "devices": 1,
    "metrics": 1,
    "telemetry": 2,
    "sinks": 3,
    "steps": 4,
    "alerts": 5,
    "integrations": 6,
    "train": 6,
    "sweep": 7,
    "analysis": 7,
    "cli": 8,
}
"""A package (or top-level module) may import its own modules and those of a lower number only."""

NARROW: dict[tuple[str, str], frozenset[str]] = {
    ("analysis", "train"): frozenset({"charllm_nemo.train.config", "charllm_nemo.train.config_io"}),
    ("steps", "sinks"): frozenset(),
}
"""(importer, imported package): the only modules of a lower package it may import. The analysis
takes the training config (for the re-run command and the FLOP model), never its launcher. The
step API reads the figure layout beside the figure table (telemetry/rank_vector.py), never through the
W&B keys: a sink is one of its observers, handed to it."""


DYNAMIC_IMPORTS: dict[str, str] = {
    "charllm_nemo._exports": "each package's lazy public names: its own modules",
    "charllm_nemo.devices.factory": "the vendor backend asked for, from its table of devices/ modules",
    "charllm_nemo.devices.amdsmi": "amdsmi, whose import raises KeyError without ROCm",
    "charllm_nemo.telemetry.process.ring": "_posixshmem, the C module without type stubs",
    "charllm_nemo.train.mcore_compat": "megatron.core, imported once its CPU shims are in",
    "charllm_nemo.train.cpu": "the megatron-core modules its CPU shim patches, those this version has",
    "charllm_nemo.train.worker": "the rank function a launcher names ('module:function')",
    "charllm_nemo.alerts.observer": "the user's alert hook ('package.module:function')",
}
"""The only modules that may import by name at run time (``importlib.import_module``,
``__import__``), and why: such an import is invisible to the layer check unless its name is a
constant (then it counts as an import, below)."""

_DYNAMIC_CALLS = frozenset({"import_module", "__import__"})


def _module_name(path: Path, src: Path = SRC) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dynamic_imports(tree: ast.AST) -> list[ast.Call]:
    """Calls of ``importlib.import_module``, ``import_module`` or ``__import__`` in ``tree``."""
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in _DYNAMIC_CALLS:
                calls.append(node)
    return calls


def _imports(path: Path, src: Path = SRC) -> set[str]:
    """Every charllm_nemo module ``path`` imports (``from a import b``: ``a.b`` when that is a
    module, else ``a``; a dynamic import of a constant name counts too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = _module_name(path, src)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for call in _dynamic_imports(tree):
        if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
            found.add(call.args[0].value)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], base]).strip(".")
            for a in node.names:
                full = f"{base}.{a.name}"
                found.add(full if _is_module(full, src) else base)
    return {m for m in found if m == ROOT or m.startswith(ROOT + ".")}


def _is_module(dotted: str, src: Path = SRC) -> bool:
    p = src.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _is_package(dotted: str) -> bool:
    return (SRC.joinpath(*dotted.split(".")) / "__init__.py").is_file()


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _files(src: Path) -> list[Path]:
    return sorted((src / ROOT).rglob("*.py"))


def _graph(src: Path = SRC) -> dict[str, set[str]]:
    return {_module_name(p, src): _imports(p, src) for p in _files(src)}


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for each import against :data:`LAYERS` and :data:`NARROW`."""
    wrong = []
    for module, imported in graph.items():
        mine = _layer(module)
        if not mine:  # the package's own __init__: lazy names only
            continue
        for dep in imported:
            theirs = _layer(dep)
            if not theirs or theirs == mine or theirs == "_exports":
                continue
            narrow = NARROW.get((mine, theirs))
            if LAYERS[theirs] >= LAYERS[mine] or (narrow is not None and dep not in narrow):
                wrong.append(f"{module} -> {dep}")
    return sorted(wrong)


def dynamic_importers(src: Path = SRC) -> dict[str, int]:
    """Module -> how many dynamic imports it makes, for every module that makes one."""
    out = {}
    for path in _files(src):
        n = len(_dynamic_imports(ast.parse(path.read_text(encoding="utf-8"))))
        if n:
            out[_module_name(path, src)] = n
    return out


def test_every_package_is_in_the_table() -> None:
    tops = {p.stem for p in (SRC / ROOT).iterdir() if p.suffix == ".py" and p.stem != "__init__"}
    tops |= {p.name for p in (SRC / ROOT).iterdir() if (p / "__init__.py").is_file()}
    assert tops == set(LAYERS)


def test_imports_go_down_the_layers_only() -> None:
    wrong = layer_violations(_graph())
    assert wrong == [], "imports against docs/architecture.md's layers:\n" + "\n".join(wrong)


def test_only_the_listed_modules_import_by_name_at_run_time() -> None:
    found = dynamic_importers()
    assert sorted(found) == sorted(DYNAMIC_IMPORTS), (
        "a run-time import (importlib.import_module / __import__) outside tests/test_layers.py's "
        "DYNAMIC_IMPORTS, or a listed module that no longer makes one: import it with an import "
        f"statement (the layer check sees those), or list it with why: {found}"
    )


def test_no_import_cycle_between_modules() -> None:
    graph = {m: {d for d in deps if d != m} for m, deps in _graph().items()}
    # a package's __init__ only names its modules lazily: an edge to it is not one to its modules
    graph = {m: {d for d in deps if not _is_package(d)} for m, deps in graph.items()}
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join([*stack[stack.index(d) :], d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in {"charllm_nemo/__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_sees_a_lazy_import_against_the_order(tmp_path: Path) -> None:
    # The real checker on a small tree: an import inside a function is still a dependency
    # (train/app.py's sweep import was one), relative imports resolve, imports down are fine.
    src = _tree(
        tmp_path,
        {
            "charllm_nemo/sweep/__init__.py": "",
            "charllm_nemo/sweep/plan.py": "from ..telemetry import figures\n",
            "charllm_nemo/telemetry/__init__.py": "",
            "charllm_nemo/telemetry/figures.py": "",
            "charllm_nemo/sinks/__init__.py": "",
            "charllm_nemo/sinks/keys.py": "def f():\n    from charllm_nemo.sweep.plan import plan\n",
            "charllm_nemo/steps/__init__.py": "",
            "charllm_nemo/steps/report.py": "from charllm_nemo.sinks import keys\n",
        },
    )
    assert layer_violations(_graph(src)) == [
        "charllm_nemo.sinks.keys -> charllm_nemo.sweep.plan",  # lazy, up the layers
        "charllm_nemo.steps.report -> charllm_nemo.sinks.keys",  # down, but NARROW forbids it
    ]


def test_the_checker_sees_an_import_by_name(tmp_path: Path) -> None:
    src = _tree(
        tmp_path,
        {
            "charllm_nemo/sweep/__init__.py": "",
            "charllm_nemo/sweep/plan.py": "",
            "charllm_nemo/sinks/__init__.py": "",
            "charllm_nemo/sinks/keys.py": (
                "import importlib\n"
                "def f(name):\n"
                "    importlib.import_module('charllm_nemo.sweep.plan')\n"
                "    return __import__(name)\n"
            ),
            "charllm_nemo/sinks/base.py": "from importlib import import_module\nimport_module('json')\n",
        },
    )
    assert dynamic_importers(src) == {"charllm_nemo.sinks.keys": 2, "charllm_nemo.sinks.base": 1}
    assert layer_violations(_graph(src)) == ["charllm_nemo.sinks.keys -> charllm_nemo.sweep.plan"]
