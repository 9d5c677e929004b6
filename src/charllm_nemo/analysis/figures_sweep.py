"""Figures across configurations, in the paper's designs: stacked panels per configuration with
the efficiency on a twin axis (Figures 4, 8, 13) and per-GPU heatmaps (Figures 5, 17).

Each function takes the analysis tables (Arrow) and a path stem, saves ``<stem>.png`` and
``<stem>.pdf`` and returns both paths (none when there is nothing to draw)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a window (also on a machine without a display)

import matplotlib.pyplot as plt
import numpy as np
import pyarrow as pa
from matplotlib.colors import LogNorm, Normalize
from matplotlib.ticker import FuncFormatter

from charllm_nemo.telemetry.write import write_with

PANELS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("throughput (tokens/s)", (("tokens_per_s", "tokens/s"),)),
    ("energy per token (J)", (("energy_per_token_j", "energy per token"),)),
    ("efficiency (samples/(s·MJ))", (("efficiency_samples_per_s_per_mj", "efficiency"),)),
    ("GPU power (W)", (("power_avg_w", "average"), ("power_peak_w", "peak"))),
    ("GPU temperature (°C)", (("temp_gpu_avg_c", "average"), ("temp_gpu_peak_c", "peak"))),
    ("SM clock (MHz)", (("clock_sm_avg_mhz", "average"),)),
)
"""The configuration figure's panels (Figure 4's quantities, plus throughput and energy of their
own): a label and its series (column, legend name)."""

SERIES_COLOURS = {"average": "tab:blue", "peak": "tab:red"}
EFFICIENCY = "efficiency_samples_per_s_per_mj"

IDENTITY = (
    "model", "device", "layout", "tp", "pp", "vpp", "cp", "ep", "dp", "fsdp", "world_size",
    "micro_batch_size", "global_batch_size", "seq_length", "optim", "layers_per_stage",
)  # fmt: skip
"""What makes a configuration: runs equal in all of these are repeats of one (aggregated)."""

LABEL_FIELDS: tuple[tuple[str, str], ...] = (
    ("layers_per_stage", "{}"),
    ("micro_batch_size", "mb{}"),
    ("global_batch_size", "gb{}"),
    ("seq_length", "seq{}"),
    ("optim", "{}"),
    ("world_size", "{}x"),
    ("device", "{}"),
)
"""Beyond the layout, what a configuration's label shows when its model's configurations differ
in it (``+layout=`` presets of one parallelism with [4,4] and [7,1] stages differ in the first)."""


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


def _sortable(v: Any) -> tuple[int, Any]:
    return (0, v) if isinstance(v, (int, float)) else (1, str(v))


@dataclass
class Config:
    """One configuration: its identity, its runs that have figures (repeats) and, when none
    has, the state that left it without (``OOM``, ``FAILED``, ...)."""

    key: tuple[Any, ...]
    fields: dict[str, Any]
    runs: list[dict[str, Any]]
    gap: str | None

    def values(self, col: str) -> list[float]:
        return [float(v) for r in self.runs if (v := r.get(col)) is not None and np.isfinite(v)]


def configurations(rows: list[dict[str, Any]], by_microbatch: bool) -> list[Config]:
    """Runs grouped into configurations (:data:`IDENTITY`), ordered by model, then by
    parallelism (pipeline, tensor, data, expert degrees; layers per stage), or by micro batch
    size first when ``by_microbatch``. A gap (a configuration that never ran) takes its place."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in IDENTITY), []).append(r)
    out = []
    for key, members in groups.items():
        ran = [r for r in members if _ran(r)]
        out.append(
            Config(key, dict(zip(IDENTITY, key, strict=True)), ran, None if ran else _gap_label(members[0]))
        )

    def order(c: Config) -> tuple[Any, ...]:
        f = c.fields
        par = tuple(
            _sortable(f.get(k)) for k in ("pp", "tp", "dp", "ep", "cp", "vpp", "layers_per_stage", "optim")
        )
        mb = (_sortable(f.get("micro_batch_size")),)
        rest = (
            _sortable(f.get("global_batch_size")),
            _sortable(f.get("world_size")),
            _sortable(f.get("device")),
        )
        return (str(f.get("model")), *(mb + par if by_microbatch else par + mb), *rest)

    return sorted(out, key=order)


