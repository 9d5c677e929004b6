"""The telemetry process's side of the shared block, driven in one process: the rings carry
samples and window records exactly, the collector stores them and answers figure requests with
the very figures the stored run gives, and a full ring drops (and counts) instead of blocking."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from charllm_nemo.telemetry.attribution import attribute_windows
from charllm_nemo.telemetry.process import mark_ring
from charllm_nemo.telemetry.process import ring as shm
from charllm_nemo.telemetry.process.collector import MAX_HOLD_NS, Collector, decode_figures, salvage
from charllm_nemo.telemetry.process.mark_ring import figure_columns
from charllm_nemo.telemetry.reader import load_rank, to_arrays
from charllm_nemo.telemetry.sampler import rows_to_arrays
from charllm_nemo.telemetry.schema import METRIC_INDEX, METRICS
from charllm_nemo.telemetry.store import RankStore
from charllm_nemo.telemetry.windows import WindowRecorder

PERIOD = 10_000_000  # 100 Hz


def _reading(t: int) -> tuple:
    values: list = [None] * len(METRICS)
    values[METRIC_INDEX["power_instant_w"]] = 300.0 + (t // PERIOD) % 7 * 10.0
    values[METRIC_INDEX["energy_mj"]] = 10**12 + t // 5_000_000 // 10 * 10  # 64-bit, ticks every 50 ms
    values[METRIC_INDEX["temp_gpu_c"]] = 60.0
    values[METRIC_INDEX["throttle_reasons"]] = 0x4 if (t // PERIOD) % 5 == 0 else 0
    return tuple(values)


@pytest.fixture
def block(tmp_path):
    lay = shm.Layout(128, mark_capacity=8, fig_slots=4, n_devices=2, n_fig_columns=len(figure_columns()))
    name = f"charllm-test-{secrets.token_hex(4)}"
    b = shm.create(name, lay)
    yield b
    try:  # a failed test may leave a collector's views open: close raises, unlink all the same
        b.close()
    finally:
        shm.unlink(name)


def _collector(block, tmp_path, **kw) -> Collector:
    if not (tmp_path / "rank=0" / "manifest.json").exists():  # later collectors of one block go on
        RankStore(tmp_path, 0, {"rank": 0}, writes_segments=False)  # the manifest, as the session makes it
    return Collector(block, tmp_path / "rank=0", source="test", period_ns=PERIOD, **kw)


def _serve(block, tmp_path, seq: int):
    """A collector takes what the block holds, answers, stores it all: request ``seq``'s answer."""
    c = _collector(block, tmp_path)
    c.tick()
    answer = mark_ring.read_figures(block, seq)
    c.finish()
    c.close()
    return answer


def _assert_live_as_stored(answer, tmp_path, w0: int, w1: int, devices=(0,)) -> None:
    """Each device's live energy and power equal the stored run's attribution, and are numbers."""
    assert answer is not None and [d for d, _ in answer[2]] == list(devices)
    stored = to_arrays(load_rank(tmp_path, 0).samples)
    for dev, values in answer[2]:
        live = decode_figures(values, mark_ring.figure_columns())
        per_dev = {k: v[stored["device_index"] == dev] for k, v in stored.items()}
        expected = attribute_windows(per_dev, {"t_begin_mono_ns": [w0], "t_end_mono_ns": [w1]})
        assert not np.isnan(expected["energy_j"][0])
        for name in ("energy_j", "power_avg_w", "power_peak_w"):
            assert live[name] == pytest.approx(expected[name][0], rel=1e-12), (dev, name)


def _wire(block) -> tuple[shm.RingWriter, mark_ring.MarkWriter, WindowRecorder]:
    marks = mark_ring.MarkWriter(block)
    rec = WindowRecorder()
    rec.names.set_on_new(marks.publish_name)
    rec.set_sink(marks.emit_many)
    return shm.RingWriter(block), marks, rec


