"""The one-way import order of docs/architecture.md ("Layers"), enforced over src/ by reading
every module's imports (module level and inside functions alike: a lazy import is still a
dependency), and no import cycle between modules."""

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
}
"""(importer, imported package): the only modules of a lower package it may import. The analysis
takes the training config (for the re-run command and the FLOP model), never its launcher."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every charllm_nemo module ``path`` imports (``from a import b``: ``a.b`` when that is a
    module, else ``a``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
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
                found.add(full if _is_module(full) else base)
    return {m for m in found if m == ROOT or m.startswith(ROOT + ".")}


def _is_module(dotted: str) -> bool:
    p = SRC.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _is_package(dotted: str) -> bool:
    return (SRC.joinpath(*dotted.split(".")) / "__init__.py").is_file()


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted((SRC / ROOT).rglob("*.py"))}


def test_every_package_is_in_the_table() -> None:
    tops = {p.stem for p in (SRC / ROOT).iterdir() if p.suffix == ".py" and p.stem != "__init__"}
    tops |= {p.name for p in (SRC / ROOT).iterdir() if (p / "__init__.py").is_file()}
    assert tops == set(LAYERS)


def test_imports_go_down_the_layers_only() -> None:
    wrong = []
    for module, imported in _graph().items():
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
    assert wrong == [], "imports against docs/architecture.md's layers:\n" + "\n".join(wrong)


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


def test_the_checker_sees_a_lazy_import_against_the_order(tmp_path: Path) -> None:
    # the AST pass finds imports inside functions too (train/app.py's sweep import was one)
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from charllm_nemo.sweep.plan import plan_configuration\n")
    tree = ast.parse(f.read_text())
    found = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert found == {"charllm_nemo.sweep.plan"}