def config_labels(configs: list[Config]) -> list[str]:
    """One label a configuration: the layout, then each :data:`LABEL_FIELDS` field in which its
    model's configurations differ (a gap's unknown field is no difference), then ``n=<runs>``
    (``n=1`` included) unless it is a gap."""
    varies: dict[str, set[str]] = {}
    for c in configs:
        model = str(c.fields.get("model"))
        for name, _ in LABEL_FIELDS:
            # a field a gap's row cannot know (None) is no difference; a run's None is a value
            values = {
                str(v)
                for d in configs
                if str(d.fields.get("model")) == model
                and ((v := d.fields.get(name)) is not None or not d.gap)
            }
            if len(values) > 1:
                varies.setdefault(model, set()).add(name)
    labels = []
    for c in configs:
        parts = [str(c.fields.get("layout") or "?")]
        for name, fmt in LABEL_FIELDS:
            if name in varies.get(str(c.fields.get("model")), set()):
                v = c.fields.get(name)
                parts.append("-" if v is None else fmt.format(v))
        if c.runs:  # n=1 too: a single run's bar has no spread, and must not look exact
            parts.append(f"n={len(c.runs)}")
        labels.append("\n".join(parts))
    return labels


def bars_caption(configs: list[Config], by_microbatch: bool = False) -> str:
    """The configuration figure's x-axis caption: what a bar is, and how many runs the bars hold
    (each label's ``n=``; hatched: one run, no whisker)."""
    counts = sorted({len(c.runs) for c in configs if c.runs})
    ones = sum(1 for c in configs if len(c.runs) == 1)
    if not counts:
        held = "no runs"
    elif len(counts) == 1:
        held = f"{counts[0]} run" + ("s" if counts[0] > 1 else "")
    else:
        held = f"{counts[0]}-{counts[-1]} runs"
    order = " (ordered by micro batch size)" if by_microbatch else ""
    single = f"; hatched: a single run ({ones} of {len(configs)}), its spread unknown" if ones else ""
    return (
        f"configuration{order}; bars: median of the n runs under each label ({held} a bar), "
        f"whiskers: min-max{single}"
    )


def _by_microbatch(rows: list[dict[str, Any]], normalise: bool) -> bool:
    return normalise and len({r.get("micro_batch_size") for r in rows}) > 1


def configs_caption(runs: pa.Table, normalise: bool = False) -> str:
    """:func:`bars_caption` of the configuration figure drawn from ``runs`` (the report's)."""
    rows = runs.to_pylist()
    by_mb = _by_microbatch(rows, normalise)
    return bars_caption(configurations(rows, by_mb), by_mb)


