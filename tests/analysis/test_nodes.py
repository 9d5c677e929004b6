"""The host is a column of the ranks table, and the nodes table aggregates per run and host."""

from __future__ import annotations

from pathlib import Path

import pytest

from charllm_nemo.analysis.analyze import analyze

from .helpers import constant_run


def test_per_node_aggregates(tmp_path: Path) -> None:
    # 4 ranks at 400 W for 5 s, two per node; temperatures 50, 53 on a and 60, 51 on b.
    constant_run(tmp_path, ranks=4, power_w=400.0, hosts=["a", "a", "b", "b"], temps=[50, 53, 60, 51],
                 manifest={"env": {"SLURM_JOB_ID": "4242"}})  # fmt: skip
    t = analyze(tmp_path).tables
    assert sorted(set(t["ranks"].column("host").to_pylist())) == ["a", "b"]
    nodes = {r["host"]: r for r in t["nodes"].to_pylist()}
    assert set(nodes) == {"a", "b"}
    for host, spread in (("a", 3.0), ("b", 9.0)):
        n = nodes[host]
        assert n["ranks"] == 2 and n["devices"] == 2
        assert n["power_avg_w"] == pytest.approx(800.0)
        assert n["energy_j"] == pytest.approx(4000.0)
        assert n["temp_gpu_peak_spread_c"] == pytest.approx(spread)
    (run,) = t["runs"].to_pylist()
    assert run["job_id"] == "4242" and run["hosts"] == "a,b"