@pytest.mark.parametrize("devices", [(0, 1), (0,)], ids=["two-devices", "one-device"])
def test_samples_and_windows_cross_exactly_and_figures_equal_the_stored_run(block, tmp_path, devices):
    ring, marks, rec = _wire(block)
    rows = []
    for i in range(40):
        t = 1_000_000_000 + i * PERIOD
        for dev in devices:
            row = (t + dev, t + dev + 5, 1000, dev, _reading(t))
            ring.emit(row)
            rows.append(row)
    w0, w1 = 1_000_000_000 + 3 * PERIOD + 123, 1_000_000_000 + 31 * PERIOD + 7
    rec.record("step", None, w0, w1, step=0, timing="host")
    rec.record("phase", "a-new-name", w0, w0 + 5, step=0, microbatch=2)
    marks.request_figures(0, w0, w1)
    answer = _serve(block, tmp_path, 0)
    # stored exactly: 64-bit counters, nulls, both devices, and the window records
    rd = load_rank(tmp_path, 0)
    stored = to_arrays(rd.samples)
    mine = rows_to_arrays(rows)
    for name in ("t_mono_ns", "energy_mj", "throttle_reasons", "power_instant_w", "power_avg_w"):
        np.testing.assert_array_equal(stored[name], mine[name])
    assert rd.windows.column("name").to_pylist() == ["step", "a-new-name"]
    assert rd.windows.column("microbatch").to_pylist() == [None, 2]
    # the live figures are the attribution of the stored samples, every column
    assert answer is not None and answer[:2] == (w0, w1)
    columns = mark_ring.figure_columns()
    for dev, values in answer[2]:
        live = decode_figures(values, columns)
        per_dev = {k: v[stored["device_index"] == dev] for k, v in stored.items()}
        expected = attribute_windows(per_dev, {"t_begin_mono_ns": [w0], "t_end_mono_ns": [w1]})
        for name in columns:
            want = expected[name][0]
            if isinstance(want, float) and np.isnan(want):
                assert np.isnan(live[name]), name
            else:  # the live slice starts later: prefix sums may round in the last bit
                assert live[name] == pytest.approx(want, rel=1e-12, abs=1e-12), name
    assert [d for d, _ in answer[2]] == list(devices)
    assert block.q[shm.H_ROWS_SAMPLES] == 40 * len(devices) and block.q[shm.H_FIGURES_SERVED] == 1


@pytest.mark.parametrize("devices", [(0, 1), (0,)], ids=["two-devices", "one-device"])
def test_a_window_right_after_a_sampling_stall_gets_its_figures_as_the_stored_run_does(
    block, tmp_path, devices
):
    # The sampler was held off the CPU for 70 ms (a loaded node) just before a step began: the
    # last sample before the step is more than two periods older than its start. Live figures
    # must still bracket the window with it, as the stored run does, not come back NaN.
    ring, marks, _rec = _wire(block)
    t0 = 1_000_000_000
    times = [t0 + i * PERIOD for i in range(6)] + [t0 + i * PERIOD for i in range(12, 20)]
    for t in times:
        for dev in devices:
            ring.emit((t + dev, t + dev, 1000, dev, _reading(t)))
    w0, w1 = t0 + 11 * PERIOD, t0 + 15 * PERIOD + 3  # starts in the stall
    marks.request_figures(0, w0, w1)
    _assert_live_as_stored(_serve(block, tmp_path, 0), tmp_path, w0, w1, devices)


def test_a_window_right_before_a_long_sampling_stall_gets_its_figures_as_the_stored_run_does(block, tmp_path):
    # The first sample after the window came 1.5 s later (longer than the slice's 1 s tail), and
    # in a later take: it still closes the window, as in the stored run.
    ring, marks, _rec = _wire(block)
    t0 = 1_000_000_000
    w0, w1 = t0 + 11 * PERIOD, t0 + 15 * PERIOD + 3
    marks.request_figures(0, w0, w1)
    c = _collector(block, tmp_path)
    for i in range(16):
        ring.emit((t0 + i * PERIOD, 0, 1000, 0, _reading(t0 + i * PERIOD)))
    c.tick()  # one chunk up to 150 ms; the window is not passed yet
    assert mark_ring.read_figures(block, 0) is None
    for i in range(3):
        t = t0 + 15 * PERIOD + 1_500_000_000 + i * PERIOD
        ring.emit((t, 0, 1000, 0, _reading(t)))
    c.tick()  # a second chunk, starting 1.5 s after the window's end
    answer = mark_ring.read_figures(block, 0)
    c.finish()
    c.close()
    _assert_live_as_stored(answer, tmp_path, w0, w1)


