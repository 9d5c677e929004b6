"""Each default and each check is declared once in src/ (issue 44): the sampling rate's default
and range check, the session options' defaults (telemetry/session_options.py), how long a figure
request waits for its batch, and the finite-number filter.
Read from the source (ast), so a copy pasted anywhere under src/ fails here."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "charllm_nemo"

ONCE = {
    "DEFAULT_HZ": "telemetry/sample_loop.py",
    "MIN_HZ": "telemetry/sample_loop.py",
    "MAX_HZ": "telemetry/sample_loop.py",
    "MAX_HOLD_NS": "telemetry/process/mark_ring.py",
    "DEFAULT_NICE": "telemetry/placement.py",
    "DEFAULT_COLLECTOR_SCHED": "telemetry/placement.py",
    "DEFAULT_SAMPLER": "telemetry/placement.py",
    "DEFAULT_OVERWRITE": "telemetry/session_options.py",
    "DEFAULT_DRIVER_BUFFERS": "telemetry/session_options.py",
}
"""Module-level names declared (assigned) in exactly one file."""

RATE_NAMES = frozenset({"hz", "sampling_hz"})
"""Names that carry the sampling rate (not ``counter_hz``, a separate option)."""


@functools.cache
def _trees(src: Path = SRC) -> dict[str, ast.Module]:
    return {
        str(p.relative_to(src)): ast.parse(p.read_text(encoding="utf-8")) for p in sorted(src.rglob("*.py"))
    }


def _numbers(node: ast.AST | None) -> list[object]:
    """The numeric literals in ``node`` (bools are not numbers here)."""
    if node is None:
        return []
    return [
        n.value
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool)
    ]


def _target_name(t: ast.expr) -> str | None:
    if isinstance(t, ast.Name):
        return t.id
    if isinstance(t, ast.Attribute):
        return t.attr
    return None


def stray_rate_literals(trees: dict[str, ast.Module]) -> list[str]:
    """Places that give the sampling rate a number of their own: ``hz=100`` as a keyword, a
    parameter default or a field, ``hz = 100.0 if ...``, ``{"sampling_hz": 100.0}``, an
    ``add_argument("--hz", default=100.0, type=finite_number(1.0, most=1000.0))``."""
    found: list[str] = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            where = f"{path}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.keyword) and node.arg in RATE_NAMES and _numbers(node.value):
                found.append(f"{where} {node.arg}={ast.unparse(node.value)}")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = {_target_name(t) for t in targets}
                if names & RATE_NAMES and _numbers(node.value):
                    found.append(f"{where} {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and any(
                isinstance(a, ast.Constant) and a.value == "--hz" for a in node.args
            ):
                literals = [f"{k.arg}={ast.unparse(k.value)}" for k in node.keywords if _numbers(k.value)]
                found.extend(f"{where} --hz {lit}" for lit in literals)
            elif isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values, strict=True):
                    if isinstance(k, ast.Constant) and k.value in RATE_NAMES and _numbers(v):
                        found.append(f"{where} {k.value!r}: {ast.unparse(v)}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                positional = [*args.posonlyargs, *args.args]
                pairs = list(
                    zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True)
                )
                pairs += [
                    (a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None
                ]
                for arg, default in pairs:
                    if arg.arg in RATE_NAMES and _numbers(default):
                        found.append(f"{where} def {node.name}({arg.arg}={ast.unparse(default)})")
    return found


def declarations(trees: dict[str, ast.Module]) -> dict[str, list[str]]:
    """For each name of :data:`ONCE`, the files that assign it at module level."""
    out: dict[str, list[str]] = {name: [] for name in ONCE}
    for path, tree in trees.items():
        for node in tree.body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for t in targets:
                if isinstance(t, ast.Name) and t.id in out:
                    out[t.id].append(path)
    return out


def range_checks(trees: dict[str, ast.Module]) -> list[str]:
    """Comparisons against MIN_HZ / MAX_HZ (the range check), where they are."""
    return [
        f"{path}:{node.lineno}"
        for path, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        and any(isinstance(n, ast.Name) and n.id in ("MIN_HZ", "MAX_HZ") for n in ast.walk(node))
    ]


def finite_filters(trees: dict[str, ast.Module]) -> list[str]:
    """Functions that filter one value to a finite float or None: one parameter, annotated
    ``-> float | None``, calling ``isfinite`` (how each of the five copies was written), as
    ``path:name``."""
    return [
        f"{path}:{node.name}"
        for path, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and len(node.args.args) == 1
        and node.returns is not None
        and ast.unparse(node.returns) == "float | None"
        and any(_target_name(n.func) == "isfinite" for n in ast.walk(node) if isinstance(n, ast.Call))
    ]


def test_the_sampling_rate_has_no_literal_beside_its_default() -> None:
    assert stray_rate_literals(_trees()) == []


def test_each_default_is_declared_in_one_place() -> None:
    assert declarations(_trees()) == {name: [path] for name, path in ONCE.items()}


def test_the_rate_range_is_checked_in_one_function() -> None:
    checks = range_checks(_trees())
    assert len(checks) == 1 and checks[0].startswith("telemetry/sample_loop.py:"), checks


def test_the_finite_number_filter_has_one_copy() -> None:
    assert finite_filters(_trees()) == ["telemetry/figures.py:finite_or_none"]


def test_the_checks_see_the_copies_they_refuse(tmp_path: Path) -> None:
    # The checkers themselves, on a tree holding each kind of copy this file refuses.
    (tmp_path / "a.py").write_text(
        "DEFAULT_HZ = 100.0\nMAX_HOLD_NS = 1\n"
        "def f(hz=100.0, *, sampling_hz=5): pass\n"
        "g(hz=100)\nhz = 100.0 if x else y\nd = {'sampling_hz': 100.0}\n"
        "ok = 1 <= v <= MAX_HZ\n"
        "def _finite(v) -> float | None: return v if math.isfinite(v) else None\n"
        "p.add_argument('--hz', type=finite_number(1.0, most=1000.0), default=100.0)\n"
    )
    (tmp_path / "b.py").write_text("DEFAULT_HZ = 50.0\ng(hz=DEFAULT_HZ, counter_hz=10)\n")
    trees = _trees(tmp_path)
    assert len(stray_rate_literals(trees)) == 7
    assert declarations(trees)["DEFAULT_HZ"] == ["a.py", "b.py"]
    assert range_checks(trees) == ["a.py:7"]
    assert finite_filters(trees) == ["a.py:_finite"]
