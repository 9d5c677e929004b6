"""A rank's reduction attributes each device once (the windows, the device's whole sampled span
and the measured steps' span as windows of one call, issue #45): the figures equal those of
separate calls of the reference attribution, exactly, on a rough store (NaN gaps, a counter
reset, throttle bits)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from charllm_nemo.analysis.load import find_runs, open_run, rank_arrays
from charllm_nemo.analysis.rank_tables import measured_steps, rank_tables
from charllm_nemo.telemetry.attribution import attribute_windows, prepare_samples

from .helpers import rough_run

SPAN = ("energy_j", "energy_method", "energy_bound_j")


def _same(a: np.ndarray, b: np.ndarray) -> None:
    if a.dtype.kind == "f":
        np.testing.assert_array_equal(a, b)  # NaN in the same places, every other value equal
    else:
        assert a.tolist() == b.tolist()


def test_one_call_equals_separate_calls(tmp_path: Path) -> None:
    rough_run(tmp_path / "run", seed=3)
    run = open_run(find_runs(tmp_path / "run")[0], tmp_path)
    for r in run.ranks:
        data = rank_arrays(run.files.ranks[r], [])
        assert data is not None
        rt = rank_tables(data)
        s, _ = prepare_samples(data.samples)
        t, w = s["t_mono_ns"], data.windows
        # the windows: every attribution column
        ref = attribute_windows(s, w)
        for k, v in ref.items():
            _same(rt.windows[k], v)
        # the whole sampled span: the ranks table's energy figures
        whole = attribute_windows(s, [(int(t[0]), int(t[-1]))], figures=SPAN)
        assert rt.devices["energy_method"][0] == whole["energy_method"][0]
        _same(rt.devices["energy_j"], whole["energy_j"])
        _same(rt.devices["energy_bound_j"], whole["energy_bound_j"])
        # the measured steps' span: the runs table's energy
        steps = measured_steps(w["step"][w["kind"] == "step"])
        sel = (w["kind"] == "step") & np.isin(w["step"], steps)
        span = (int(w["t_begin_mono_ns"][sel].min()), int(w["t_end_mono_ns"][sel].max()))
        one = attribute_windows(s, [span], figures=("duration_s", *SPAN))
        _same(rt.span["span_s"], one["duration_s"])
        _same(rt.span["span_energy_j"], one["energy_j"])
        _same(rt.span["span_energy_bound_j"], one["energy_bound_j"])
        assert rt.span["span_energy_method"].tolist() == one["energy_method"].tolist()
