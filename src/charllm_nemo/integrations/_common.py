"""What every framework integration shares: plain-value options, and the one call that turns
them into this rank's :class:`~charllm_nemo.steps.StepTelemetry`.

The integrations hold no per-step logic of their own: they say where steps (and, where the
framework says so, microbatches and phases) begin and end, and the step-telemetry API does the
rest (charllm_nemo.steps). Nothing here imports a training framework.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import re
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from charllm_nemo.errors import CharllmError, ConfigError
from charllm_nemo.telemetry.config import TelemetryConfig

if TYPE_CHECKING:
    from charllm_nemo.steps import StepTelemetry
    from charllm_nemo.telemetry.config import Placement

log = logging.getLogger(__name__)

LOG_TO = ("trainer", "wandb", "none")
"""Where per-step figures go besides steps.jsonl: the framework's own loggers (``trainer``), our
W&B sink (``wandb``), or neither. One of them, never both: a key is logged once."""


_TELEMETRY = TelemetryConfig()
"""The telemetry defaults, declared once in TelemetryConfig: an integration's shared options
(hz, counter_hz, backend, sampler, windows, attention_flops, overwrite, enabled) take theirs."""


@dataclass
class IntegrationOptions:
    """The plain values a user gives an integration (so NeMo-Run / Fiddle can configure it): the
    one declaration of the integrations' options. The callbacks and MegatronLMTelemetry take
    them as ``**options`` checked against these fields (their signatures are made from them:
    :func:`options_signature`); a new option is one field here (and its check in
    :meth:`problems` when it has one).

    ``hz``: power samples a second; ``counter_hz``: energy / violation counter reads a second
    (None: every sample); ``backend``: auto | nvml | amdsmi | synthetic; ``out_dir``: the run
    directory (``{time}`` becomes ``YYYYmmdd-HHMMSS``); ``windows``: the window kinds recorded
    (step, microbatch, phase; a string is one kind or a comma list); ``sampler``: auto | thread |
    process; ``log_to``: see :data:`LOG_TO`; ``key_prefix``: prefix of the keys given to the
    framework's loggers; ``steps_file``: write ``steps.jsonl`` in the run directory;
    ``console``: rank 0 prints a line a step; ``attention_flops``: full | causal (how MFU counts
    attention; :data:`~charllm_nemo.telemetry.config.ATTENTION_FLOPS`); ``peak_tflops_per_gpu``:
    the MFU denominator in TFLOP/s (None: looked up for the device); ``precision``: the peak's
    precision (bf16 | fp16 | fp8 | tf32 | fp32); ``overwrite``: replace an earlier run in
    ``out_dir``; ``enabled``: False does nothing; ``alerts``: live alerts on rank 0 with the
    default thresholds (docs/alerts.md: console, ``alerts.jsonl``, our W&B sink with
    ``log_to="wandb"``, an ``on_alert`` function); False installs nothing.
    """

    hz: float = _TELEMETRY.hz
    counter_hz: float | None = _TELEMETRY.counter_hz
    backend: str = _TELEMETRY.backend
    out_dir: str = "runs/{time}"
    windows: Sequence[str] = field(default_factory=lambda: tuple(_TELEMETRY.windows))
    sampler: str = _TELEMETRY.sampler
    log_to: str = "trainer"
    key_prefix: str = "charllm/"
    steps_file: bool = True
    console: bool = False
    attention_flops: str = _TELEMETRY.attention_flops
    peak_tflops_per_gpu: float | None = None
    precision: str = "bf16"
    overwrite: bool = _TELEMETRY.overwrite
    enabled: bool = _TELEMETRY.enabled
    alerts: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.windows, str):  # "step" is one kind, "step,phase" a list; not letters
            self.windows = tuple(w.strip() for w in self.windows.split(",") if w.strip())
        elif isinstance(self.windows, Sequence):
            self.windows = tuple(self.windows)

    @classmethod
    def from_keywords(cls, owner: str, options: Mapping[str, Any]) -> IntegrationOptions:
        """The options of ``owner``'s keywords, checked in full: ConfigError (one line, the
        keyword as the user wrote it, ``hz=0``) for an unknown keyword or a value that cannot
        work, before anything is opened or made."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ConfigError(
                f"{owner}: unknown option {', '.join(unknown)}; the options are {', '.join(names)}"
            )
        opts = cls(**options)
        opts.validate(owner)
        return opts

    def problems(self, name: Callable[[str], str] = lambda f: f) -> list[str]:
        """Every problem of these options, one message each; ``name(field)``: how the user wrote
        the option (``hz`` for a keyword, the default; ``telemetry.hz`` for a config file).
        The telemetry fields are TelemetryConfig's checks (one validation), renamed."""
        from charllm_nemo.metrics.peak import DTYPES, normalize_dtype
        from charllm_nemo.telemetry.config import telemetry_problems

        problems = [
            re.sub(r"telemetry\.(\w+)", lambda m: name(m.group(1)), p)
            for p in telemetry_problems(self.telemetry_config(self.resolved_out_dir()))
        ]
        if self.log_to not in LOG_TO:
            problems.append(f"{name('log_to')}={self.log_to!r} is not valid; use one of {', '.join(LOG_TO)}")
        if not isinstance(self.key_prefix, str):
            problems.append(f"{name('key_prefix')}={self.key_prefix!r} must be a string such as 'charllm/'")
        for flag in ("steps_file", "console", "alerts"):
            if not isinstance(getattr(self, flag), bool):
                problems.append(f"{name(flag)}={getattr(self, flag)!r} must be True or False")
        p = self.peak_tflops_per_gpu
        if p is not None and (
            isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or p <= 0
        ):
            problems.append(
                f"{name('peak_tflops_per_gpu')}={p!r} must be a positive finite rate in TFLOP/s, or None "
                "to look the device up"
            )
        try:
            normalize_dtype(self.precision)
        except ConfigError:
            problems.append(
                f"{name('precision')}={self.precision!r} is not known; use one of {', '.join(DTYPES)}"
            )
        return problems

    def validate(self, owner: str, name: Callable[[str], str] = lambda f: f) -> None:
        """Raise ConfigError, one line ``<owner>: <problems>``, when an option cannot work."""
        problems = self.problems(name)
        if problems:
            raise ConfigError(f"{owner}: " + "; ".join(problems))

    def resolved_out_dir(self) -> str:
        return str(self.out_dir).replace("{time}", time.strftime("%Y%m%d-%H%M%S"))

    def telemetry_config(self, out_dir: str) -> TelemetryConfig:
        return TelemetryConfig(
            enabled=self.enabled,
            backend=self.backend,
            hz=self.hz,
            counter_hz=self.counter_hz,
            sampler=self.sampler,
            out_dir=out_dir,
            overwrite=self.overwrite,
            windows=list(self.windows) if isinstance(self.windows, Sequence) else self.windows,
            attention_flops=self.attention_flops,
        )


