"""Sampling in a separate process: rows cross a shared-memory ring exactly, nothing is lost
silently, and the sampling process never outlives the training process."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from tests.deadline import deadline
from tests.fakes import nvml_stub

from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.join import attribute_run
from charllm_nemo.telemetry.placement import (
    _cgroup_cpu_quota,
    local_ranks_from_env,
    resolve_collector_sched,
    resolve_sampler_mode,
)
from charllm_nemo.telemetry.process import ring as shm
from charllm_nemo.telemetry.process.parent import ProcessSampler
from charllm_nemo.telemetry.reader import load_run
from charllm_nemo.telemetry.schema import METRIC_INDEX, METRICS
from charllm_nemo.telemetry.session import TelemetrySession
from charllm_nemo.telemetry.session_options import Placement, ProcessOptions, SessionOptions

SHM = Path("/dev/shm")


def _value(reading, name):
    return reading[METRIC_INDEX[name]]


def _gone(pid: int) -> bool:
    """True once ``pid`` no longer runs (a zombie waiting for init to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_until(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError):
                pass
    return out


def _rows(table) -> list[dict]:
    """A stored samples table as one dict per row (None where a metric is null)."""
    cols = table.to_pydict()
    return [dict(zip(cols, values, strict=True)) for values in zip(*cols.values(), strict=True)]


def test_synthetic_rows_cross_the_ring_into_the_store_with_their_values_and_monotonic_timestamps(tmp_path):
    # Two modelled devices at full activity: 550 W (under the cap), 100 % busy; the model's nulls stay null.
    t_before = time.monotonic_ns()
    with TelemetrySession(
        tmp_path,
        SessionOptions(
            backend="synthetic",
            devices=[0, 1],
            hz=500,
            sampler="process",
            backend_options={"count": 2, "activity": 1.0},
        ),
        handle_signals=False,
    ) as tel:
        assert tel.sampler_mode == "process" and tel.sampler.running
        assert tel.sampler.health.startup_ns < 5e9  # with a store: numpy, pyarrow and a warm-up first
        time.sleep(0.4)
    t_after = time.monotonic_ns()
    assert not tel.sampler.running
    run = load_run(tmp_path)
    h = run.manifests[0]["sampler"]
    rows = _rows(run.samples)
    assert h["stop_reason"] == "stopped" and h["rows_lost"] == 0 and h["errors"] == 0
    # Every row the telemetry process sampled is stored, none twice: one per device in every slot
    # it did not skip, and in the last one at stop. The slots count every deadline that passed
    # while it ran (>= 0.4 s at 500 Hz), skipped ones included: a loaded machine skips, it never
    # loses count.
    assert h["samples"] == len(rows) == 2 * (h["slots"] - h["deadlines_missed"] + 1)
    assert 0.9 * 0.4 * 500 <= h["slots"] <= (t_after - t_before) / 2e6
    for dev in (0, 1):
        mine = [r for r in rows if r["device_index"] == dev]
        t = np.array([r["t_mono_ns"] for r in mine])
        assert (np.diff(t) > 0).all() and t_before < t[0] and t[-1] < t_after  # one system-wide clock
        assert abs(mine[-1]["t_wall_ns"] - time.time_ns()) < 60e9  # wall clock, for humans
        assert all(r["read_ns"] > 0 and r["source"] == "synthetic" for r in mine)
        for r in mine[5:]:
            assert r["power_instant_w"] == 550.0 and r["util_gpu_pct"] == 100.0
            assert r["power_memory_w"] is None and r["nvlink_tx_bytes"] is None
            assert isinstance(r["pcie_tx_bytes"], int)
        energy = [r["energy_mj"] for r in mine]
        assert energy == sorted(energy) and energy[-1] > energy[0]


_NVML_CHILD = textwrap.dedent(
    """
    import json, sys, time
    from charllm_nemo.devices.factory import open_backend
    from charllm_nemo.telemetry.reader import load_run
    from charllm_nemo.telemetry.schema import METRICS
    from charllm_nemo.telemetry.session import TelemetrySession
    from charllm_nemo.telemetry.session_options import SessionOptions

    out, mode, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    expected = None
    if mode == "values":
        backend = open_backend("nvml", [0])
        expected = backend.devices[0].read()
        backend.close()
    opts = SessionOptions(backend="nvml", hz=200, counter_hz=10, sampler="process")
    with TelemetrySession(out, opts, handle_signals=False) as tel:
        assert tel.sampler_mode == "process"
        time.sleep(seconds)
        running = tel.sampler.running
        with tel.windows.window("step", step=0):  # after a lost device too: the user's window
            time.sleep(0.01)
    run = load_run(out)
    cols = run.samples.to_pydict()
    readings = [[cols[m.name][i] for m in METRICS] for i in range(run.samples.num_rows)]
    print("RESULT " + json.dumps({
        "expected": expected, "readings": readings, "t": cols["t_mono_ns"], "running": running,
        "manifest": run.manifests[0], "windows": run.windows.num_rows, "exit": tel.sampler._proc.returncode,
    }))
    """
)


def _run_nvml_child(tmp_path: Path, script: list[str], mode: str, seconds: float) -> dict:
    pytest.importorskip("pynvml")
    try:
        env = nvml_stub.subprocess_env(script, tmp_dir=tmp_path)
    except nvml_stub.StubUnavailable as exc:
        pytest.skip(str(exc))
    proc = subprocess.run(
        [sys.executable, "-c", _NVML_CHILD, str(tmp_path / "run"), mode, str(seconds)],
        env=env,
        capture_output=True,
        text=True,
        timeout=deadline(90),
    )
    assert proc.returncode == 0, proc.stderr
    result: dict = json.loads(proc.stdout.split("RESULT ", 1)[1])
    result["stderr"] = proc.stderr
    return result


def test_nvml_stand_in_rows_are_stored_exactly_including_64_bit_counters_above_2_53(tmp_path):
    # The telemetry process opens the real NVML backend on the stand-in (it inherits
    # LD_LIBRARY_PATH and FAKE_NVML_SCRIPT) and stores the rows; every stored row must equal a
    # direct read, to the last bit of the counters (ring -> collector -> Parquet -> reader).
    big = 2**53 + 1  # 9007199254740993: a float64 would make it ...992
    r = _run_nvml_child(
        tmp_path,
        [
            "0 power_instant_mw 251234",
            f"0 pcie_tx_bytes {big}",
            f"0 pcie_rx_bytes {2**62 + 7}",
            f"0 energy_mj {big + 2}",
            "0 temp_memory_c NOT_SUPPORTED",
            "0 violation_ts_us 1700000000123456",  # the driver's own stamp, fixed: else it moves
        ],
        "values",
        0.3,
    )
    readings, expected, h = r["readings"], r["expected"], r["manifest"]["sampler"]
    assert len(readings) >= 30
    # The counters are read on every 20th slot (200 Hz, counter_hz 10) and at stop; the other rows
    # hold null for them and the same gauges.
    assert h["counter_every"] == 20
    counters = {i for i, m in enumerate(METRICS) if m.cumulative}
    gauges_only = [None if i in counters else v for i, v in enumerate(expected)]
    whole = [reading for reading in readings if reading[METRIC_INDEX["energy_mj"]] is not None]
    assert 2 <= len(whole) <= len(readings) // 20 + 2
    assert readings[0] == expected and readings[-1] == expected
    assert all(reading == expected for reading in whole)
    assert all(reading == gauges_only for reading in readings if reading not in whole)
    assert _value(expected, "pcie_tx_bytes") == big and _value(expected, "energy_mj") == big + 2
    assert _value(expected, "pcie_rx_bytes") == 2**62 + 7
    assert _value(expected, "violation_power_ts_us") == 1700000000123456
    assert _value(expected, "temp_hbm_c") is None and _value(expected, "power_instant_w") == 251.234
    assert (np.diff(r["t"]) > 0).all()
    assert h["samples"] == len(readings) and h["stop_reason"] == "stopped" and h["rows_lost"] == 0


def test_a_lost_device_stops_sampling_the_store_goes_on_and_health_says_so(tmp_path):
    r = _run_nvml_child(tmp_path, ["0 lose_after_calls 250"], "lost", 0.6)
    h = r["manifest"]["sampler"]
    # No sample after the loss, but the telemetry process keeps storing the user's windows.
    assert r["running"] and r["exit"] == 0 and r["windows"] == 1
    assert h["devices_lost"] == 1 and h["stop_reason"] == "no devices left"
    assert 0 < h["samples"] == len(r["readings"]) < 40  # ~9 calls per read
    assert "lost" in r["stderr"]  # the telemetry process's one log line reaches the job's stderr


def test_a_collector_lapped_by_the_sample_ring_counts_what_it_lost(tmp_path, monkeypatch):
    # A 32-row ring at 1 kHz: the collector, woken at least every 0.1 s when nothing else wakes it
    # (child.MAX_SLEEP_S), finds the sampling loop ~100 rows ahead of it each time.
    from charllm_nemo.telemetry.process import parent

    monkeypatch.setattr(parent, "MIN_CAPACITY", 32)
    monkeypatch.setattr(parent, "RING_SECONDS", 0.0)
    with TelemetrySession(
        tmp_path,
        SessionOptions(backend="synthetic", hz=1000, sampler="process", backend_options={"activity": 0.5}),
        handle_signals=False,
    ) as tel:
        assert tel.sampler.capacity == 32
        time.sleep(0.5)
        assert 0 < len(tel.live_rows()) <= 32  # what the ring still holds
    run = load_run(tmp_path)
    h = run.manifests[0]["sampler"]
    assert h["rows_lost"] >= 100
    # every row the telemetry process sampled was either stored or counted as lost, none twice
    assert run.samples.num_rows + h["rows_lost"] == h["samples"]
    t = run.samples.column("t_mono_ns").to_numpy()
    assert (np.diff(t) > 0).all()


def test_without_marks_auto_follows_the_training_process_cpu_then_the_marks(tmp_path):
    with TelemetrySession(
        tmp_path,
        SessionOptions(backend="synthetic", hz=200, sampler="process", backend_options={"activity": "auto"}),
        handle_signals=False,
    ) as tel:
        end = time.perf_counter() + 0.8
        while time.perf_counter() < end - 0.5:  # this process busy: the child sees it in /proc/<ppid>/stat
            pass
        cpu0, wall0 = time.process_time(), time.perf_counter()
        while time.perf_counter() < end:
            pass
        share = (time.process_time() - cpu0) / (time.perf_counter() - wall0)  # < 1 on a loaded machine
        t_busy = time.monotonic_ns()
        time.sleep(0.5)
        t_idle = time.monotonic_ns()
        with tel.windows.window("step", step=0), tel.windows.window("phase", "optimizer", step=0):
            time.sleep(0.1)  # the optimizer's level: 0.5 (devices/synthetic.py), published to the child
            t_opt = time.monotonic_ns()
    rows = _rows(load_run(tmp_path).samples)
    util = np.array([r["util_gpu_pct"] for r in rows])
    t = np.array([r["t_mono_ns"] for r in rows])
    busy = util[(t > t_busy - 400_000_000) & (t < t_busy)]
    idle = util[(t > t_idle - 200_000_000) & (t < t_idle)]
    # The model follows the CPU share this process got (a full core when the machine is quiet).
    assert np.median(busy) > max(15.0, 50.0 * share) and np.median(idle) < 10
    marked = util[(t > t_opt - 50_000_000) & (t < t_opt)]
    assert len(marked) >= 3 and set(marked.tolist()) == {50.0}


def test_the_telemetry_process_exits_and_unlinks_its_block_when_the_parent_is_killed(tmp_path):
    code = (
        "import sys, time\n"
        "from charllm_nemo.telemetry.session import TelemetrySession\n"
        "from charllm_nemo.telemetry.session_options import SessionOptions\n"
        "opts = SessionOptions(backend='synthetic', hz=1000, sampler='process')\n"
        "tel = TelemetrySession(sys.argv[1], opts, handle_signals=False).start()\n"
        "print(tel.sampler.pid, tel.sampler.shm_name, tel.sampler.running, flush=True)\n"
        "time.sleep(60)\n"
    )
    out = tmp_path / "run"
    parent = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid_s, name, running = parent.stdout.readline().split()
        child = int(pid_s)
        assert running == "True" and not _gone(child) and (SHM / name).exists()
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _wait_until(lambda: _gone(child), 5.0), "the telemetry process outlived its parent"
        assert _wait_until(lambda: not (SHM / name).exists(), 1.0), "shared memory left in /dev/shm"
    finally:
        if parent.poll() is None:
            parent.kill()
    assert load_run(out).manifests[0]["status"] == "killed"  # it stored what it had, and said so


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_blocks_of_runs_killed_whole_are_swept_and_every_other_block_is_kept():
    dead, other_dead = _dead_pid(), _dead_pid()
    lay = shm.Layout(64)
    cases = {  # name -> (the telemetry process's pid in the header, swept?)
        f"charllm-sampler-{dead}-0000aaa1": (0, True),  # owner dead, child never started
        f"charllm-sampler-{dead}-0000aaa2": (other_dead, True),  # owner and child dead
        f"charllm-sampler-{dead}-0000aaa3": (os.getpid(), False),  # child alive: still flushing
        shm.block_name(os.getpid()): (0, False),  # owner alive
        f"charllm-samplers-{dead}-0000aaa4": (0, False),  # not one of ours
    }
    try:
        for name, (child, _swept) in cases.items():
            block = shm.create(name, lay)
            block.q[shm.H_PID] = child
            block.close()
        removed = shm.sweep_stale()
        mine = {n for n in removed if n in cases}
        assert mine == {n for n, (_c, swept) in cases.items() if swept}
        assert all((SHM / n).exists() != swept for n, (_c, swept) in cases.items())
    finally:
        for name in cases:
            shm.unlink(name)


def test_a_crashed_telemetry_process_is_reported_and_its_block_still_unlinked(tmp_path):
    with TelemetrySession(
        tmp_path,
        SessionOptions(backend="synthetic", hz=500, sampler="process", backend_options={"activity": 1.0}),
        handle_signals=False,
    ) as tel:
        time.sleep(0.1)
        s = tel.sampler
        name, child = s.shm_name, s.pid
        assert name is not None and child is not None
        os.kill(child, signal.SIGKILL)
        assert _wait_until(lambda: not s.running, 2.0)
        assert s.health.stop_reason == "sampling process exited unexpectedly (exit code -9)"
        assert len(tel.live_rows()) > 10  # what it wrote before it died is still there
    assert not (SHM / name).exists() and s.shm_name is None


def test_a_telemetry_process_needs_its_whole_store(tmp_path):
    # There is no mode without a store (the rows go to the rank's segments, never back here).
    with pytest.raises(ConfigError, match=r"store lacks \['flush_interval_s', 'live_window_s'\]"):
        ProcessSampler("synthetic", [0], store={"rank_dir": tmp_path})
    with pytest.raises(TypeError, match="store"):
        ProcessSampler("synthetic", [0])  # type: ignore[call-arg]
    assert not any(tmp_path.iterdir()) and not list(SHM.glob(f"charllm-sampler-{os.getpid()}-*"))


def test_a_session_whose_sampling_process_cannot_start_samples_in_a_thread(tmp_path, monkeypatch):
    import charllm_nemo.telemetry.process.child as tp

    monkeypatch.setattr(tp, "CHILD_CODE", "raise SystemExit(3)")
    with TelemetrySession(
        tmp_path, SessionOptions(backend="synthetic", hz=500, sampler="process"), handle_signals=False
    ) as tel:
        assert tel.sampler_mode == "thread" and tel.sampler.running
        time.sleep(0.1)
    m = load_run(tmp_path).manifests[0]
    assert m["sampler_mode"] == "thread" and m["sampler"]["samples"] > 20
    assert "exit code 3" in m["sampler_process_error"]


def test_the_sampling_process_imports_neither_torch_nor_numpy_nor_pyarrow():
    # What the child imports before it samples: its own module, the factory and a backend.
    code = (
        "import sys\n"
        "import charllm_nemo.telemetry.process.child, charllm_nemo.devices.factory\n"
        "import charllm_nemo.devices.synthetic, charllm_nemo.devices.nvml\n"
        "print(sorted(m for m in ('torch', 'numpy', 'pyarrow') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=deadline(60))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_sampler_mode_auto_is_a_process_at_every_rate_and_unknown_modes_are_refused(tmp_path):
    assert resolve_sampler_mode("auto", 1000) == "process"
    assert resolve_sampler_mode("auto", 1) == "process"
    assert resolve_sampler_mode("thread", 1000) == "thread"
    assert resolve_sampler_mode("process", 10) == "process"
    with pytest.raises(ConfigError, match=r"telemetry\.sampler='fork'.*auto, thread, process"):
        TelemetrySession(tmp_path, SessionOptions(backend="synthetic", hz=100, sampler="fork"))
    assert not any(tmp_path.iterdir())
    with pytest.raises(ConfigError, match="cannot cross into the sampling process"):
        TelemetrySession(
            tmp_path,
            SessionOptions(backend="synthetic", hz=100, sampler="process", backend_options={"activity": abs}),
        )
    tel = TelemetrySession(
        tmp_path / "a",
        SessionOptions(backend="synthetic", hz=1000, backend_options={"activity": abs}),
        handle_signals=False,
    )
    assert tel.sampler_mode == "thread"  # auto: a callable activity cannot cross; stays in a thread
    tel.close()


def test_a_session_in_process_mode_stores_marked_steps_whose_marks_drive_the_model(tmp_path):
    with TelemetrySession(
        tmp_path,
        SessionOptions(backend="synthetic", hz=1000, backend_options={"activity": "marks"}),
        handle_signals=False,
    ) as tel:
        assert tel.sampler_mode == "process" and tel.sampler.running
        for step in range(3):
            with tel.windows.window("step", step=step):
                t0 = time.monotonic_ns()
                with tel.windows.window("phase", "forward", step=step, microbatch=0):
                    time.sleep(0.06)
                t1 = time.monotonic_ns()
                with tel.windows.window("phase", "optimizer", step=step):
                    time.sleep(0.04)
            time.sleep(0.03)
        live = tel.step_figures(t0, t1, wait_s=1.0)
        assert live is not None and live[0]["power_avg_w"] == pytest.approx(550.0, rel=0.03)
        child = tel.sampler.pid
    assert child is not None and _wait_until(lambda: _gone(child), 2.0)
    run = load_run(tmp_path)
    m = run.manifests[0]
    assert m["status"] == "complete" and m["sampler_mode"] == "process"
    assert m["sampler"]["samples"] == run.samples.num_rows >= 300
    assert m["sampler"]["rows_lost"] == 0 and m["sampler"]["startup_ns"] < deadline(1e9)
    assert run.windows.num_rows == 9
    t = run.samples.column("t_mono_ns").to_numpy()
    assert (np.diff(t) > 0).all()
    phases = attribute_run(run, ("phase",)).to_pylist()
    forward = [p["power_avg_w"] for p in phases if p["name"] == "forward"]
    optimizer = [p["power_avg_w"] for p in phases if p["name"] == "optimizer"]
    # forward: activity 1.0 -> 550 W; optimizer: 0.5 -> 75 + 0.5 * (550 - 75) = 312.5 W
    assert all(p == pytest.approx(550.0, rel=0.03) for p in forward), forward
    assert all(p == pytest.approx(312.5, rel=0.05) for p in optimizer), optimizer
    assert not math.isnan(phases[0]["energy_j"])


def _thread_stat(pid: int, field: int) -> dict[str, int]:
    """Field ``field`` (numbered as in proc(5): 19 = nice, 41 = policy) of
    /proc/<pid>/task/<tid>/stat for each thread of ``pid`` named like the interpreter (``python``;
    not the threads a library started, e.g. jemalloc's)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        stat = (task / "stat").read_text()
        if stat[stat.index("(") + 1 : stat.rindex(")")].startswith("python"):
            out[task.name] = int(stat[stat.rindex(")") + 2 :].split()[field - 3])
    return out


def _thread_nices(pid: int) -> dict[str, int]:
    return _thread_stat(pid, 19)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
@pytest.mark.parametrize("nice", [None, 7, 19])
def test_every_thread_of_the_telemetry_process_runs_at_telemetry_nice(tmp_path, nice):
    process = ProcessOptions() if nice is None else ProcessOptions(nice=nice)
    rank_nice = os.getpriority(os.PRIO_PROCESS, 0)
    with TelemetrySession(
        tmp_path, SessionOptions(backend="synthetic", process=process), handle_signals=False
    ) as tel:
        assert tel.sampler_mode == "process"
        child = tel.sampler.pid
        assert _wait_until(lambda: len(_thread_nices(child)) >= 2, 5.0)  # sampling + collector
        want = max(0 if nice is None else nice, rank_nice)  # never above the rank's priority
        assert set(_thread_nices(child).values()) == {want}
    assert os.getpriority(os.PRIO_PROCESS, 0) == rank_nice  # the rank keeps its own


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="needs Linux's SCHED_IDLE")
@pytest.mark.parametrize(
    ("setting", "rank_threads", "policy"),
    [("idle", 1, "idle"), ("normal", 1, "normal"), ("auto", 0, "idle"), ("auto", 4096, "normal")],
)
def test_collector_sched_puts_the_collector_thread_alone_under_sched_idle(
    tmp_path, setting, rank_threads, policy
):
    process = ProcessOptions(collector_sched=setting, rank_threads=rank_threads)
    opts = SessionOptions(backend="synthetic", process=process)
    with TelemetrySession(
        tmp_path, opts, placement=Placement(local_world_size=1), handle_signals=False
    ) as tel:
        assert tel.sampler_mode == "process"
        assert tel.collector_sched is not None and tel.collector_sched["policy"] == policy
        child = tel.sampler.pid
        assert _wait_until(lambda: len(_thread_stat(child, 41)) >= 2, 5.0)  # sampling + collector
        assert _wait_until(
            lambda: tel.sampler._block.q[shm.H_SVC_STATE] == shm.SVC_RUNNING, 5.0
        )  # policy set
        policies = _thread_stat(child, 41)
        sampling = policies.pop(str(child))  # the sampling loop runs on the process's main thread
        assert sampling == os.SCHED_OTHER
        # the collector (the others: a library's idle workers, e.g. OpenBLAS's, keep the policy)
        assert list(policies.values()).count(os.SCHED_IDLE) == (1 if policy == "idle" else 0)
        time.sleep(0.3)  # samples and a flush under that policy
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the rank keeps its own
    m = load_run(tmp_path).manifests[0]
    assert m["status"] == "complete" and m["sampler"]["samples"] > 10
    assert m["collector_sched"]["setting"] == setting and m["collector_sched"]["policy"] == policy


def test_collector_sched_auto_is_idle_only_where_a_cpu_is_spare():
    def auto(ranks, threads, mask, quota=None):
        return resolve_collector_sched("auto", ranks, threads, cpus=(mask, quota))

    assert auto(1, 1, 2)[0] == "idle"  # one rank, one intra-op thread, two CPUs: this VM
    policy, why = auto(2, 1, 2)  # the two-rank CPU runs here: both CPUs busy
    assert policy == "normal" and why.endswith("2 kept busy by 2 local rank(s) sharing them: none to spare")
    assert auto(1, 2, 2)[0] == "normal"  # one rank whose two intra-op threads fill both
    assert auto(8, 1, 112)[0] == "idle"  # a GPU node, every rank seeing every core
    assert auto(8, 1, 112, quota=8.0)[0] == "normal"  # ... in a container limited to 8 CPUs
    policy, why = auto(8, 1, 4)  # srun --cpu-bind: 4 cores of its own per rank
    assert policy == "idle" and "this rank, bound to its own 4 CPU(s)" in why
    assert auto(8, 1, 1)[0] == "normal"  # one core per rank
    assert resolve_collector_sched("idle", 8, cpus=(1, None))[0] == "idle"  # asked for: as asked
    assert resolve_collector_sched("normal", 1, cpus=(64, None))[0] == "normal"
    with pytest.raises(ConfigError, match=r"telemetry\.collector_sched='lowest'.*auto, idle, normal"):
        resolve_collector_sched("lowest", 1)
    with pytest.raises(ConfigError, match=r"telemetry\.collector_sched"):
        TelemetrySession(
            "unused", SessionOptions(backend="synthetic", process=ProcessOptions(collector_sched="batch"))
        )


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({"LOCAL_WORLD_SIZE": "4", "SLURM_NTASKS_PER_NODE": "8"}, 4),
        ({"SLURM_NTASKS_PER_NODE": "8(x4)"}, 8),
        ({}, 16),
    ],
)
def test_local_ranks_come_from_torchrun_then_slurm_then_the_world(env, want):
    assert local_ranks_from_env(env, world_size=16) == want


@pytest.mark.parametrize(
    ("cgroup", "files", "want"),
    [
        ("0::/job\n", {"job/cpu.max": "150000 100000\n"}, 1.5),
        ("0::/job\n", {"job/cpu.max": "max 100000\n"}, None),
        (
            "4:cpu,cpuacct:/job\n0::/\n",
            {"cpu,cpuacct/job/cpu.cfs_quota_us": "300000", "cpu,cpuacct/job/cpu.cfs_period_us": "100000"},
            3.0,
        ),
        (
            "4:cpu,cpuacct:/job\n",
            {"cpu,cpuacct/job/cpu.cfs_quota_us": "-1", "cpu,cpuacct/job/cpu.cfs_period_us": "100000"},
            None,
        ),
        ("0::/gone\n", {}, None),
    ],
)
def test_the_cgroup_cpu_quota_caps_the_usable_cpus(tmp_path, cgroup, files, want):
    (tmp_path / "cgroup").write_text(cgroup)
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text)
    assert _cgroup_cpu_quota(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == want


@pytest.mark.parametrize("bad", [-1, 20, 2.5, True, "19"])
def test_telemetry_nice_out_of_range_is_refused_naming_the_field(tmp_path, bad):
    with pytest.raises(ConfigError, match=r"telemetry\.nice"):
        TelemetrySession(tmp_path, SessionOptions(backend="synthetic", process=ProcessOptions(nice=bad)))


def test_sigkill_of_the_training_process_of_a_1khz_run_loses_no_sample_and_leaves_no_sampler(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "telemetry", "--backend", "synthetic", "--hz", "1000",
           "--sampler", "process", "--seconds", "30", "--step-s", "0.2", "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert _wait_until(lambda: len(list(out.glob("rank=0/samples-*.parquet"))) >= 3, 20.0)
        children = _children(proc.pid)
        blocks = list(SHM.glob(f"charllm-sampler-{proc.pid}-*"))
        assert len(children) >= 1 and len(blocks) == 1
        time.sleep(0.7)  # land somewhere between two flushes
        killed_at = time.monotonic_ns()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The telemetry process notices, stores what it has, marks the manifest and goes.
    assert _wait_until(lambda: all(_gone(c) for c in children), 3.0)
    assert _wait_until(lambda: not any(b.exists() for b in blocks), 1.0)
    run = load_run(out)
    assert run.manifests[0]["sampler_mode"] == "process" and run.manifests[0]["status"] == "killed"
    t = run.samples.column("t_mono_ns").to_numpy()
    # Sampled throughout (a loaded 2-core VM keeps ~1 s of a 1 kHz run to a few hundred rows), in order.
    assert run.samples.num_rows >= 200 and (np.diff(t) > 0).all()
    # Negative: the telemetry process outlives its parent by a few ms and samples until it notices.
    lost_s = (killed_at - t.max()) / 1e9
    assert -1.0 <= lost_s <= 0.05, f"lost {lost_s:.3f} s of samples"
    assert run.windows.num_rows > 0


def test_live_figures_of_a_process_session_equal_the_stored_run_for_every_column(tmp_path):
    steps = []
    with TelemetrySession(
        tmp_path,
        SessionOptions(backend="synthetic", hz=200, backend_options={"activity": "marks"}),
        handle_signals=False,
    ) as tel:
        assert tel.sampler_mode == "process"
        for step in range(4):
            t0 = time.monotonic_ns()
            wid = tel.windows.begin("step", step=step, t_mono_ns=t0)
            with tel.windows.window("phase", "forward", step=step, microbatch=0):
                time.sleep(0.03 + 0.02 * step)
            t1 = time.monotonic_ns()
            tel.windows.end(wid, t_mono_ns=t1)
            tel.request_figures(t0, t1)  # as the loop does at step end
            steps.append((t0, t1))
        live = [tel.step_figures(t0, t1, wait_s=2.0) for t0, t1 in steps]
        some = tel.step_figures(*steps[0], figures=["energy_j"])
    assert some is not None and set(some[0]) == {"duration_s", "energy_j", "device_index"}
    stored = attribute_run(load_run(tmp_path), ("step",)).to_pylist()
    assert len(stored) == 4
    for row, figs in zip(sorted(stored, key=lambda r: r["step"]), live, strict=True):
        assert figs is not None and len(figs) == 1
        for name, value in figs[0].items():
            if name == "device_index":
                continue
            want = row[name]
            if name == "energy_bound_j":
                # The stored bound may use the counter's envelope, whose tick after the step a
                # live figure does not have yet (docs/attribution.md), so they need not be
                # equal; both bound the same truth: the energies lie within their sum.
                known = value is not None and not math.isnan(value) and not math.isnan(want)
                assert not known or abs(figs[0]["energy_j"] - row["energy_j"]) <= value + want + 1e-9
                continue
            if (isinstance(want, float) and math.isnan(want)) or want is None:
                assert value is None or math.isnan(value), name
            elif isinstance(want, float):
                assert value == pytest.approx(want, rel=1e-9, abs=1e-9), name
            else:
                assert value == want, name
    m = load_run(tmp_path).manifests[0]
    assert m["store_process"]["figures_served"] >= 4 and m["flusher"]["where"] == "telemetry process"


def test_a_request_for_some_figures_is_asked_again_when_more_are_wanted(tmp_path):
    with TelemetrySession(tmp_path, SessionOptions(backend="synthetic", hz=200), handle_signals=False) as tel:
        t0 = time.monotonic_ns()
        time.sleep(0.05)
        t1 = time.monotonic_ns()
        tel.request_figures(t0, t1, ["energy_j"])  # the telemetry process computes energy only
        first = tel.step_figures(t0, t1, wait_s=2.0, figures=["energy_j"])
        more = tel.step_figures(t0, t1, wait_s=2.0, figures=["energy_j", "temp_gpu_peak_c"])
        every = tel.step_figures(t0, t1, wait_s=2.0)
    assert first is not None and set(first[0]) == {"duration_s", "energy_j", "device_index"}
    assert more is not None and more[0]["temp_gpu_peak_c"] > 0  # asked again: computed, not NaN
    assert more[0]["energy_j"] == first[0]["energy_j"]
    assert every is not None and not math.isnan(every[0]["clock_sm_avg_mhz"])
    assert load_run(tmp_path).manifests[0]["store_process"]["figures_served"] == 3


def test_a_telemetry_process_that_dies_loses_only_its_last_flush_of_samples_and_no_window(tmp_path):
    with TelemetrySession(
        tmp_path,
        SessionOptions(backend="synthetic", hz=200, backend_options={"activity": 1.0}),
        handle_signals=False,
    ) as tel:
        time.sleep(0.7)  # at least one flush by the telemetry process
        os.kill(tel.sampler.pid, signal.SIGKILL)
        assert _wait_until(lambda: not tel.sampler.running, 2.0)
        for step in range(3):  # the training process goes on marking into the ring
            with tel.windows.window("step", step=step):
                time.sleep(0.01)
        # No request_figures (a loop that asks for none): no takeover mid-run, the close salvages.
        # (tests/telemetry/test_session.py: a loop that asks is taken over at its next step.)
    run = load_run(tmp_path)
    m = run.manifests[0]
    assert m["status"] == "complete" and m["store_process"]["salvaged"] is True
    assert m["store_process"]["done"] is False
    assert run.windows.column("step").to_pylist() == [0, 1, 2]  # written by the training process
    assert m["rows"] == {"samples": run.samples.num_rows, "windows": 3}
    assert run.samples.num_rows >= 100  # everything the ring held, to the moment it died
    assert "exited unexpectedly" in m["sampler"]["stop_reason"]


def test_a_failing_wake_up_check_never_reaches_the_sampling_loop(caplog):
    # The sampling loop asks the collector's service after every slot whether to wake it; a
    # check that raises must not stop sampling: logged once, the collector woken every slot.
    import threading

    from charllm_nemo.telemetry.process.child import _Service

    class Broken:
        calls = 0

        def has_work(self) -> bool:
            Broken.calls += 1
            raise RuntimeError("block released")

    svc = object.__new__(_Service)  # its thread and Collector are not needed for this
    svc.collector = Broken()
    svc._wake = threading.Event()
    svc._nudge_failed = False
    with caplog.at_level(logging.ERROR, logger="charllm_nemo.sampler"):
        for _ in range(3):
            svc._wake.clear()
            svc.nudge()
            assert svc._wake.is_set()
    assert Broken.calls == 1 and caplog.text.count("wake-up check failed") == 1


_NVML_SESSION_CHILD = textwrap.dedent(
    """
    import json, math, sys, time
    from charllm_nemo.telemetry.join import attribute_run
    from charllm_nemo.telemetry.reader import load_rank, load_run, to_arrays
    from charllm_nemo.telemetry.schema import INT_NULL
    from charllm_nemo.telemetry.session import TelemetrySession
    from charllm_nemo.telemetry.session_options import SessionOptions

    out = sys.argv[1]
    steps = []
    opts = SessionOptions(backend="nvml", hz=200, counter_hz=20, sampler=sys.argv[2])
    with TelemetrySession(out, opts, handle_signals=False) as tel:
        mode, period = tel.sampler_mode, tel.figures_period_ns
        for step in range(4):
            t0 = time.monotonic_ns()
            wid = tel.windows.begin("step", step=step, t_mono_ns=t0)
            time.sleep(0.06 + 0.03 * step)
            t1 = time.monotonic_ns()
            tel.windows.end(wid, t_mono_ns=t1)
            tel.request_figures(t0, t1)
            steps.append((t0, t1))
        live = [tel.step_figures(t0, t1, wait_s=2.0)[0] for t0, t1 in steps]
    stored = sorted(attribute_run(load_run(out), ("step",)).to_pylist(), key=lambda r: r["step"])
    s = to_arrays(load_rank(out, 0).samples)
    print("RESULT " + json.dumps({
        "mode": mode, "period": period, "live": live, "stored": stored,
        "energy_rows": int((s["energy_mj"] != INT_NULL).sum()),
        "pcie_rows": int((s["pcie_tx_bytes"] != INT_NULL).sum()),
        "rows": int(len(s["t_mono_ns"])), "sampler": load_run(out).manifests[0]["sampler"],
    }, default=lambda v: None))
    """
)


@pytest.mark.parametrize("sampler", ["process", "thread"])
def test_nvml_counters_read_apart_still_give_every_live_figure_as_stored(tmp_path, sampler):
    # NVML reads its cumulative counters on every 10th slot here (200 Hz, counter_hz 20); the
    # live figures wait for such a slot past each step's end, so counter deltas (violation
    # times, PCIe bytes) and the energy are there live, equal to the stored run's.
    pytest.importorskip("pynvml")
    script = [
        "0 energy_mode dynamic",
        "0 energy_update_ms 20",
        "0 power_square_mw 400000",
        "0 power_period_ms 30",
    ]
    try:
        env = nvml_stub.subprocess_env(script, tmp_dir=tmp_path)
    except nvml_stub.StubUnavailable as exc:
        pytest.skip(str(exc))
    proc = subprocess.run(
        [sys.executable, "-c", _NVML_SESSION_CHILD, str(tmp_path / "run"), sampler],
        env=env,
        capture_output=True,
        text=True,
        timeout=deadline(90),
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert r["mode"] == sampler and r["period"] == 10 * 5_000_000
    assert r["sampler"]["counter_every"] == 10
    assert r["energy_rows"] == r["pcie_rows"] and 0 < r["energy_rows"] <= r["rows"] // 10 + 2
    names = ("energy_j", "violation_power_s", "pcie_tx_bytes", "power_avg_w")
    for row, figs in zip(r["stored"], r["live"], strict=True):
        for name in names:  # live as stored; a step a loaded host left without a sample: both NaN
            assert figs[name] is not None, name
            assert figs[name] == pytest.approx(row[name], rel=1e-9, abs=1e-9, nan_ok=True), name
    for name in names:
        assert any(not math.isnan(figs[name]) for figs in r["live"]), name
