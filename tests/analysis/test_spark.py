"""The Spark engine's tables equal the single-host engine's on the same store: the DataFrame-API
tables (analysis/spark.py) through sqlframe (the PySpark DataFrame API on DuckDB, no JVM); and
``charllm analyze --engine spark`` (analysis/spark_windows.py) on real Spark, ``local[2]``, and
under spark-submit: every table and the per-window table, on a rough store (NaN gaps in power,
a counter reset, throttle bits, a sampler that stalls for 0.5 s) and a constant run."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from charllm_nemo.analysis.analyze import analyze, write_tables
from charllm_nemo.analysis.columns import TABLE_COLUMNS, names
from charllm_nemo.analysis.spark import collect, spark_tables

from .helpers import constant_run, rough_run


def local_tables(path: Path) -> dict[str, dict[tuple, dict]]:
    t = analyze(path).tables
    return {
        "ranks": {(r["run"], int(r["rank"]), r["device_index"]): r for r in t["ranks"].to_pylist()},
        "nodes": {(r["run"], r["host"]): r for r in t["nodes"].to_pylist()},
        "runs": {(r["run"],): r for r in t["runs"].to_pylist()},
    }


def same(a: object, b: object, rel: float = 1e-9) -> bool:
    if a is None or (isinstance(a, float) and math.isnan(a)):
        return b is None or (isinstance(b, float) and math.isnan(b))
    return b is not None and float(b) == pytest.approx(float(a), rel=rel, abs=1e-9)  # type: ignore[arg-type]


KEYS = {"ranks": ("run", "rank", "device_index"), "nodes": ("run", "host"), "runs": ("run",)}


def check_equal(local: dict, ranks: list[dict], nodes: list[dict], runs: list[dict]) -> None:
    """Every column the Spark engine writes (analysis/columns.py) equal to the local engine's,
    to the agreement the declaration states; the Spark tables hold exactly those columns."""
    for table, rows in (("ranks", ranks), ("nodes", nodes), ("runs", runs)):
        assert len(rows) == len(local[table]), table
        declared = TABLE_COLUMNS[table]
        for row in rows:
            assert set(row) == set(names(table, "spark")), (table, set(row) ^ set(names(table, "spark")))
            key = tuple(int(row[k]) if k == "rank" else row[k] for k in KEYS[table])
            want = local[table][key]
            bad = {}
            for col in declared:
                if "spark" not in col.engines:
                    continue
                a, b = want[col.name], row[col.name]
                ok = a == b if isinstance(a, str) or isinstance(b, str) else same(a, b, col.rel)
                if not ok:
                    bad[col.name] = (a, b)
            assert not bad, (table, key, bad)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("spark") / "sweep=s"
    rough_run(root / "run=rough", seed=1)
    constant_run(root / "run=flat", ranks=2, hosts=["h0", "h0"])
    return root


def test_sqlframe_tables_equal_the_local_engine(store: Path) -> None:
    sqlframe = pytest.importorskip("sqlframe.duckdb")
    t = spark_tables(sqlframe.DuckDBSession(), store)
    check_equal(local_tables(store), collect(t.ranks), collect(t.nodes), collect(t.runs))


def _java() -> bool:
    return shutil.which("java") is not None or bool(os.environ.get("JAVA_HOME"))


def same_tables(store: Path, out: Path, tmp_path: Path) -> None:
    """Every table the local engine writes, and its window table, written by the Spark engine
    into ``out`` with the same columns (names, types, order) and rows, each value equal to 1e-9
    relative (exactly, in practice: the same reduction runs on both)."""
    local_out = tmp_path / "local"
    local = analyze(store, local_out / "windows.parquet")
    write_tables(local, local_out)
    names = [*local.tables, "windows"]
    assert {p.stem for p in out.glob("*.parquet")} == set(names)
    for name in names:
        want, got = pq.read_table(local_out / f"{name}.parquet"), pq.read_table(out / f"{name}.parquet")
        assert got.schema == want.schema, name
        assert got.num_rows == want.num_rows, name
        bad = [
            (name, i, k, a, row[k])
            for i, (wrow, row) in enumerate(zip(want.to_pylist(), got.to_pylist(), strict=True))
            for k, a in wrow.items()
            if not (a == row[k] if isinstance(a, (str, bool)) or a is None else same(a, row[k]))
        ]
        assert not bad, bad[:5]
    assert (out / "problems.txt").read_text() == (local_out / "problems.txt").read_text()


def test_real_spark_local2_through_the_cli_equals_the_local_engine(store: Path, tmp_path: Path) -> None:
    required = os.environ.get("CHARLLM_REQUIRE_SPARK") == "1"
    try:
        import pyspark  # noqa: F401
    except ImportError:
        if required:
            pytest.fail("pyspark is not installed (pip install -e '.[spark]'); CHARLLM_REQUIRE_SPARK=1")
        pytest.skip("pyspark is not installed (pip install -e '.[spark]')")
    if not _java():
        if required:
            pytest.fail(
                "no Java for Spark (apt-get install openjdk-17-jre-headless); CHARLLM_REQUIRE_SPARK=1"
            )
        pytest.skip("no Java for Spark (apt-get install openjdk-17-jre-headless)")
    from charllm_nemo.cli import main

    out = tmp_path / "out"
    args = ["analyze", str(store), "--engine", "spark", "--spark-master", "local[2]", "--no-figures"]
    try:
        assert main([*args, "--out", str(out)]) == 0
    finally:
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None:
            active.stop()
    same_tables(store, out, tmp_path)


def test_spark_submit_runs_the_cli_as_docs_analysis_says(store: Path, tmp_path: Path) -> None:
    """docs/analysis.md's ``spark-submit ... charllm_nemo/cli.py analyze PATH --engine spark``:
    the master is spark-submit's (no --spark-master), the tables equal the local engine's."""
    import subprocess
    import sys

    pytest.importorskip("pyspark")
    if not _java():
        pytest.skip("no Java for Spark (apt-get install openjdk-17-jre-headless)")
    submit = Path(sys.executable).parent / "spark-submit"
    if not submit.is_file():
        pytest.skip("no spark-submit beside this Python (pip install -e '.[spark]')")
    import charllm_nemo.cli as cli

    out = tmp_path / "out"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PATH": f"{submit.parent}:{os.environ['PATH']}"}
    env.pop("SPARK_MASTER", None)
    cmd = [str(submit), "--master", "local[2]", cli.__file__, "analyze", str(store), "--engine", "spark"]
    cmd += ["--out", str(out), "--no-figures"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "engine: spark" in proc.stdout
    same_tables(store, out, tmp_path)


def test_no_frame_runs_to_the_partitions_end(store: Path) -> None:
    """Spark evaluates a frame ending at UNBOUNDED FOLLOWING (and starting after the current row)
    by re-aggregating the rest of the partition for each row: quadratic in samples per device
    (issue #45: 1,367 s for 2 x 26 k samples). Every frame of the plan runs from the partition's
    start instead (the SQL sqlframe generates from the same DataFrame code)."""
    sqlframe = pytest.importorskip("sqlframe.duckdb")
    t = spark_tables(sqlframe.DuckDBSession(), store)
    for name in ("ranks", "runs"):
        sql = getattr(t, name).sql(optimize=False).upper()
        assert "UNBOUNDED FOLLOWING" not in sql, name
    assert "UNBOUNDED PRECEDING" in t.ranks.sql(optimize=False).upper()
