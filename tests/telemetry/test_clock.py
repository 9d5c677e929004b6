"""The manifest's ``clock``: which clock samples carry, its wall-clock mapping at start and end,
and the host's time-sync state read from the kernel (telemetry/clock.py)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from charllm_nemo.telemetry.clock import (
    STA_UNSYNC,
    TIME_ERROR,
    alignment_bound_ns,
    classify_sync,
    clock_at_end,
    clock_at_start,
    ptp_devices,
    read_timex,
    sync_state,
    wall_ns,
)
from charllm_nemo.telemetry.filecheck import validate_manifest
from charllm_nemo.telemetry.reader import load_run
from charllm_nemo.telemetry.session import TelemetrySession
from charllm_nemo.telemetry.session_options import SessionOptions


@pytest.mark.parametrize("sampler", ["thread", "process"])
def test_the_manifest_maps_every_sample_stamp_to_the_wall_clock(tmp_path, sampler):
    with TelemetrySession(
        tmp_path, SessionOptions(backend="synthetic", hz=100, sampler=sampler), handle_signals=False
    ) as tel:
        running = dict(tel.manifest["clock"])
    run = load_run(tmp_path)
    assert not [p for p in run.problems if "clock" in p]
    m = run.manifests[0]
    clock = m["clock"]
    assert running["wall_minus_monotonic_ns_end"] is None and running["sync_end"] is None
    assert clock["sample_clock"] == "CLOCK_MONOTONIC"
    assert clock["measured_mono_ns_start"] < clock["measured_mono_ns_end"]
    assert isinstance(clock["wall_minus_monotonic_ns_end"], int)
    assert set(clock["sync_end"]) == set(clock["sync"])
    # Each sample also carries the wall clock read beside its monotonic stamp: the mapping gives it
    # back (to within the two reads' gap, a few us; a preemption between them on a loaded machine
    # is rare, hence the median).
    t_mono = run.samples.column("t_mono_ns").to_numpy()
    t_wall = run.samples.column("t_wall_ns").to_numpy()
    mapped = np.array([wall_ns(int(t), clock) for t in t_mono], dtype=np.int64)
    assert len(t_mono) > 0
    assert abs(float(np.median(t_wall - mapped))) < 1e6
    # and the close's offset agrees with the start's unless the wall clock was stepped meanwhile
    o0, o1 = clock["wall_minus_monotonic_ns_start"], clock["wall_minus_monotonic_ns_end"]
    assert abs(o1 - o0) < 1e9
    assert m["started_wall_ns"] - m["started_mono_ns"] == pytest.approx(o0, abs=50e6)


def test_the_kernel_state_is_read_through_the_real_struct_layout():
    if not sys.platform.startswith("linux"):
        pytest.skip("adjtimex is Linux's")
    got = read_timex()
    assert got is not None
    state, tx = got
    assert 0 <= state <= TIME_ERROR
    # ``tick`` (us per clock tick) sits after ``time`` in the struct: only the right layout reads
    # USER_HZ's tick there (10000 at USER_HZ 100; within the +-10 % the kernel allows).
    assert tx.tick * os.sysconf("SC_CLK_TCK") == pytest.approx(1_000_000, rel=0.1)
    assert tx.maxerror >= 0 and tx.esterror >= 0
    s = sync_state()
    assert s["kernel_state"] == state
    assert s["synchronized"] == (state != TIME_ERROR and not tx.status & STA_UNSYNC)
    assert s["source"] in (("ptp", "ntp") if s["synchronized"] else ("none",))


def test_sync_state_is_classified_from_the_kernel_flags_and_ptp_clocks(tmp_path):
    for name in ("ptp0", "ptp12", "ptpx", "tty0"):
        (tmp_path / name).touch()
    ptp = ptp_devices(tmp_path)
    assert ptp == ["ptp0", "ptp12"]
    assert ptp_devices(tmp_path / "missing") == []
    synced = classify_sync(0, 0x2001, 12_345, 67, [])
    assert synced == {
        "source": "ntp",
        "synchronized": True,
        "max_error_ns": 12_345_000,
        "est_error_ns": 67_000,
        "kernel_state": 0,
        "ptp_devices": [],
    }
    assert classify_sync(0, 0x2001, 12, 1, ptp)["source"] == "ptp"
    # either sign of unsynchronized: the state the call returns or the status bit
    assert classify_sync(TIME_ERROR, 0, 16_000_000, 16_000_000, ptp)["source"] == "none"
    unsynced = classify_sync(0, STA_UNSYNC, 16_000_000, 16_000_000, [])
    assert unsynced["source"] == "none" and unsynced["synchronized"] is False
    unknown = classify_sync(None, 0, 0, 0, ptp)
    assert unknown["source"] == "unknown" and unknown["synchronized"] is None
    assert unknown["max_error_ns"] is None


def test_the_wall_mapping_interpolates_a_slewed_offset(tmp_path):
    clock = clock_at_start(tmp_path)
    assert clock["measure_uncertainty_ns"] >= 0
    ended = clock_at_end(clock, tmp_path)
    assert ended["measure_uncertainty_ns"] >= clock["measure_uncertainty_ns"]
    assert ended["measured_mono_ns_end"] > clock["measured_mono_ns_start"]
    # a clock slewed by 1 ms over the run: halfway through, half of it
    slewed = dict(
        clock,
        measured_mono_ns_start=1_000,
        measured_mono_ns_end=2_001_000,
        wall_minus_monotonic_ns_start=5_000_000,
        wall_minus_monotonic_ns_end=6_000_000,
    )
    assert wall_ns(1_001_000, slewed) == 1_001_000 + 5_500_000
    assert wall_ns(0, slewed) == 5_000_000  # before the first measurement: the start's offset
    assert wall_ns(1_001_000, clock) == 1_001_000 + clock["wall_minus_monotonic_ns_start"]


def test_a_damaged_clock_field_is_dropped_and_named():
    problems: list[str] = []
    m = validate_manifest(
        {
            "clock": {
                "sample_clock": "CLOCK_MONOTONIC",
                "wall_minus_monotonic_ns_start": "soon",
                "sync": {"source": "ntp", "synchronized": "yes", "max_error_ns": 1000},
            }
        },
        "m.json",
        problems,
    )
    assert m["clock"] == {"sample_clock": "CLOCK_MONOTONIC", "sync": {"source": "ntp", "max_error_ns": 1000}}
    assert problems == [
        "m.json: field 'clock.wall_minus_monotonic_ns_start' is string ('soon'), expected int; ignored",
        "m.json: field 'clock.sync.synchronized' is string ('yes'), expected bool or null; ignored",
    ]


def test_the_alignment_bound_is_the_worst_pair_of_hosts_and_none_without_sync():
    def clock(max_err: int, unc: int = 100, synced: bool = True, end: int | None = None) -> dict:
        sync = classify_sync(0 if synced else TIME_ERROR, 0, max_err // 1000, 0, [])
        ended = None if end is None else classify_sync(0, 0, end // 1000, 0, [])
        return {"measure_uncertainty_ns": unc, "sync": sync, "sync_end": ended}

    # one host: one CLOCK_MONOTONIC, nothing to align, whatever its sync
    assert alignment_bound_ns([("a", clock(0, synced=False)), ("a", clock(0, synced=False))]) == 0
    three = [
        ("a", clock(2_000_000)),
        ("b", clock(5_000_000, end=7_000_000)),
        ("c", clock(1_000_000, unc=900)),
    ]
    # the two worst hosts: b (7 ms at the end + 100 ns) and a (2 ms + 100 ns)
    assert alignment_bound_ns(three) == 7_000_100 + 2_000_100
    assert alignment_bound_ns([*three, ("d", clock(1_000, synced=False))]) is None
    assert alignment_bound_ns([("a", clock(1_000)), ("b", {"sync": {"source": "unknown"}})]) is None
