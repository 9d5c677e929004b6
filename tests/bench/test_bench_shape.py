"""bench/bench_train_telemetry.py stays readable in parts (issue 44): no function over 80 lines
(its worker was one of 612 lines with a 257-line closure inside)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_train_telemetry.py"
MAX_LINES = 80


def long_functions(source: str, limit: int = MAX_LINES) -> list[str]:
    """``name (lines)`` of every function (nested ones too) longer than ``limit`` lines."""
    return [
        f"{n.name} ({n.end_lineno - n.lineno + 1})"
        for n in ast.walk(ast.parse(source))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.end_lineno is not None
        and n.end_lineno - n.lineno + 1 > limit
    ]


def test_no_function_of_the_bench_is_over_80_lines() -> None:
    assert long_functions(BENCH.read_text(encoding="utf-8")) == []


def test_the_check_sees_a_long_nested_function() -> None:
    inner = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))
    assert long_functions(f"def outer():\n    def inner():\n{inner}\n") == ["outer (82)", "inner (81)"]
