"""``charllm calibrate-energy PATH``: fit the dry run's energy model (metrics/energy_model.py) on
the measured runs of a sweep (or any folder of runs), one model per platform, and write the
table the dry run reads.

A run gives a :class:`~charllm_nemo.metrics.energy_model.Point` when it has measured steps and
energy: the hardware FLOPs per rank per step are the trainer's own (``summary.json``'s median
hardware TFLOP/s per GPU x its median step time), the step period and energy per step come from
the measured span (``charllm analyze``'s ``runs`` table: energy over the measured steps / their
count, gaps between steps included), the average power per device is that energy over ranks x
period, the peak the run's largest instant reading.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from charllm_nemo.errors import ConfigError
from charllm_nemo.metrics.energy_model import TABLE_FILE, Calibration, Point, dump_table, fit, load_table
from charllm_nemo.telemetry.filecheck import printable


def _pos(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if v == v and 0 < v < float("inf") else None


def points(analysis: Any) -> tuple[dict[str, list[Point]], dict[str, float], list[str]]:
    """Per platform (the device name), the runs' points; each platform's power limit (W, the
    largest seen; absent when none reported one); a line for each run left out and why."""
    rows = {r["run"]: r for r in analysis.tables["runs"].to_pylist()}
    limits: dict[str, float] = {}
    for r in analysis.tables["ranks"].to_pylist():
        info = rows.get(r.get("run"))
        lim = _pos(r.get("power_limit_w"))
        if info and info.get("device") and lim:
            limits[info["device"]] = max(lim, limits.get(info["device"], 0.0))
    out: dict[str, list[Point]] = defaultdict(list)
    skipped = []
    for run in analysis.runs:
        info = rows.get(run.key) or {}
        s = run.summary
        hw_tflops, step_median = (
            _pos(s.get("hardware_tflops_per_gpu_median")),
            _pos(s.get("step_time_s_median")),
        )
        steps, span, energy = (
            _pos(info.get("measured_steps")),
            _pos(info.get("execution_time_s")),
            _pos(info.get("energy_j")),
        )
        world, peak = info.get("world_size"), _pos(info.get("power_peak_w"))
        layout = s.get("layout") if isinstance(s.get("layout"), dict) else {}
        pp = layout.get("pp") or info.get("pp") or 1
        m = s.get("num_microbatches") or layout.get("num_microbatches") or 1
        device = info.get("device")
        if not (
            hw_tflops
            and step_median
            and steps
            and span
            and energy
            and peak
            and device
            and isinstance(world, int)
        ):
            skipped.append(f"{printable(run.key)}: no measured steps with FLOPs, energy and power; left out")
            continue
        period = span / steps
        out[device].append(
            Point(
                run=run.key,
                flops_per_rank=hw_tflops * 1e12 * step_median,
                world=world,
                pp=int(pp),
                microbatches=int(m),
                step_s=period,
                power_avg_w=energy / steps / (world * period),
                power_peak_w=peak,
                energy_step_j=energy / steps,
            )
        )
    return dict(out), limits, skipped


def calibrate(path: str | Path, fitted_from: str | None = None) -> tuple[dict[str, Calibration], list[str]]:
    """One model per platform found under ``path``; lines for what was left out."""
    from charllm_nemo.analysis.analyze import analyze

    analysis = analyze(path)
    per_platform, limits, notes = points(analysis)
    table = {}
    for platform, pts in sorted(per_platform.items()):
        try:
            table[platform] = fit(platform, pts, limits.get(platform), fitted_from or str(path))
        except ConfigError as exc:
            notes.append(str(exc))
    return table, notes + analysis.problems


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Print the fitted models; with ``--write FILE`` merge them into that table (the package's
    own, src/charllm_nemo/metrics/energy_calibration.json, only with ``--update-package-table``)."""
    from charllm_nemo.telemetry.layout import UnsafeFileError, read_bounded
    from charllm_nemo.telemetry.write import write_bytes

    table, notes = calibrate(args.path, args.label)
    for line in notes:
        print(f"  note: {printable(line)}")
    if not table:
        print("charllm calibrate-energy: no platform could be fitted", file=sys.stderr)
        return 2
    for cal in table.values():
        err = (
            f"held-out error median {cal.held_out_error_median:.1%}, max {cal.held_out_error_max:.1%}"
            if cal.held_out_error_median is not None and cal.held_out_error_max is not None
            else "no held-out error (fewer than 3 runs)"
        )
        print(
            f"{printable(cal.platform)}: {cal.runs} runs; {cal.s_per_flop * 1e12:.4g} s per TFLOP per rank "
            f"+ {cal.step_overhead_s:.4g} s a step; "
            f"power {cal.idle_w:.4g} W idle to {cal.busy_w:.4g} W busy, "
            f"peak x{cal.peak_ratio:.3g}; {err}"
        )
    if args.write:
        out = Path(args.write)
        if _is_package_table(out) and not args.update_package_table:
            # the installed package's own file (tracked in git in a checkout): never changed by accident
            print(
                f"charllm calibrate-energy: --write {printable(out)} is the package's own table, which "
                "every dry run reads; write a file of your own (--write my-calibration.json), or add "
                "--update-package-table to refit the package's table on purpose",
                file=sys.stderr,
            )
            return 2
        try:
            merged = load_table(read_bounded(out, 16 * 2**20).decode()) if out.exists() else {}
        except (ValueError, UnsafeFileError) as exc:
            print(
                f"charllm calibrate-energy: {printable(out)} is not a table ({printable(exc)})",
                file=sys.stderr,
            )
            return 2
        merged.update(table)
        write_bytes(out, dump_table(merged).encode())
        print(f"wrote {out} ({len(merged)} platform(s))")
    return 0


def package_table_path() -> Path:
    """The package's own calibration table, metrics/energy_calibration.json (what dry runs read)."""
    from importlib import resources

    return Path(str(resources.files("charllm_nemo.metrics").joinpath(TABLE_FILE)))


def _is_package_table(path: Path) -> bool:
    try:
        return path.resolve() == package_table_path().resolve()
    except OSError:
        return False


def add_command(sub: Any) -> None:
    c = sub.add_parser("calibrate-energy", help="fit the dry run's energy model on measured runs (a sweep)")
    c.add_argument("path", help="a sweep directory or any folder of runs")
    c.add_argument(
        "--write",
        metavar="FILE",
        help="merge the fit into this table (a file of your own; the package's own table, "
        f"metrics/{TABLE_FILE}, only with --update-package-table)",
    )
    c.add_argument(
        "--update-package-table",
        action="store_true",
        help=f"allow --write to change the package's own metrics/{TABLE_FILE}, which dry runs read",
    )
    c.add_argument("--label", help="what the fit was made from, kept in the table (default: PATH)")
    c.set_defaults(func=cmd_calibrate)
