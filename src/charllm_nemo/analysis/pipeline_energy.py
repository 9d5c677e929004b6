"""Per-stage energy bloat of pipeline runs and the per-(stage, forward/backward) profile a
frequency planner takes (``charllm analyze`` tables ``pp_bloat`` and ``pp_profile``; columns in
docs/analysis.md).

**Bloat.** Perseus (Chung et al., "Perseus: Removing Energy Bloat from Large Model Training",
arXiv 2312.06902) calls the energy a stage spends blocked on its neighbours the *intrinsic
energy bloat*: a stage off the critical path finishes its work early and then waits in
point-to-point communication at a power well above idle. Here that is, per rank and measured
step, the time in the rank's ``pp-*`` phase windows (pipeline send / receive, the wait for the
neighbour stage included: steps/marks.py) times the power the device drew while in them.

**Why power from the samples inside the windows.** The per-window attribution
(telemetry/attribution.py) draws power as a straight line between samples; a wait of a few ms
between two 10 ms samples then borrows the compute power on either side (on a CPU pp2 run at
100 Hz, waits of ~14 ms on average, it read 28-61 % above time x the power sampled inside the
waits). Perseus measures the blocking power apart and multiplies by the blocking time, and so
does this: the wait power of a step is the mean instant power of the samples that fall inside
its wait windows; a step with no sample inside any of its waits takes the rank's wait power
over the run, and a rank with none at all the attributed power of its step windows
(``wait_power_from`` says which). The attributed sum is kept beside it
(``wait_energy_attributed_j``).

**Profile.** Zeus's Perseus planner (``lowtime``, its ``examples/perseus.py``) reads an
instruction profile with columns ``stage, instruction, frequency, time, energy`` (one row per
stage, ``forward`` / ``backward`` and SM clock) and a P2P blocking power. ``pp_profile`` has
those columns for the clock each stage ran at: ``time`` the mean length of one forward
(backward) window of one microbatch on the stage, ``energy`` that time x the mean instant power
of the samples inside those windows (the attributed mean where none fell inside), averaged
over the stage's ranks and measured steps; ``p2p_power`` the stage's wait power.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from charllm_nemo.analysis.load import Run
from charllm_nemo.telemetry.reader import read_segments
from charllm_nemo.telemetry.sampler import SAMPLES_SCHEMA

PP_BLOAT_COLUMNS: tuple[str, ...] = (
    "run", "rank", "device_index", "pp_stage", "step", "step_s", "step_energy_j", "waits",
    "wait_s", "wait_share", "wait_samples", "wait_power_w", "wait_power_from", "wait_energy_j",
    "wait_energy_attributed_j", "bloat_share",
)  # fmt: skip
"""``pp_bloat``: one row per (run, rank, device, measured step) of a run with >= 2 stages."""

PP_PROFILE_COLUMNS: tuple[str, ...] = (
    "run", "stage", "instruction", "frequency", "time", "energy", "power_w", "windows", "ranks",
    "samples", "energy_from", "energy_attributed", "p2p_power",
)  # fmt: skip
"""``pp_profile``: one row per (run, stage, instruction): lowtime's columns first."""

Arr = np.ndarray[Any, Any]


def inside_sums(t: Arr, values: Arr, begins: Arr, ends: Arr) -> tuple[Arr, Arr]:
    """Per window [begin, end]: the sum and the count of the finite ``values`` of the samples at
    times ``t`` (sorted) inside it, from prefix sums (two searchsorted per window)."""
    ok = np.isfinite(values)
    csum = np.concatenate([[0.0], np.cumsum(np.where(ok, values, 0.0))])
    ccnt = np.concatenate([[0], np.cumsum(ok)])
    lo = np.searchsorted(t, begins, "left")
    hi = np.searchsorted(t, ends, "right")
    return csum[hi] - csum[lo], ccnt[hi] - ccnt[lo]


def _np(table: pa.Table, name: str) -> Arr:
    col = table.column(name)
    if pa.types.is_floating(col.type):
        return np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)
    if pa.types.is_integer(col.type):
        return np.asarray(pc.fill_null(col, -1).to_numpy(zero_copy_only=False))
    return np.asarray(col.to_pylist(), dtype=object)


def _samples(run: Run, rank: int) -> dict[str, Arr] | None:
    files = run.files.ranks.get(rank)
    if files is None:
        return None
    cols = ["t_mono_ns", "device_index", "power_instant_w", "clock_sm_mhz"]
    table = read_segments(files.samples, "samples", SAMPLES_SCHEMA, [], cols)  # problems: said by the load
    if table is None or table.num_rows == 0:
        return None
    out = {c: _np(table, c) for c in cols}
    order = np.argsort(out["t_mono_ns"], kind="stable")
    return {k: v[order] for k, v in out.items()}


