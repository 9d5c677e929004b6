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


def _by(keys: Arr, values: Arr, n: int) -> Arr:
    return np.bincount(keys, weights=values, minlength=n)


def _rank_rows(
    run: str, rank: int, w: dict[str, Arr], s: dict[str, Arr]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pp_bloat rows, per-(stage, instruction) sums) of one rank's devices. Steps and
    instructions are summed with bincount: linear in the rank's windows and samples."""
    bloat: list[dict[str, Any]] = []
    inst: list[dict[str, Any]] = []
    ends = w["t_begin_mono_ns"] + np.rint(w["duration_s"] * 1e9).astype(np.int64)
    is_pp = np.array([str(n).startswith("pp-") for n in w["name"]], bool)
    for dev in np.unique(w["device_index"]):
        sel = s["device_index"] == dev
        t, power, clock = s["t_mono_ns"][sel], s["power_instant_w"][sel], s["clock_sm_mhz"][sel]
        mine = (w["device_index"] == dev) & w["measured"]
        is_wait = mine & (w["kind"] == "phase") & is_pp
        p_sum, p_n = inside_sums(t, power, w["t_begin_mono_ns"], ends)
        c_sum, c_n = inside_sums(t, clock, w["t_begin_mono_ns"], ends)
        rank_n = int(p_n[is_wait].sum())
        rank_power = float(p_sum[is_wait].sum() / rank_n) if rank_n else float("nan")
        steps = np.flatnonzero(mine & (w["kind"] == "step"))
        if steps.size:
            uniq, pos = np.unique(w["step"][steps], return_inverse=True)
            k = np.searchsorted(uniq, w["step"][is_wait])  # each wait's step among them
            k_ok = (k < uniq.size) & (uniq[np.minimum(k, uniq.size - 1)] == w["step"][is_wait])
            k, m = k[k_ok], uniq.size
            wi = np.flatnonzero(is_wait)[k_ok]
            e, d = w["energy_j"][wi], w["duration_s"][wi]
            fin = np.isfinite(e)
            sums = {
                "n": _by(k, np.ones(k.size), m), "time": _by(k, d, m), "p_sum": _by(k, p_sum[wi], m),
                "p_n": _by(k, p_n[wi], m), "attr": _by(k, np.where(fin, e, 0.0), m),
                "attr_d": _by(k, np.where(fin, d, 0.0), m),
            }  # fmt: skip
        for j, i in enumerate(steps):
            q = pos[j]
            wait_s, n = float(sums["time"][q]), int(sums["p_n"][q])
            if n:
                pw, src = float(sums["p_sum"][q] / n), "step_samples"
            elif rank_n:
                pw, src = rank_power, "rank_samples"
            else:
                attr_d = float(sums["attr_d"][q])
                pw, src = (float(sums["attr"][q]) / attr_d if attr_d > 0 else float("nan")), "step_average"
            step_j, step_s = float(w["energy_j"][i]), float(w["duration_s"][i])
            energy = wait_s * pw if wait_s > 0 else 0.0
            bloat.append(
                {
                    "run": run, "rank": rank, "device_index": int(dev), "pp_stage": int(w["pp_stage"][i]),
                    "step": int(w["step"][i]), "step_s": step_s, "step_energy_j": step_j,
                    "waits": int(sums["n"][q]), "wait_s": wait_s,
                    "wait_share": wait_s / step_s if step_s > 0 else float("nan"),
                    "wait_samples": n, "wait_power_w": pw, "wait_power_from": src, "wait_energy_j": energy,
                    "wait_energy_attributed_j": float(sums["attr"][q]),
                    "bloat_share": energy / step_j if step_j > 0 else float("nan"),
                }
            )  # fmt: skip
        for name in ("forward", "backward"):
            ph = mine & (w["kind"] == "phase") & (w["name"] == name)
            for stage in np.unique(w["pp_stage"][ph]):
                x = ph & (w["pp_stage"] == stage)
                e, c = w["energy_j"][x], w["clock_sm_avg_mhz"][x]
                inst.append(
                    {
                        "run": run, "rank": rank, "stage": int(stage), "instruction": name,
                        "windows": int(x.sum()), "time": float(w["duration_s"][x].sum()),
                        "p_sum": float(p_sum[x].sum()), "p_n": int(p_n[x].sum()),
                        "c_sum": float(c_sum[x].sum()), "c_n": int(c_n[x].sum()),
                        "attr": float(np.nansum(e)), "attr_n": int(np.isfinite(e).sum()),
                        "clock": float(np.nansum(c)), "clock_n": int(np.isfinite(c).sum()), "p2p": rank_power,
                    }
                )  # fmt: skip
    return bloat, inst


def _profile(inst: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in inst:
        groups.setdefault((r["run"], r["stage"], r["instruction"]), []).append(r)
    rows = []
    for (run, stage, name), rs in sorted(groups.items()):

        def total(key: str, rs: list[dict[str, Any]] = rs) -> float:
            return float(sum(r[key] for r in rs))

        time = total("time") / total("windows")
        n = int(total("p_n"))
        attr_mean = total("attr") / total("attr_n") if total("attr_n") else float("nan")
        if n:
            power, src = total("p_sum") / n, "samples"
        else:
            power, src = (attr_mean / time if time > 0 else float("nan")), "attributed"
        if total("c_n"):
            freq = total("c_sum") / total("c_n")
        else:
            freq = total("clock") / total("clock_n") if total("clock_n") else float("nan")
        p2p = np.array([r["p2p"] for r in rs], float)
        rows.append(
            {
                "run": run, "stage": stage, "instruction": name,
                "frequency": round(freq) if np.isfinite(freq) else None, "time": time,
                "energy": time * power, "power_w": power, "windows": int(total("windows")),
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
        wr = wr.select(list(_WINDOW_COLS)).sort_by("rank")  # one pass, then each rank a slice
        ranks, first = np.unique(_np(wr, "rank"), return_index=True)
        for rank, lo, hi in zip(ranks, first, [*first[1:], wr.num_rows], strict=True):
            s = _samples(run, int(rank))
            if s is None:
                continue
            t = wr.slice(int(lo), int(hi - lo))
            w = {c: _np(t, c) for c in _WINDOW_COLS}
            w["measured"] = w["measured"].astype(bool)
            b, i = _rank_rows(run.key, int(rank), w, s)
            bloat += b
            inst += i
    if not bloat:
        return {}
    return {
        "pp_bloat": _table(bloat, PP_BLOAT_COLUMNS),
        "pp_profile": _table(_profile(inst), PP_PROFILE_COLUMNS),
    }
