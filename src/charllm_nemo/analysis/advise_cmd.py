"""``charllm advise PATH``: analyse a run or a sweep (:func:`.analyze.analyze`), advise on it
(:mod:`.advise`), and print the advice with the ``charllm train`` command that applies it.

The re-run command is rebuilt from the run's own ``config.yaml``: the ``model``, ``parallel``
and ``optim`` presets it names, then every key whose value differs from what those presets
compose to (``charllm train`` records the resolved config, not its command line), then the
advice's overrides. The run directory, logger and dry-run keys are left out; the command is
checked by composing it again and comparing.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from charllm_nemo.analysis.advise import (
    MBS_TOLERANCE,
    MIN_GAIN,
    MIN_STEPS,
    Advice,
    AdviceReport,
    Measured,
    NoAdvice,
    measure_run,
)
from charllm_nemo.analysis.advise_layout import layout_for
from charllm_nemo.analysis.advise_mbs import mbs_advice
from charllm_nemo.analysis.advise_placement import placement_for
from charllm_nemo.telemetry.filecheck import printable

if TYPE_CHECKING:
    from charllm_nemo.analysis.analyze import Analysis

SECTIONS = ("model", "parallel", "optim", "batch", "data", "telemetry", "launch", "extra")
"""Config sections whose differing keys the re-run command carries."""

SKIPPED = {
    "telemetry.out_dir", "telemetry.overwrite", "launch.dry_run", "launch.master_port", "launch.launcher",
}  # fmt: skip
"""Keys the re-run leaves to their defaults: a new run directory, a free port, a real run, and
the local launcher: a sweep's ``launch.launcher=slurm`` outside an allocation exits 2, so the
printed command runs here as pasted (inside an allocation add ``launcher=slurm``)."""

REPEAT_KEYS = {"data.seed"}
"""Keys in which repeats of one configuration may differ (besides :data:`SKIPPED`)."""

PRESETS = ("model", "parallel", "optim")


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict) and d:
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def hydra_value(v: Any) -> str:
    """A value as a Hydra override writes it: null, true/false, [a,b], numbers, quoted strings
    where a bare one would be read as something else."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{hydra_value(x)}" for k, x in v.items()) + "}"
    s = str(v)
    plain = s and all(c.isalnum() or c in "_-./:" for c in s) and s.lower() not in ("null", "true", "false")
    if plain and not s.replace(".", "", 1).replace("-", "", 1).isdigit():
        return s
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _compose(overrides: list[str]) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from charllm_nemo.train.config_io import compose

    cfg = compose(overrides)
    for key in ("telemetry.out_dir",):  # resolvers that depend on the launch are not needed here
        OmegaConf.update(cfg, key, "x", force_add=True)
    data = OmegaConf.to_container(cfg, resolve=True)
    return {str(k): v for k, v in data.items()} if isinstance(data, dict) else {}


def rerun_overrides(config: dict[str, Any], advised: list[str]) -> tuple[list[str], str | None]:
    """The overrides that re-run ``config`` (a run's resolved config.yaml) with ``advised``
    applied, and a problem (None when the recomposed config matches the run's in
    :data:`SECTIONS`, :data:`SKIPPED` and the advised keys aside)."""
    groups = []
    for g in PRESETS:
        name = (config.get(g) or {}).get("name") if isinstance(config.get(g), dict) else None
        if isinstance(name, str):
            groups.append(f"{g}={name}")
    try:
        base = _flatten({k: v for k, v in _compose(groups).items() if k in SECTIONS})
    except ImportError:
        raise
    except Exception:  # a preset that no longer exists: diff against the defaults instead
        groups = []
        base = _flatten({k: v for k, v in _compose([]).items() if k in SECTIONS})
    want = _flatten({k: v for k, v in config.items() if k in SECTIONS})
    advised_keys = {a.split("=", 1)[0] for a in advised}
    diffs = []
    for key, value in want.items():
        if key in SKIPPED or key in advised_keys or (key in base and base[key] == value):
            continue
        if key == "launch.nproc":
            diffs.append(f"nproc={hydra_value(value)}")
        else:
            diffs.append(f"{'' if key in base else '+'}{key}={hydra_value(value)}")
    overrides = [*groups, *diffs, *advised]
    try:
        got = _flatten({k: v for k, v in _compose(overrides).items() if k in SECTIONS})
    except Exception as exc:  # reported, not raised: the advice stands without the command
        return overrides, f"the re-run command does not compose ({exc}); apply the overrides by hand"
    bad = sorted(k for k, v in want.items() if k not in SKIPPED | advised_keys and got.get(k) != v)
    if bad:
        return overrides, f"the re-run command differs from the run's config in {', '.join(bad[:5])}"
    return overrides, None


