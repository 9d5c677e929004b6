"""One declaration per column (analysis/columns.py): the local engine's ``ranks``, ``nodes`` and
``runs`` tables hold exactly the columns declared for it (the Spark engine's: test_spark.py's
check_equal), and the SQL both engines run is the declaration's text."""

from __future__ import annotations

from pathlib import Path

from charllm_nemo.analysis import columns
from charllm_nemo.analysis.analyze import analyze
from charllm_nemo.analysis.run_summary import NODE_SQL, RUN_SQL

from .helpers import rough_run


def test_local_tables_hold_exactly_the_declared_columns(tmp_path: Path) -> None:
    rough_run(tmp_path / "run", seed=2)
    tables = analyze(tmp_path / "run").tables
    for name in columns.TABLE_COLUMNS:
        got = set(tables[name].column_names)
        want = set(columns.names(name, "local"))
        assert got == want, (name, "undeclared:", got - want, "declared, missing:", want - got)


def test_each_column_declared_once_and_every_gap_explained() -> None:
    for name, cols in columns.TABLE_COLUMNS.items():
        seen = [c.name for c in cols]
        assert len(seen) == len(set(seen)), name
        for c in cols:
            assert set(c.engines) <= {"local", "spark"} and "local" in c.engines, (name, c)
            if c.engines != columns.BOTH or c.rel > 1e-9:
                assert c.why, (name, c.name, "an engine lacks it or agrees loosely: say why")


def test_the_sql_is_the_declaration() -> None:
    for name, expr in columns.NODE_REDUCTIONS:
        assert f"{expr} AS {name}" in NODE_SQL
    for name, expr in (*columns.RUN_DEVICE_REDUCTIONS, *columns.RUN_DERIVED):
        assert f"{expr} AS {name}" in RUN_SQL
