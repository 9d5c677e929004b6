"""A rank's session end to end in-process: marks + samples -> store -> figures."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pyarrow.compute as pc
import pytest
from tests.deadline import deadline

from charllm_nemo.errors import ConfigError, StoreError
from charllm_nemo.telemetry.join import attribute_run
from charllm_nemo.telemetry.placement import (
    default_device_indices,
    local_device_ordinal,
    match_device_uuid,
    visible_device_entry,
)
from charllm_nemo.telemetry.reader import load_run
from charllm_nemo.telemetry.session import TelemetrySession
from charllm_nemo.telemetry.session_options import SessionOptions, StoreOptions


def test_marked_steps_land_in_the_store_and_attribute_per_step(tmp_path):
    with TelemetrySession(
        tmp_path,
        SessionOptions(backend="synthetic", hz=200, backend_options={"activity": "marks"}),
        config={"model": "x"},
        handle_signals=False,
    ) as tel:
        for step in range(3):
            with tel.windows.window("step", step=step):
                with tel.windows.window("phase", "forward", step=step, microbatch=0):
                    time.sleep(0.05)
                with tel.windows.window("phase", "optimizer", step=step):
                    time.sleep(0.02)
            time.sleep(0.03)
    run = load_run(tmp_path)
    assert run.manifests[0]["status"] == "complete"
    assert run.manifests[0]["config"] == {"model": "x"}
    assert run.manifests[0]["devices"][0]["backend"] == "synthetic"
    assert run.windows.num_rows == 9
    table = attribute_run(run, ("step",))
    assert table.num_rows == 3
    t = run.samples.filter(pc.is_valid(run.samples["power_instant_w"]))["t_mono_ns"].to_pylist()
    assert t[-1] >= max(table["t_end_mono_ns"].to_pylist())  # the sample taken at stop
    for w in table.to_pylist():
        bracketed = t[0] <= w["t_begin_mono_ns"] and w["t_end_mono_ns"] <= t[-1]
        if not bracketed:  # a sampler started late on a loaded machine: no figure made up
            assert w["energy_method"] == "none" and math.isnan(w["energy_j"]), w
            continue
        # a step is ~70 ms of forward (1.0 activity -> 550 W) and optimizer (0.5 -> 312.5 W)
        assert 200 * w["duration_s"] < w["energy_j"] < 550 * w["duration_s"] * 1.01, w


@pytest.mark.parametrize("sampler", ["process", "thread"])
def test_a_session_closed_mid_step_stores_what_the_step_marked(tmp_path, sampler):
    # A StepMarker records a step's windows at step end (in process mode, the telemetry process
    # makes them from the step's log); a session closed before that (SIGTERM, an exception)
    # still stores the finished phases, and the step and the running phase as open.
    from charllm_nemo.train.marks import StepMarker

    tel = TelemetrySession(
        tmp_path, SessionOptions(backend="synthetic", hz=200, sampler=sampler), handle_signals=False
    )
    tel.start()
    assert tel.sampler_mode == sampler
    marker = StepMarker(tel.windows, num_microbatches=1)
    for step in (0, 1):
        marker.begin_step(step)
        marker("forward-compute").start()
        marker("forward-compute").stop()
        marker("backward-compute").start()
        if step == 0:
            marker("backward-compute").stop()
            marker.end_step()
    tel.close("terminated")
    assert tel.windows.steps_shipped == (1 if sampler == "process" else 0)
    run = load_run(tmp_path)
    rows = sorted(run.windows.to_pylist(), key=lambda r: (r["step"], r["t_begin_mono_ns"], r["kind"]))
    assert [(r["step"], r["kind"], r["name"], r["t_end_mono_ns"] is None) for r in rows] == [
        (0, "step", "step", False), (0, "microbatch", "microbatch", False), (0, "phase", "forward", False),
        (0, "phase", "backward", False),
        (1, "step", "step", True), (1, "phase", "forward", False), (1, "phase", "backward", True),
    ]  # fmt: skip
    assert run.manifests[0]["windows_open_at_close"] == 2
    assert run.manifests[0]["windows_recorded"] == 5


def test_step_figures_wait_for_the_sampler_to_pass_the_window_and_never_block_by_default(tmp_path):
    with TelemetrySession(
        tmp_path,
        SessionOptions(backend="synthetic", hz=100, backend_options={"activity": 1.0}),
        handle_signals=False,
    ) as tel:
        time.sleep(0.05)
        t0 = time.monotonic_ns()
        time.sleep(0.1)
        t1 = time.monotonic_ns()
        start = time.perf_counter()
        maybe = tel.step_figures(t0, t1)  # the next sample may not exist yet
        assert time.perf_counter() - start < deadline(0.05)  # no wait for the next sample
        figs = tel.step_figures(t0, t1, wait_s=1.0)
        assert maybe is None or maybe[0]["energy_j"] > 0
        assert figs is not None and len(figs) == 1
        f = figs[0]
        # the counter publishes whole mJ every 50 ms and ticks are stamped up to a period late
        assert f["power_avg_w"] == pytest.approx(550.0, rel=1e-3)
        assert f["energy_j"] == pytest.approx(550.0 * (t1 - t0) / 1e9, rel=0.02)


def test_a_rank_samples_the_device_cuda_visible_devices_gives_it():
    assert default_device_indices(1, {"CUDA_VISIBLE_DEVICES": "4,5,6"}) == [5]
    # srun --gpus-per-task=1: local rank 3 sees one GPU, physically 5 (its device 0).
    assert default_device_indices(3, {"CUDA_VISIBLE_DEVICES": "5"}) == [5]
    assert default_device_indices(3, {"CUDA_VISIBLE_DEVICES": "2,7"}) == [7]
    assert [local_device_ordinal(r, 8) for r in (0, 7)] == [0, 7]
    assert [local_device_ordinal(r, 1) for r in (0, 3)] == [0, 0]
    assert local_device_ordinal(2, 0) == 2  # nothing visible: the rank's own number, for the error
    assert default_device_indices(1, {}) == [1]
    assert default_device_indices(0, {"CUDA_VISIBLE_DEVICES": "GPU-abc"}) == [0]  # a UUID: resolved at open
    assert visible_device_entry(1, {"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b"}) == "GPU-b"
    assert visible_device_entry(3, {"ROCR_VISIBLE_DEVICES": "GPU-a"}) == "GPU-a"
    assert visible_device_entry(0, {"CUDA_VISIBLE_DEVICES": ""}) is None


def test_a_visible_device_uuid_is_matched_as_cuda_reads_it():
    uuids = ["GPU-fa4e0000-0000-4000-8000-000000000000", "GPU-8932F937-d72c-4106-c12f-20bd9faed9f6", None]
    assert match_device_uuid("GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", uuids) == 1  # any case
    assert match_device_uuid("GPU-8932f937", uuids) == 1  # a unique prefix, as CUDA accepts
    assert match_device_uuid("8932f937d72c", uuids) == 1  # without GPU- and dashes
    assert match_device_uuid("GPU-", uuids) is None  # names nothing
    assert match_device_uuid("GPU-fa4e", [*uuids, "GPU-fa4e0000-1111"]) is None  # ambiguous
    assert match_device_uuid("GPU-0bad", uuids) is None  # not on this host
    # a MIG instance: NVML's power and energy are its GPU's, not the instance's
    assert match_device_uuid("MIG-8932f937-d72c-4106-c12f-20bd9faed9f6", uuids) is None


def test_a_bad_rate_fails_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"telemetry\.hz"):
        TelemetrySession(tmp_path, SessionOptions(backend="synthetic", hz=2000))
    assert not any(tmp_path.iterdir())


def _short_run(out, steps=3, store=None):
    with TelemetrySession(
        out, SessionOptions(backend="synthetic", hz=100, store=store or StoreOptions()), handle_signals=False
    ) as tel:
        for step in range(steps):
            with tel.windows.window("step", step=step):
                time.sleep(0.02)
        return tel.sampler_mode


def test_a_run_directory_holding_an_earlier_run_is_refused_before_anything_starts(tmp_path):
    _short_run(tmp_path, steps=10, store=StoreOptions(flush_interval_s=0.05))  # several segments
    before = sorted((tmp_path / "rank=0").iterdir())
    # several segments, compacted at close into windows-000000-<last>.parquet
    assert any(p.name.startswith("windows-000000-") for p in before)
    with pytest.raises(StoreError, match=r"rank=0 already holds a run .*telemetry\.overwrite=true"):
        TelemetrySession(
            tmp_path, SessionOptions(backend="synthetic", sampler="process"), handle_signals=False
        )
    assert sorted((tmp_path / "rank=0").iterdir()) == before  # untouched, and nothing was started
    # Replaced: the second run's files only (it writes fewer segments than the first left).
    mode = _short_run(tmp_path, store=StoreOptions(overwrite=True), steps=1)
    run = load_run(tmp_path)
    assert mode == "process" and run.manifests[0]["status"] == "complete"
    assert run.windows.column("step").to_pylist() == [0]


def test_live_rows_can_reach_back_to_the_sample_before_a_window(tmp_path):
    # Thread mode's live figures take one slot before their slice, so that a window starting
    # after a sampling stall is still bracketed (the collector does the same in process mode).
    with TelemetrySession(
        tmp_path, SessionOptions(backend="synthetic", hz=200, sampler="thread"), handle_signals=False
    ) as tel:
        time.sleep(0.1)
        rows = tel.live_rows()
        since = rows[5][0] + 1  # just after the 6th sample
        assert tel.live_rows(since)[0] == rows[6]
        assert tel.live_rows(since, before=1)[0] == rows[5]
        assert tel.live_rows(0, before=3)[0] == rows[0]


def test_auto_falls_back_to_synthetic_without_a_driver(tmp_path):
    # In a child with no NVML library reachable and no amdsmi: auto must pick synthetic, loudly.
    code = (
        "import sys; sys.modules['amdsmi'] = None\n"
        "from charllm_nemo.devices import open_backend\n"
        "b = open_backend('auto'); print('BACKEND', b.name)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=deadline(60)
    )
    assert proc.returncode == 0, proc.stderr
    assert "BACKEND synthetic" in proc.stdout
    assert "SYNTHETIC" in proc.stderr


def test_importing_the_package_needs_no_vendor_or_framework_library():
    code = (
        "import sys\n"
        "for m in ('pynvml', 'amdsmi', 'torch', 'megatron', 'wandb', 'hydra', 'nemo'):\n"
        "    sys.modules[m] = None\n"
        "import charllm_nemo, charllm_nemo.devices, charllm_nemo.telemetry.session, charllm_nemo.cli\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=deadline(60))
    assert proc.returncode == 0, proc.stderr


def test_a_rank_confined_to_one_cpu_is_warned_and_the_manifest_says_which(tmp_path):
    # The telemetry process inherits the rank's CPU mask: with one CPU it shares it with training.
    code = (
        "import os, sys\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "from charllm_nemo.telemetry.session import TelemetrySession\n"
        "from charllm_nemo.telemetry.session_options import SessionOptions\n"
        "options = SessionOptions(backend='synthetic', hz=50)\n"
        "with TelemetrySession(sys.argv[1], options, handle_signals=False):\n"
        "    pass\n"
    )
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    cmd = [sys.executable, "-c", code, str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=deadline(60))
    assert proc.returncode == 0, proc.stderr
    assert "may run on CPU" in proc.stderr and "--cpus-per-task=2" in proc.stderr
    cpus = load_run(tmp_path).manifests[0]["cpu_affinity"]
    assert len(cpus) == 1
    with TelemetrySession(
        tmp_path / "wide", SessionOptions(backend="synthetic", hz=50), handle_signals=False
    ):
        pass
    assert load_run(tmp_path / "wide").manifests[0]["cpu_affinity"] == sorted(os.sched_getaffinity(0))


def test_a_telemetry_process_lost_mid_run_is_taken_over_and_the_run_goes_on_being_recorded(tmp_path, caplog):
    # The telemetry process is killed (the OOM killer, a crash) between two steps: the next step's
    # request_figures notices, the training process stores what the rings held, and samples,
    # stores and computes figures itself from then on. Nothing marked is lost.
    import signal

    import numpy as np

    from charllm_nemo.train.marks import StepMarker

    tel = TelemetrySession(
        tmp_path, SessionOptions(backend="synthetic", hz=200, sampler="process"), handle_signals=False
    )
    tel.start()
    marker = StepMarker(tel.windows, num_microbatches=1)

    def step(n: int) -> tuple[int, int]:
        marker.begin_step(n)
        marker("forward-compute").start()
        time.sleep(0.02)
        marker("forward-compute").stop()
        timing = marker.end_step()
        tel.request_figures(timing.t_begin_mono_ns, timing.t_end_mono_ns)
        return timing.t_begin_mono_ns, timing.t_end_mono_ns

    for n in range(3):
        step(n)
    time.sleep(0.6)  # a flush on disk, and some samples not yet
    os.kill(tel.sampler.pid, signal.SIGKILL)
    killed_at = time.monotonic_ns()
    time.sleep(0.2)
    tel.engine._liveness_due = 0  # the next step checks (they do once a second)
    step(3)
    assert tel.sampler_mode == "thread" and "stopped mid-run" in caplog.text
    for n in range(4, 8):
        last = step(n)
    figures = tel.step_figures(*last, wait_s=1.0)
    assert figures is not None and figures[0]["energy_j"] > 0  # live figures from this process
    tel.close()
    run = load_run(tmp_path)
    m = run.manifests[0]
    assert m["status"] == "complete" and m["sampler_mode"] == "thread"
    assert m["telemetry_process_lost"]["store"]["salvaged"] is True
    assert m["rows"] == {"samples": run.samples.num_rows, "windows": run.windows.num_rows}
    steps = sorted(r["step"] for r in run.windows.to_pylist() if r["kind"] == "step")
    assert steps == list(range(8))
    assert m["windows_recorded"] == run.windows.num_rows
    t = np.sort(run.samples.column("t_mono_ns").to_numpy())
    assert t[t < killed_at].size > 100 and t[t > killed_at + 200_000_000].size > 10
    assert (np.diff(t) > 0).all()


def test_live_figures_wait_for_every_device_not_just_the_first(tmp_path):
    # Two devices, the second slow to read: a window must not be answered once device 0 has a
    # sample past its end while device 1's is still being read (its figures would be NaN).
    from charllm_nemo.devices.base import DeviceIdentity
    from charllm_nemo.telemetry.schema import METRIC_INDEX, METRIC_NAMES

    class Dev:
        def __init__(self, i: int, delay: float) -> None:
            self.identity = DeviceIdentity(index=i, name="f", vendor="x", backend="fake", uuid=None,
                                           driver_version=None)  # fmt: skip
            self.delay = delay

        def read(self) -> tuple:
            time.sleep(self.delay)
            values = [None] * len(METRIC_NAMES)
            values[METRIC_INDEX["power_instant_w"]] = 100.0
            return tuple(values)

        def supported_metrics(self) -> dict[str, bool]:
            return {m: True for m in METRIC_NAMES}

    class Backend:
        name = "fake"

        def __init__(self) -> None:
            self.devices = [Dev(0, 0.0), Dev(1, 0.03)]

        def close(self) -> None:
            pass

    tel = TelemetrySession(tmp_path, SessionOptions(backend=Backend(), hz=20), handle_signals=False).start()
    try:
        time.sleep(0.3)
        for _ in range(5):
            t1 = time.monotonic_ns()
            figs = tel.step_figures(t1 - 200_000_000, t1, wait_s=1.0, figures=["energy_j"])
            assert figs is not None
            assert [f["energy_j"] for f in figs] == [pytest.approx(20.0), pytest.approx(20.0)]
    finally:
        tel.close()


def test_a_close_that_cannot_store_the_open_windows_still_finishes_the_manifest(tmp_path, caplog):
    tel = TelemetrySession(
        tmp_path, SessionOptions(backend="synthetic", hz=100, sampler="thread"), handle_signals=False
    )
    tel.start()
    tel.windows.begin("step", step=0)  # still open at close
    write = tel.store.write_segment

    def full_disk(kind, table):
        if kind == "windows":
            raise OSError(28, "No space left on device")
        return write(kind, table)

    tel.store.write_segment = full_disk
    tel.close("failed")
    m = load_run(tmp_path).manifests[0]
    assert m["status"] == "failed" and m["flusher"]["errors"] >= 1
    assert "could not store the 1 window(s) open at close" in caplog.text


@pytest.mark.parametrize("sampler", ["thread", "process"])
def test_no_manifest_holds_a_secret_of_the_config_or_argv(tmp_path, monkeypatch, sampler):
    # Every manifest (at start, and each rewrite at close) held a config's token in plaintext.
    secret = "s3cr3t-" + sampler
    monkeypatch.setattr(sys, "argv", ["charllm", "train", f"+extra.hf_token={secret}"])
    config = {
        "extra": {"hf_token": secret, "db": f"postgres://me:{secret}@db/x"},
        "moe_token_dispatcher": "a2a",
    }
    tel = TelemetrySession(
        tmp_path,
        SessionOptions(backend="synthetic", hz=100, sampler=sampler),
        config=config,
        handle_signals=False,
    )
    manifest = tmp_path / "rank=0" / "manifest.json"
    with tel:
        assert secret not in manifest.read_text()
    text = manifest.read_text()
    assert secret not in text and '"status": "complete"' in text
    m = load_run(tmp_path).manifests[0]
    assert m["config"]["moe_token_dispatcher"] == "a2a" and m["config"]["extra"]["hf_token"] == "<redacted>"
    assert m["argv"][-1] == "+extra.hf_token=<redacted>"
