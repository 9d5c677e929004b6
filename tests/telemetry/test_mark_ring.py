"""The mark ring, names and figure slots never hand a reader a torn entry (mark_ring's module doc).

x86-64 never shows another core's stores out of order, so the out-of-order visibility an aarch64
reader may meet is staged here by hand: an entry with one word still holding its old value (as
if that store were not visible yet) must be left for later, then taken once the word arrives.
The stress tests run a writer process against a reader, wrapping small rings thousands of times,
and check that every entry taken is whole and none is lost or taken twice."""

from __future__ import annotations

import multiprocessing
import secrets
import time

import pytest

from charllm_nemo.telemetry.process import mark_ring
from charllm_nemo.telemetry.process import ring as shm
from charllm_nemo.telemetry.process.collector import Collector
from charllm_nemo.telemetry.process.mark_ring import figure_columns
from charllm_nemo.telemetry.reader import load_rank
from charllm_nemo.telemetry.schema import METRIC_INDEX, METRICS
from charllm_nemo.telemetry.store import RankStore
from charllm_nemo.telemetry.windows import NULL, RECORD_FIELDS, RECORD_LEN, RECORD_WINDOW, SEEDED_NAMES

F = {name: i for i, name in enumerate(RECORD_FIELDS)}


def _layout(mark_capacity: int = 8, fig_slots: int = 4) -> shm.Layout:
    return shm.Layout(
        16, mark_capacity=mark_capacity, fig_slots=fig_slots, n_devices=2, n_fig_columns=len(figure_columns())
    )


@pytest.fixture
def block():
    name = f"charllm-test-{secrets.token_hex(4)}"
    b = shm.create(name, _layout())
    yield b
    try:
        b.close()
    finally:
        shm.unlink(name)


def _window(i: int) -> tuple[int, ...]:
    """Window record ``i``: every field a function of ``i``, so a mix of two records shows."""
    rec = [NULL] * RECORD_LEN
    rec[F["record_type"]] = RECORD_WINDOW
    rec[F["window_id"]], rec[F["step"]] = i, i
    rec[F["kind"]], rec[F["name"]] = SEEDED_NAMES.index("step"), SEEDED_NAMES.index("step")
    rec[F["t_begin_mono_ns"]] = 1_000 * i
    rec[F["t_end_mono_ns"]] = 1_000 * i + i % 7 + 1
    rec[F["t_begin_wall_ns"]] = 10**18 + i
    rec[F["timing"]] = SEEDED_NAMES.index("host")
    return tuple(rec)


def _collector(block, tmp_path) -> Collector:
    if not (tmp_path / "rank=0" / "manifest.json").exists():
        RankStore(tmp_path, 0, {"rank": 0}, writes_segments=False)
    return Collector(block, tmp_path / "rank=0", source="test", period_ns=1_000_000, names=list(SEEDED_NAMES))


def _stored_ids(tmp_path) -> list[int]:
    windows = load_rank(tmp_path, 0).windows
    ids = windows.column("window_id").to_pylist()
    for i, step, t0, t1 in zip(
        ids,
        windows.column("step").to_pylist(),
        windows.column("t_begin_mono_ns").to_pylist(),
        windows.column("t_end_mono_ns").to_pylist(),
        strict=True,
    ):
        assert (step, t0, t1) == (i, 1_000 * i, 1_000 * i + i % 7 + 1), f"torn record {i}"
    return ids


def test_a_record_with_a_word_not_visible_yet_waits_and_so_do_those_after_it(block, tmp_path):
    marks = mark_ring.MarkWriter(block)
    for i in range(3):
        marks.emit(_window(i))
    lay = block.layout
    word = lay.marks0 + 1 * RECORD_LEN + F["t_end_mono_ns"]  # record 1's end: as if still unseen
    new, block.q[word] = block.q[word], 0
    c = _collector(block, tmp_path)
    c.take_marks()
    c.flush()
    assert _stored_ids(tmp_path) == [0]
    assert block.q[shm.H_MARKS_FLUSHED] == 1  # records 1 and 2 keep their slots
    block.q[word] = new  # the store arrives
    c.take_marks()
    c.finish()
    c.close()
    assert _stored_ids(tmp_path) == [0, 1, 2]


