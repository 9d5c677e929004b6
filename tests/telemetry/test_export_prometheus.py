"""A real Prometheus server scrapes a 2-rank CPU training run with telemetry.export=prometheus.

Debian's ``prometheus`` (scripts/test.sh installs it) runs on 127.0.0.1 with a scrape interval
of 200 ms over both ranks' endpoints; two Megatron-Core ranks train tiny_gpt on CPU over gloo
with the synthetic backend. Afterwards the test asks Prometheus' HTTP API for every raw sample
it stored and checks them against the run directory: each rank's power is a power the store
holds for that rank around the scrape, and each scraped (step, step energy) pair is that step's
energy in the stored run, within 1 %, with the labels the exporter promises. Loopback only; every
process has a deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from tests.train.test_cpu_training import run_ranks, tiny_cfg

from charllm_nemo.telemetry.join import attribute_run
from charllm_nemo.telemetry.reader import load_run

PROMETHEUS = shutil.which("prometheus")
if PROMETHEUS is None:
    if os.environ.get("CHARLLM_REQUIRE_PROMETHEUS") == "1":
        pytest.fail("prometheus is not installed (scripts/test.sh installs Debian's package)")
    pytest.skip("Debian's prometheus package is not installed", allow_module_level=True)

START_S = 60  # Prometheus ready, at most


def _free_ports(n: int) -> int:
    """A port p with p .. p+n-1 free now (each rank serves export_port + its local rank)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def _api(port: int, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]


