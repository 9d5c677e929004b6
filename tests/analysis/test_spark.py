"""The Spark engine's tables equal the single-host engine's on the same store: through sqlframe
(the PySpark DataFrame API on DuckDB, no JVM) and once on real Spark, ``local[2]``."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from charllm_nemo.analysis.analyze import analyze
from charllm_nemo.analysis.spark import RANK_COLUMNS, collect, spark_tables

from .helpers import constant_run, rough_run

NODE_COLUMNS = (
    "ranks", "devices", "power_avg_w", "device_power_peak_w", "energy_j", "temp_gpu_avg_c",
    "temp_gpu_peak_c", "temp_gpu_peak_spread_c", "clock_sm_avg_mhz", "clock_sm_avg_min_mhz",
)  # fmt: skip
RUN_EXACT = ("measured_steps", "execution_time_s", "samples_per_s", "tokens_per_s")
RUN_APPROX = ("energy_j", "efficiency_samples_per_s_per_mj", "tokens_per_j")  # edges: one counter period


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


def check_equal(local: dict, ranks: list[dict], nodes: list[dict], runs: list[dict]) -> None:
    assert len(ranks) == len(local["ranks"]) and len(nodes) == len(local["nodes"])
    for r in ranks:
        want = local["ranks"][(r["run"], int(r["rank"]), r["device_index"])]
        assert want["host"] == r["host"]
        numeric = [c for c in RANK_COLUMNS if c not in ("run", "rank", "device_index", "host")]
        bad = [c for c in numeric if not same(want[c], r[c])]
        assert not bad, {c: (want[c], r[c]) for c in bad}
    for n in nodes:
        want = local["nodes"][(n["run"], n["host"])]
        assert all(same(want[c], n[c]) for c in NODE_COLUMNS), (want, n)
    for row in runs:
        want = local["runs"][(row["run"],)]
        assert all(same(want[c], row[c]) for c in RUN_EXACT), (want, row)
        assert all(same(want[c], row[c], rel=0.01) for c in RUN_APPROX), (want, row)


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
    try:
        assert (
            main(
                ["analyze", str(store), "--engine", "spark", "--spark-master", "local[2]", "--out", str(out)]
            )
            == 0
        )
    finally:
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None:
            active.stop()
    tables = {name: pq.read_table(out / f"{name}.parquet").to_pylist() for name in ("ranks", "nodes", "runs")}
    check_equal(local_tables(store), tables["ranks"], tables["nodes"], tables["runs"])
