"""Run directories with hand-computable traces, written in the store's real format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from charllm_nemo.analysis.store_writer import write_rank, write_summary

HZ = 100
MS = 1_000_000


def constant_run(
    run: Path,
    ranks: int = 2,
    power_w: float = 400.0,
    seconds: float = 5.0,
    steps: int = 4,
    gbs: int = 8,
    seq: int = 16,
    micro: int = 1,
    hosts: list[str] | None = None,
    temps: list[float] | None = None,
    manifest: dict[str, Any] | None = None,
    energy_mj: np.ndarray | None = None,
) -> None:
    """``ranks`` ranks sampled every 10 ms from t=0 to ``seconds`` at a constant ``power_w`` (the
    energy counter agrees: it moves ``power_w`` x 10 ms = 4000 mJ per sample at 400 W, unless
    ``energy_mj`` gives its values); step k spans [0.5 + k, 1.4 + k] s with 2 microbatches
    [b, b+0.4], [b+0.45, b+0.85]."""
    n = int(seconds * HZ) + 1
    t = (np.arange(n) * 10 * MS).astype(np.int64)
    for r in range(ranks):
        temp = temps[r] if temps else 50.0 + r
        samples = {
            "t_mono_ns": t,
            "power_instant_w": np.full(n, power_w),
            "energy_mj": (10**15 + np.arange(n) * int(power_w * 10)).astype(np.int64)
            if energy_mj is None
            else energy_mj,
            "temp_gpu_c": np.full(n, temp),
            "clock_sm_mhz": np.full(n, 1800.0 - 10 * temp),
            "power_limit_w": np.full(n, 700.0),
            "throttle_reasons": np.zeros(n, np.int64),
            "pcie_tx_bytes": (np.arange(n) * 1000).astype(np.int64),
        }
        b = (500 + np.arange(steps) * 1000) * MS
        mb_b = np.stack((b, b + 450 * MS), axis=1).ravel()
        windows = {
            "window_id": np.arange(3 * steps, dtype=np.int64),
            "kind": ["step"] * steps + ["microbatch"] * (2 * steps),
            "name": ["step"] * steps + ["microbatch"] * (2 * steps),
            "step": np.concatenate((np.arange(steps), np.repeat(np.arange(steps), 2))).astype(np.int64),
            "microbatch": np.concatenate((np.full(steps, -1), np.tile([0, 1], steps))).astype(np.int64),
            "t_begin_mono_ns": np.concatenate((b, mb_b)).astype(np.int64),
            "t_end_mono_ns": np.concatenate((b + 900 * MS, mb_b + 400 * MS)).astype(np.int64),
            "pp_stage": np.zeros(3 * steps, np.int64),
        }
        m = {"world_size": ranks, "host": hosts[r] if hosts else "node0",
             "config": {"model": {"name": "toy", "seq_length": seq},
                        "batch": {"global_batch_size": gbs, "micro_batch_size": micro},
                        "parallel": {"tp": 1, "pp": 1, "cp": 1, "ep": 1}}}  # fmt: skip
        m.update(manifest or {})
        write_rank(run, r, samples, windows, m)
    write_summary(run, {"status": "complete", "model": "toy", "world_size": ranks})


def phased_run(
    run: Path,
    layout: list[dict[str, int]],
    clocks: list[float],
    busy_scale: list[float] | None = None,
    hole: tuple[int, float, float] | None = None,
    steps: int = 4,
    overlap_s: float = 0.0,
) -> None:
    """Ranks with a forward [b, b + 0.3 s] and backward [b + 0.3, b + 0.7 s] phase in each step
    [b, b + 0.9 s], b = 0.5 + k s, sampled every 10 ms over [0, steps + 1] s at 400 W.

    ``layout``: per rank its ``pp_stage``, ``tp_rank``, ``dp_rank``. ``clocks``: each rank's SM
    clock (MHz, constant). ``busy_scale``: each rank's phase lengths times this (the step window
    stays). ``hole``: (rank, from_s, to_s): that rank has no sample strictly inside. ``overlap_s``:
    a ``grad-sync`` phase [b + 0.7 - overlap_s, b + 0.9 s] that overlaps the backward by that much."""
    n = int((steps + 1) * HZ) + 1
    t_all = (np.arange(n) * 10 * MS).astype(np.int64)
    for r, lay in enumerate(layout):
        t = t_all
        if hole is not None and hole[0] == r:
            t = t[(t <= hole[1] * 1e9) | (t >= hole[2] * 1e9)]
        k = t.size
        samples = {
            "t_mono_ns": t,
            "power_instant_w": np.full(k, 400.0),
            "temp_gpu_c": np.full(k, 50.0),
            "clock_sm_mhz": np.full(k, clocks[r]),
            "power_limit_w": np.full(k, 700.0),
            "throttle_reasons": np.zeros(k, np.int64),
        }
        scale = busy_scale[r] if busy_scale else 1.0
        begin: list[int] = []
        end: list[int] = []
        kind: list[str] = []
        name: list[str] = []
        step: list[int] = []
        for s in range(steps):
            b = (500 + 1000 * s) * MS
            f, bw = int(300 * MS * scale), int(400 * MS * scale)
            rows = [("step", "step", b, b + 900 * MS), ("phase", "forward", b, b + f),
                    ("phase", "backward", b + f, b + f + bw)]  # fmt: skip
            if overlap_s:
                rows.append(("phase", "grad-sync", b + f + bw - int(overlap_s * 1e9), b + 900 * MS))
            for kd, nm, t0, t1 in rows:
                kind.append(kd)
                name.append(nm)
                step.append(s)
                begin.append(t0)
                end.append(t1)
        m = len(kind)
        windows = {
            "window_id": np.arange(m, dtype=np.int64),
            "kind": kind,
            "name": name,
            "step": np.array(step, np.int64),
            "microbatch": np.full(m, -1, np.int64),
            "t_begin_mono_ns": np.array(begin, np.int64),
            "t_end_mono_ns": np.array(end, np.int64),
            "pp_stage": np.full(m, lay["pp_stage"], np.int64),
            "tp_rank": np.full(m, lay["tp_rank"], np.int64),
            "dp_rank": np.full(m, lay["dp_rank"], np.int64),
        }
        man = {"world_size": len(layout), "host": "node0",
               "config": {"model": {"name": "toy", "seq_length": 16},
                          "batch": {"global_batch_size": 8, "micro_batch_size": 1},
                          "parallel": {"tp": 1, "pp": 1, "cp": 1, "ep": 1}}}  # fmt: skip
        write_rank(run, r, samples, windows, man)
    write_summary(run, {"status": "complete", "model": "toy", "world_size": len(layout)})


def rough_run(run: Path, seed: int) -> None:
    """2 ranks on 2 hosts: a square-wave power with NaN gaps, an energy counter that moves every
    30 ms and resets once, throttle bits that come and go, temperatures that drift; rank 1's
    sampler stalls for 0.5 s."""
    rng = np.random.default_rng(seed)
    n = 700
    t = (np.arange(n) * 10 * MS + rng.integers(0, MS, n)).astype(np.int64)
    for r in range(2):
        p = np.where((np.arange(n) // 25) % 2 == 0, 300.0, 650.0) + 10 * r
        p[rng.choice(n, 20, replace=False)] = np.nan
        e = np.cumsum(np.nan_to_num(p, nan=300.0) * 10).astype(np.int64)
        e = e[(np.arange(n) // 3) * 3]
        e[400:] -= e[400]  # a reset (driver reload)
        mask = np.where(p > 600, 0x4, 0).astype(np.int64) | np.where(np.arange(n) % 97 < 10, 0x40, 0)
        samples = {
            "t_mono_ns": t, "power_instant_w": p, "energy_mj": e,
            "temp_gpu_c": 50 + np.arange(n) / 100 + r, "temp_hbm_c": 45 + np.arange(n) / 200,
            "clock_sm_mhz": np.where(p > 600, 1500.0, 1980.0), "throttle_reasons": mask,
            "pcie_tx_bytes": np.cumsum(rng.integers(0, 1000, n)).astype(np.int64),
            "power_limit_w": np.full(n, 700.0),
        }  # fmt: skip
        if r == 1:  # a stalled sampler: 0.5 s without a sample
            keep = (np.arange(n) < 550) | (np.arange(n) >= 600)
            samples = {k: v[keep] for k, v in samples.items()}
        b = (500 + np.arange(5) * 1000) * MS
        windows = {
            "window_id": np.arange(5, dtype=np.int64), "kind": ["step"] * 5, "name": ["step"] * 5,
            "step": np.arange(5, dtype=np.int64), "microbatch": np.full(5, -1, np.int64),
            "t_begin_mono_ns": b.astype(np.int64), "t_end_mono_ns": (b + 900 * MS).astype(np.int64),
            "pp_stage": np.zeros(5, np.int64),
        }  # fmt: skip
        m = {"world_size": 2, "host": f"h{r}", "config": {"model": {"name": "toy", "seq_length": 32},
             "batch": {"global_batch_size": 8, "micro_batch_size": 1}}}  # fmt: skip
        write_rank(run, r, samples, windows, m, segment_rows=128)
    write_summary(run, {"status": "complete", "model": "toy", "world_size": 2})
