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
) -> None:
    """``ranks`` ranks sampled every 10 ms from t=0 to ``seconds`` at a constant ``power_w`` (the
    energy counter agrees: it moves ``power_w`` x 10 ms = 4000 mJ per sample at 400 W); step k
    spans [0.5 + k, 1.4 + k] s with 2 microbatches [b, b+0.4], [b+0.45, b+0.85]."""
    n = int(seconds * HZ) + 1
    t = (np.arange(n) * 10 * MS).astype(np.int64)
    for r in range(ranks):
        temp = temps[r] if temps else 50.0 + r
        samples = {
            "t_mono_ns": t,
            "power_instant_w": np.full(n, power_w),
            "energy_mj": (10**15 + np.arange(n) * int(power_w * 10)).astype(np.int64),
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