def test_a_request_waits_for_a_sample_past_the_window_end(block, tmp_path):
    ring, marks, _rec = _wire(block)
    c = _collector(block, tmp_path)
    for i in range(5):
        ring.emit((i * PERIOD, 0, 0, 0, _reading(i * PERIOD)))
    assert not c.has_work()  # samples alone: the collector may sleep until its flush
    marks.request_figures(3, PERIOD, 6 * PERIOD)
    assert c.has_work()  # a record to take
    c.tick()
    assert mark_ring.read_figures(block, 3) is None  # no sample at or after 60 ms yet
    assert not c.has_work()  # nothing to do until a sample reaches the window's end
    ring.emit((6 * PERIOD, 0, 0, 0, _reading(6 * PERIOD)))
    assert c.has_work()
    c.tick()
    assert mark_ring.read_figures(block, 3) is not None
    assert not c.has_work()
    assert mark_ring.read_figures(block, 7) is None  # slot 3 holds request 3, not request 7
    c.close()


def test_a_full_mark_ring_drops_and_counts_and_never_blocks(block):
    _ring, marks, rec = _wire(block)
    for step in range(12):  # the ring holds 8 records until the collector flushes
        rec.record("step", None, step, step + 1, step=step)
    assert marks.dropped == 4 == block.q[shm.H_MARKS_DROPPED]


def test_a_filling_mark_ring_is_flushed_early_so_bursts_fit(block, tmp_path):
    _ring, marks, rec = _wire(block)
    c = _collector(block, tmp_path, flush_interval_s=1.0)
    for step in range(3):  # more than a quarter of the 8-record ring, long before the interval
        rec.record("step", None, step, step + 1, step=step)
    c.tick()
    assert block.q[shm.H_MARKS_FLUSHED] == 3
    for step in range(3, 11):  # the whole ring is free again
        rec.record("step", None, step, step + 1, step=step)
    assert marks.dropped == 0
    c.finish()
    c.close()
    assert load_rank(tmp_path, 0).windows.column("step").to_pylist() == list(range(11))


def test_a_lapped_ring_loses_the_oldest_rows_and_says_how_many(block, tmp_path):
    ring, _marks, _rec = _wire(block)
    c = _collector(block, tmp_path)
    for i in range(300):  # 300 rows into a 128-row ring before the collector looks
        ring.emit((i * PERIOD, 0, 0, 0, _reading(i * PERIOD)))
    c.finish()
    c.close()
    t = load_rank(tmp_path, 0).samples.column("t_mono_ns").to_pylist()
    # the newest rows, minus the one slot the writer may have been overwriting while copied
    assert t == [i * PERIOD for i in range(300 - len(t), 300)] and len(t) >= 127
    assert block.q[shm.H_ROWS_LOST] == 300 - len(t)


def test_salvage_writes_what_a_dead_collector_had_not_and_numbers_on(block, tmp_path):
    from charllm_nemo.train.marks import StepMarker

    ring, marks, rec = _wire(block)
    c = _collector(block, tmp_path)
    for i in range(10):
        ring.emit((i * PERIOD, 0, 0, 0, _reading(i * PERIOD)))
    rec.record("step", None, 0, 5 * PERIOD, step=0)
    c.finish()  # one samples and one windows segment on disk
    c.close()
    for i in range(10, 25):  # then it "dies": these never reach its store
        ring.emit((i * PERIOD, 0, 0, 0, _reading(i * PERIOD)))
    rec.record("step", None, 5 * PERIOD, 20 * PERIOD, step=1)
    rec.log_sink = marks.emit_step_log  # and a step whose windows the telemetry process makes
    marker = StepMarker(rec, num_microbatches=1, kinds=("step", "phase"))
    marker.begin_step(2)
    marker("forward-compute").start()
    marker("forward-compute").stop()
    marker.end_step()
    counts = salvage(block, tmp_path / "rank=0", source="test", names=rec.names.names)
    assert counts["rows"] == {"samples": 25, "windows": 4}
    assert counts["segments"] == {"samples": 2, "windows": 2}
    rd = load_rank(tmp_path, 0)
    assert rd.samples.column("t_mono_ns").to_pylist() == [i * PERIOD for i in range(25)]
    assert rd.windows.column("step").to_pylist() == [0, 1, 2, 2]
    assert rd.windows.column("name").to_pylist()[2:] == ["step", "forward"]