def configs_figure(runs: pa.Table, stem: Path, normalise: bool = False) -> list[Path]:
    """One group of bars per configuration (grouped by model, separators between models), one
    panel per quantity of :data:`PANELS`; repeats of a configuration as the median bar with a
    min-max whisker; configurations without figures (out of memory, failed) as hatched gaps in
    their place. ``normalise``: every series divided by its model's largest median (Figures 8,
    13), configurations ordered by micro batch size when a model's runs differ in it."""
    rows = runs.to_pylist()
    if not rows:
        return []
    by_mb = _by_microbatch(rows, normalise)
    configs = configurations(rows, by_mb)
    n = len(configs)
    x = np.arange(n)
    models = [str(c.fields.get("model")) for c in configs]
    fig, axes = plt.subplots(
        len(PANELS), 1, figsize=(max(6.0, 0.9 * n + 3), 2.0 * len(PANELS) + 1.2), sharex=True
    )
    single = np.array([len(c.runs) == 1 for c in configs])
    for ax, (label, series) in zip(axes, PANELS, strict=True):
        width = 0.8 / len(series)
        for j, (col, name) in enumerate(series):
            med = np.array([np.median(v) if (v := c.values(col)) else np.nan for c in configs])
            lo = np.array([min(v) if (v := c.values(col)) else np.nan for c in configs])
            hi = np.array([max(v) if (v := c.values(col)) else np.nan for c in configs])
            if normalise:
                for m in set(models):
                    sel = np.array([mm == m for mm in models])
                    top = np.nanmax(med[sel]) if np.isfinite(med[sel]).any() else np.nan
                    scale = top if top and np.isfinite(top) else np.nan
                    med[sel], lo[sel], hi[sel] = med[sel] / scale, lo[sel] / scale, hi[sel] / scale
            pos = x + (j - (len(series) - 1) / 2) * width
            colour = SERIES_COLOURS.get(name, "tab:green" if col == EFFICIENCY else "tab:purple")
            # A single run has no spread: hatched and without a whisker (a zero-length one looks
            # like repeats that agree; repeats on a loaded CPU varied up to 5 x).
            bars = ax.bar(pos, med, width * 0.95, color=colour, label=name)
            for bar, one in zip(bars, single, strict=True):
                if one:
                    bar.set_hatch("///")
                    bar.set_edgecolor("white")
            many = ~single & np.isfinite(med)
            err = np.vstack((med - lo, hi - med))[:, many]
            if many.any():
                ax.errorbar(pos[many], med[many], yerr=np.where(np.isfinite(err), err, 0), fmt="none",
                            ecolor="black", capsize=3, elinewidth=1)  # fmt: skip
        ax.set_ylabel(label + (" (norm.)" if normalise else ""), fontsize=8)
        ax.grid(True, axis="y", linestyle="--", alpha=0.5)
        if len(series) > 1:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), borderaxespad=0.2)
        for i, c in enumerate(configs):
            if c.gap:
                ax.axvspan(i - 0.45, i + 0.45, color="lightgrey", alpha=0.6, hatch="//")
                ax.text(i, 0.5, c.gap, transform=ax.get_xaxis_transform(), ha="center", va="center",
                        rotation=90, fontsize=8)  # fmt: skip
        for i in range(1, n):
            if models[i] != models[i - 1]:
                ax.axvline(i - 0.5, color="black", linewidth=1)
    for m in dict.fromkeys(models):
        idx = [i for i, mm in enumerate(models) if mm == m]
        axes[0].text(np.mean(idx), 1.04, m, transform=axes[0].get_xaxis_transform(), ha="center", va="bottom")
    axes[-1].set_xticks(x)
    axes[-1].set_xticklabels(config_labels(configs), fontsize=7)
    axes[-1].set_xlim(-0.5, n - 0.5)
    axes[-1].set_xlabel(bars_caption(configs, by_mb), fontsize=8)
    fig.tight_layout()
    return save(fig, stem)


HEAT_METRICS: tuple[tuple[str, str, tuple[str, ...], bool, float], ...] = (
    ("GPU power avg", "W", ("power_avg_w",), False, 50.0),
    ("GPU temp avg", "°C", ("temp_gpu_avg_c",), False, 10.0),
    ("GPU temp peak", "°C", ("temp_gpu_peak_c",), False, 10.0),
    ("PCIe traffic (tx+rx)", "B/s", ("pcie_tx_bytes", "pcie_rx_bytes"), True, 0.0),
    ("NVLink traffic (tx+rx)", "B/s", ("nvlink_tx_bytes", "nvlink_rx_bytes"), True, 0.0),
)
"""Heatmap panels: name, unit, the ``ranks`` columns summed, a log scale (traffic, as a rate:
bytes over the device's sampled time), and the smallest colour span (a 0.2 °C spread drawn on
a 10 °C span reads as the near-equal it is, not as black against yellow)."""


def colour_range(values: np.ndarray[Any, Any], min_span: float) -> tuple[float, float]:
    """The colour scale's (low, high): the data's range, widened about its middle to at least
    ``min_span``."""
    lo, hi = float(np.nanmin(values)), float(np.nanmax(values))
    if hi - lo < min_span:
        mid = (lo + hi) / 2
        lo, hi = mid - min_span / 2, mid + min_span / 2
    return lo, hi