def advise(
    path: str | Path,
    min_gain: float = MIN_GAIN,
    min_steps: int = MIN_STEPS,
    tolerance: float = MBS_TOLERANCE,
    commands: bool = True,
    analysis: Analysis | None = None,
) -> AdviceReport:
    """Analyse ``path`` (a run or a sweep) and advise on every run in it. ``commands``: build
    the whole re-run command (composes the Hydra config: needs the ``megatron`` extra's hydra).
    ``analysis``: ``path``'s analysis when the caller has it already (the report)."""
    from charllm_nemo.analysis.analyze import analyze

    if analysis is None:
        analysis = analyze(path)
    rows = {name: t.to_pylist() for name, t in analysis.tables.items()}
    if analysis.windows is not None:
        per = analysis.windows.group_by(["run", "rank"]).aggregate([("host", "min")])
        rows["hosts"] = [{"run": r["run"], "rank": r["rank"], "host": r["host_min"]} for r in per.to_pylist()]
        rows["busy_steps"] = busy_steps(analysis.windows)
    report = AdviceReport(str(path), problems=list(analysis.problems))
    by_key = {r.key: r for r in analysis.runs}
    configurations: dict[str, list[Measured]] = {}
    for info in rows.get("runs", []):
        run = by_key.get(info["run"])
        if run is None:  # a sweep gap (out of memory, failed): no figures
            continue
        ms = measure_run(info, run.summary, run.config, rows, min_steps)
        if isinstance(ms, NoAdvice):
            report.no_advice += [ms, NoAdvice("rank_placement", ms.run, ms.reason)]
        else:  # repeats of one configuration are advised on together
            configurations.setdefault(configuration_key(run.config, ms), []).append(ms)
    for group in configurations.values():
        for advise_group in (layout_for, placement_for):
            got = advise_group(group, min_gain)
            (report.advice if isinstance(got, Advice) else report.no_advice).append(got)  # type: ignore[arg-type]
    for got in mbs_advice(rows, min_gain, tolerance):
        (report.advice if isinstance(got, Advice) else report.no_advice).append(got)  # type: ignore[arg-type]
    if commands:
        for a in report.advice:
            run = by_key.get(a.run)
            if run is None or not run.config:
                report.problems.append(f"{a.run}: no config.yaml; apply {' '.join(a.overrides)} by hand")
                continue
            try:
                env = a.kind == "rank_placement"  # an environment setting, not an override
                overrides, problem = rerun_overrides(run.config, [] if env else a.overrides)
            except ImportError as exc:  # hydra is the megatron extra's
                report.problems.append(
                    f"{a.run}: no re-run command ({exc.name} is not installed: pip install -e "
                    f"'.[megatron]'); apply {' '.join(a.overrides)} to the run's own command"
                )
                continue
            a.command = "charllm train " + " ".join(shlex.quote(o) for o in overrides)
            if env:
                a.command = f"{' '.join(a.overrides)} {a.command}"
            if problem:
                report.problems.append(f"{a.run}: {problem}")
    return report


def busy_steps(windows: Any) -> list[dict[str, Any]]:
    """Each rank's forward + backward time per measured step (s): ``run``, ``rank``, ``step``,
    ``busy_s`` rows from the analysis's window table (the step-to-step noise of a stage)."""
    import pyarrow.compute as pc

    keep = pc.and_(
        pc.and_(
            pc.equal(windows["kind"], "phase"), pc.is_in(windows["name"], pa_array(["forward", "backward"]))
        ),
        pc.fill_null(windows["measured"], False),
    )
    phases = windows.filter(keep)
    if phases.num_rows == 0:
        return []
    per = phases.group_by(["run", "rank", "step"]).aggregate([("duration_s", "sum")])
    return [
        {"run": r["run"], "rank": r["rank"], "step": r["step"], "busy_s": r["duration_s_sum"]}
        for r in per.to_pylist()
    ]