def test_names_beyond_the_names_area_are_stored_as_a_question_mark(block, tmp_path):
    _ring, marks, rec = _wire(block)
    long = "x" * 4000
    for i in range(5):  # 5 x 4 KB > 16 KiB
        rec.record("phase", f"{long}{i}", 0, 1)
        c = _collector(block, tmp_path)
        c.finish()
        c.close()
    assert marks.overflow_names >= 1
    names = load_rank(tmp_path, 0).windows.column("name").to_pylist()
    assert names[:3] == [f"{long}{i}" for i in range(3)] and names[-1] == "?"


def test_a_full_names_area_never_writes_past_its_end_into_the_figure_slots(block, tmp_path):
    # Once not even an empty entry (its 6-byte head) fits, later names are not published at all:
    # the figure slot after the area keeps its answer, and the names read back stay whole.
    ring, marks, _rec = _wire(block)
    for i in range(10):
        ring.emit((i * PERIOD, 0, 0, 0, _reading(i * PERIOD)))
    marks.request_figures(0, 0, PERIOD, 0, 1)
    c = _collector(block, tmp_path)
    c.tick()  # answers request 0 into slot 0
    answer = mark_ring.read_figures(block, 0)
    assert answer is not None
    code = first = block.q[shm.H_NAMES_COUNT]  # the recorder's own names come first
    left, head = shm.NAMES_SIZE - marks._names_used, mark_ring.NAME_HEAD_BYTES
    while left > 4096 + head + 1:  # names of 4096 bytes (the longest kept) until one more fills it
        marks.publish_name(code, "x" * 4096)
        code, left = code + 1, left - 4096 - head
    marks.publish_name(code, "y" * (left - head - 1))  # 1 byte left: not even an empty entry fits now
    assert marks._names_used == shm.NAMES_SIZE - 1 and marks.overflow_names == 0
    for later in range(code + 1, code + 9):
        marks.publish_name(later, f"later{later}")
    assert marks._names_used == shm.NAMES_SIZE - 1 and marks.overflow_names == 1  # (then: no code is next)
    assert block.q[shm.H_NAMES_COUNT] == code + 1  # the later ones: unpublished, stored as "?"
    assert repr(mark_ring.read_figures(block, 0)) == repr(answer)  # (NaN figures: compared as text)
    known: list[str] = []
    mark_ring.read_names(block, known)
    assert len(known) == code + 1
    assert known[first:] == ["x" * 4096] * (code - first) + ["y" * (left - head - 1)]
    c.close()


def test_a_request_computes_only_the_figures_its_mask_names(block, tmp_path):
    ring, marks, _rec = _wire(block)
    for i in range(12):
        ring.emit((i * PERIOD, 0, 0, 0, _reading(i * PERIOD)))
    wanted = ("duration_s", "energy_j", "throttle_any_limiting_s")
    marks.request_figures(0, PERIOD, 6 * PERIOD, mark_ring.figure_mask(wanted))
    marks.request_figures(1, PERIOD, 6 * PERIOD)  # no mask: every figure
    c = _collector(block, tmp_path)
    c.tick()
    c.close()
    columns = mark_ring.figure_columns()
    some, every = mark_ring.read_figures(block, 0), mark_ring.read_figures(block, 1)
    assert some is not None and every is not None
    values = dict(zip(columns, some[2][0][1], strict=True))
    assert [n for n in columns if not np.isnan(values[n])] == list(wanted)  # the others: not computed
    full = decode_figures(every[2][0][1], columns)
    assert decode_figures(some[2][0][1], columns, keep=wanted) == {n: full[n] for n in wanted}
    assert full["throttle_any_limiting_s"] > 0 and not np.isnan(full["temp_gpu_peak_c"])


def test_figure_masks_round_trip_and_reject_unknown_names():
    assert mark_ring.mask_figures(mark_ring.figure_mask(None)) is None
    wanted = mark_ring.figure_mask(["power_peak_w", "energy_j"])
    assert mark_ring.mask_figures(wanted) == ("energy_j", "power_peak_w")
    assert len(mark_ring.figure_columns()) < 63  # one int64 record field holds the mask
    with pytest.raises(ValueError, match="power_peak"):
        mark_ring.figure_mask(["power_peak"])


