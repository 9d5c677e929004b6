"""Kernel breakdown from PyTorch profiler traces (the paper's Figure 15): GPU time by kernel
category per rank, from the chrome-trace JSON files ``charllm train`` records for the steps in
``telemetry.profile_steps`` (``<run>/traces/rank=<r>/step-<NNNNNN>.json``, train/profile.py).

A trace's GPU kernels are its complete events (``"ph": "X"``) of category ``kernel``,
``gpu_memcpy`` or ``gpu_memset``; a CPU-only trace has none, and then its top-level CPU operators
(``cpu_op``) are counted instead, so that a CPU mirror run still gets a breakdown (marked
``source = cpu_op``). Each event's name is put in the first category whose pattern matches."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from charllm_nemo.telemetry.layout import MiB, read_bounded

CATEGORIES: tuple[tuple[str, str], ...] = (
    ("send/recv", r"sendrecv|send|recv|p2p"),
    ("all-gather", r"all_?gather|allgather"),
    ("reduce-scatter", r"reduce_?scatter"),
    ("all-reduce", r"all_?reduce"),
    ("attention", r"flash|fmha|attn|attention|scaled_dot_product|softmax"),
    ("normalisation", r"layer_?norm|rms_?norm|\bnorm"),
    ("compute GEMM", r"gemm|xmma|cutlass|cublas|matmul|\bmm\b|addmm|bmm|linear|sm\d+_"),
    ("memory / elementwise",
     r"memcpy|memset|copy|fill|elementwise|vectorized|cat|index|add|mul|gelu|silu|dropout|to\b|zero"),
)  # fmt: skip
"""(category, regular expression on the lower-cased event name), first match wins; ``other``
when none matches. Collectives before compute: NCCL kernel names contain neither GEMM nor norm."""

_PATTERNS = [(name, re.compile(p)) for name, p in CATEGORIES]
TRACE_CAP = 512 * MiB
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_TRACE_NAME = re.compile(r"^step-(\d{6})\.json$")
_RANK_NAME = re.compile(r"^rank=(0|[1-9][0-9]{0,8})$")


def categorise(name: str) -> str:
    """The category of one kernel (or operator) name."""
    low = name.lower()
    for cat, pat in _PATTERNS:
        if pat.search(low):
            return cat
    return "other"


def trace_breakdown(events: list[Any]) -> tuple[dict[str, float], str]:
    """Seconds per category over one trace's events, and the source (``kernel`` or ``cpu_op``)."""
    xs = [
        e
        for e in events
        if isinstance(e, dict) and e.get("ph") == "X" and isinstance(e.get("dur"), (int, float))
    ]
    gpu = [e for e in xs if e.get("cat") in GPU_CATS]
    source = "kernel"
    if not gpu:
        gpu = _top_level(e for e in xs if e.get("cat") == "cpu_op")
        source = "cpu_op"
    out: dict[str, float] = {}
    for e in gpu:
        cat = categorise(str(e.get("name", "")))
        out[cat] = out.get(cat, 0.0) + float(e["dur"]) / 1e6  # chrome trace durations are in us
    return out, source


def _top_level(ops: Any) -> list[dict[str, Any]]:
    """CPU operators not nested in another one on the same thread (nested ones would count twice)."""
    by_thread: dict[Any, list[dict[str, Any]]] = {}
    for e in ops:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    top = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.get("ts", 0), -e["dur"]))
        end = -np.inf
        for e in evs:
            if e.get("ts", 0) >= end:
                top.append(e)
                end = e.get("ts", 0) + e["dur"]
    return top


def find_traces(run_dir: Path) -> dict[int, list[Path]]:
    """``<run>/traces/rank=<r>/step-NNNNNN.json`` files, regular files only (no links)."""
    root = run_dir / "traces"
    out: dict[int, list[Path]] = {}
    if not root.is_dir() or root.is_symlink():
        return out
    for d in sorted(root.iterdir()):
        m = _RANK_NAME.match(d.name)
        if not m or d.is_symlink() or not d.is_dir():
            continue
        files = sorted(
            p for p in d.iterdir() if _TRACE_NAME.match(p.name) and p.is_file() and not p.is_symlink()
        )
        if files:
            out[int(m.group(1))] = files
    return out


def kernel_table(runs: list[tuple[str, Path, dict[int, int]]], problems: list[str]) -> pa.Table:
    """One row per (run, rank, category): seconds and share of the rank's traced time.
    ``runs``: (run key, run directory, rank -> pipeline stage)."""
    rows: list[dict[str, Any]] = []
    for key, path, stages in runs:
        for rank, files in find_traces(path).items():
            total: dict[str, float] = {}
            source = "kernel"
            for f in files:
                try:
                    doc = json.loads(read_bounded(f, TRACE_CAP))
                except Exception as exc:  # a damaged or hostile file: reported, the rest read
                    problems.append(f"{f}: unreadable trace skipped ({type(exc).__name__})")
                    continue
                events = (
                    doc.get("traceEvents", [])
                    if isinstance(doc, dict)
                    else doc
                    if isinstance(doc, list)
                    else []
                )
                part, source = trace_breakdown(events)
                for k, v in part.items():
                    total[k] = total.get(k, 0.0) + v
            all_s = sum(total.values())
            for cat, sec in sorted(total.items()):
                rows.append({"run": key, "rank": rank, "pp_stage": stages.get(rank), "category": cat,
                             "seconds": sec, "share": sec / all_s if all_s else None, "source": source,
                             "steps_traced": len(files)})  # fmt: skip
    return pa.Table.from_pylist(rows) if rows else pa.table({"run": pa.array([], pa.string())})
