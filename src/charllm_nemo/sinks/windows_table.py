"""The end-of-run table of per-window figures, built from the run directory.

One row per (window, device) of the kinds asked for (default: microbatch and phase windows),
every rank that is on this file system, with the columns of :data:`WINDOW_TABLE_COLUMNS`.
Reading and attributing a run costs seconds for a long run: call this off the training thread
(:class:`~charllm_nemo.sinks.wandb.WandbSink` does it in its ``finish``, on the sink thread).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from charllm_nemo.telemetry.filecheck import printable
from charllm_nemo.telemetry.layout import RankFiles, read_parquet

log = logging.getLogger("charllm_nemo.sinks")

WINDOW_TABLE_COLUMNS: tuple[str, ...] = (
    "rank",
    "step",
    "microbatch",
    "kind",
    "name",
    "device_index",
    "pp_stage",
    "tp_rank",
    "dp_rank",
    "ep_rank",
    "vpp_chunk",
    "t_begin_mono_ns",
    "duration_s",
    "energy_j",
    "energy_method",
    "energy_bound_j",
    "power_avg_w",
    "power_peak_w",
    "temp_gpu_peak_c",
    "temp_hbm_peak_c",
    "clock_sm_avg_mhz",
    "throttle_any_limiting_s",
    "n_samples",
    "coverage",
)
"""Columns of the windows table: where the window sits (rank, step, microbatch, kind, phase
name, device, parallel labels), when it began (CLOCK_MONOTONIC ns), and its figures (units in
the names; see docs/store.md and docs/attribution.md)."""


def _cell(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _rank_rows(
    run_dir: str | os.PathLike[str], files: RankFiles, kinds: tuple[str, ...]
) -> list[dict[str, Any]]:
    import numpy as np
    import pyarrow as pa

    from charllm_nemo.telemetry.join import attribute_run
    from charllm_nemo.telemetry.reader import RunData, load_rank

    rank = files.rank
    rd = load_rank(run_dir, rank, files)
    for problem in rd.problems:
        log.warning("windows table: %s", printable(problem, 1000))

    def ranked(t: pa.Table) -> pa.Table:
        return t.add_column(0, "rank", pa.array(np.full(t.num_rows, rank, np.int32)))

    run = RunData(Path(run_dir), {rank: rd.manifest}, ranked(rd.samples), ranked(rd.windows), rd.problems)
    table = attribute_run(run, kinds=kinds)
    if table.num_rows == 0:
        return []
    present = [c for c in WINDOW_TABLE_COLUMNS if c in table.column_names]
    cols = {c: table.column(c).to_pylist() for c in present}
    rows = [{c: _cell(cols[c][i]) for c in present} for i in range(table.num_rows)]
    rows.sort(key=_order)
    return rows


_KIND_ORDER = {"step": 0, "microbatch": 1, "phase": 2}


def _order(r: dict[str, Any]) -> tuple[int, int, int, int]:
    def num(k: str) -> int:
        v = r.get(k)
        return -1 if v is None else int(v)

    kind = _KIND_ORDER.get(str(r.get("kind")), 3)
    return (num("step"), num("t_begin_mono_ns"), kind, num("device_index"))


def _count_rows(files: RankFiles, kinds: tuple[str, ...]) -> int:
    """Rows a rank would give without attributing it: its windows of ``kinds`` x its devices."""
    from charllm_nemo.telemetry.reader import read_manifest

    devices = len(read_manifest(files, []).get("devices") or [None])
    n = 0
    for seg in files.windows:
        try:
            kind = read_parquet(seg, columns=["kind"]).column("kind").to_pylist()
        except Exception:  # a damaged segment: the reader skips it too
            continue
        n += sum(1 for k in kind if k in kinds)
    return n * max(devices, 1)


def windows_table_rows(
    run_dir: str | os.PathLike[str],
    *,
    kinds: tuple[str, ...] = ("microbatch", "phase"),
    max_rows: int | None = 10_000,
) -> tuple[list[dict[str, Any]], int]:
    """Rows for the windows table from a run directory, and how many rows there are in all.

    Rows are ordered by rank, step, begin time, kind (a microbatch before its phases) and
    device; with ``max_rows`` the first ``max_rows`` are kept (the rest stay in the run
    directory). Ranks are read one at a time and only until ``max_rows`` rows are there, so a
    large run costs what the table holds (the ranks not read are only counted). Unknown
    figures are None.
    """
    from charllm_nemo.telemetry.layout import scan_run
    from charllm_nemo.telemetry.reader import accepted_ranks

    files = scan_run(run_dir)
    for problem in files.problems():
        log.warning("windows table: %s", printable(problem, 1000))
    rows: list[dict[str, Any]] = []
    total = 0
    for rank in accepted_ranks(files):
        if max_rows is not None and len(rows) >= max_rows:
            total += _count_rows(files.ranks[rank], kinds)
            continue
        got = _rank_rows(run_dir, files.ranks[rank], kinds)
        total += len(got)
        rows.extend(got)
    if max_rows is not None and total > max_rows:
        log.info(
            "windows table: keeping the first %d of %d rows (the run directory has them all)",
            max_rows,
            total,
        )
        rows = rows[:max_rows]
    return rows, total