def options_signature(init: Callable[..., Any]) -> inspect.Signature:
    """The class's signature (``init``'s, less ``self``) with its ``**options`` spelled out
    as IntegrationOptions' fields (keyword-only, with their defaults), so IDEs, ``help`` and
    Fiddle / NeMo-Run see every option although it is declared once."""
    sig = inspect.signature(init)
    params = [p for p in list(sig.parameters.values())[1:] if p.kind is not inspect.Parameter.VAR_KEYWORD]
    defaults = IntegrationOptions()
    params += [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=getattr(defaults, f.name))
        for f in fields(IntegrationOptions)
    ]
    return sig.replace(parameters=params)


class LoggersObserver:
    """Each step report to a framework's loggers, as ``<prefix><field>`` scalars at the report's
    step (rank 0 only; the API calls observers on rank 0). ``log_metrics(metrics, step)`` is
    Lightning's Logger method; Bridge and Megatron-LM callers pass a function of the same shape.

    ``every``: log the steps ``s`` with ``(s + 1) % every == 0``, Lightning's rule for its own
    metrics under ``log_every_n_steps``, and the last report at :meth:`close` (Lightning logs
    when the run stops); steps.jsonl and ``log_to="wandb"`` keep every step. What it saves:
    a report's ~20 scalars cost Lightning's TensorBoardLogger 0.77 ms of CPU a step logged
    every step, 0.075 ms at ``every=10`` (bench/bench_trainer_loggers.py, load 59; tensorboard
    computes each record's CRC in Python), more than the step hooks on a 28 ms CPU step."""

    def __init__(
        self, log_metrics: Callable[[dict[str, float], int], Any], prefix: str = "charllm/", every: int = 1
    ) -> None:
        self._log = log_metrics
        self._prefix = prefix
        self._every = max(1, int(every))
        self._unlogged: Any = None  # the last report skipped by ``every`` (logged at close)
        self._alerts: deque[Mapping[str, Any]] = deque()

    def on_step(self, report: Any) -> None:
        self._log_alerts()
        if (int(report.step) + 1) % self._every:
            self._unlogged = report
            return
        self._unlogged = None
        self._log_report(report)

    def _log_report(self, report: Any) -> None:
        row = report.to_dict()
        metrics = {
            f"{self._prefix}{k}": float(v)
            for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None
        }
        if metrics:
            self._log(metrics, int(report.step))

    def close(self, status: str) -> None:
        self._log_last()
        self._log_alerts()

    def _log_last(self) -> None:
        """The last report, when ``every`` skipped it."""
        last, self._unlogged = self._unlogged, None
        if last is not None:
            self._log_report(last)

    def log_alert(self, alert: Mapping[str, Any]) -> None:
        """An alert (charllm_nemo.alerts) for the framework's loggers: one scalar,
        ``<prefix>alerts/<kind>`` = the rank (-1 for none), at the alert's step, so with
        ``log_to="trainer"`` the framework's W&B run gets the alert as a key. Called on the alert
        thread; logged from the training thread at the next step (a framework's loggers are
        the training thread's)."""
        self._alerts.append(alert)  # deque.append: safe across threads

    def _log_alerts(self) -> None:
        while self._alerts:
            alert = self._alerts.popleft()
            rank = alert.get("rank")
            self._log(
                {f"{self._prefix}alerts/{alert.get('kind')}": float(-1 if rank is None else rank)},
                int(alert["step"]),
            )