def _rank_rows(
    run: str, rank: int, w: dict[str, Arr], s: dict[str, Arr]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pp_bloat rows, per-window instruction records) of one rank's devices."""
    bloat: list[dict[str, Any]] = []
    inst: list[dict[str, Any]] = []
    for dev in np.unique(w["device_index"]):
        sel = s["device_index"] == dev
        t, power, clock = s["t_mono_ns"][sel], s["power_instant_w"][sel], s["clock_sm_mhz"][sel]
        mine = (w["device_index"] == dev) & w["measured"]
        ends = w["t_begin_mono_ns"] + np.rint(w["duration_s"] * 1e9).astype(np.int64)
        is_wait = mine & (w["kind"] == "phase") & np.array([str(n).startswith("pp-") for n in w["name"]])
        p_sum, p_n = inside_sums(t, power, w["t_begin_mono_ns"], ends)
        c_sum, c_n = inside_sums(t, clock, w["t_begin_mono_ns"], ends)
        rank_n = int(p_n[is_wait].sum())
        rank_power = float(p_sum[is_wait].sum() / rank_n) if rank_n else float("nan")
        steps = np.flatnonzero(mine & (w["kind"] == "step"))
        for i in steps:
            waits = is_wait & (w["step"] == w["step"][i])
            wait_s = float(w["duration_s"][waits].sum())
            n = int(p_n[waits].sum())
            if n:
                pw, src = float(p_sum[waits].sum() / n), "step_samples"
            elif rank_n:
                pw, src = rank_power, "rank_samples"
            else:
                e, d = w["energy_j"][waits], w["duration_s"][waits]
                ok = np.isfinite(e)
                pw = float(e[ok].sum() / d[ok].sum()) if ok.any() and d[ok].sum() > 0 else float("nan")
                src = "step_average"
            step_j, step_s = float(w["energy_j"][i]), float(w["duration_s"][i])
            energy = wait_s * pw if wait_s > 0 else 0.0
            attributed = w["energy_j"][waits]
            bloat.append(
                {
                    "run": run, "rank": rank, "device_index": int(dev), "pp_stage": int(w["pp_stage"][i]),
                    "step": int(w["step"][i]), "step_s": step_s, "step_energy_j": step_j,
                    "waits": int(waits.sum()), "wait_s": wait_s,
                    "wait_share": wait_s / step_s if step_s > 0 else float("nan"),
                    "wait_samples": n, "wait_power_w": pw, "wait_power_from": src, "wait_energy_j": energy,
                    "wait_energy_attributed_j": float(np.nansum(attributed)) if attributed.size else 0.0,
                    "bloat_share": energy / step_j if step_j > 0 else float("nan"),
                }
            )  # fmt: skip
        for name in ("forward", "backward"):
            for i in np.flatnonzero(mine & (w["kind"] == "phase") & (w["name"] == name)):
                inst.append(
                    {
                        "run": run, "rank": rank, "stage": int(w["pp_stage"][i]), "instruction": name,
                        "time": float(w["duration_s"][i]), "p_sum": float(p_sum[i]), "p_n": int(p_n[i]),
                        "c_sum": float(c_sum[i]), "c_n": int(c_n[i]), "energy_attr": float(w["energy_j"][i]),
                        "clock_attr": float(w["clock_sm_avg_mhz"][i]), "p2p": rank_power,
                    }
                )  # fmt: skip
    return bloat, inst


def _profile(inst: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in inst:
        groups.setdefault((r["run"], r["stage"], r["instruction"]), []).append(r)
    rows = []
    for (run, stage, name), rs in sorted(groups.items()):
        time = float(np.mean([r["time"] for r in rs]))
        n = sum(r["p_n"] for r in rs)
        attr = np.array([r["energy_attr"] for r in rs])
        attr_mean = float(np.nanmean(attr)) if np.isfinite(attr).any() else float("nan")
        if n:
            power, src = sum(r["p_sum"] for r in rs) / n, "samples"
        else:
            power, src = attr_mean / time if time > 0 else float("nan"), "attributed"
        cn = sum(r["c_n"] for r in rs)
        clocks = np.array([r["clock_attr"] for r in rs])
        freq = (
            sum(r["c_sum"] for r in rs) / cn
            if cn
            else (float(np.nanmean(clocks)) if np.isfinite(clocks).any() else float("nan"))
        )
        p2p = np.array(sorted({(r["rank"], r["p2p"]) for r in rs}), dtype=float)[:, 1]
        rows.append(
            {
                "run": run, "stage": stage, "instruction": name,
                "frequency": round(float(freq)) if np.isfinite(freq) else None, "time": time,
                "energy": time * power, "power_w": power, "windows": len(rs),
                "ranks": len({r["rank"] for r in rs}), "samples": n, "energy_from": src,
                "energy_attributed": attr_mean,
                "p2p_power": float(np.nanmean(p2p)) if np.isfinite(p2p).any() else float("nan"),
            }
        )  # fmt: skip
    return rows


_WINDOW_COLS = ("rank", "device_index", "kind", "name", "step", "pp_stage", "measured", "t_begin_mono_ns",
                "duration_s", "energy_j", "clock_sm_avg_mhz")  # fmt: skip


def _table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> pa.Table:
    return pa.Table.from_pylist([{c: r[c] for c in columns} for r in rows]) if rows else pa.table({})


def pipeline_tables(runs: list[Run], windows: pa.Table | None) -> dict[str, pa.Table]:
    """``pp_bloat`` and ``pp_profile`` of the runs with at least two pipeline stages (``windows``:
    analyze's kept window columns); empty when no run has a pipeline. Each rank's samples are read
    again, two columns and the clock, one rank at a time."""
    if windows is None or windows.num_rows == 0:
        return {}
    bloat: list[dict[str, Any]] = []
    inst: list[dict[str, Any]] = []
    for run in runs:
        wr = windows.filter(pc.equal(windows.column("run"), run.key))
        stages = pc.unique(pc.drop_null(wr.column("pp_stage")))
        if len(stages) < 2:
            continue
        for rank in sorted(set(wr.column("rank").to_pylist())):
            s = _samples(run, rank)
            if s is None:
                continue
            t = wr.filter(pc.equal(wr.column("rank"), rank)).select(list(_WINDOW_COLS))
            w = {c: _np(t, c) for c in _WINDOW_COLS}
            w["measured"] = w["measured"].astype(bool)
            b, i = _rank_rows(run.key, rank, w, s)
            bloat += b
            inst += i
    if not bloat:
        return {}
    return {
        "pp_bloat": _table(bloat, PP_BLOAT_COLUMNS),
        "pp_profile": _table(_profile(inst), PP_PROFILE_COLUMNS),
    }