def test_a_check_word_of_the_previous_lap_is_not_taken(block, tmp_path):
    marks = mark_ring.MarkWriter(block)
    cap = block.layout.mark_capacity
    c = _collector(block, tmp_path)
    for i in range(cap):
        marks.emit(_window(i))
    c.take_marks()
    c.flush()
    check = block.layout.checks0
    previous = block.q[check]  # record 0's check word
    marks.emit(_window(cap))  # slot 0 again: lap 2
    new, block.q[check] = block.q[check], previous  # as if its check word were still unseen
    c.take_marks()
    c.flush()
    assert _stored_ids(tmp_path) == list(range(cap))
    block.q[check] = new
    c.take_marks()
    c.finish()
    c.close()
    assert _stored_ids(tmp_path) == list(range(cap + 1))


def test_a_figure_slot_is_read_only_whole(block):
    columns = len(figure_columns())
    per_device = [(0, [1.5] * columns), (1, [2.5] * columns)]
    mark_ring.write_figures(block, 5, 100, 200, per_device)
    assert mark_ring.read_figures(block, 5) == (100, 200, per_device)
    lay = block.layout
    word = lay.figs0 + (5 % lay.fig_slots) * lay.slot_words + shm.FIG_HEAD + 1 + columns + 3
    new = block.d[word]
    block.d[word] = 9.0  # device 1's fourth figure: the previous request's value still showing
    assert mark_ring.read_figures(block, 5) is None
    block.d[word] = new
    assert mark_ring.read_figures(block, 5) == (100, 200, per_device)
    assert mark_ring.read_figures(block, 1) is None  # slot 1 holds request 5, not 1


def test_a_name_not_visible_whole_is_not_read_and_holds_its_windows_back(block, tmp_path):
    marks = mark_ring.MarkWriter(block)
    for code, text in enumerate(SEEDED_NAMES):
        marks.publish_name(code, text)
    code = len(SEEDED_NAMES)
    marks.publish_name(code, "attention")
    off = block.layout.names_offset + block.q[shm.H_NAMES_BYTES] - 1  # the name's last byte
    block.mm[off] = ord("X")
    known: list[str] = []
    assert mark_ring.read_names(block, known) is False and known == list(SEEDED_NAMES)
    rec = list(_window(0))
    rec[F["name"]] = code
    marks.emit(tuple(rec))
    c = Collector(block, tmp_path / "rank=0", source="test", period_ns=1_000_000)
    RankStore(tmp_path, 0, {"rank": 0}, writes_segments=False)
    c.take_marks()
    c.flush()
    assert block.q[shm.H_MARKS_FLUSHED] == 0  # not stored: its name is not known yet
    block.mm[off] = ord("n")
    c.flush()
    c.close()
    assert block.q[shm.H_MARKS_FLUSHED] == 1
    assert load_rank(tmp_path, 0).windows.column("name").to_pylist() == ["attention"]


# -- writer process against reader ----------------------------------------------------------------


def _mark_writer(name: str, mark_capacity: int, n: int) -> None:
    block = shm.attach(name, _layout(mark_capacity))
    marks = mark_ring.MarkWriter(block)
    q = block.q
    for i in range(n):
        while q[shm.H_MARK_WRITE] - q[shm.H_MARKS_FLUSHED] >= mark_capacity:
            pass  # full: wait for the reader (the real writer drops instead)
        marks.emit(_window(i))
    assert marks.dropped == 0
    block.close()


def test_stress_a_writer_process_never_hands_the_collector_a_torn_record(tmp_path):
    name, cap, n = f"charllm-test-{secrets.token_hex(4)}", 16, 3000
    block = shm.create(name, _layout(cap))
    try:
        writer = multiprocessing.get_context("fork").Process(target=_mark_writer, args=(name, cap, n))
        writer.start()
        c = _collector(block, tmp_path)
        deadline = time.monotonic() + 120
        while block.q[shm.H_MARKS_FLUSHED] < n and time.monotonic() < deadline:
            c.take_marks()
            c.flush()
        c.finish()
        c.close()
        writer.join(30)
        assert writer.exitcode == 0
        assert _stored_ids(tmp_path) == list(range(n))  # whole, in order, none lost or twice
    finally:
        block.close()
        shm.unlink(name)


def _figure_writer(name: str, n: int) -> None:
    block = shm.attach(name, _layout())
    columns = len(figure_columns())
    for seq in range(n):
        mark_ring.write_figures(
            block, seq, seq, 2 * seq, [(0, [float(seq)] * columns), (7, [-float(seq)] * columns)]
        )
    block.close()