class _Clock:
    """A deterministic CLOCK_MONOTONIC for marks.py: 1 µs further at every reading."""

    def __init__(self) -> None:
        self.t = 10**9

    def monotonic_ns(self) -> int:
        self.t += 1000
        return self.t


def _mark_steps(marker, steps: int, n_forward: int, after_step=lambda: None) -> None:
    """Steps as mcore marks them without pipelining (plus a p2p timer and the loop's optimizer),
    then one cut short in its second forward."""
    for step in range(steps):
        marker.begin_step(step)
        for _ in range(n_forward):
            marker("forward-compute").start()
            marker("forward-compute").stop()
            marker("forward-send").start()
            marker("forward-send").stop()
        for _ in range(n_forward):
            marker("backward-compute").start()
            marker("backward-compute").stop()
        marker("backward-compute").stop()  # a stop without its start: counted, never logged
        marker("all-grads-sync").start()
        marker("all-grads-sync").stop()
        opt = marker.phase("optimizer")
        opt.start()
        opt.stop()
        marker.end_step()
        after_step()
    marker.begin_step(steps)
    marker("forward-compute").start()
    marker("forward-compute").stop()
    marker("forward-compute").start()


@pytest.mark.parametrize("chunks", [1, 2], ids=["plain", "virtual-pipeline"])
def test_step_logs_shipped_to_the_collector_store_the_windows_made_in_process(tmp_path, monkeypatch, chunks):
    # Process mode: the training thread ships each step's raw log and the collector makes its
    # windows. Thread mode: the windows are made in process. Same marks, same clock: the stored
    # windows must be the in-process ones, ids, parents, microbatches and chunks included.
    from charllm_nemo.steps import marks as marks_module
    from charllm_nemo.train.marks import StepMarker

    if chunks > 1:
        pytest.importorskip("megatron.core")
    # A step log takes 5 records (9 with chunks): a 12-record ring wraps within most of them.
    lay = shm.Layout(128, mark_capacity=12, fig_slots=4, n_devices=1, n_fig_columns=len(figure_columns()))
    name = f"charllm-test-{secrets.token_hex(4)}"
    block = shm.create(name, lay)
    try:
        _ring, writer, shipped = _wire(block)
        shipped.log_sink = writer.emit_step_log
        here = WindowRecorder()
        c = _collector(block, tmp_path)
        out = {}
        for rec in (shipped, here):
            rec.set_labels(pp_stage=1, tp_rank=0, dp_rank=2)
            clock = _Clock()
            monkeypatch.setattr(marks_module, "time", clock)
            group = 2 if chunks > 1 else None
            marker = StepMarker(rec, num_microbatches=4, num_chunks=chunks, group_size=group)
            marker._clock = clock.monotonic_ns  # the timers' clock too (C timers read their own)
            _mark_steps(marker, 5, 4 * chunks, after_step=c.tick if rec is shipped else lambda: None)
            rec.flush_pending()  # the session's close: the cut-short step is made here in both
            out[id(rec)] = marker
        assert block.q[shm.H_MARK_WRITE] > lay.mark_capacity  # the ring wrapped
        c.finish()
        c.close()
    finally:
        try:
            block.close()
        finally:
            shm.unlink(name)
    assert shipped.steps_shipped == 5 and here.steps_shipped == 0
    assert out[id(shipped)].unmatched == out[id(here)].unmatched == 5
    assert writer.dropped == 0
    stored = load_rank(tmp_path, 0).windows.to_pylist()
    for row in stored:
        row.pop("t_begin_wall_ns")
    made = here.drain()
    for row in made:
        row.pop("t_begin_wall_ns")
    # per step: itself, 4 microbatches, 4 * chunks forwards, sends and backwards, grad sync and
    # optimizer; then the cut-short step's one finished forward
    assert len(made) == 5 * (1 + 4 + 12 * chunks + 2) + 1
    key = lambda r: r["window_id"]  # noqa: E731
    assert sorted(stored, key=key) == sorted(made, key=key)
    if chunks > 1:
        assert {r["vpp_chunk"] for r in made if r["name"] == "forward"} == {0, 1}


