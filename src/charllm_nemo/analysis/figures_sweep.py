"""Figures across configurations, in the paper's designs: stacked panels per configuration with
the efficiency on a twin axis (Figures 4, 8, 13) and per-GPU heatmaps (Figures 5, 17).

Each function takes the analysis tables (Arrow) and a path stem, saves ``<stem>.png`` and
``<stem>.pdf`` and returns both paths (none when there is nothing to draw)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a window (also on a machine without a display)

import matplotlib.pyplot as plt
import numpy as np
import pyarrow as pa
from matplotlib.colors import LogNorm

from charllm_nemo.telemetry.write import write_with

PANELS = (
    ("GPU temp (°C)", "temp_gpu_avg_c", "temp_gpu_peak_c"),
    ("GPU power (W)", "power_avg_w", "power_peak_w"),
    ("SM clock (MHz)", "clock_sm_avg_mhz", None),
)
EFFICIENCY = "efficiency_samples_per_s_per_mj"


def save(fig: Any, stem: Path) -> list[Path]:
    """``stem``.png (150 dpi) and ``stem``.pdf; closes the figure."""
    out = [stem.with_suffix(".png"), stem.with_suffix(".pdf")]
    write_with(out[0], lambda f: fig.savefig(f, format="png", dpi=150, bbox_inches="tight"))
    write_with(out[1], lambda f: fig.savefig(f, format="pdf", bbox_inches="tight"))
    plt.close(fig)
    return out


def _ran(row: dict[str, Any]) -> bool:
    return bool(row.get("measured_steps")) and row.get("energy_j") is not None


def _gap_label(row: dict[str, Any]) -> str:
    status = str(row.get("status") or "")
    return "OOM" if "out_of_memory" in status else (status or "no data").upper()[:12]


def _order(rows: list[dict[str, Any]], by_microbatch: bool) -> list[dict[str, Any]]:
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        second = r.get("micro_batch_size") or 0 if by_microbatch else (r.get("layout") or "")
        return (str(r.get("model")), second, str(r.get("platform")), r["run"])

    return sorted(rows, key=key)


def _label(r: dict[str, Any], with_mb: bool) -> str:
    """``layout / mb<size> / <GPUs>x``, leaving out what the run does not say."""
    parts = [str(r.get("layout") or r["run"])]
    if with_mb and r.get("micro_batch_size") is not None:
        parts.append(f"mb{r['micro_batch_size']}")
    if r.get("world_size") is not None:
        parts.append(f"{r['world_size']}x")
    return "\n".join(parts)


def configs_figure(runs: pa.Table, stem: Path, normalise: bool = False) -> list[Path]:
    """One x position per run (grouped by model, separators between models); three stacked
    panels (GPU temperature avg/peak, power avg/peak, SM clock avg) with the efficiency metric
    on a twin axis; runs without figures (out of memory, failed) drawn as marked grey gaps.
    ``normalise``: every series divided by its model's largest value (Figures 8, 13), with the
    configurations ordered by micro batch size when a model's runs differ in it."""
    rows = runs.to_pylist()
    if not rows:
        return []
    by_mb = normalise and len({r.get("micro_batch_size") for r in rows}) > 1
    rows = _order(rows, by_mb)
    n = len(rows)
    x = np.arange(n)
    models = [str(r.get("model")) for r in rows]

    def series(col: str | None) -> np.ndarray[Any, Any]:
        if col is None:
            return np.full(n, np.nan)
        v = np.array([r.get(col) if _ran(r) and r.get(col) is not None else np.nan for r in rows], float)
        if normalise:
            for m in set(models):
                sel = np.array([mm == m for mm in models])
                top = np.nanmax(v[sel]) if np.isfinite(v[sel]).any() else np.nan
                v[sel] = v[sel] / top if top and np.isfinite(top) else np.nan
        return v

    fig, axes = plt.subplots(3, 1, figsize=(max(6.0, 0.9 * n + 3), 7.5), sharex=True)
    eff = series(EFFICIENCY)
    for ax, (label, avg_col, peak_col) in zip(axes, PANELS, strict=True):
        ax.plot(x, series(avg_col), "o-", color="tab:blue", label="average")
        if peak_col:
            ax.plot(x, series(peak_col), "s-", color="tab:red", label="peak")
        ax.set_ylabel(label + (" (norm.)" if normalise else ""), color="tab:blue")
        ax.grid(True, linestyle="--", alpha=0.5)
        twin = ax.twinx()
        twin.plot(x, eff, "x--", color="tab:green", label="efficiency")
        twin.set_ylabel("samples/(s·MJ)" + (" (norm.)" if normalise else ""), color="tab:green")
        for i, r in enumerate(rows):
            if not _ran(r):
                ax.axvspan(i - 0.5, i + 0.5, color="lightgrey", alpha=0.6, hatch="//")
                ax.text(i, 0.5, _gap_label(r), transform=ax.get_xaxis_transform(), ha="center", va="center",
                        rotation=90, fontsize=9)  # fmt: skip
        for i in range(1, n):
            if models[i] != models[i - 1]:
                ax.axvline(i - 0.5, color="black", linewidth=1)
    for m in dict.fromkeys(models):
        idx = [i for i, mm in enumerate(models) if mm == m]
        axes[0].text(np.mean(idx), 1.04, m, transform=axes[0].get_xaxis_transform(), ha="center", va="bottom")
    handles = axes[0].get_lines()[:2] + axes[0].figure.axes[-1].get_lines()[:1]
    fig.legend(
        handles, [h.get_label() for h in handles], loc="upper center", ncol=3, bbox_to_anchor=(0.5, 1.03)
    )
    labels = [_label(r, with_mb=by_mb or not normalise) for r in rows]
    axes[-1].set_xticks(x)
    axes[-1].set_xticklabels(labels, fontsize=8)
    axes[-1].set_xlim(-0.5, n - 0.5)
    axes[-1].set_xlabel("configuration (micro batch size)" if by_mb else "configuration")
    fig.tight_layout()
    return save(fig, stem)