def test_stress_the_training_side_never_reads_a_torn_figure_slot():
    name, n = f"charllm-test-{secrets.token_hex(4)}", 20_000
    block = shm.create(name, _layout())
    try:
        writer = multiprocessing.get_context("fork").Process(target=_figure_writer, args=(name, n))
        writer.start()
        columns, whole, seq = len(figure_columns()), 0, 0
        deadline = time.monotonic() + 120  # a writer that died early must not hang the test
        while (writer.is_alive() or seq < n) and time.monotonic() < deadline:
            for s in range(seq, seq + block.layout.fig_slots):  # the slots' newest requests
                answer = mark_ring.read_figures(block, s)
                if answer is not None:
                    assert answer == (s, 2 * s, [(0, [float(s)] * columns), (7, [-float(s)] * columns)])
                    whole += 1
            seq = max(seq, block.q[block.layout.figs0] - 1)  # slot 0's request: roughly where it is
            if not writer.is_alive() and seq >= n - block.layout.fig_slots:
                break
        writer.join(30)
        assert writer.exitcode == 0
        assert whole > 0  # the reader did read answers while they were being rewritten
    finally:
        block.close()
        shm.unlink(name)


# -- the sample ring, read from the training process (live rows) ---------------------------------


def _reading(k: int) -> tuple:
    values: list = [None] * len(METRICS)
    values[METRIC_INDEX["power_instant_w"]] = 300.0 + k
    values[METRIC_INDEX["energy_mj"]] = 2**53 + k
    return tuple(values)


def test_a_sample_row_with_a_word_not_visible_yet_fails_its_check(block):
    ring = shm.RingWriter(block)
    for k in range(3):
        ring.emit((1_000 + k, 2_000 + k, 10, 0, _reading(k)))
    bad = list(_reading(3))
    bad[METRIC_INDEX["temp_gpu_c"]] = "hot"  # a backend's wrong type: stored null, still checked
    ring.emit((1_003, 2_003, 10, 0, tuple(bad)))
    rows, ok = shm.copy_rows(block, 0, 4)
    assert ok == [True] * 4 and [r[4][METRIC_INDEX["energy_mj"]] for r in rows] == [
        2**53 + k for k in range(4)
    ]
    assert rows[3][4][METRIC_INDEX["temp_gpu_c"]] is None and ring.bad_values == 1
    lay = block.layout
    word = lay.float_base(shm.FLOAT_COLUMNS.index("power_instant_w")) + 1  # row 1's power: still old
    new, block.d[word] = block.d[word], 0.0
    assert shm.copy_rows(block, 0, 4)[1] == [True, False, True, True]
    block.d[word] = new
    for k in range(4, 4 + lay.capacity):  # a lap later, row 0's slot holds row 16: index 0 fails
        ring.emit((1_000 + k, 2_000 + k, 10, 0, _reading(k)))
    assert shm.copy_rows(block, 0, 1)[1] == [False]
    assert all(shm.copy_rows(block, 4, 4 + lay.capacity)[1])


def test_a_figure_request_reaches_the_collector_field_by_field(block, tmp_path):
    # Every field a different value: a word read from the wrong position shows.
    mark_ring.MarkWriter(block).request_figures(5, 1_000, 2_000, mask=0b101, batch=3)
    c = _collector(block, tmp_path)
    try:
        c.take_marks()
        assert list(c._requests) == [mark_ring.FigureRequest(5, 1_000, 2_000, 0b101, 3)]
    finally:
        c.close()


def test_the_store_counts_round_trip_through_the_header(block):
    counts = {
        "segments": {"samples": 3, "windows": 4},
        "rows": {"samples": 30, "windows": 40},
        "bytes_written": 999,
        "rows_unwritten": {"samples": 5, "windows": 6},
        "disk_full": True,
    }
    assert shm.read_store_counts(block.q) == {
        "segments": {"samples": 0, "windows": 0},
        "rows": {"samples": 0, "windows": 0},
        "bytes_written": 0,
    }
    shm.write_store_counts(block.q, counts)
    assert shm.read_store_counts(block.q) == counts
    words = [w for kind in shm.STORE_WORDS.values() for w in kind] + list(shm.COLLECTOR_COUNTERS.values())
    assert len(set(words)) == len(words), "two named store words share a header word"
