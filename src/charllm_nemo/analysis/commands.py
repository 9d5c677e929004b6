"""``charllm analyze`` and ``charllm report``: argument parsing and printing only (the work is in
:mod:`.analyze`, :mod:`.figures_sweep`, :mod:`.figures_run` and :mod:`.report`). DuckDB and
matplotlib are imported when a command runs, so ``charllm`` works without the analysis extra."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from charllm_nemo.progress import Progress

if TYPE_CHECKING:
    from charllm_nemo.analysis.energy import GridIntensity
    from charllm_nemo.analysis.grid_power import GridOptions

_EXTRA_HINT = "the analysis needs the 'analysis' extra: pip install -e '.[analysis]' (duckdb, matplotlib)"


def _imports_ok(figures: bool = True) -> bool:
    """The analysis extra is installed (matplotlib only where figures are drawn). Looked up, not
    imported: ``--no-figures`` never imports matplotlib (issue #45)."""
    from importlib.util import find_spec

    for name in ("duckdb", "matplotlib") if figures else ("duckdb",):
        if find_spec(name) is None:
            print(f"charllm: {name} is not installed; {_EXTRA_HINT}", file=sys.stderr)
            return False
    return True


def _out_dir(args: argparse.Namespace) -> Path:
    from charllm_nemo.telemetry.write import anchor

    # Every folder written below the run (PATH/analysis/figures) or below --out is checked from
    # there: a link planted at PATH/analysis is refused, whichever file is written first.
    anchor(args.out if args.out else args.path)
    return Path(args.out) if args.out else Path(args.path) / "analysis"


def cmd_analyze(args: argparse.Namespace) -> int:
    """Write every table (and, unless --no-figures, every figure) for the runs under PATH."""
    if not _imports_ok(figures=not args.no_figures):
        return 2
    from charllm_nemo.analysis.analyze import analyze, to_jsonable, write_tables
    from charllm_nemo.errors import ConfigError

    try:
        wave = _power_wave(args)
    except ConfigError as exc:
        print(f"charllm analyze: {exc}", file=sys.stderr)
        return 2
    out = _out_dir(args)
    with Progress("charllm analyze") as progress:
        if args.engine == "spark":
            spark = _analyze_on_spark(args, out, progress, wave)
            if isinstance(spark, int):
                return spark
            analysis = spark
        else:
            analysis = analyze(args.path, out / "windows.parquet", progress, wave)
        progress.stage("writing the tables")
        written = write_tables(analysis, out, True if args.windows_csv else None)
        if not args.no_figures:
            from charllm_nemo.analysis.figures import write_figures

            progress.stage("drawing the figures")
            written += write_figures(analysis, out / "figures")
    if args.format == "json":
        json.dump(to_jsonable(analysis), sys.stdout, indent=1, default=str)
        print()
        return 0
    _print_summary(analysis.tables, analysis.problems)
    print(f"wrote {len(written)} files to {out}" + (" (engine: spark)" if args.engine == "spark" else ""))
    return 0


MAX_PRINTED_PROBLEMS = 50
"""Problems printed to the terminal (20,000 empty rank folders make 20,000; the file has all)."""


def _analyze_on_spark(args: argparse.Namespace, out: Path, progress: Progress, wave: Any) -> Any:
    """``--engine spark``: the per-rank reduction on Spark, every table from its rows
    (analysis/spark.py); the window table written to ``out/windows.parquet``. Returns
    the Analysis, or an exit status when Spark cannot start."""
    from charllm_nemo.analysis.spark import spark_analysis, spark_session
    from charllm_nemo.telemetry.filecheck import printable

    progress.stage(
        f"starting Spark (master {printable(args.spark_master or 'spark-submit / $SPARK_MASTER / local[*]')})"
    )
    try:
        session = spark_session(args.spark_master)
    except ImportError as exc:
        print(f"charllm analyze: {exc}", file=sys.stderr)
        return 2
    return spark_analysis(session, args.path, wave, out / "windows.parquet", progress)


def _print_summary(tables: dict[str, Any], problems: list[str]) -> None:
    from charllm_nemo.analysis.grid_power import scope_name
    from charllm_nemo.telemetry.filecheck import printable

    runs = tables["runs"].to_pylist()
    print(f"{len(runs)} run(s)")
    for r in runs:  # names and problems come from run directories: printed escaped
        r = {k: printable(v) if isinstance(v, str) else v for k, v in r.items()}
        eff = r.get("efficiency_samples_per_s_per_mj")
        tpj = r.get("tokens_per_j")
        print(
            f"  {r['run']}: {r.get('model')} {r.get('layout')} on {r.get('platform')} [{r.get('status')}]: "
            f"{_fmt(r.get('samples_per_s'))} samples/s, {_fmt(r.get('energy_j'))} J over "
            f"{r.get('measured_steps')} steps, {_fmt(eff)} samples/(s*MJ), {_fmt(tpj)} tokens/J"
        )
    wave = tables.get("grid_power")
    for r in wave.to_pylist() if wave is not None else []:
        if r["scope"] == "job":
            print(
                f"  {printable(r['run'])}: job power ({scope_name(r['power_scope'])}): swing "
                f"{_fmt(r['swing_p50_w'])} W "
                f"({_fmt(r['swing_pct_of_peak'])} % of peak) per iteration, ramps up to "
                f"{_fmt(r['ramp_up_max_w_per_s'])} W/s, dominant {_fmt(r['dominant_hz'])} Hz "
                f"(iterations {_fmt(r['iteration_hz'])} Hz)"
            )
    gaps = data_quality_line(tables)
    if gaps:
        print(f"  {gaps}")
    for p in problems[:MAX_PRINTED_PROBLEMS]:
        print(f"  problem: {printable(p, 2000)}")
    if len(problems) > MAX_PRINTED_PROBLEMS:
        print(f"  ... and {len(problems) - MAX_PRINTED_PROBLEMS} more problems (all in problems.txt)")


def data_quality_line(tables: dict[str, Any]) -> str | None:
    """The findings' data-quality line: measured steps with a sampling gap (docs/analysis.md,
    sampling tables), or None when every step was sampled throughout."""
    if "sampling_steps" not in tables or tables["sampling_steps"].num_rows == 0:
        return None
    steps = tables["sampling_steps"].to_pylist()
    ranks = [r for r in tables["sampling_ranks"].to_pylist() if r.get("flagged")]
    worst = max(s["gap_max_s"] for s in steps)
    return (
        f"data quality: {len(steps)} measured step(s) with a sampling gap (no sample for more than 2 "
        f"sample periods, longest {worst:.3g} s) on {len(ranks)} rank(s); their figures are drawn "
        "across the gap: see sampling_steps and sampling_ranks"
    )


def _fmt(v: Any) -> str:
    return "n/a" if v is None or (isinstance(v, float) and v != v) else f"{v:.4g}"


def cmd_report(args: argparse.Namespace) -> int:
    """Analyse PATH and write one self-contained HTML page."""
    if not _imports_ok():
        return 2
    from charllm_nemo.analysis.analyze import analyze, write_tables
    from charllm_nemo.analysis.figures import write_figures
    from charllm_nemo.analysis.report import write_report
    from charllm_nemo.analysis.report_sections import ReportOptions
    from charllm_nemo.errors import ConfigError

    try:
        options = ReportOptions(compare=args.compare or [], grid=_grid(args), pue=args.pue)
        wave = _power_wave(args)
    except ConfigError as exc:
        print(f"charllm report: {exc}", file=sys.stderr)
        return 2
    if len(options.compare) == 1:
        print("charllm report: --compare needs at least two runs: BASELINE OTHER [...]", file=sys.stderr)
        return 2
    out = _out_dir(args)
    html = Path(args.html) if args.html else out / "report.html"
    with Progress("charllm report") as progress:
        analysis = analyze(args.path, out / "windows.parquet", progress, wave)
        progress.stage("writing the tables")
        write_tables(analysis, out)
        progress.stage("drawing the figures")
        figures = write_figures(analysis, out / "figures")
        progress.stage("writing the page")
        write_report(analysis, [f for f in figures if f.suffix == ".png"], html, str(args.path), options)
    print(f"report: {html}")
    return 0


def _grid(args: argparse.Namespace) -> GridIntensity | None:
    """The grid intensity of ``--grid-csv`` / ``--grid-g-per-kwh`` (None without either)."""
    from charllm_nemo.analysis.energy import GridIntensity, read_grid_csv

    if args.grid_csv:
        return read_grid_csv(Path(args.grid_csv))
    if args.grid_g_per_kwh is not None:
        return GridIntensity(((0.0, args.grid_g_per_kwh),))
    return None


def cmd_compare(args: argparse.Namespace) -> int:
    """``charllm compare`` (numpy and pyarrow are imported only when it runs)."""
    from charllm_nemo.analysis.compare import cmd_compare as run

    return run(args)


def cmd_energy(args: argparse.Namespace) -> int:
    """``charllm energy``: each run's energy report (uncertainty, optional carbon, MLPerf rules)."""
    if not _imports_ok():
        return 2
    from charllm_nemo.analysis.analyze import analyze
    from charllm_nemo.analysis.energy import EnergyDataError, energy_reports, render
    from charllm_nemo.errors import ConfigError

    try:
        reports = energy_reports(analyze(args.path), grid=_grid(args), pue=args.pue)
    except ConfigError as exc:
        print(f"charllm energy: {exc}", file=sys.stderr)
        return 2
    except EnergyDataError as exc:
        # Corrupt data: no figure, no MLPerf statement; the column is named (docs/compare-energy.md).
        print(f"charllm energy: bad data: {exc}", file=sys.stderr)
        return 1
    if args.format == "json":
        json.dump(reports, sys.stdout, indent=1, default=str)
        print()
    else:
        print(render(reports))
    return 0


def finite_number(least: float) -> Any:
    """An argparse ``type``: a finite number >= ``least`` (a usage error naming the bound)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and value >= least):
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= {least:g}")
        return value

    parse.__name__ = "number"
    return parse


def _carbon_arguments(parser: argparse.ArgumentParser) -> None:
    """The energy report's carbon inputs (``charllm energy`` and ``charllm report``)."""
    grid = parser.add_mutually_exclusive_group()
    grid.add_argument(
        "--grid-g-per-kwh",
        type=finite_number(0.0),
        help="grid carbon intensity, g CO2e per kWh",
    )
    grid.add_argument("--grid-csv", help="grid carbon intensity over time: a CSV of time,g_per_kwh")
    parser.add_argument(
        "--pue", type=finite_number(1.0), default=1.0, help="power usage effectiveness (>= 1)"
    )


def _power_wave_arguments(parser: argparse.ArgumentParser) -> None:
    """How the job power waveform is read (``analyze`` and ``report``; docs/grid.md)."""
    parser.add_argument(
        "--fleet-gpus",
        type=int,
        help="scale the job's swing and ramp rates to a fleet of N GPUs moving as it does",
    )
    parser.add_argument("--rack-map", help="a file of 'host rack' lines: the waveform is summed per rack too")
    parser.add_argument(
        "--critical-band",
        nargs=2,
        type=finite_number(0.0),
        metavar=("LO_HZ", "HI_HZ"),
        default=[0.1, 20.0],
        help="the band whose share of the swing's energy is reported (default 0.1 20)",
    )
    parser.add_argument(
        "--power-floor",
        nargs="+",
        type=finite_number(0.0),
        metavar="W",
        help="what-if floors, W per GPU (default: six from the job's mean GPU trough to its peak)",
    )
    parser.add_argument(
        "--wave-step-ms",
        type=finite_number(0.5),
        default=10.0,
        help="the waveform's grid step (default 10 ms)",
    )


def _power_wave(args: argparse.Namespace) -> GridOptions:
    """The :class:`GridOptions` of the command line (ConfigError on a bad value or rack map)."""
    from charllm_nemo.analysis.grid_power import GridOptions, read_group_map

    return GridOptions(
        step_s=args.wave_step_ms / 1000,
        fleet_gpus=args.fleet_gpus,
        band_hz=(args.critical_band[0], args.critical_band[1]),
        floors_w=tuple(args.power_floor or ()),
        groups=read_group_map(Path(args.rack_map)) if args.rack_map else {},
    )


def add_commands(sub: Any) -> None:
    """Add ``analyze``, ``report``, ``compare`` and ``energy`` to the ``charllm`` sub-command parser."""

    a = sub.add_parser("analyze", help="tables (Parquet, CSV) and figures for a run or a sweep directory")
    a.add_argument("path", help="a run directory or a tree of them (a sweep)")
    a.add_argument("--out", help="where to write (default: PATH/analysis)")
    a.add_argument("--format", choices=["text", "json"], default="text", help="json: print the tables")
    a.add_argument("--no-figures", action="store_true", help="tables only")
    a.add_argument(
        "--engine",
        choices=["local", "spark"],
        default="local",
        help="spark: the same tables with each rank reduced on Apache Spark (docs/analysis.md, 'Engines')",
    )
    a.add_argument("--spark-master", help="with --engine spark: local[2], spark://host:7077, yarn, ...")
    a.add_argument(
        "--windows-csv",
        action="store_true",
        help="write windows.csv however many windows (default: up to 200,000)",
    )
    _power_wave_arguments(a)
    a.set_defaults(func=cmd_analyze)
    r = sub.add_parser("report", help="one self-contained HTML page for a run or a sweep directory")
    r.add_argument("path", help="a run directory or a tree of them (a sweep)")
    r.add_argument("--out", help="where tables and figures go (default: PATH/analysis)")
    r.add_argument("--html", help="the page to write (default: OUT/report.html)")
    r.add_argument(
        "--compare",
        nargs="+",
        metavar="PATH",
        help="runs or sweep configurations to compare in the report (the first is the baseline)",
    )
    _carbon_arguments(r)
    _power_wave_arguments(r)
    r.set_defaults(func=cmd_report)
    c = sub.add_parser(
        "compare",
        help="runs or sweep configurations against the first: differences with bootstrap intervals",
    )
    c.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="run directories or sweep configurations; the first is the baseline",
    )
    c.add_argument("--format", choices=["text", "json"], default="text", help="json: the comparison as JSON")
    c.set_defaults(func=cmd_compare)
    e = sub.add_parser(
        "energy", help="energy to train with its uncertainty, optional carbon, MLPerf power rules"
    )
    e.add_argument("path", help="a run directory or a tree of them (a sweep)")
    _carbon_arguments(e)
    e.add_argument("--format", choices=["text", "json"], default="text", help="json: the reports as JSON")
    e.set_defaults(func=cmd_energy)
