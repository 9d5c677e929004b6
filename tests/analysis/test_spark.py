"""``charllm analyze --engine spark`` (analysis/spark.py) writes the local engine's tables: every
table and the per-window table, column for column and value for value: in this process with
Spark's side played by pickle (no JVM; a store with broken input too), and on real Spark,
``local[2]``, through the CLI and under spark-submit, on a rough store (NaN gaps in power, a
counter reset, throttle bits, a sampler that stalls for 0.5 s) and a constant run."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from charllm_nemo.analysis.analyze import analyze, write_tables
from charllm_nemo.analysis.rank_tables import reduce_task
from charllm_nemo.analysis.spark import TASKS_PER_CORE, spark_analysis

from .helpers import constant_run, rough_run
from .in_process_spark import InProcessSpark


def same(a: object, b: object, rel: float = 1e-9) -> bool:
    if a is None or (isinstance(a, float) and math.isnan(a)):
        return b is None or (isinstance(b, float) and math.isnan(b))
    return b is not None and float(b) == pytest.approx(float(a), rel=rel, abs=1e-9)  # type: ignore[arg-type]


def equal_tables(want: pa.Table, got: pa.Table, name: str) -> None:
    """The same columns (names, types, order) and rows, each value equal to 1e-9 relative
    (exactly, in practice: the same reduction runs on both)."""
    assert got.schema == want.schema, name
    assert got.num_rows == want.num_rows, name
    bad = [
        (name, i, k, a, row[k])
        for i, (wrow, row) in enumerate(zip(want.to_pylist(), got.to_pylist(), strict=True))
        for k, a in wrow.items()
        if not (a == row[k] if isinstance(a, (str, bool)) or a is None else same(a, row[k]))
    ]
    assert not bad, bad[:5]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("spark") / "sweep=s"
    rough_run(root / "run=rough", seed=1)
    constant_run(root / "run=flat", ranks=2, hosts=["h0", "h0"])
    return root


def test_in_process_the_engine_gives_the_local_engines_tables(tmp_path: Path) -> None:
    """The engine's driver side, each task and result pickled as Spark's workers get and give
    them, on a store with broken input (a truncated segment, a rank folder without samples):
    every table, the window table and the problems equal the local engine's, and the function
    mapped over the ranks is the local engine's task."""
    root = tmp_path / "sweep=s"
    rough_run(root / "run=rough", seed=5)
    constant_run(root / "run=flat", ranks=3, hosts=["h0", "h0", "h1"])
    seg = root / "run=flat" / "rank=1" / "samples-000000.parquet"
    (seg.parent / "samples-000001.parquet").write_bytes(seg.read_bytes()[:300])
    for p in (root / "run=flat" / "rank=2").glob("samples-*.parquet"):
        p.unlink()
    spark = InProcessSpark(parallelism=1)
    got = spark_analysis(spark, root, windows_out=tmp_path / "spark-windows.parquet")
    want = analyze(root, tmp_path / "windows.parquet")
    assert spark.sparkContext.mapped == [reduce_task, reduce_task]  # one job per run
    assert spark.sparkContext.slice_counts == [
        min(3, TASKS_PER_CORE),
        min(2, TASKS_PER_CORE),
    ]  # flat, rough; 1 core
    assert list(got.tables) == list(want.tables)
    for name, table in want.tables.items():
        equal_tables(table, got.tables[name], name)
    assert got.windows_path == tmp_path / "spark-windows.parquet"
    equal_tables(pq.read_table(tmp_path / "windows.parquet"), pq.read_table(got.windows_path), "windows")
    text = "\n".join(got.problems)
    assert "samples-000001.parquet: unreadable samples segment skipped" in text
    assert "rank=2: no readable samples; rank skipped" in text
    assert got.problems == want.problems


def _java() -> bool:
    return shutil.which("java") is not None or bool(os.environ.get("JAVA_HOME"))


def same_tables(store: Path, out: Path, tmp_path: Path) -> None:
    """Every table the local engine writes, and its window table, written by the Spark engine
    into ``out``: equal (:func:`equal_tables`), and the same problems."""
    local_out = tmp_path / "local"
    local = analyze(store, local_out / "windows.parquet")
    write_tables(local, local_out)
    names = [*local.tables, "windows"]
    assert {p.stem for p in out.glob("*.parquet")} == set(names)
    for name in names:
        equal_tables(
            pq.read_table(local_out / f"{name}.parquet"), pq.read_table(out / f"{name}.parquet"), name
        )
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


class _Builder:
    """pyspark's ``SparkSession.builder``, recording what it is told."""

    def __init__(self) -> None:
        self.conf: dict[str, str] = {}
        self.url: str | None = None

    def appName(self, name: str) -> _Builder:
        return self

    def config(self, key: str, value: str) -> _Builder:
        self.conf[key] = value
        return self

    def master(self, url: str) -> _Builder:
        self.url = url
        return self

    def getOrCreate(self) -> _Builder:
        return self


@pytest.mark.parametrize(
    ("master", "env", "local"),
    [
        ("local[2]", None, True),
        (None, "local[*]", True),
        ("spark://head:7077", None, False),
        (None, None, False),
    ],
)
def test_the_local_settings_only_for_a_local_master_this_process_names(
    monkeypatch: pytest.MonkeyPatch, master: str | None, env: str | None, local: bool
) -> None:
    """No UI and the lighter JVM for ``local[...]`` named by --spark-master or $SPARK_MASTER;
    a cluster's master, or spark-submit's (none named), keeps the user's settings."""
    import sys
    import types

    from charllm_nemo.analysis.spark import LOCAL_CONF, spark_session

    builder = _Builder()
    fake = types.ModuleType("pyspark.sql")
    fake.SparkSession = types.SimpleNamespace(builder=builder)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pyspark.sql", fake)
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)  # restored after: the function may set it
    if env is None:
        monkeypatch.delenv("SPARK_MASTER", raising=False)
    else:
        monkeypatch.setenv("SPARK_MASTER", env)
    assert spark_session(master) is builder
    assert builder.url == (master or env)
    assert builder.conf == (LOCAL_CONF if local else {})