def test_records_that_do_not_all_fit_are_written_as_far_as_they_fit(block):
    _ring, marks, _rec = _wire(block)  # 8 records
    recs = [tuple(range(i * 17, (i + 1) * 17)) for i in range(11)]
    marks.emit_many(recs[:5])
    marks.emit_many(recs[5:])  # 3 free: 3 written, 3 dropped
    assert block.q[shm.H_MARK_WRITE] == 8 and marks.dropped == 3 == block.q[shm.H_MARKS_DROPPED]
    lay = block.layout
    ring = block.q[lay.marks0 : lay.marks0 + 8 * 17].tolist()
    assert ring == [v for rec in recs[:8] for v in rec]
    with pytest.raises(TypeError, match="17 ints"):
        marks.emit_many([tuple(range(16))])


def test_a_step_log_that_does_not_fit_is_dropped_whole_and_counted(block):
    _ring, marks, _rec = _wire(block)  # 8 records
    marks.emit_step_log(list(range(5 * 17)))  # 6 records: fits
    marks.emit_step_log(list(range(5 * 17)))  # 6 more: 2 free, dropped whole
    assert block.q[shm.H_MARK_WRITE] == 6 and marks.dropped == 6 == block.q[shm.H_MARKS_DROPPED]


def test_requests_in_a_batch_are_answered_together_and_equal_one_by_one(block, tmp_path):
    # A loop that reads a step's figures a few steps later asks with batch=k: the collector
    # answers k requests in one computation once the samples pass the k-th window, or the
    # oldest alone once it has waited (k + 1) window lengths past its end.
    ring, marks, _rec = _wire(block)
    c = _collector(block, tmp_path)
    step = 3 * PERIOD  # 30 ms steps, 100 Hz
    windows = [(PERIOD + k * step + 1234, PERIOD + (k + 1) * step) for k in range(4)]
    for seq, (t0, t1) in enumerate(windows):
        marks.request_figures(seq, t0, t1, batch=3)

    def sample_until(t: int) -> None:  # 100 Hz samples until one at or after t
        while block.q[shm.H_WRITE_COUNT] == 0 or shm.newest_t(block) < t:
            n = block.q[shm.H_WRITE_COUNT]
            ring.emit((n * PERIOD, 0, 0, 0, _reading(n * PERIOD)))

    sample_until(windows[1][1])  # two of three answerable: held
    c.tick()
    assert mark_ring.read_figures(block, 0) is None and not c.has_work()
    sample_until(windows[2][1])
    assert c.has_work()
    c.tick()
    answers = [mark_ring.read_figures(block, seq) for seq in range(4)]
    assert all(a is not None for a in answers[:3]) and answers[3] is None
    for (t0, t1), answer in zip(windows, answers[:3], strict=False):
        alone = c.figures(t0, t1)[0][1]
        assert answer[:2] == (t0, t1)
        np.testing.assert_allclose(answer[2][0][1], alone, rtol=1e-12, atol=1e-12)
    # The fourth is alone now: answered once the samples are 4 window lengths past its end.
    t0, t1 = windows[3]
    sample_until(t1 + 4 * (t1 - t0) - PERIOD)
    c.tick()
    assert mark_ring.read_figures(block, 3) is None
    sample_until(t1 + 4 * (t1 - t0))
    c.tick()
    assert mark_ring.read_figures(block, 3) is not None
    # A long window (a slow step) is held MAX_HOLD_NS at most, not (batch + 1) of its lengths.
    t0, t1 = t1, t1 + 10 * MAX_HOLD_NS
    marks.request_figures(4, t0, t1, batch=8)
    sample_until(t1 + MAX_HOLD_NS - PERIOD)
    c.tick()
    assert mark_ring.read_figures(block, 4) is None
    sample_until(t1 + MAX_HOLD_NS)
    c.tick()
    assert mark_ring.read_figures(block, 4) is not None
    # A run's last step asks with batch=1 (train/loop.py): answered at the first sample past it.
    t0, t1 = t1, t1 + step
    marks.request_figures(5, t0, t1, batch=1)
    sample_until(t1)
    c.tick()
    assert mark_ring.read_figures(block, 5) is not None
    c.close()


class _Killed(BaseException):
    """The telemetry process dying at a chosen point of a flush."""