HEAT_METRICS = (
    ("PCIe bytes (tx+rx)", ("pcie_tx_bytes", "pcie_rx_bytes"), True),
    ("NVLink bytes (tx+rx)", ("nvlink_tx_bytes", "nvlink_rx_bytes"), True),
    ("GPU temp avg (°C)", ("temp_gpu_avg_c",), False),
    ("GPU temp peak (°C)", ("temp_gpu_peak_c",), False),
)


def heatmaps_figure(
    ranks: pa.Table, runs: pa.Table, windows_hosts: dict[tuple[str, int], str], stem: Path
) -> list[Path]:
    """Configurations (rows) x GPUs (columns) heatmaps of traffic (log colour scale) and GPU
    temperature, one panel per metric that was measured; vertical lines separate nodes (from the
    ranks' hosts, in rank order)."""
    rows = ranks.to_pylist()
    if not rows:
        return []
    run_keys = [r["run"] for r in _order(runs.to_pylist(), False) if any(x["run"] == r["run"] for x in rows)]
    n_gpu = max(int(r["rank"]) for r in rows) + 1
    panels = []
    for label, cols, log in HEAT_METRICS:
        grid = np.full((len(run_keys), n_gpu), np.nan)
        for r in rows:
            vals = [v for v in (r.get(c) for c in cols) if v is not None and v == v]  # v != v: NaN
            if vals:  # a direction the device does not count is left out, not taken as 0
                grid[run_keys.index(r["run"]), int(r["rank"])] = float(sum(vals))
        if np.isfinite(grid).any():
            panels.append((label, grid, log))
    if not panels:
        return []
    width = max(6.0, 0.35 * n_gpu + 4)
    height = 1.2 + len(panels) * (0.5 * len(run_keys) + 0.8)
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, height), squeeze=False)
    for ax, (label, grid, log) in zip(axes[:, 0], panels, strict=True):
        pos = grid[np.isfinite(grid) & (grid > 0)]
        norm = LogNorm(vmin=max(pos.min(), 1.0), vmax=max(pos.max(), 10.0)) if log and pos.size else None
        cmap = "viridis" if log else "inferno"
        im = ax.imshow(
            np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, norm=norm, interpolation="nearest"
        )
        fig.colorbar(im, ax=ax, label=label)
        ax.set_yticks(range(len(run_keys)))
        ax.set_yticklabels(run_keys, fontsize=7)
        ax.set_xlabel("GPU (rank)")
        ax.set_xticks(range(n_gpu))
        for i, run in enumerate(run_keys):
            for g in range(1, n_gpu):
                a, b = windows_hosts.get((run, g - 1)), windows_hosts.get((run, g))
                if a is not None and b is not None and a != b:
                    ax.plot([g - 0.5, g - 0.5], [i - 0.5, i + 0.5], color="white", linewidth=2)
        ax.set_title(label, fontsize=10)
    fig.tight_layout()
    return save(fig, stem)