def collectives_in_phases() -> bool:
    """Whether this job's tensor, expert or context parallel collectives sit inside the forward
    and backward phases (docs/alerts.md, "Culprit or victim"): read from megatron-core's
    parallel state when the framework has initialised it (never imported here: a framework that
    did not load it has none of these groups), else False."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None:
        return False
    try:
        if not ps.model_parallel_is_initialized():
            return False
        sizes = [ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()]
        sizes.append(ps.get_expert_model_parallel_world_size())
    except Exception:  # an older or partial megatron-core: judge as data parallel, as before
        return False
    return any(int(n or 1) > 1 for n in sizes)


@dataclass(frozen=True)
class RunFacts:
    """What a framework says of its run, for :func:`open_step_telemetry`: ``model`` (a
    ModelShape) with ``global_batch_size`` (sequences a step) and ``seq_length`` (default the
    shape's) for throughput and MFU (no rates without both of the first two); ``device``
    (``cuda``: marks timed with CUDA events); ``num_microbatches`` a step; ``total_steps`` (the
    last step asks for its figures at once; the console's progress)."""

    model: Any = None
    global_batch_size: int | None = None
    seq_length: int | None = None
    device: str = "cpu"
    num_microbatches: int = 1
    total_steps: int | None = None


def open_step_telemetry(
    opts: IntegrationOptions,
    placement: Placement,
    *,
    framework: str,
    sources: Mapping[str, str],
    run: RunFacts | None = None,
    observers: Sequence[Any] = (),
    run_config: Mapping[str, Any] | None = None,
    group: Any = None,
    wandb_config: Any = None,
    on_alert: Callable[[dict[str, Any]], object] | None = None,
    alerts_config: Any = None,
) -> tuple[StepTelemetry, str]:
    """Open this rank's session and its StepTelemetry from ``opts``; returns it with the run
    directory. ``sources``: where each window kind's boundaries come from (written into the
    manifest under ``integration.sources``). ``run``: what the framework says of the run (None:
    nothing: no rates, the host clock). ``observers``: rank 0's, besides steps.jsonl /
    console / W&B that ``opts`` asks for. With ``opts.alerts``, rank 0 also gets the alert
    observer (``alerts_config``: an AlertsConfig, None = the defaults; ``on_alert``: called with
    each alert's dict) and every rank sums its phases and sends its facts once."""
    from charllm_nemo.steps import ConsoleObserver, RateInputs, StepOptions, StepsFileObserver
    from charllm_nemo.steps.open import build_step_telemetry
    from charllm_nemo.telemetry.config import open_session

    run = run if run is not None else RunFacts()
    out_dir = opts.resolved_out_dir()
    cfg = opts.telemetry_config(out_dir)
    config = {
        "integration": {
            "framework": framework,
            "owner": OWNERS.get(framework, "open_step_telemetry"),
            "sources": dict(sources),
            "options": asdict(opts),
        },
        "telemetry": asdict(cfg),
        **(dict(run_config) if run_config else {}),
    }
    try:
        session = open_session(cfg, placement, run_config=config)
    except CharllmError as exc:
        raise in_keywords(exc, OWNERS.get(framework, "open_step_telemetry")) from exc
    obs: list[Any] = list(observers)
    if placement.rank == 0:
        if opts.steps_file:
            obs.append(StepsFileObserver(Path(out_dir) / "steps.jsonl"))
        if opts.console:
            obs.append(ConsoleObserver(run.total_steps, placement.world_size, progress=False))
        if opts.log_to == "wandb":
            obs.append(_wandb_observer(wandb_config, out_dir, config, session))

    def alerter(others: Sequence[Any]) -> Any:
        """Rank 0's alert observer, reporting to our W&B sink and the framework's loggers."""
        from charllm_nemo.alerts import AlertsConfig, alert_observer
        from charllm_nemo.steps.observers import WandbObserver

        sink = next((o.sink for o in others if isinstance(o, WandbObserver)), None)
        hooks: list[Any] = [o.log_alert for o in others if isinstance(o, LoggersObserver)]
        if on_alert is not None:
            hooks.append(on_alert)
        return alert_observer(
            alerts_config or AlertsConfig(),
            run_dir=out_dir,
            sink=sink,
            hooks=hooks,
            collectives_in_phases=collectives_in_phases(),
        )

    try:
        st = build_step_telemetry(
            session,
            placement,
            StepOptions(
                device=run.device,
                windows=tuple(opts.windows),
                total_steps=run.total_steps,
                num_microbatches=run.num_microbatches,
            ),
            rates=None
            if run.model is None or run.global_batch_size is None
            else RateInputs(
                run.model,
                run.global_batch_size,
                run.seq_length,
                opts.attention_flops,
                opts.peak_tflops_per_gpu,
                opts.precision,
            ),
            observers=obs,
            alerter=alerter if opts.alerts else None,
            group=group,
        )
    except BaseException:
        session.close("failed")
        raise
    return st, out_dir


OWNERS = {
    "nemo": "PowerThermalCallback",
    "lightning": "PowerThermalCallback",
    "megatron-bridge": "PowerThermalBridgeCallback",
    "megatron-lm": "MegatronLMTelemetry",
}
"""The class a user wrote for each ``framework`` of :func:`open_step_telemetry`: its errors say so."""

# How the store and the session name an option for `charllm train` / `charllm telemetry`, and
# how a user of the integrations wrote it (the keyword).
_CLI_SPELLINGS = (
    (re.compile(r"telemetry\.out_dir=\.\.\. / --out DIR"), "out_dir=..."),
    (re.compile(r"telemetry\.overwrite=true / --overwrite"), "overwrite=True"),
    (re.compile(r"--out / telemetry\.out_dir|telemetry\.out_dir / --out"), "out_dir"),
    (re.compile(r"--out DIR"), "out_dir=..."),
    (re.compile(r"--overwrite\b"), "overwrite=True"),
    (re.compile(r"telemetry\.(\w+)=true\b"), r"\1=True"),
    (re.compile(r"telemetry\.(\w+)=false\b"), r"\1=False"),
    (re.compile(r"telemetry\.(\w+)"), r"\1"),
)


def in_keywords(exc: CharllmError, owner: str) -> CharllmError:
    """``exc`` again (same class), its message in the integration's words: ``<owner>: ``
    first, and the options named as the keywords the user gave (``out_dir=...``,
    ``overwrite=True``), not as ``charllm train``'s ``telemetry.out_dir`` or the CLI's ``--out``,
    which the store and the session say. ``exc`` itself when its class takes no plain message."""
    message = str(exc)
    for pattern, keyword in _CLI_SPELLINGS:
        message = pattern.sub(keyword, message)
    if not message.startswith(f"{owner}: "):
        message = f"{owner}: {message}"
    try:
        return type(exc)(message)
    except TypeError:
        return exc


TRACEBACK_ENV = "CHARLLM_TRACEBACK"
"""Set to 1 to see the traceback of a refused option (:func:`quiet_option_errors`)."""


def quiet_option_errors() -> None:
    """Make an integration's refused option, left uncaught, print its message alone.

    A bad keyword of ``run.Config(PowerThermalCallback, hz=0)`` fails when NeMo-Run / Fiddle
    builds the recipe; uncaught, Python printed ~90 lines of Fiddle's and NeMo-Run's frames
    above the one line that says what to change. Installed once (when an integration module is
    imported), this ``sys.excepthook`` prints only a :class:`ConfigError` whose message starts
    with an integration's name (:data:`OWNERS`), with the notes a framework added (Fiddle's
    one line of where), then how to see the traceback (``CHARLLM_TRACEBACK=1``); every other
    exception goes to the hook that was there before, untouched."""
    previous = sys.excepthook
    if getattr(previous, "charllm_quiet", False):
        return

    def hook(etype: type[BaseException], value: BaseException, tb: Any) -> None:
        ours = isinstance(value, ConfigError) and str(value).startswith(
            tuple(f"{o}: " for o in {*OWNERS.values(), "open_step_telemetry"})
        )
        if not ours or os.environ.get(TRACEBACK_ENV) == "1":
            previous(etype, value, tb)
            return
        notes = [n for n in getattr(value, "__notes__", ()) if isinstance(n, str)]
        lines = [f"{etype.__name__}: {value}", *notes, f"({TRACEBACK_ENV}=1 shows the traceback)"]
        sys.stderr.write("\n".join(lines) + "\n")

    hook.charllm_quiet = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _wandb_observer(wandb_config: Any, out_dir: str, config: Mapping[str, Any], session: Any) -> Any:
    """Our W&B sink (charllm_nemo.sinks), started, as an observer; ``wandb_config``: a
    LoggerConfig (None: the defaults with name ``wandb``). ``start`` gets the run's config (the
    integration's options, the telemetry config) and this rank's manifest as it stands: a copy,
    since ``wandb.init`` runs later on the sink's thread while the session goes on writing it.
    Without ``start`` every later call is refused (``start() has not run``): nothing reaches W&B."""
    import copy

    from charllm_nemo.sinks.config import LoggerConfig, build_sink
    from charllm_nemo.steps import WandbObserver

    cfg = wandb_config if wandb_config is not None else LoggerConfig(name="wandb")
    sink = build_sink(cfg, 0, run_dir=out_dir)
    if sink is None:
        raise ConfigError("log_to='wandb' but the logger config builds no W&B sink; set its name to 'wandb'")
    sink.start(copy.deepcopy(dict(config)), copy.deepcopy(dict(session.manifest)))
    return WandbObserver(sink, run_dir=out_dir)


def loss_of(output: Any) -> float | None:
    """A float loss from what a framework's step returned (a tensor, a dict with ``loss`` /
    ``lm loss`` / ``reduced_train_loss``, or a number); None when there is none (a pipeline stage
    without the loss)."""
    if output is None:
        return None
    if isinstance(output, Mapping):
        for key in ("loss", "lm loss", "reduced_train_loss", "avg"):
            if key in output:
                return loss_of(output[key])
        return None
    item = getattr(output, "item", None)
    if item is not None:
        try:
            if getattr(output, "numel", lambda: 1)() != 1:
                return None
            return float(item())
        except (RuntimeError, ValueError):
            return None
    if isinstance(output, (int, float)) and not isinstance(output, bool):
        return float(output)
    return None