def pa_array(values: list[str]) -> Any:
    import pyarrow as pa

    return pa.array(values)


def configuration_key(config: dict[str, Any], ms: Measured) -> str:
    """What makes runs repeats of one configuration: their config (the sections the re-run
    command carries, less :data:`SKIPPED` and :data:`REPEAT_KEYS`) and their measured layout;
    a run without a config is its own configuration."""
    if not config:
        return f"run:{ms.run}"
    flat = _flatten({k: v for k, v in config.items() if k in SECTIONS})
    kept = {k: v for k, v in flat.items() if k not in SKIPPED | REPEAT_KEYS}
    layout = [s.layers for s in ms.stages]
    return json.dumps([kept, layout, ms.microbatches], sort_keys=True, default=str)


def render(report: AdviceReport) -> str:
    """The report as console text."""
    lines = [f"charllm advise {report.path}"]
    for a in report.advice:
        lines.append("")
        if a.kind == "pipeline_layout":
            lines.append(
                f"[{a.run}] pipeline layout {a.current} -> {a.proposed}: expected step "
                f"{a.measured_step_s * 1e3:.1f} -> {a.expected_step_s * 1e3:.1f} ms "  # type: ignore[operator]
                f"({a.expected_gain * 100:.1f}% shorter)"
            )
        elif a.kind == "rank_placement":
            lines.append(
                f"[{a.run}] rank placement {a.current} -> {a.proposed}: expected step "
                f"{a.measured_step_s * 1e3:.1f} -> {a.expected_step_s * 1e3:.1f} ms "  # type: ignore[operator]
                f"({a.expected_gain * 100:.1f}% shorter)"
            )
        else:
            lines.append(
                f"[{a.run}] micro batch size {a.proposed} (of {a.current}): "
                f"{a.expected_gain * 100:.1f}% more samples/s"
            )
        lines += [f"  evidence: {e}" for e in a.evidence]
        if a.placement:
            lines.append(f"  placement: {a.placement}")
        lines.append(f"  overrides: {' '.join(a.overrides)}")
        if a.command:
            lines.append(f"  re-run:    {a.command}")
    for n in report.no_advice:
        lines += ["", f"[{n.run}] no {n.kind.replace('_', ' ')} advice: {n.reason}"]
    for p in report.problems:
        lines.append(f"problem: {p}")
    # Run keys, model names, problems come from run directories: no escape sequence reaches the terminal.
    return "\n".join(printable(line, 4000) for line in lines)


def cmd_advise(args: argparse.Namespace) -> int:
    """Print the advice for PATH (text, or JSON with --json); 0 when it was computed."""
    try:
        import duckdb  # noqa: F401
    except ImportError:
        print("charllm: duckdb is not installed; pip install -e '.[analysis]'", file=sys.stderr)
        return 2
    if not 0 <= args.min_gain < 1:
        print(f"charllm advise: --min-gain={args.min_gain} must be in [0, 1)", file=sys.stderr)
        return 2
    if args.min_steps < 1:
        print(f"charllm advise: --min-steps={args.min_steps} must be >= 1", file=sys.stderr)
        return 2
    report = advise(args.path, args.min_gain, args.min_steps)
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=1, default=str)
        print()
    else:
        print(render(report))
    return 0


def add_command(sub: Any) -> None:
    """Add ``advise`` to the ``charllm`` sub-command parser."""
    a = sub.add_parser(
        "advise", help="a pipeline layout and micro batch size from a run's or sweep's measurements"
    )
    a.add_argument("path", help="a run directory or a tree of them (a sweep)")
    a.add_argument("--json", action="store_true", help="print the advice as JSON (docs/advisor.md)")
    a.add_argument(
        "--min-gain",
        type=float,
        default=MIN_GAIN,
        help=f"smallest expected gain worth advising, fraction (default {MIN_GAIN})",
    )
    a.add_argument(
        "--min-steps",
        type=int,
        default=MIN_STEPS,
        help=f"fewest measured steps for layout advice (default {MIN_STEPS})",
    )
    a.set_defaults(func=cmd_advise)
