"""``charllm analyze`` and ``charllm report``: argument parsing and printing only (the work is in
:mod:`.analyze`, :mod:`.figures_sweep`, :mod:`.figures_run` and :mod:`.report`). DuckDB and
matplotlib are imported when a command runs, so ``charllm`` works without the analysis extra."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

_EXTRA_HINT = "the analysis needs the 'analysis' extra: pip install -e '.[analysis]' (duckdb, matplotlib)"


def _imports_ok() -> bool:
    try:
        import duckdb  # noqa: F401
        import matplotlib  # noqa: F401
    except ImportError as exc:
        print(f"charllm: {exc.name} is not installed; {_EXTRA_HINT}", file=sys.stderr)
        return False
    return True


def _out_dir(args: argparse.Namespace) -> Path:
    return Path(args.out) if args.out else Path(args.path) / "analysis"


def cmd_analyze(args: argparse.Namespace) -> int:
    """Write every table (and, unless --no-figures, every figure) for the runs under PATH."""
    if not _imports_ok():
        return 2
    from charllm_nemo.analysis.analyze import analyze, to_jsonable, write_tables

    out = _out_dir(args)
    analysis = analyze(args.path, out / "windows.parquet")
    written = write_tables(analysis, out, True if args.windows_csv else None)
    if not args.no_figures:
        from charllm_nemo.analysis.figures import write_figures

        written += write_figures(analysis, out / "figures")
    if args.format == "json":
        json.dump(to_jsonable(analysis), sys.stdout, indent=1, default=str)
        print()
        return 0
    _print_summary(analysis.tables, analysis.problems)
    print(f"wrote {len(written)} files to {out}")
    return 0


MAX_PRINTED_PROBLEMS = 50
"""Problems printed to the terminal (20,000 empty rank folders make 20,000; the file has all)."""


def _print_summary(tables: dict[str, Any], problems: list[str]) -> None:
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
    for p in problems[:MAX_PRINTED_PROBLEMS]:
        print(f"  problem: {printable(p, 2000)}")
    if len(problems) > MAX_PRINTED_PROBLEMS:
        print(f"  ... and {len(problems) - MAX_PRINTED_PROBLEMS} more problems (all in problems.txt)")


def _fmt(v: Any) -> str:
    return "n/a" if v is None or (isinstance(v, float) and v != v) else f"{v:.4g}"


def cmd_report(args: argparse.Namespace) -> int:
    """Analyse PATH and write one self-contained HTML page."""
    if not _imports_ok():
        return 2
    from charllm_nemo.analysis.analyze import analyze, write_tables
    from charllm_nemo.analysis.figures import write_figures
    from charllm_nemo.analysis.report import write_report

    out = _out_dir(args)
    analysis = analyze(args.path, out / "windows.parquet")
    write_tables(analysis, out)
    figures = write_figures(analysis, out / "figures")
    html = Path(args.html) if args.html else out / "report.html"
    write_report(analysis, [f for f in figures if f.suffix == ".png"], html)
    print(f"report: {html}")
    return 0


def add_commands(sub: Any) -> None:
    """Add ``analyze`` and ``report`` to the ``charllm`` sub-command parser."""
    a = sub.add_parser("analyze", help="tables (Parquet, CSV) and figures for a run or a sweep directory")
    a.add_argument("path", help="a run directory or a tree of them (a sweep)")
    a.add_argument("--out", help="where to write (default: PATH/analysis)")
    a.add_argument("--format", choices=["text", "json"], default="text", help="json: print the tables")
    a.add_argument("--no-figures", action="store_true", help="tables only")
    a.add_argument(
        "--windows-csv",
        action="store_true",
        help="write windows.csv however many windows (default: up to 200,000)",
    )
    a.set_defaults(func=cmd_analyze)
    r = sub.add_parser("report", help="one self-contained HTML page for a run or a sweep directory")
    r.add_argument("path", help="a run directory or a tree of them (a sweep)")
    r.add_argument("--out", help="where tables and figures go (default: PATH/analysis)")
    r.add_argument("--html", help="the page to write (default: OUT/report.html)")
    r.set_defaults(func=cmd_report)