def heatmaps_figure(
    ranks: pa.Table, runs: pa.Table, windows_hosts: dict[tuple[str, int], str], stem: Path
) -> list[Path]:
    """Configurations (rows) x GPUs (columns) heatmaps, one panel per measured quantity of
    :data:`HEAT_METRICS` (power, temperatures, traffic rates), each on its own colour scale whose
    range is stated in the panel's title; white lines separate nodes (from the ranks' hosts, in
    rank order)."""
    rows = ranks.to_pylist()
    if not rows:
        return []
    measured = {r["run"] for r in rows}
    run_keys = [c.runs[0]["run"] for c in configurations(runs.to_pylist(), False) if c.runs]
    run_keys += [r["run"] for r in runs.to_pylist() if r["run"] in measured and r["run"] not in run_keys]
    run_keys = [k for k in run_keys if k in measured]
    n_gpu = max(int(r["rank"]) for r in rows) + 1
    panels = []
    for label, unit, cols, log, span in HEAT_METRICS:
        grid = np.full((len(run_keys), n_gpu), np.nan)
        for r in rows:
            if r["run"] not in run_keys:
                continue
            vals = [v for v in (r.get(c) for c in cols) if v is not None and v == v]  # v != v: NaN
            if not vals:  # a direction the device does not count is left out, not taken as 0
                continue
            value = float(sum(vals))
            if unit == "B/s":
                dur = r.get("duration_s")
                value = value / dur if dur else np.nan
            grid[run_keys.index(r["run"]), int(r["rank"])] = value
        if np.isfinite(grid).any():
            panels.append((label, unit, grid, log, span))
    if not panels:
        return []
    width = max(6.0, 0.35 * n_gpu + 4)
    height = 1.2 + len(panels) * (0.5 * len(run_keys) + 1.0)
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, height), squeeze=False, layout="constrained")
    for ax, (label, unit, grid, log, span) in zip(axes[:, 0], panels, strict=True):
        finite = grid[np.isfinite(grid)]
        pos = finite[finite > 0]
        if log:
            hi = max(float(pos.max()), 10.0) if pos.size else 10.0
            lo = max(min(float(pos.min()), hi / 10), 1.0) if pos.size else 1.0  # a decade at least
            norm: Any = LogNorm(vmin=lo, vmax=hi)
        else:
            lo, hi = colour_range(finite, span)
            norm = Normalize(vmin=lo, vmax=hi)
        cmap = "viridis" if log else "inferno"
        im = ax.imshow(
            np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, norm=norm, interpolation="nearest"
        )
        cbar = fig.colorbar(im, ax=ax, pad=0.01, fraction=0.04)
        cbar.set_label(unit, fontsize=8)
        cbar.ax.tick_params(labelsize=7)
        if log:  # 5 plain labels: the log formatter writes mathtext, drawn raw with mathtext off
            cbar.set_ticks(np.geomspace(lo, hi, 5).tolist())
            cbar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.2g}"))
            cbar.ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.set_yticks(range(len(run_keys)))
        ax.set_yticklabels(run_keys, fontsize=7)
        ax.set_xlabel("GPU (rank)", fontsize=8)
        ax.set_xticks(range(n_gpu))
        for i, run in enumerate(run_keys):
            for g in range(1, n_gpu):
                a, b = windows_hosts.get((run, g - 1)), windows_hosts.get((run, g))
                if a is not None and b is not None and a != b:
                    ax.plot([g - 0.5, g - 0.5], [i - 0.5, i + 0.5], color="white", linewidth=2)
        data = f"data {np.nanmin(finite):.4g}-{np.nanmax(finite):.4g} {unit}"
        scale = f"scale {lo:.4g}-{hi:.4g}{' (log)' if log else ''}"
        ax.set_title(f"{label} ({unit}): {data}; {scale}", fontsize=9)
    return save(fig, stem)
