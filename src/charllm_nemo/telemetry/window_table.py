"""``charllm inspect``'s window table: one line per window with its figures, and the line that
names the windows with a sampling gap. Plain formatting over the attributed window table
(charllm_nemo.telemetry.join.attribute_run); every string from the run is escaped."""

from __future__ import annotations

from typing import Any


def sampling_gap_line(table: Any) -> str | None:
    """One line naming the windows with a sampling gap (``coverage`` < 1: no sample for more than
    2 sample periods, docs/attribution.md) and the longest gap; None when there is none."""
    if "coverage" not in table.column_names:
        return None
    cov = table.column("coverage").to_pylist()
    gap = table.column("gap_max_s").to_pylist()
    hit = [i for i, c in enumerate(cov) if c is not None and c == c and c < 1.0]
    if not hit:
        return None
    kinds = table.column("kind").to_pylist()
    steps = sorted(
        {s for i in hit if kinds[i] == "step" and (s := table.column("step")[i].as_py()) is not None}
    )
    ranks = sorted({r for i in hit if (r := table.column("rank")[i].as_py()) is not None})
    worst = max((gap[i] for i in hit if gap[i] is not None and gap[i] == gap[i]), default=0.0)
    shown = ", ".join(map(str, steps[:12])) + (" ..." if len(steps) > 12 else "")
    return (
        f"SAMPLING GAP: {len(hit)} window(s) with coverage below 100 % (marked '!'), longest "
        f"{worst * 1e3:.0f} ms without a sample; steps {shown or '-'} on rank(s) "
        f"{', '.join(map(str, ranks[:12]))}: their figures are drawn across the gap"
    )


NAME_WIDTH = 24
"""Widest phase name the inspect table shows whole (longer ones are cut, ending in ``~``)."""


def window_table_lines(table: Any) -> list[str]:
    """The inspect table of per-window figures (a header line, then one line per row).

    Each column is as wide as its widest cell, so a long phase name shifts no column; names are
    cut at :data:`NAME_WIDTH` characters. ``mb`` is the microbatch index of microbatch and
    phase rows (``-`` for a step, or a phase outside any microbatch such as the optimizer);
    ``dev`` (the device index) appears when the rows hold more than one device."""
    from charllm_nemo.telemetry.filecheck import printable

    cols = [
        ("rank", "rank", "{}"),
        ("kind", "kind", "{}"),
        ("name", "name", "{}"),
        ("step", "step", "{}"),
        ("microbatch", "mb", "{}"),
        ("device_index", "dev", "{}"),
        ("duration_s", "dur ms", "{:.1f}"),
        ("energy_j", "energy J", "{:.2f}"),
        ("energy_bound_j", "+- J", "{:.2f}"),
        ("energy_method", "method", "{}"),
        ("power_avg_w", "avg W", "{:.1f}"),
        ("power_peak_w", "peak W", "{:.1f}"),
        ("power_peak_buffered_w", "buf peak W", "{:.1f}"),
        ("temp_gpu_peak_c", "T max C", "{:.1f}"),
        ("clock_sm_avg_mhz", "SM MHz", "{:.0f}"),
        ("throttle_any_limiting_s", "thr ms", "{:.1f}"),
        ("n_samples", "n", "{}"),
        ("coverage", "cov %", "{:.0f}"),
        ("gap_max_s", "gap ms", "{:.0f}"),
    ]
    present = [c for c in cols if c[0] in table.column_names]
    if "device_index" in table.column_names and len(set(table.column("device_index").to_pylist())) <= 1:
        present = [c for c in present if c[0] != "device_index"]
    data = {c[0]: table.column(c[0]).to_pylist() for c in present}
    scale = {"duration_s": 1e3, "throttle_any_limiting_s": 1e3, "coverage": 100.0, "gap_max_s": 1e3}
    text_cols = {"kind", "name", "energy_method"}
    cells: dict[str, list[str]] = {}
    for name, _, fmt in present:
        column = []
        for v in data[name]:
            if v is None or (isinstance(v, float) and v != v):
                column.append("-")
                continue
            if name in scale:
                v = v * scale[name]
            text = printable(fmt.format(v), 1000)
            if name == "coverage" and v < 100.0:
                # a sampling gap (docs/attribution.md, Coverage); never rounds up to a clean 100
                text = f"{min(v, 99.0):.0f}!"
            if name == "name" and len(text) > NAME_WIDTH:
                text = text[: NAME_WIDTH - 1] + "~"
            column.append(text)
        cells[name] = column
    widths = {name: max(len(head), *(len(c) for c in cells[name])) for name, head, _ in present}

    def line(values: dict[str, str]) -> str:
        return "  ".join(
            values[n].ljust(widths[n]) if n in text_cols else values[n].rjust(widths[n])
            for n, _, _ in present
        ).rstrip()

    out = [line({n: head for n, head, _ in present})]
    out += [line({n: cells[n][i] for n, _, _ in present}) for i in range(table.num_rows)]
    return out
