"""One declaration per column and one implementation per reduction (analysis/columns.py, issue
#45): the local engine's ``ranks``, ``nodes`` and ``runs`` tables hold exactly the declared
columns; ``--engine spark`` writes every table with the local engine's columns, because it runs
the local engine's per-rank task and assembly (no reduction of its own: no other module uses
Spark); and the SQL over other tables' rows is the declaration's text."""

from __future__ import annotations

import ast
from pathlib import Path

import pyarrow.parquet as pq

import charllm_nemo
from charllm_nemo.analysis import analyze as local_engine
from charllm_nemo.analysis import columns, rank_tables
from charllm_nemo.analysis.analyze import analyze
from charllm_nemo.analysis.run_summary import NODE_SQL, RUN_SQL
from charllm_nemo.analysis.spark import spark_analysis

from .helpers import rough_run
from .in_process_spark import InProcessSpark

SRC = Path(charllm_nemo.__file__).parent


def test_local_tables_hold_exactly_the_declared_columns(tmp_path: Path) -> None:
    rough_run(tmp_path / "run", seed=2)
    tables = analyze(tmp_path / "run").tables
    for name in columns.TABLE_COLUMNS:
        got = set(tables[name].column_names)
        want = set(columns.names(name))
        assert got == want, (name, "undeclared:", got - want, "declared, missing:", want - got)


def test_the_spark_engine_writes_the_local_engines_columns_in_every_table(tmp_path: Path) -> None:
    """Every table's columns (names, types, order) from both engines' code, Spark's side of the
    Spark engine played in this process (tests/analysis/in_process_spark.py); a column that one
    engine alone computed would show here."""
    rough_run(tmp_path / "run", seed=2)
    local = analyze(tmp_path / "run", tmp_path / "windows.parquet")
    spark = spark_analysis(InProcessSpark(), tmp_path / "run", windows_out=tmp_path / "spark.parquet")
    assert set(local.tables) >= set(columns.TABLE_COLUMNS)
    assert {n: t.schema for n, t in spark.tables.items()} == {n: t.schema for n, t in local.tables.items()}
    assert pq.read_schema(tmp_path / "spark.parquet") == pq.read_schema(tmp_path / "windows.parquet")


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_no_reduction_of_spark_s_own(tmp_path: Path) -> None:
    """One module talks to Spark (analysis/spark.py; nothing imports pyspark or sqlframe else),
    it imports no numeric code (numpy, pyarrow.compute, the metrics and attribution modules) and
    hands Spark the local engine's per-rank task, rank_tables.reduce_task."""
    users = {
        p.relative_to(SRC).as_posix()
        for p in SRC.rglob("*.py")
        if any(m.split(".")[0] in ("pyspark", "sqlframe") for m in _imports(p))
    }
    assert users == {"analysis/spark.py"}
    spark_imports = _imports(SRC / "analysis" / "spark.py")
    numeric = {"numpy", "pyarrow.compute", "duckdb", "charllm_nemo.analysis.metrics"}
    numeric |= {"charllm_nemo.telemetry.attribution", "charllm_nemo.telemetry.timelines"}
    assert not spark_imports & numeric, spark_imports & numeric
    rough_run(tmp_path / "run", seed=3)
    spark = InProcessSpark()
    spark_analysis(spark, tmp_path / "run")
    assert spark.sparkContext.mapped == [rank_tables.reduce_task]  # the local engine's task
    assert local_engine.reduce_task is rank_tables.reduce_task


def test_each_column_declared_once() -> None:
    for name, cols in columns.TABLE_COLUMNS.items():
        seen = [c.name for c in cols]
        assert len(seen) == len(set(seen)), name
        assert all(c.definition for c in cols), name


def test_the_sql_is_the_declaration() -> None:
    for name, expr in columns.NODE_REDUCTIONS:
        assert f"{expr} AS {name}" in NODE_SQL
    for name, expr in (*columns.RUN_DEVICE_REDUCTIONS, *columns.RUN_DERIVED):
        assert f"{expr} AS {name}" in RUN_SQL