@pytest.mark.parametrize(
    "dies",
    ["writing samples", "after samples written", "after samples published", "writing windows",
     "after windows written", "after windows published"],
)  # fmt: skip
def test_a_telemetry_process_dying_anywhere_in_a_flush_loses_nothing_and_stores_nothing_twice(
    block, tmp_path, dies
):
    ring, _marks, rec = _wire(block)
    c = _collector(block, tmp_path)
    for i in range(10):
        ring.emit((i * PERIOD, 0, 0, 0, _reading(i * PERIOD)))
    rec.record("step", None, 0, 5 * PERIOD, step=0)
    c.take_samples()
    c.take_marks()
    kind, when = ("samples" if "samples" in dies else "windows"), dies.split()[0]
    write, publish = c.writer.write_segment, c.publish

    def write_segment(k, table):
        if k == kind and when == "writing":
            raise _Killed
        path = write(k, table)
        if k == kind and when == "after" and "written" in dies:
            raise _Killed
        return path

    def publish_then_die():
        publish()
        if when == "after" and "published" in dies and c.writer.counts()["segments"][kind] == 1:
            raise _Killed

    c.writer.write_segment, c.publish = write_segment, publish_then_die
    with pytest.raises(_Killed):
        c.flush()
    c.close()
    for i in range(10, 25):  # sampled after the death: only the salvage stores these
        ring.emit((i * PERIOD, 0, 0, 0, _reading(i * PERIOD)))
    rec.record("step", None, 5 * PERIOD, 20 * PERIOD, step=1)
    counts = salvage(block, tmp_path / "rank=0", source="test", names=rec.names.names)
    rd = load_rank(tmp_path, 0)
    assert rd.samples.column("t_mono_ns").to_pylist() == [i * PERIOD for i in range(25)]
    assert rd.windows.column("step").to_pylist() == [0, 1]
    assert counts["rows"] == {"samples": 25, "windows": 2}


def test_a_request_waits_for_a_sample_past_the_window_end_on_every_device(block, tmp_path):
    # Process mode: the sampling loop publishes each slot's time once all its devices are in the
    # ring; a slot half written (device 0 past the end, device 1 not yet) answers nothing.
    ring, marks, _rec = _wire(block)
    c = _collector(block, tmp_path)
    for k in range(5):
        for dev in (0, 1):
            ring.emit((k * PERIOD + dev, 0, 0, dev, _reading(k * PERIOD)))
        block.q[shm.H_SLOT_T] = k * PERIOD
    marks.request_figures(0, PERIOD, 4 * PERIOD + 5, 0, 1)
    ring.emit((5 * PERIOD, 0, 0, 0, _reading(5 * PERIOD)))  # slot 5: device 0 only, so far
    c.tick()
    assert mark_ring.read_figures(block, 0) is None
    ring.emit((5 * PERIOD + 1, 0, 0, 1, _reading(5 * PERIOD)))
    block.q[shm.H_SLOT_T] = 5 * PERIOD
    ring.emit((6 * PERIOD, 0, 0, 0, _reading(6 * PERIOD)))
    c.tick()
    answer = mark_ring.read_figures(block, 0)
    assert answer is not None and [d for d, _ in answer[2]] == [0, 1]
    c.close()


def test_a_killed_rank_is_marked_in_its_manifest_but_never_through_a_link(tmp_path, caplog) -> None:
    import json

    from charllm_nemo.telemetry.process.collector import mark_manifest_killed

    st = RankStore(tmp_path, 0, {"rank": 0, "backend": "synthetic", "status": "running"})
    mark_manifest_killed(st.dir, {"segments_samples": 3}, {"killed_by": "SIGKILL"})
    manifest = json.loads((st.dir / "manifest.json").read_text())
    assert manifest["status"] == "killed" and manifest["killed_by"] == "SIGKILL"
    assert manifest["segments_samples"] == 3

    victim = tmp_path / "victim.json"
    victim.write_text('{"status": "mine"}')
    (st.dir / "manifest.json").unlink()
    (st.dir / "manifest.json").symlink_to(victim)
    mark_manifest_killed(st.dir, {}, {})
    assert victim.read_text() == '{"status": "mine"}'
    assert (st.dir / "manifest.json").is_symlink()  # no manifest made of the linked file's content
    assert "is a symbolic link; not followed" in caplog.text