def _start_prometheus(tmp: Path, targets: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    # Not one of the targets' ports: they are free until the ranks bind them, and the kernel hands
    # a just-freed port out again (a CI run's Prometheus listened on rank 0's export port, whose
    # exporter then could not start: "Address already in use")
    taken = {int(t.rsplit(":", 1)[1]) for t in targets}
    port = _free_ports(1)
    while port in taken:
        port = _free_ports(1)
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 200ms\n  scrape_timeout: 150ms\n"
        "scrape_configs:\n  - job_name: charllm\n    static_configs:\n"
        f"      - targets: {json.dumps(targets)}\n"
    )
    log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed by the caller's finally
    proc = subprocess.Popen(
        [
            str(PROMETHEUS),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {(tmp / 'prometheus.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("prometheus was not ready in time")


def _series(port: int, metric: str) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
    """Every raw sample of ``metric`` Prometheus stored (a range selector over the last hour)."""
    data = _api(port, "query", query=f"{metric}[1h]", time=str(time.time()))
    return [(r["metric"], [(float(t), float(v)) for t, v in r["values"]]) for r in data["result"]]


def test_prometheus_scrapes_power_and_step_energy_of_two_ranks(tmp_path: Path) -> None:
    base = _free_ports(2)
    prom, prom_port = _start_prometheus(tmp_path, [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"])
    try:
        cfg = tiny_cfg()
        cfg.batch.train_steps = 120
        cfg.telemetry.enabled = True
        cfg.telemetry.backend = "synthetic"
        cfg.telemetry.export = "prometheus"
        cfg.telemetry.export_port = base
        results = run_ranks(cfg, 2, tmp_path)
        assert [r["steps"] for r in results] == [120, 120]
        time.sleep(0.5)  # the last scrapes' samples committed
        power = _series(prom_port, "DCGM_FI_DEV_POWER_USAGE")
        steps = _series(prom_port, "charllm_step")
        energy = _series(prom_port, "charllm_step_energy_joules")
        swing = _series(prom_port, "charllm_step_power_swing_watts")
        freq = _series(prom_port, "charllm_power_dominant_frequency_hertz")
        # the job's swing is PromQL's sum over the ranks' series (docs/export.md), at the last scrape
        last = max(t for _, values in swing for t, _ in values)
        job = _api(prom_port, "query", query="sum by (run) (charllm_step_power_swing_watts)", time=str(last))[
            "result"
        ]
    finally:
        prom.terminate()
        try:
            prom.wait(timeout=30)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()

    run = load_run(tmp_path / "run")
    col = {
        name: run.samples.column(name).to_numpy(zero_copy_only=False)
        for name in ("rank", "t_wall_ns", "power_avg_w")
    }
    # One series per rank: every label is fixed from the first scrape (none joins later).
    by_rank = {labels["dl_rank"]: (labels, values) for labels, values in power}
    assert sorted(by_rank) == ["0", "1"] and len(power) == 2, power
    for rank, (labels, values) in by_rank.items():
        # dcgm-exporter's labels, and ours
        assert labels["gpu"] == "0" and labels["UUID"] and labels["Hostname"] == socket.gethostname()
        assert labels["local_rank"] == rank and labels["run"] == "run" and labels["job"] == "charllm"
        assert labels["pp_stage"] == "0" and labels["tp_rank"] == "0" and labels["dp_rank"] == rank
        assert len(values) >= 3, values
        mine = col["rank"] == int(rank)
        t, p = col["t_wall_ns"][mine] / 1e9, col["power_avg_w"][mine]
        for ts, v in values:
            # The newest sample the collector had taken when the scrape was answered: up to a
            # flush interval (0.5 s) before the scrape's timestamp, or a little after it on a
            # loaded machine (the timestamp is when the scrape began).
            near = p[(t <= ts + 0.5) & (t >= ts - 1.5)]
            assert near.size, (rank, ts)
            assert min(abs(near - v)) <= 0.01 * abs(v), (rank, ts, v)

    table = attribute_run(run, kinds=("step",))
    stored = {
        (r, s): e
        for r, s, e in zip(
            table.column("rank").to_pylist(),
            table.column("step").to_pylist(),
            table.column("energy_j").to_pylist(),
            strict=True,
        )
    }
    step_of = {(lab["dl_rank"], t): v for lab, values in steps for t, v in values}
    checked = 0
    for labels, values in energy:
        rank = labels["dl_rank"]
        assert labels["pp_stage"] == "0" and labels["dp_rank"] == rank, labels
        for ts, joules in values:
            step = int(step_of[(rank, ts)])
            want = stored[(int(rank), step)]
            assert abs(joules - want) <= 0.01 * abs(want), (rank, step, joules, want)
            checked += 1
    assert {lab["dl_rank"] for lab, _ in energy} == {"0", "1"}
    assert checked >= 4
    _check_grid_gauges(table, step_of, swing, freq, job, last)


def _check_grid_gauges(table: Any, step_of: dict, swing: list, freq: list, job: Any, last: float) -> None:
    """Each scraped swing is that step's stored one; the job's (PromQL's sum at the last scrape)
    the sum of each rank's newest; each frequency 1 / a step time within the rank's stored ones."""
    cols = ("rank", "step", "power_swing_w", "duration_s")
    rows = list(zip(*(table.column(c).to_pylist() for c in cols), strict=True))
    stored = {(r, s): w for r, s, w, _ in rows}
    checked = 0
    for labels, values in swing:
        rank = labels["dl_rank"]
        for ts, watts in values:
            want = stored[(int(rank), int(step_of[(rank, ts)]))]
            assert abs(watts - want) <= 0.01 * abs(want) + 1e-9, (rank, ts, watts, want)
            checked += 1
    assert {lab["dl_rank"] for lab, _ in swing} == {"0", "1"} and checked >= 4
    newest = [max(v for v in values if v[0] <= last)[1] for _, values in swing]
    assert len(job) == 1 and float(job[0]["value"][1]) == pytest.approx(sum(newest))
    for labels, values in freq:
        durations = [d for r, _, _, d in rows if r == int(labels["dl_rank"]) and d]
        for _, hz in values:
            assert min(durations) * 0.99 <= 1 / hz <= max(durations) * 1.01, (labels["dl_rank"], hz)
    assert {lab["dl_rank"] for lab, _ in freq} == {"0", "1"}
