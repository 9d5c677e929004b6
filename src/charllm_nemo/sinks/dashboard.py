"""A ready-made W&B workspace for the keys the W&B sink logs (``charllm wandb-dashboard``).

The panels are described here as plain data (:data:`SECTIONS`: section name, then panels with
explicit keys or an anchored key pattern), turned into a ``wandb_workspaces`` Workspace by
:func:`build_workspace`, serialized without a server by :func:`workspace_spec`, and checked
against the key set :mod:`charllm_nemo.sinks.keys` produces by :func:`spec_problems` (every
explicit key is a key the sink logs; every pattern matches at least one such key and nothing
else). Saving (:func:`save_workspace`) needs W&B credentials and a reachable server.

The per-rank keys ``rank/<r>/<figure>`` are drawn with a pattern (``^rank/\\d+/power_avg_w$``)
so one panel shows every rank of any world size; aggregates ``all/*``, ``perf/*`` and
``train/*`` by name; every panel's x axis is the custom step axis ``trainer/global_step``.
Alerts are whatever the alerts observer logs under :data:`ALERTS_PREFIX`.

``wandb_workspaces`` (and with it wandb) is imported only inside the functions that need it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from charllm_nemo.errors import CharllmError, ConfigError
from charllm_nemo.sinks.keys import (
    STEP_FIGURE_KEYS,
    STEP_KEY,
    SUMMARY_KEYS,
    THROTTLE_FIGURES,
    TRAFFIC_FIGURES,
    step_metrics,
)
from charllm_nemo.telemetry.filecheck import printable

ALERTS_PREFIX = "alerts/"
"""Prefix of the keys the alerts observer logs (docs/alerts.md); the Alerts section draws them."""

DEFAULT_SWEEP_GROUP_BY: tuple[str, ...] = (
    "model.name",
    "parallel.name",
    "optim.name",
    "batch.micro_batch_size",
)
"""Config keys a sweep's runs are grouped by (one line per configuration, repeats and attempts
averaged with their min-max band) when ``--sweep`` / ``--group`` is given without ``--group-by``."""

INSTALL_HINT = "the dashboard needs the 'wandb' extra: pip install -e '.[wandb]' (wandb, wandb-workspaces)"


@dataclass(frozen=True)
class PanelSpec:
    """One line plot: ``keys`` (exact key names) or ``pattern`` (an anchored regular expression
    over key names, W&B's ``metricRegex``), never both. ``stacked``: a stacked-area plot."""

    title: str
    keys: tuple[str, ...] = ()
    pattern: str | None = None
    stacked: bool = False
    y_title: str | None = None

    def __post_init__(self) -> None:
        if bool(self.keys) == (self.pattern is not None):
            raise ValueError(f"panel {self.title!r}: give keys or a pattern, not both nor neither")


@dataclass(frozen=True)
class SectionSpec:
    """A workspace section: a name and its panels, open when the workspace loads."""

    name: str
    panels: tuple[PanelSpec, ...]
    note: str | None = None  # a markdown panel first, when set


def per_rank(figure: str) -> str:
    """The anchored pattern for ``rank/<r>/<figure>`` of every rank."""
    if figure not in STEP_FIGURE_KEYS:
        raise ValueError(f"{figure!r} is not a per-rank figure (keys.STEP_FIGURE_KEYS)")
    return rf"^rank/\d+/{re.escape(figure)}$"


def sections(detail_rank: int = 0) -> tuple[SectionSpec, ...]:
    """The workspace's sections; ``detail_rank``: the rank whose throttle reasons are stacked."""
    reasons = tuple(
        f"rank/{int(detail_rank)}/{name}" for name in THROTTLE_FIGURES if name != "throttle_any_limiting_s"
    )
    return (
        SectionSpec(
            "Throughput and MFU",
            (
                PanelSpec("Tokens per second (global batch)", ("perf/tokens_per_s",), y_title="tokens/s"),
                PanelSpec(
                    "TFLOP/s per GPU (model, hardware)",
                    ("perf/tflops_per_gpu", "perf/hw_tflops_per_gpu"),
                    y_title="TFLOP/s",
                ),
                PanelSpec("MFU", ("perf/mfu",), y_title="fraction of peak"),
                PanelSpec("Step time (slowest rank)", ("perf/step_time_s",), y_title="s"),
                PanelSpec(
                    "Step window per rank (a straggler stands out)",
                    pattern=per_rank("duration_s"),
                    y_title="s",
                ),
                PanelSpec("Samples per second", ("perf/samples_per_s",), y_title="samples/s"),
                PanelSpec("Loss and gradient norm", ("train/loss", "train/grad_norm")),
            ),
        ),
        SectionSpec(
            "Power",
            (
                PanelSpec("Average power per rank", pattern=per_rank("power_avg_w"), y_title="W"),
                PanelSpec("Peak instant power per rank", pattern=per_rank("power_peak_w"), y_title="W"),
                PanelSpec(
                    "Power across ranks (mean, max, min of the averages; highest peak)",
                    ("all/power_mean_w", "all/power_max_w", "all/power_min_w", "all/power_peak_w"),
                    y_title="W",
                ),
                PanelSpec(
                    "Job power swing per step (sum of the ranks' peak - trough: an upper bound)",
                    ("all/power_swing_w",),
                    y_title="W",
                ),
                PanelSpec("Power swing per rank", pattern=per_rank("power_swing_w"), y_title="W"),
                PanelSpec(
                    "Steepest power rise per rank", pattern=per_rank("power_ramp_up_w_s"), y_title="W/s"
                ),
                PanelSpec(
                    "Steepest power fall per rank", pattern=per_rank("power_ramp_down_w_s"), y_title="W/s"
                ),
            ),
        ),
        SectionSpec(
            "Energy",
            (
                PanelSpec("Energy per step, per rank", pattern=per_rank("energy_j"), y_title="J"),
                PanelSpec(
                    "Energy per step, all ranks, and its bound (docs/attribution.md)",
                    ("all/energy_j", "all/energy_bound_j"),
                    y_title="J",
                ),
                PanelSpec("Energy bound per step, per rank", pattern=per_rank("energy_bound_j"), y_title="J"),
                PanelSpec("Ranks reporting energy", ("all/ranks_reporting",), y_title="ranks"),
            ),
        ),
        SectionSpec(
            "Temperature",
            (
                PanelSpec("GPU peak temperature per rank", pattern=per_rank("temp_gpu_peak_c"), y_title="°C"),
                PanelSpec("HBM peak temperature per rank", pattern=per_rank("temp_hbm_peak_c"), y_title="°C"),
                PanelSpec(
                    "Hotspot peak temperature per rank", pattern=per_rank("temp_hotspot_peak_c"), y_title="°C"
                ),
                PanelSpec(
                    "Across ranks: hottest GPU, spread (hottest - coolest), hottest HBM",
                    ("all/temp_max_c", "all/temp_spread_c", "all/temp_hbm_max_c"),
                    y_title="°C",
                ),
            ),
        ),
        SectionSpec(
            "Clocks",
            (
                PanelSpec("Average SM clock per rank", pattern=per_rank("clock_sm_avg_mhz"), y_title="MHz"),
                PanelSpec("Lowest SM clock per rank", pattern=per_rank("clock_sm_min_mhz"), y_title="MHz"),
                PanelSpec("SM clock, mean over ranks", ("all/clock_sm_mean_mhz",), y_title="MHz"),
            ),
        ),
        SectionSpec(
            "Throttle",
            (
                PanelSpec(
                    "Ranks throttled (a limiting reason set)", ("all/ranks_throttled",), y_title="ranks"
                ),
                PanelSpec(
                    "Largest share of a rank's step under a limiting reason",
                    ("all/throttle_share",),
                    y_title="fraction",
                ),
                PanelSpec("Longest limiting-throttle time", ("all/throttle_max_s",), y_title="s"),
                PanelSpec(
                    "Limiting-throttle time per rank",
                    pattern=per_rank("throttle_any_limiting_s"),
                    y_title="s",
                ),
                PanelSpec(
                    f"Rank {int(detail_rank)}: time under each throttle reason",
                    reasons,
                    stacked=True,
                    y_title="s",
                ),
                PanelSpec(
                    "Power-cap violation time per rank (driver counter)",
                    pattern=per_rank("violation_power_s"),
                    y_title="s",
                ),
                PanelSpec(
                    "Thermal violation time per rank (driver counter)",
                    pattern=per_rank("violation_thermal_s"),
                    y_title="s",
                ),
            ),
        ),
        SectionSpec(
            "Traffic",
            (
                PanelSpec("NVLink sent per step, per rank", pattern=per_rank("nvlink_tx_bytes"), y_title="B"),
                PanelSpec(
                    "NVLink received per step, per rank", pattern=per_rank("nvlink_rx_bytes"), y_title="B"
                ),
                PanelSpec("PCIe sent per step, per rank", pattern=per_rank("pcie_tx_bytes"), y_title="B"),
                PanelSpec("PCIe received per step, per rank", pattern=per_rank("pcie_rx_bytes"), y_title="B"),
                PanelSpec(
                    "Traffic per step, all ranks",
                    tuple(f"all/{name}" for name in TRAFFIC_FIGURES),
                    y_title="B",
                ),
            ),
        ),
        SectionSpec(
            "Sampling",
            (
                PanelSpec(
                    "Share of the step with samples, per rank",
                    pattern=per_rank("coverage"),
                    y_title="fraction",
                ),
                PanelSpec("Longest sampling gap per rank", pattern=per_rank("gap_max_s"), y_title="s"),
                PanelSpec("Lowest coverage over ranks", ("all/coverage_min",), y_title="fraction"),
                PanelSpec("Longest sampling gap over ranks", ("all/gap_max_s",), y_title="s"),
            ),
            note="A rank whose sampler fell behind (a busy host, a paused telemetry process) leaves "
            "part of a step without samples: coverage below 1, and the step's `sampling_gap` in steps.jsonl.",
        ),
        SectionSpec(
            "Alerts",
            (PanelSpec("Alert keys", pattern=rf"^{re.escape(ALERTS_PREFIX)}.+$"),),
            note=(
                f"Keys under `{ALERTS_PREFIX}` come from charllm's alerts (throttle onset and end, "
                "stragglers, thermal imbalance, power over the limit, sampler health; docs/alerts.md). "
                "Empty when alerts are off. Each alert is also a W&B alert and a line of the run "
                "directory's alerts.jsonl."
            ),
        ),
    )


@dataclass(frozen=True)
class DashboardOptions:
    """What the workspace shows: ``sweep`` (runs tagged ``sweep:<name>``) or ``group`` (runs
    of that W&B group) or neither (every run of the project); ``group_by``: config keys the
    runs are grouped by (None: :data:`DEFAULT_SWEEP_GROUP_BY` with a sweep or group, else no
    grouping); ``detail_rank``: the rank whose throttle reasons are stacked; ``max_runs``: runs
    (or groups) drawn per panel; ``name``: the workspace's name."""

    entity: str
    project: str
    name: str | None = None
    sweep: str | None = None
    group: str | None = None
    group_by: tuple[str, ...] | None = None
    detail_rank: int = 0
    max_runs: int = 20

    def __post_init__(self) -> None:
        for label, value in (("--entity", self.entity), ("--project", self.project)):
            if not value or not value.strip():
                raise ConfigError(f"{label} is empty; give the W&B entity (user or team) and project")
        if self.sweep and self.group:
            raise ConfigError("give --sweep or --group, not both (a sweep's runs are tagged sweep:<name>)")
        if self.detail_rank < 0:
            raise ConfigError(f"--detail-rank {self.detail_rank}: a rank is >= 0")
        if self.max_runs < 1:
            raise ConfigError(f"--max-runs {self.max_runs}: draw at least 1 run per panel")
        for key in self.group_by or ():
            if not re.fullmatch(r"[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*", key):
                raise ConfigError(f"--group-by {key!r}: give a dotted config key such as model.name")

    @property
    def grouping(self) -> tuple[str, ...]:
        """The config keys runs are grouped by."""
        if self.group_by is not None:
            return self.group_by
        return DEFAULT_SWEEP_GROUP_BY if (self.sweep or self.group) else ()

    @property
    def title(self) -> str:
        """The workspace's name."""
        if self.name:
            return self.name
        if self.sweep:
            return f"charllm telemetry: sweep {self.sweep}"
        if self.group:
            return f"charllm telemetry: group {self.group}"
        return "charllm telemetry"


def _require_workspaces() -> tuple[Any, Any]:
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as exc:
        raise CharllmError(f"{exc.name or 'wandb_workspaces'} is not installed; {INSTALL_HINT}") from exc
    return ws, wr


def build_workspace(options: DashboardOptions) -> Any:
    """The ``wandb_workspaces.workspaces.Workspace`` of :func:`sections` for ``options``
    (built offline; nothing is sent)."""
    ws, wr = _require_workspaces()
    specs = sections(options.detail_rank)
    built = []
    for spec in specs:
        panels: list[Any] = []
        if spec.note:
            panels.append(wr.MarkdownPanel(markdown=spec.note))
        for p in spec.panels:
            panels.append(
                wr.LinePlot(
                    title=p.title,
                    x=STEP_KEY,
                    y=list(p.keys),
                    metric_regex=p.pattern,
                    plot_type="stacked-area" if p.stacked else None,
                    title_x="step",
                    title_y=p.y_title,
                    max_runs_to_show=options.max_runs,
                    legend_template="${run:displayName} ${metricName}" if p.pattern else None,
                )
            )
        built.append(
            ws.Section(
                name=spec.name,
                panels=panels,
                is_open=True,
                # every panel on one page: rows enough for all of them at 3 a row
                layout_settings=ws.SectionLayoutSettings(columns=3, rows=max(1, -(-len(panels) // 3))),
                panel_settings=ws.SectionPanelSettings(x_axis=STEP_KEY),
            )
        )
    filters: Any = ""  # every run of the project
    if options.sweep:
        filters = ws.And(ws.Tags().isin([f"sweep:{options.sweep}"]))
    elif options.group:
        filters = ws.And(ws.Metric("Group") == options.group)
    try:
        return ws.Workspace(
            entity=options.entity,
            project=options.project,
            name=options.title,
            sections=built,
            settings=ws.WorkspaceSettings(x_axis=STEP_KEY, max_runs=options.max_runs, smoothing_type="none"),
            runset_settings=ws.RunsetSettings(
                filters=filters, groupby=[ws.Config(k) for k in options.grouping]
            ),
        )
    except ValueError as exc:  # pydantic's ValidationError: a name W&B refuses (emoji, control characters)
        first = exc.errors()[0] if hasattr(exc, "errors") else {}
        where = ".".join(str(x) for x in first.get("loc", ())) or "workspace"
        raise ConfigError(
            f"W&B refuses the workspace's {where} {printable(repr(first.get('input', '')), 80)}: "
            f"{printable(first.get('msg', exc), 200)}; give another --name / --project / --entity"
        ) from None


def workspace_spec(workspace: Any) -> dict[str, Any]:
    """The workspace as the JSON W&B stores (the view: entity, project, displayName, spec with
    sections, panels and run set), built offline. wandb_workspaces exposes this only through
    its model (``_to_model``), the same one ``Workspace.save`` sends."""
    model = workspace._to_model()
    spec: dict[str, Any] = model.model_dump(by_alias=True, exclude_none=True, mode="json")
    return spec


def all_keys(ranks: int = 2) -> frozenset[str]:
    """Every key the W&B sink logs for a job of ``ranks`` ranks with every figure known,
    computed by :func:`charllm_nemo.sinks.keys.step_metrics` itself."""
    figures = {name: 1.0 for name in STEP_FIGURE_KEYS}
    summary = {name: 1.0 for name in SUMMARY_KEYS}
    return frozenset(step_metrics(0, summary=summary, per_rank=[figures] * ranks))


def spec_panels(spec: Mapping[str, Any]) -> Iterable[tuple[str, Mapping[str, Any]]]:
    """``(section name, panel)`` for every panel of a :func:`workspace_spec`."""
    for section in spec["spec"]["section"]["panelBankConfig"]["sections"]:
        for panel in section.get("panels", []):
            yield section["name"], panel


def spec_problems(spec: Mapping[str, Any], keys: frozenset[str] | None = None) -> list[str]:
    """What in a :func:`workspace_spec` does not fit the keys the sink logs (empty: all fit).

    Every line plot must plot against ``trainer/global_step``; its explicit metrics must be keys
    of ``keys`` (default :func:`all_keys`); its pattern must match at least one of them, or, in
    the Alerts section, be a pattern of keys under :data:`ALERTS_PREFIX` only.
    """
    known = all_keys() if keys is None else keys
    problems: list[str] = []
    for section, panel in spec_panels(spec):
        if panel.get("viewType") != "Run History Line Plot":
            continue
        cfg = panel.get("config", {})
        title = f"{section} / {cfg.get('chartTitle')!r}"
        if cfg.get("xAxis") != STEP_KEY:
            problems.append(f"{title}: x axis {cfg.get('xAxis')!r}, not {STEP_KEY}")
        for key in cfg.get("metrics", []):
            if key not in known:
                problems.append(f"{title}: {key!r} is not a key the W&B sink logs")
        pattern = cfg.get("metricRegex")
        if pattern is None:
            if not cfg.get("metrics"):
                problems.append(f"{title}: no metrics and no pattern")
            continue
        regex = re.compile(pattern)
        if pattern.startswith("^" + re.escape(ALERTS_PREFIX)):
            if any(regex.search(k) for k in known):
                problems.append(f"{title}: alerts pattern {pattern!r} matches a non-alert key")
            if not regex.search(ALERTS_PREFIX + "x"):
                problems.append(f"{title}: alerts pattern {pattern!r} matches no key under {ALERTS_PREFIX}")
        elif not any(regex.search(k) for k in known):
            problems.append(f"{title}: pattern {pattern!r} matches no key the W&B sink logs")
    return problems


def save_workspace(workspace: Any, env: Mapping[str, str] | None = None) -> str:
    """Save ``workspace`` to the W&B server and return its URL. Raises :class:`CharllmError`
    naming the fix when there are no credentials (``WANDB_API_KEY``), the server cannot be
    reached, or the server refuses (a wrong ``--entity`` / ``--project``)."""
    from charllm_nemo.sinks.wandb import has_api_key, server_problem

    if not has_api_key(env):
        raise CharllmError(
            "cannot save the workspace: no W&B credentials (set WANDB_API_KEY, or `wandb login`); "
            "--dry-run writes its specification without a server"
        )
    problem = server_problem(env=env)
    if problem is not None:
        raise CharllmError(
            f"cannot save the workspace: W&B server unreachable: {problem} (WANDB_BASE_URL selects "
            "the server); --dry-run writes its specification without a server"
        )
    try:
        workspace.save()
        return str(workspace.url)
    except Exception as exc:  # wandb raises its own CommError / HTTPError / ValueError here
        raise CharllmError(
            f"W&B refused the workspace for --entity {workspace.entity!r} --project {workspace.project!r}: "
            f"{type(exc).__name__}: {exc} "
            "(check that the entity exists and that your WANDB_API_KEY may write to it)"
        ) from exc


def cmd_wandb_dashboard(args: Any) -> int:
    """``charllm wandb-dashboard``: build, check, and print/write or save the workspace."""
    import sys

    entity = args.entity or ("ENTITY" if args.dry_run else None)
    if entity is None:
        raise ConfigError(
            "--entity is required to save the workspace (the W&B user or team that owns --project)"
        )
    options = DashboardOptions(
        entity=entity,
        project=args.project,
        name=args.name,
        sweep=args.sweep,
        group=args.group,
        group_by=tuple(args.group_by) if args.group_by else None,
        detail_rank=args.detail_rank,
        max_runs=args.max_runs,
    )
    workspace = build_workspace(options)
    spec = workspace_spec(workspace)
    problems = spec_problems(spec)
    if problems:  # a key renamed in keys.py without this module following
        raise CharllmError("the workspace does not fit the logged keys:\n  " + "\n  ".join(problems))
    text = json.dumps(spec, indent=1, sort_keys=False) + "\n"
    if args.json:
        from charllm_nemo.telemetry.write import write_text

        write_text(Path(args.json), text)  # no link followed (telemetry/write.py)
    elif args.dry_run:
        sys.stdout.write(text)
    n_panels = sum(1 for _ in spec_panels(spec))
    n_sections = len(spec["spec"]["section"]["panelBankConfig"]["sections"])
    summary = f"workspace {options.title!r}: {n_sections} sections, {n_panels} panels, x axis {STEP_KEY}" + (
        f", grouped by {', '.join(options.grouping)}" if options.grouping else ""
    )
    if args.dry_run:
        print(summary + " (dry run: not saved)", file=sys.stderr)
        return 0
    url = save_workspace(workspace)
    print(f"{summary}; saved: {url}")
    return 0


def panel_key_count(spec: Mapping[str, Any], keys: Sequence[str]) -> int:
    """How many of ``keys`` the workspace draws (explicitly or through a pattern)."""
    explicit: set[str] = set()
    patterns: list[re.Pattern[str]] = []
    for _, panel in spec_panels(spec):
        cfg = panel.get("config", {})
        explicit.update(cfg.get("metrics", []))
        if cfg.get("metricRegex"):
            patterns.append(re.compile(cfg["metricRegex"]))
    return sum(1 for k in keys if k in explicit or any(p.search(k) for p in patterns))


__all__ = [
    "ALERTS_PREFIX",
    "DEFAULT_SWEEP_GROUP_BY",
    "DashboardOptions",
    "PanelSpec",
    "SectionSpec",
    "all_keys",
    "build_workspace",
    "cmd_wandb_dashboard",
    "panel_key_count",
    "save_workspace",
    "sections",
    "spec_panels",
    "spec_problems",
    "workspace_spec",
]
