"""The driver-buffered timeline (telemetry/buffered.py): drained by the real NVML backend from the
stand-in library, stored as buffered-NNNNNN.parquet by either sampler mode, read back, and
used for each window's peak power (docs/store.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from tests.deadline import deadline
from tests.fakes import nvml_stub

from charllm_nemo.cli import main
from charllm_nemo.telemetry.buffered import BufferedStore, load_buffered, next_seq, window_peaks
from charllm_nemo.telemetry.join import attribute_run
from charllm_nemo.telemetry.layout import scan_run
from charllm_nemo.telemetry.reader import load_run

PERIOD_US = 2000  # the stand-in driver's buffer: a sample every 2 ms


def _run(tmp_path: Path, sampler: str, *extra: str) -> Path:
    # 300 W for 2 ms, then 650 W for 2 ms: the buffer sees both halves evenly
    script = [f"0 samples_period_us {PERIOD_US}", "0 samples_buffer 2000", "0 power_instant_mw 300000",
              "0 power_square_mw 650000", "0 power_period_ms 4"]  # fmt: skip
    try:
        env = nvml_stub.subprocess_env(script, tmp_dir=tmp_path)
    except nvml_stub.StubUnavailable as exc:
        pytest.skip(str(exc))
    out = tmp_path / f"run-{sampler}"
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "telemetry", "--backend", "nvml", "--hz", "50",
           "--seconds", "1.5", "--step-s", "0.2", "--out", str(out), "--sampler", sampler]  # fmt: skip
    cmd += extra
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=deadline(120))
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize("sampler", ["process", "thread"])
def test_the_driver_buffer_is_stored_as_its_own_timeline(
    tmp_path: Path, sampler: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _run(tmp_path, sampler)
    files = scan_run(out).ranks[0]
    # One segment a flush (0.5 s), compacted into one file at close (samples-<first>-<last>).
    segments = sum(int(p.stem.split("-")[-1]) - int(p.stem.split("-")[1]) + 1 for p in files.buffered)
    assert segments >= 2 and len(files.buffered) == 1
    table = load_buffered(out)
    assert set(table.column_names) == {"t_mono_ns", "t_wall_ns", "device_index", "metric", "value", "rank"}
    metric = np.array(table.column("metric").to_pylist())
    assert set(metric) == {"power_w", "clock_sm_mhz", "util_gpu_pct"}
    power = table.filter(np.asarray(metric == "power_w"))
    t = power.column("t_mono_ns").to_numpy()
    w = power.column("value").to_numpy()
    # every driver sample once, none lost between drains: 2 ms apart from first to last (the
    # driver's stamps exactly; on CLOCK_MONOTONIC up to the wall-to-monotonic offset's jitter
    # between two drains)
    assert np.all(np.diff(power.column("t_wall_ns").to_numpy()) == PERIOD_US * 1000)
    assert np.all(np.abs(np.diff(t) - PERIOD_US * 1000) < 100_000)
    run = load_run(out)
    span = run.samples.column("t_mono_ns").to_numpy()
    # on the samples' clock: from the device's open (in process mode the telemetry process's,
    # before its store's warm-up and first sample) to the last drain, at close, which follows
    # the last polled sample by up to a flush
    assert run.manifests[0]["started_mono_ns"] - 0.5e9 <= t[0] <= span[0] + 0.1e9
    assert span[-1] - 0.1e9 <= t[-1] <= span[-1] + 1e9
    assert len(t) >= 0.8 * (span[-1] - span[0]) / (PERIOD_US * 1000)
    assert set(w) == {300.0, 650.0} and 0.4 < np.mean(w == 650.0) < 0.6
    # each step's peak from the buffer
    steps = run.windows.filter(np.asarray(np.array(run.windows.column("kind").to_pylist()) == "step"))
    peaks = window_peaks(
        t, w, steps.column("t_begin_mono_ns").to_numpy(), steps.column("t_end_mono_ns").to_numpy()
    )
    # (a 1.5 s run of 0.2 s steps marks ~6 steps; on a loaded machine as few as 2: CI beside two
    # busy loops); every step holds ~100 buffered samples, so none may be NaN
    assert len(peaks) >= 1 and np.all(peaks == 650.0)
    # the same through the run's attribution, and charllm inspect's column
    joined = attribute_run(run, ("step",), table)
    assert joined.column("power_peak_buffered_w").to_pylist() == peaks.tolist()
    assert "power_peak_buffered_w" not in attribute_run(run, ("step",)).column_names
    if sampler == "thread":
        assert main(["inspect", str(out), "--kind", "step"]) == 0
        lines = capsys.readouterr().out.splitlines()
        header = next(line for line in lines if "buf peak W" in line)
        end = header.index("buf peak W") + len("buf peak W")  # numbers are right-aligned
        rows = [line for line in lines[lines.index(header) + 1 :] if line.strip()]
        assert rows and {r[:end].split()[-1] for r in rows} == {"650.0"}
    manifest = run.manifests[0]
    assert manifest["devices"][0]["extra"]["driver_buffers"]["metrics"] == [
        "power_w",
        "util_gpu_pct",
        "clock_sm_mhz",
    ]
    if sampler == "thread":  # the telemetry process's counts do not reach the manifest (docs/store.md)
        counts = manifest["driver_buffers"]
        assert counts["rows"] == table.num_rows and counts["segments"] == segments
        assert counts["polls"] >= 2 and counts["poll_ns_mean"] > 0


def test_off_writes_no_buffered_segment(tmp_path: Path) -> None:
    out = _run(tmp_path, "thread", "--no-driver-buffers")
    assert scan_run(out).ranks[0].buffered == ()
    assert load_buffered(out).num_rows == 0
    assert "driver_buffers" not in load_run(out).manifests[0]


class _Lost:
    has_driver_buffers = True  # devices/base.py ServesDriverBuffers

    def __init__(self) -> None:
        self.identity = type("I", (), {"index": 3})()

    def read_buffered(self) -> list[tuple[str, list[int], list[float]]]:
        from charllm_nemo.errors import DeviceLost

        raise DeviceLost("gone")


def test_a_lost_device_is_dropped(tmp_path: Path) -> None:
    store = BufferedStore(tmp_path, [_Lost()])
    assert store.flush() is None and store.devices == []
    assert store.counts()["devices"] == [] and store.counts()["polls"] == 1


class _Replay:
    """A device whose first drain returns ``batches`` (timestamps in us), later ones nothing."""

    has_driver_buffers = True

    def __init__(self, index: int, batches: list[tuple[str, list[int], list[float]]]) -> None:
        self.identity = type("I", (), {"index": index})()
        self.batches = batches

    def read_buffered(self) -> list[tuple[str, list[int], list[float]]]:
        out, self.batches = self.batches, []
        return out


def test_a_store_taking_over_numbers_on_and_repeats_no_sample(tmp_path: Path) -> None:
    first = BufferedStore(tmp_path, [_Replay(0, [("power_w", [1, 2, 3], [10.0, 20.0, 30.0])])])
    assert first.flush() == tmp_path / "buffered-000000.parquet"
    (tmp_path / "buffered-000003.parquet").write_bytes((tmp_path / "buffered-000000.parquet").read_bytes())
    assert next_seq(tmp_path) == 4
    # the training process's own handle, drained last at its open: its first drain repeats 2, 3
    again = [("power_w", [2, 3, 4, 5], [20.0, 30.0, 40.0, 50.0]), ("clock_sm_mhz", [3], [1500.0])]
    second = BufferedStore(tmp_path, [_Replay(0, again)])
    assert second.flush() == tmp_path / "buffered-000004.parquet"
    got = pq.read_table(tmp_path / "buffered-000004.parquet")
    rows = sorted(zip(got.column("metric").to_pylist(), got.column("t_wall_ns").to_pylist(), strict=True))
    assert rows == [("clock_sm_mhz", 3000), ("power_w", 4000), ("power_w", 5000)]


def test_window_peaks_are_nan_without_a_sample() -> None:
    t = np.array([10, 20, 30], np.int64)
    w = np.array([1.0, 5.0, 2.0])
    got = window_peaks(t, w, np.array([0, 15, 31]), np.array([10, 30, 40]))
    assert got[0] == 1.0 and got[1] == 5.0 and np.isnan(got[2])


def test_a_failed_write_keeps_the_samples_for_the_next_flush(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from charllm_nemo.telemetry import store as store_module

    dev = _Replay(0, [("power_w", [1, 2], [10.0, 20.0])])
    buffered = BufferedStore(tmp_path, [dev])
    real = store_module.atomic_write_table

    def fail_once(path: Path, table: object) -> None:
        monkeypatch.setattr(store_module, "atomic_write_table", real)
        raise OSError("EIO")

    monkeypatch.setattr(store_module, "atomic_write_table", fail_once)
    assert buffered.flush() is None and buffered.write_errors == 1
    dev.batches = [("power_w", [3], [30.0])]
    assert buffered.flush() == tmp_path / "buffered-000000.parquet"
    got = pq.read_table(tmp_path / "buffered-000000.parquet")
    assert got.column("t_wall_ns").to_pylist() == [1000, 2000, 3000]
    assert buffered.counts()["rows"] == 3
