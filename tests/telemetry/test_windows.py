"""Window records: what a mark costs the training thread is one flat tuple of ints; the windows
table built from records (vectorised) says exactly what the marks said."""

from __future__ import annotations

import threading
import time

import pytest

from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry import steplog
from charllm_nemo.telemetry.steplog import mark_key
from charllm_nemo.telemetry.store import records_to_table, windows_to_table
from charllm_nemo.telemetry.windows import NULL, RECORD_LEN, WindowRecorder, decode_record


def _marked() -> WindowRecorder:
    rec = WindowRecorder()
    rec.set_labels(pp_stage=1, tp_rank=0, dp_rank=3)
    with rec.window("step", step=7) as step:
        with rec.window("phase", "forward", step=7, microbatch=0, vpp_chunk=1):
            pass
        rec.record("microbatch", None, 10, 20, step=7, microbatch=0, timing="host", parent_id=step)
        rec.record("phase", "pp-forward-recv", 11, 12, step=7, timing="cuda_event")
    return rec


def test_records_decode_to_the_marks_with_nulls_and_labels():
    rec = _marked()
    records = rec.drain_records()
    assert all(len(r) == RECORD_LEN and all(isinstance(v, int) for v in r) for r in records)
    rows = [decode_record(r, rec.names.names) for r in records]
    fwd, mb, recv, step = rows
    assert (step["kind"], step["step"], step["parent_id"], step["microbatch"]) == ("step", 7, None, None)
    assert fwd["parent_id"] == step["window_id"] and fwd["vpp_chunk"] == 1 and fwd["pp_stage"] == 1
    assert (mb["t_begin_mono_ns"], mb["t_end_mono_ns"], mb["timing"]) == (10, 20, "host")
    assert recv["name"] == "pp-forward-recv" and recv["timing"] == "cuda_event" and recv["cp_rank"] is None
    assert step["dp_rank"] == 3 and step["vpp_chunk"] is None


def test_the_vectorised_table_equals_the_row_by_row_table():
    rec = _marked()
    records = rec.drain_records()
    rows = [decode_record(r, rec.names.names) for r in records]
    assert records_to_table(records, rec.names.names).equals(windows_to_table(rows))


def test_open_windows_come_out_with_a_null_end():
    rec = WindowRecorder()
    rec.begin("step", step=0)
    (r,) = rec.open_records()
    assert r[8] == NULL
    assert records_to_table([r], rec.names.names).column("t_end_mono_ns").to_pylist() == [None]


def test_a_sink_gets_every_record_in_order_including_those_recorded_before_it():
    rec = WindowRecorder()
    rec.record("step", None, 1, 2, step=0)
    got: list[tuple[int, ...]] = []
    rec.set_sink(got.extend)
    rec.record("step", None, 3, 4, step=1)
    assert [r[5] for r in got] == [0, 1] and rec.drain_records() == []
    rec.reset_sink()
    rec.record("step", None, 5, 6, step=2)
    assert [r["step"] for r in rec.drain()] == [2]


def test_a_step_log_makes_the_windows_recorded_one_by_one_and_survives_packing():
    # The same step marked by hand (record) and as a StepMarker's flat log (steplog): equal
    # records, window ids included; and the log packed for the mark ring unpacks unchanged.
    one, batch = WindowRecorder(), WindowRecorder()
    for r in (one, batch):
        r.set_labels(pp_stage=1, tp_rank=0)
    wid = one.record("step", None, 100, 900, step=3, timing="host")
    one.record("microbatch", None, 110, 500, step=3, microbatch=0, timing="host", parent_id=wid)
    one.record("phase", "forward", 110, 200, step=3, microbatch=0, timing="host", parent_id=wid)
    one.record("phase", "backward", 300, 500, step=3, microbatch=0, timing="host", parent_id=wid)
    one.record("phase", "optimizer", 600, 800, step=3, timing="host", parent_id=wid)
    code = batch.names.code
    fwd, bwd, opt = (code(n) for n in ("forward", "backward", "optimizer"))
    marks = [mark_key(fwd, 0, True), 110, mark_key(fwd, 0, False), 200,
             mark_key(bwd, 1, True), 300, mark_key(bwd, 1, False), 500,
             mark_key(opt, 2, True), 600, mark_key(opt, 2, False), 800]  # fmt: skip
    kinds = steplog.KIND_MICROBATCH | steplog.KIND_PHASE
    step_id = batch.reserve_ids(1)
    first = batch.reserve_ids(steplog.ids_needed(len(marks), 1, kinds))
    log = steplog.StepLog(3, 100, 900, batch.wall_offset(100), code("host"), step_id, None, first,
                          1, 1, kinds, batch.label_values, [], marks)  # fmt: skip
    assert steplog.unpack(steplog.pack(log)) == log
    made, still_open = steplog.step_records(log)
    assert still_open == []
    wall = 9  # t_begin_wall_ns: each recorder reads its own wall-clock offset
    want = one.drain_records()
    assert [r[:wall] + r[wall + 1 :] for r in made] == [r[:wall] + r[wall + 1 :] for r in want]
    assert len({r[wall] - r[7] for r in made}) == 1


def test_new_names_are_published_before_a_record_uses_them():
    rec = WindowRecorder()
    published: list[tuple[int, str]] = []
    sent: list[tuple[int, ...]] = []
    rec.names.set_on_new(lambda code, text: published.append((code, text)))
    rec.set_sink(sent.extend)
    known = len(published)
    rec.record("phase", "grad-sync", 1, 2)
    assert published[known:] == [(known, "grad-sync")]
    assert sent[-1][4] == known
    assert [c for c, _ in published] == list(range(len(published)))


def test_window_ids_stay_unique_across_threads():
    rec = WindowRecorder()

    def mark() -> None:
        for _ in range(2000):
            rec.end(rec.begin("phase", "forward"))

    threads = [threading.Thread(target=mark) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [r[1] for r in rec.drain_records()]
    assert len(ids) == len(set(ids)) == 8000


def test_bad_kinds_and_labels_are_refused_with_the_valid_ones():
    rec = WindowRecorder()
    with pytest.raises(ConfigError, match="step, microbatch, phase"):
        rec.begin("epoch")
    with pytest.raises(ConfigError, match="pp_stage"):
        rec.begin("step", stage=1)


def test_a_mark_costs_microseconds():
    # The loop marks ~15 windows per step; at a few µs each that is < 0.2 % of a 40 ms CPU step.
    rec = WindowRecorder()
    rec.set_labels(pp_stage=0, tp_rank=0, dp_rank=0, ep_rank=0, cp_rank=0)
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        rec.end(rec.begin("phase", "forward", step=1, microbatch=0))
    per_window_us = (time.perf_counter() - t0) / n * 1e6
    assert per_window_us < 20, per_window_us  # ~2 µs here; generous for a loaded CI machine
