"""Live export (telemetry/export/): the exposition text, the values it holds, the textfile
write, the options, the Grafana dashboard's queries, and one rank's endpoint end to end."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from tests.deadline import deadline
from tests.telemetry.export_endpoint import parse, scrape_at_step, serving_session

from charllm_nemo.devices.contract import INT_NULL, THROTTLE_BITS
from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.config import Placement, TelemetryConfig, open_session, validate_telemetry
from charllm_nemo.telemetry.export import metric_names
from charllm_nemo.telemetry.export.exporter import write_textfile
from charllm_nemo.telemetry.export.names import ALL_FAMILIES, DEVICE_FAMILIES
from charllm_nemo.telemetry.export.state import ExportState, label_text
from charllm_nemo.telemetry.join import attribute_run
from charllm_nemo.telemetry.reader import load_run

ROOT = Path(__file__).resolve().parents[2]


def _state() -> ExportState:
    return ExportState([(0, "GPU-abc", "H100")], {"run": "r", "dl_rank": 3, "slurm_job_id": None}, "node-1")


def _chunk(t: list[int], **cols: list[float]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {
        "t_mono_ns": np.array(t, np.int64),
        "device_index": np.zeros(len(t), np.int16),
    }
    for name, values in cols.items():
        kind = np.int64 if name in ("energy_mj", "throttle_reasons", "mem_used_bytes") else np.float64
        out[name] = np.array(values, kind)
    out.setdefault("throttle_reasons", np.full(len(t), INT_NULL, np.int64))
    return out


def test_render_keeps_dcgm_names_and_labels_and_skips_missing_values() -> None:
    st = _state()
    st.set_parallel({"pp_stage": 1, "tp_rank": 0})
    st.take_samples(
        _chunk([0, 10], power_avg_w=[100.0, math.nan], energy_mj=[5000, INT_NULL], temp_gpu_c=[40.0, 41.0])
    )
    series = parse(st.render().decode())
    # The newest non-null value of each column; a column never seen has no series at all.
    assert series["DCGM_FI_DEV_POWER_USAGE"][0][1] == 100.0
    assert series["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"][0][1] == 5000  # a counter, no _total
    assert series["DCGM_FI_DEV_GPU_TEMP"][0][1] == 41.0
    assert "DCGM_FI_DEV_MEMORY_TEMP" not in series and "charllm_step" not in series
    labels = series["DCGM_FI_DEV_POWER_USAGE"][0][0]
    assert labels == (
        '{gpu="0",UUID="GPU-abc",modelName="H100",Hostname="node-1",run="r",dl_rank="3",pp_stage="1",tp_rank="0"}'
    )
    assert set(series) <= metric_names()


def test_label_values_are_escaped() -> None:
    assert label_text({"a": 'x"y\\z\nw', "b": None, "c": ""}) == '{a="x\\"y\\\\z\\nw"}'


def test_throttle_time_is_held_until_the_next_mask_across_chunks() -> None:
    st = _state()
    cap, therm = THROTTLE_BITS["sw_power_cap"], THROTTLE_BITS["hw_thermal"]
    st.take_samples(_chunk([0, 10, 30], throttle_reasons=[cap, cap | therm, 0]))
    st.take_samples(_chunk([45, 50], throttle_reasons=[INT_NULL, therm]))
    st.take_samples(_chunk([70], throttle_reasons=[0]))
    held = st.throttle_ns[0]
    assert held["sw_power_cap"] == 10 + 20  # 0-10 and 10-30
    assert held["hw_thermal"] == 20 + 20  # 10-30 and 50-70; the null at 45 holds nothing
    assert held["idle"] == 0
    series = parse(st.render().decode())
    assert series["DCGM_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP_NS"][0][1] == 30
    assert series["DCGM_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN_NS"][0][1] == 40


def test_step_figures_throughput_and_mfu() -> None:
    st = _state()
    fig = {"energy_j": 50.0, "power_avg_w": 100.0, "throttle_any_limiting_s": 0.125}
    st.take_step(7, 0.5, {0: fig}, (4096.0, 2e12, 1e13))
    st.take_step(8, 0.5, {0: fig}, (0.0, 0.0, 0.0))  # rates unknown: no throughput, no MFU
    s = parse(st.render().decode())
    assert s["charllm_step"][0][1] == 8
    assert s["charllm_step_throttle_share"][0][1] == 0.25
    assert s["charllm_steps_total"][0][1] == 2 and s["charllm_energy_joules_total"][0][1] == 100.0
    assert "charllm_step_mfu" not in s and "charllm_step_tokens_per_second" not in s
    st.take_step(9, 0.5, {0: fig}, (4096.0, 2e12, 1e13))
    s = parse(st.render().decode())
    assert s["charllm_step_tokens_per_second"][0][1] == 8192.0
    assert s["charllm_step_mfu"][0][1] == pytest.approx(0.4)  # 2e12 / 0.5 s / 1e13
    # The step is a gauge, never a label.
    assert all("step" not in labels for values in s.values() for labels, _ in values)


def test_every_family_is_named_once_and_device_sources_exist() -> None:
    from charllm_nemo.devices.contract import METRIC_NAMES

    names = [f.name for f in ALL_FAMILIES]
    assert len(names) == len(set(names))
    assert {f.source for f in DEVICE_FAMILIES} <= set(METRIC_NAMES)
    assert not any(n.startswith("DCGM") and n.endswith("_total") for n in names)


def test_textfile_is_replaced_atomically_and_never_written_through_a_link(tmp_path: Path) -> None:
    target = tmp_path / "charllm-rank0.prom"
    write_textfile(target, b"a 1\n")
    write_textfile(target, b"a 2\n")
    assert target.read_bytes() == b"a 2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["charllm-rank0.prom"]
    # A link planted at the temporary's name: the open fails, the link's target is untouched.
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (tmp_path / f".charllm-rank0.prom.{os.getpid()}.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_textfile(target, b"a 3\n")
    assert victim.read_bytes() == b"keep" and target.read_bytes() == b"a 2\n"
    # A link at the file's own name is replaced by the file, not written through.
    (tmp_path / f".charllm-rank0.prom.{os.getpid()}.tmp").unlink()
    target.unlink()
    target.symlink_to(victim)
    write_textfile(target, b"a 4\n")
    assert not target.is_symlink() and target.read_bytes() == b"a 4\n" and victim.read_bytes() == b"keep"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"export": "statsd"},
            "telemetry.export='statsd' is not valid; use one of [off, prometheus, textfile, otlp]",
        ),
        (
            {"export": "otlp", "export_otlp_endpoint": "127.0.0.1:4318"},
            "telemetry.export_otlp_endpoint='127.0.0.1:4318' is not",
        ),
        ({"export": "prometheus", "export_port": 0}, "telemetry.export_port=0 is not a TCP port"),
        ({"export": "textfile"}, "telemetry.export=textfile needs telemetry.export_textfile_dir"),
        ({"export": "prometheus", "export_interval_s": -1.0}, "telemetry.export_interval_s=-1.0 must be"),
    ],
)
def test_bad_export_options_name_the_field(tmp_path: Path, changes: dict, message: str) -> None:
    cfg = TelemetryConfig(out_dir=str(tmp_path / "run"), **changes)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_telemetry(cfg)


PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "and",
    "or",
    "unless",
}


def dashboard_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not a function or an
    aggregation (followed by '('), a label inside {...} or by (...), a range, or a keyword."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[m.end() :].lstrip()
        if rest.startswith("(") or m.group(0) in PROMQL_WORDS or re.fullmatch(r"\d.*|e\d+", m.group(0)):
            continue
        names.add(m.group(0))
    return names


def test_dashboard_queries_name_only_metrics_the_exporter_emits() -> None:
    dash = json.loads((ROOT / "grafana" / "charllm-dashboard.json").read_text())
    assert dash["panels"]
    seen: set[str] = set()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = dashboard_metrics(target["expr"])
            assert names, (panel["title"], target["expr"])
            assert names <= metric_names(), (panel["title"], names - metric_names())
            seen |= names
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.match(r"label_values\((\w+),", var["definition"])
            assert m and m.group(1) in metric_names()
    assert {"DCGM_FI_DEV_POWER_USAGE", "charllm_step_energy_joules", "charllm_step_mfu"} <= seen


def test_the_query_parser_finds_what_it_must() -> None:
    assert dashboard_metrics('sum by (pp_stage) (rate(x_total{run=~"$run"}[1m])) / 1e9') == {"x_total"}
    assert dashboard_metrics("a + on (gpu) b") == {"a", "b"}


def _steps(session, n: int) -> None:
    for step in range(n):
        t0 = time.monotonic_ns()
        time.sleep(0.05)
        session.windows.record("step", None, t0, time.monotonic_ns(), step=step)


def test_one_rank_endpoint_serves_its_step_figures_as_stored(tmp_path: Path) -> None:
    session, url = serving_session(tmp_path)
    try:
        session.publish_step_rates(1000.0, 1e12, 1e14)
        _steps(session, 6)
        s = scrape_at_step(url, 5)
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(url.replace("/metrics", "/other"), timeout=10)
    finally:
        session.close()
    assert s["charllm_step"][0][1] == 5 and s["charllm_steps_total"][0][1] == 6
    assert 'pp_stage="0"' in s["DCGM_FI_DEV_POWER_USAGE"][0][0]
    table = attribute_run(load_run(tmp_path / "run"), kinds=("step",))
    energy = dict(zip(table.column("step").to_pylist(), table.column("energy_j").to_pylist(), strict=True))
    assert s["charllm_step_energy_joules"][0][1] == pytest.approx(energy[5], rel=0.01)
    assert s["charllm_energy_joules_total"][0][1] == pytest.approx(sum(energy.values()), rel=0.01)
    duration = s["charllm_step_time_seconds"][0][1]
    assert s["charllm_step_tokens_per_second"][0][1] == pytest.approx(1000.0 / duration)
    assert s["charllm_step_mfu"][0][1] == pytest.approx(1e12 / duration / 1e14)


def test_textfile_mode_writes_the_rank_file(tmp_path: Path) -> None:
    folder = tmp_path / "textfile"
    folder.mkdir()
    cfg = TelemetryConfig(
        backend="synthetic",
        sampler="process",
        out_dir=str(tmp_path / "run"),
        export="textfile",
        export_textfile_dir=str(folder),
        export_interval_s=0.2,
    )
    session = open_session(cfg, Placement(2, 0, 3, 1))
    try:
        _steps(session, 3)
    finally:
        session.close()
    assert sorted(p.name for p in folder.iterdir()) == ["charllm-rank2.prom"]
    s = parse((folder / "charllm-rank2.prom").read_text())
    assert 'dl_rank="2"' in s["DCGM_FI_DEV_POWER_USAGE"][0][0]
    assert s["charllm_steps_total"][0][1] == 3  # the close writes the last figures


class _FakeCollector:
    """What Exporter.update reads of a collector: the newest sample time, the figure columns,
    and figures_of_windows (counted)."""

    def __init__(self) -> None:
        from charllm_nemo.telemetry.process.mark_ring import figure_columns

        self.columns = figure_columns()
        self._last_t = 0
        self.calls: list[list[tuple[int, int]]] = []

    def figures_of_windows(self, windows, figures):
        self.calls.append(list(windows))
        return [[(0, [1.0 if c == "energy_j" else 0.0 for c in self.columns])] for _ in windows]


def _step_record(step: int, t0: int, t1: int) -> np.ndarray:
    from charllm_nemo.telemetry.windows import NULL, RECORD_FIELDS, RECORD_LEN

    rec = np.full(RECORD_LEN, NULL, np.int64)
    rec[0] = 0  # RECORD_WINDOW
    rec[RECORD_FIELDS.index("kind")] = 0  # "step"
    rec[RECORD_FIELDS.index("step")] = step
    rec[RECORD_FIELDS.index("t_begin_mono_ns")] = t0
    rec[RECORD_FIELDS.index("t_end_mono_ns")] = t1
    rec[RECORD_FIELDS.index("pp_stage")] = 2
    return rec.reshape(1, -1)


class _Device:
    def __init__(self) -> None:
        from charllm_nemo.devices.base import DeviceIdentity

        self.identity = DeviceIdentity(0, "H100", "nvidia", "nvml", uuid="GPU-x")


def test_served_steps_reuse_the_answer_and_the_others_are_computed_in_one_call(tmp_path: Path) -> None:
    from charllm_nemo.telemetry.export.exporter import BATCH_NS, MAX_HOLD_NS, Exporter

    options = {"mode": "textfile", "textfile_dir": str(tmp_path), "interval_s": 3600, "rank": 0}
    ex = Exporter(options, [_Device()], period_ns=10_000_000)
    col = _FakeCollector()
    columns = col.columns
    answer = [(0, [7.0 if c == "energy_j" else 0.0 for c in columns])]
    ex.update(col, [], [_step_record(0, 0, 100), _step_record(1, 100, 200), _step_record(2, 200, 300)])
    ex.served(0, 100, answer, None)  # step 0 was asked for, with every figure
    ex.served(100, 200, answer, ("energy_j",))  # step 1's request lacks the step figures: not used
    col._last_t = 250
    ex.update(col, [], [])
    assert col.calls == [] and ex.state.steps == 1 and ex.state.step[0]["energy_j"] == 7.0
    assert ex.state.parallel == {"pp_stage": 2}
    col._last_t = 300 + MAX_HOLD_NS + 10_000_000  # past both unserved steps' longest wait
    ex.update(col, [], [])
    assert col.calls == []  # not yet: waits to batch more
    col._last_t = 200 + MAX_HOLD_NS + 10_000_000 + BATCH_NS  # the oldest unserved one is BATCH_NS late
    ex.update(col, [], [])
    assert col.calls == [[(100, 200), (200, 300)]] and ex.state.steps == 3
    assert ex.state.step[0]["step"] == 2.0 and ex.state.energy_total_j[0] == 7.0 + 1.0 + 1.0
    ex.close()
    assert (tmp_path / "charllm-rank0.prom").exists()


def test_step_telemetry_publishes_the_rates_once_at_setup() -> None:
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from charllm_nemo.steps import StepTelemetry
    from charllm_nemo.steps.rates import StepRates
    from charllm_nemo.telemetry.windows import WindowRecorder

    calls: list[tuple[float, float, float]] = []
    session = SimpleNamespace(
        windows=WindowRecorder(),
        hz=100.0,
        counter_every=1,
        sampler_mode="process",
        rank=0,
        local_rank=0,
        world_size=1,
        publish_step_rates=lambda *a: calls.append(a),
    )
    rates = StepRates(8e12, global_batch_size=16, seq_length=512, world_size=4, peak_tflops_per_gpu=100.0)
    StepTelemetry(session, Placement(0, 0, 1, 1), rates=rates)
    assert calls == [(16 * 512, 2e12, 100e12)]


def _otlp_step(bodies: list[dict]) -> float | None:
    """The ``charllm_step`` gauge of the last OTLP body received (None: none yet, or no step)."""
    for body in bodies[-1:]:
        for m in body["resourceMetrics"][0]["scopeMetrics"][0]["metrics"]:
            if m["name"] == "charllm_step":
                return float(m["gauge"]["dataPoints"][0]["asDouble"])
    return None


def test_otlp_mode_pushes_the_same_series_with_the_rank_on_the_resource(tmp_path: Path) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bodies: list[dict] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            assert self.path == "/v1/metrics" and self.headers["Content-Type"] == "application/json"
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    import threading

    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = TelemetryConfig(
            backend="synthetic",
            sampler="process",
            out_dir=str(tmp_path / "run"),
            export="otlp",
            export_otlp_endpoint=f"http://127.0.0.1:{server.server_address[1]}/v1/metrics",
            export_interval_s=0.2,
        )
        session = open_session(cfg, Placement(1, 1, 2, 2, {"pp_stage": 1}))
        try:
            _steps(session, 3)
            # a periodic push (every 0.2 s) with a step's figures before the close's: waited
            # for, not slept for (a loaded machine takes seconds to compute them)
            until = time.monotonic() + deadline(10)
            while _otlp_step(bodies) is None and time.monotonic() < until:
                time.sleep(0.05)
        finally:
            session.close()  # pushes once more
    finally:
        server.shutdown()
        server.server_close()
    assert len(bodies) >= 2
    last = bodies[-1]["resourceMetrics"][0]
    res = {a["key"]: a["value"] for a in last["resource"]["attributes"]}
    assert res["dl.rank"] == {"intValue": "1"} and res["service.name"] == {"stringValue": "charllm-nemo"}
    metrics = {m["name"]: m for m in last["scopeMetrics"][0]["metrics"]}
    assert set(metrics) <= metric_names()
    energy = metrics["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]["sum"]
    assert energy["isMonotonic"] is True and energy["aggregationTemporality"] == 2
    step = metrics["charllm_step"]["gauge"]["dataPoints"][0]
    assert step["asDouble"] == 2.0
    attrs = {a["key"]: a["value"] for a in step["attributes"]}
    assert attrs["gpu"] == {"intValue": "0"} and attrs["pp_stage"] == {"intValue": "1"}


def test_a_taken_port_is_named_by_the_exporter_and_on_the_launcher_console(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two jobs on one node: the second's rank cannot listen on its port. The rank's error names
    the port, and ``charllm train`` says it on the console once before starting the ranks (it was
    a line in logs/rank<N>.log only, without the port)."""
    from types import SimpleNamespace

    from charllm_nemo.telemetry.export.exporter import Exporter, taken_ports
    from charllm_nemo.train.app import _say_taken_export_ports

    with socket.socket() as other_job:
        other_job.bind(("127.0.0.1", 0))
        other_job.listen()
        port = other_job.getsockname()[1]
        with pytest.raises(OSError, match=f"port {port} on 127.0.0.1"):
            Exporter({"mode": "prometheus", "host": "127.0.0.1", "port": port}, [_Device()], 10_000_000)
        assert [t[:2] for t in taken_ports("127.0.0.1", port, 1)] == [(0, port)]
        tel = SimpleNamespace(export="prometheus", export_host="127.0.0.1", export_port=port)
        _say_taken_export_ports(SimpleNamespace(telemetry=tel, launch=SimpleNamespace(nproc=1)))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"port {port} on 127.0.0.1 (local rank 0)" in err, err
    assert "telemetry.export_port=" in err
