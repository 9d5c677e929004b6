"""Join a run's windows with its samples: one row per (window, device) with its figures.

The maths is in attribution.py (plain functions over arrays); this module only groups a run's
tables by rank and device and stitches the results back onto the window columns.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from charllm_nemo.telemetry.attribution import attribute_windows
from charllm_nemo.telemetry.buffered import window_peaks
from charllm_nemo.telemetry.reader import RunData, to_arrays


def attribute_run(
    run: RunData, kinds: tuple[str, ...] | None = None, buffered: pa.Table | None = None
) -> pa.Table:
    """Per-window figures for every rank and device of ``run``.

    ``kinds`` filters windows (e.g. ``("step",)``). The result has the window's columns, a
    ``device_index`` column, and every column :func:`attribute_windows` returns. ``buffered``:
    the run's driver-buffered timeline (:func:`charllm_nemo.telemetry.buffered.load_buffered`);
    when it holds power samples, a ``power_peak_buffered_w`` column (W) holds each window's
    highest driver-buffered power (NaN where none falls in the window).
    """
    windows = run.windows
    if kinds is not None and windows.num_rows:
        mask = np.isin(np.asarray(windows.column("kind").to_pylist(), dtype=object), list(kinds))
        windows = windows.filter(pa.array(mask))
    if windows.num_rows == 0:
        return pa.table({})
    samples = to_arrays(run.samples)
    power = _buffered_power(buffered)
    win_ranks = windows.column("rank").to_numpy()
    pieces: list[pa.Table] = []
    for rank in np.unique(win_ranks):
        w_rank = windows.filter(pa.array(win_ranks == rank))
        w_arr = to_arrays(w_rank, ["t_begin_mono_ns", "t_end_mono_ns"])
        in_rank = samples["rank"] == rank if samples else np.zeros(0, bool)
        dev_ids = np.unique(samples["device_index"][in_rank]) if samples else np.zeros(0, np.int64)
        for dev in dev_ids if len(dev_ids) else [-1]:
            sel = in_rank & (samples["device_index"] == dev)
            per_dev = {k: v[sel] for k, v in samples.items() if v.dtype != object}
            figures: dict[str, Any] = attribute_windows(per_dev, w_arr)
            t = w_rank.append_column("device_index", pa.array(np.full(w_rank.num_rows, dev, np.int16)))
            for name, values in figures.items():
                t = t.append_column(name, pa.array(values))
            if power is not None:
                on = (power["rank"] == rank) & (power["device_index"] == dev)
                peaks = window_peaks(
                    power["t_mono_ns"][on],
                    power["value"][on],
                    w_arr["t_begin_mono_ns"],
                    w_arr["t_end_mono_ns"],
                )
                t = t.append_column("power_peak_buffered_w", pa.array(peaks))
            pieces.append(t)
    return pa.concat_tables(pieces, promote_options="default")


def _buffered_power(buffered: pa.Table | None) -> dict[str, np.ndarray[Any, Any]] | None:
    """The ``power_w`` rows of a :func:`load_buffered` table as arrays (sorted by rank, device,
    time), or None when it holds none."""
    if buffered is None or buffered.num_rows == 0:
        return None
    metric = np.asarray(buffered.column("metric").to_pylist(), dtype=object)
    rows = buffered.filter(pa.array(metric == "power_w"))
    if rows.num_rows == 0:
        return None
    return {name: rows.column(name).to_numpy() for name in ("rank", "device_index", "t_mono_ns", "value")}
