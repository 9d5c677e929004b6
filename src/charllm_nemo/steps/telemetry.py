"""The per-step telemetry API of one rank: every training loop says where steps, microbatches
and phases begin and end; this does the rest.

::

    st = StepTelemetry(session, placement, options=StepOptions(device="cuda", total_steps=100),
                       rates=RateInputs(shape, global_batch_size=512),
                       observers=[ConsoleObserver(total_steps=100)])
    config.timers = st.timers(inner=config.timers)   # Megatron-Core's forward/backward marks
    for step in range(100):
        st.begin_step(step)
        ...forward/backward...
        with st.phase("optimizer"):
            optimizer.step()
        st.end_step(loss=loss)          # one all_gather of one small vector per rank
    st.finish("complete")

Per step, on the training thread: the marks are appended to a flat log (charllm_nemo.steps.marks);
at :meth:`StepTelemetry.end_step` the step's window goes to the telemetry process, which is asked
for its figures; the figures of an earlier step, now due (charllm_nemo.steps.pending), are read,
and each rank's one vector (loss, step time, those figures: charllm_nemo.steps.report) crosses
the ranks once; rank 0 completes that earlier step's :class:`StepReport` (throughput and MFU
from :class:`~charllm_nemo.steps.rates.StepRates`, cross-rank telemetry) and hands it to its
observers. :meth:`StepTelemetry.finish` waits (bounded) for the last steps' figures.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from charllm_nemo.errors import ConfigError
from charllm_nemo.steps.host import HostPressure
from charllm_nemo.steps.marks import StepMarker, StepTiming
from charllm_nemo.steps.observers import Observer
from charllm_nemo.steps.options import RateInputs, StepOptions
from charllm_nemo.steps.pending import MAX_FIGURES_LAG, PendingSteps, final_wait
from charllm_nemo.steps.rates import StepRates
from charllm_nemo.steps.report import StepReport, apply_rank_figures, combine_head, pack_rank_vector
from charllm_nemo.steps.session import StepSession
from charllm_nemo.steps.timers import TimersAdapter
from charllm_nemo.telemetry.attribution import ATTRIBUTION_COLUMN_NAMES
from charllm_nemo.telemetry.config import Placement
from charllm_nemo.telemetry.figures import finite_or_none as _finite
from charllm_nemo.telemetry.rank_vector import STEP_FIGURE_COLUMNS, STEP_FIGURE_KEYS, THROTTLE_FIGURES
from charllm_nemo.telemetry.sample_loop import DEFAULT_HZ, health_counts
from charllm_nemo.telemetry.schema import WINDOW_KINDS
from charllm_nemo.telemetry.windows import WindowRecorder

log = logging.getLogger("charllm_nemo.steps")

THREAD_MODE_FIGURES: tuple[str, ...] = (
    "duration_s",
    "energy_j",
    "power_avg_w",
    "power_peak_w",
    "power_swing_w",
    "power_ramp_up_w_s",
    "power_ramp_down_w_s",
    "temp_gpu_peak_c",
    "throttle_any_limiting_s",
    "coverage",
    "gap_max_s",
)
"""The figures a rank reports by default where they are computed on its training thread
(sampler ``thread``): those of the console line and of the report's cross-rank fields."""

ALERT_FIGURES: tuple[str, ...] = (
    "clock_sm_avg_mhz",
    "clock_sm_min_mhz",
    *(f for f in THROTTLE_FIGURES if f != "throttle_any_limiting_s"),
)
"""What the alerts read besides :data:`THREAD_MODE_FIGURES`: added to those in thread mode
when ``phase_times`` is on (process mode computes every figure anyway)."""


def figure_columns(figures: Sequence[str]) -> tuple[str, ...]:
    """The attribution columns the step ``figures`` are read from (telemetry/rank_vector.py
    ``STEP_FIGURE_COLUMNS``), leaving out a column the attribution does not have: its figure
    travels as NaN, unknown, as any figure a device cannot give."""
    wanted = dict.fromkeys(STEP_FIGURE_COLUMNS[f] for f in figures)
    return tuple(c for c in wanted if c in ATTRIBUTION_COLUMN_NAMES)


@dataclass(frozen=True)
class StepOutcome:
    """What every rank knows of its last ended step: the loss over all ranks (None: no rank had
    one), the slowest rank's step time and this rank's own (s), and its gradient norm."""

    step: int
    loss: float | None
    step_time_s: float
    local_step_time_s: float
    grad_norm: float | None


class _Phase:
    """A reusable context manager around one phase timer (``with st.phase("optimizer")``)."""

    __slots__ = ("_timer",)

    def __init__(self, timer: Any) -> None:
        self._timer = timer

    def __enter__(self) -> None:
        self._timer.start()

    def __exit__(self, *exc: object) -> None:
        self._timer.stop()


class StepTelemetry:
    """One rank's per-step telemetry (module doc).

    ``session``: the rank's started TelemetrySession (``open_session``), or None: no telemetry
    (steps are still timed, losses gathered and reports made). ``placement``: where the rank
    sits (default: the session's rank and world size). ``options``: how its steps are cut and
    telemetered (:class:`~charllm_nemo.steps.options.StepOptions`; None: the defaults).
    ``rates``: ready :class:`StepRates`, or the :class:`~charllm_nemo.steps.options.RateInputs`
    they are counted from (FLOPs, throughput and MFU; the peak looked up for the CUDA device
    when not given); None: no rates. ``observers``: rank 0's (others ignore them). ``group``:
    the torch.distributed group of the one gather a step (None: the default group when
    initialised; none without). ``recorder``: a bare WindowRecorder to record into when there
    is no session (tests). ``max_figure_wait_s`` is an attribute too: a caller may change it
    between steps. Where the figures are computed on the training thread (sampler ``thread``)
    only :data:`THREAD_MODE_FIGURES` are reported by default (about 1 ms a step for all of
    them, 0.1 ms for these, measured by bench/bench_step_marks.py). With ``phase_times`` each
    step's phases are summed by group on every rank (``StepReport.per_rank_timing``); with
    ``rank_info`` every rank sends its static facts once at the first step's end (host, local
    rank, device index, UUID, name, power limit: :func:`rank_facts`; one
    ``all_gather_object``), and rank 0's observers that have ``on_rank_info(list)`` get them
    before their first step. Both must be the same on every rank (alerts set them:
    charllm_nemo.alerts).
    """

    def __init__(
        self,
        session: StepSession | None = None,
        placement: Placement | None = None,
        *,
        options: StepOptions | None = None,
        rates: StepRates | RateInputs | None = None,
        observers: Sequence[Observer] = (),
        group: Any = None,
        recorder: WindowRecorder | None = None,
    ) -> None:
        o = options if options is not None else StepOptions()
        if placement is None:
            placement = (
                Placement(session.rank, session.local_rank, session.world_size)
                if session is not None
                else Placement.from_env()
            )
        self.session = session
        self.placement = placement
        self.group = group
        self.total_steps = o.total_steps
        kinds = tuple(WINDOW_KINDS if o.windows is None else o.windows)
        unknown = [k for k in kinds if k not in WINDOW_KINDS]
        if unknown:
            raise ConfigError(
                f"telemetry.windows has unknown kinds {unknown}; use a subset of {WINDOW_KINDS}"
            )
        marking = session is not None or recorder is not None
        self.recorder = session.windows if session is not None else (recorder or WindowRecorder())
        if recorder is not None and session is None and placement.labels:
            self.recorder.set_labels(**placement.labels)
        self.cuda = str(o.device).startswith("cuda")
        self.marker = StepMarker(
            self.recorder,
            num_microbatches=o.num_microbatches,
            num_chunks=o.num_chunks,
            group_size=o.group_size,
            kinds=kinds if marking else (),
            cuda=self.cuda,
        )
        self.marker.sum_phases = bool(o.phase_times)
        # the host's CPU contention per step, beside the phases (alerts: host contention)
        self._host = HostPressure() if o.phase_times else None
        self._timings: dict[int, tuple[float, ...]] = {}  # step -> its RANK_TIMING_FIELDS, until due
        self._rank_info = bool(o.rank_info)
        self.rank_infos: list[dict[str, Any]] | None = None
        """Every rank's static facts (index = rank) once exchanged (``rank_info``)."""
        self._torch, self.world_size, self.rank = self._process_group(group)
        self.is_reporting_rank = self.rank == 0
        self.observers: list[Observer] = list(observers) if self.is_reporting_rank else []
        self._broken: set[int] = set()
        self.rates = self._rates(rates) if isinstance(rates, RateInputs) else rates
        r = self.rates
        publish = getattr(session, "publish_step_rates", None)
        if r is not None and publish is not None:  # the live exporter's constants, once (docs/export.md)
            peak = (r.peak_tflops_per_gpu or 0.0) * 1e12
            publish(r.global_batch_size * r.seq_length, r.model_flops_per_step / max(1, r.world_size), peak)
        # How soon after a step's end its figures can be ready: a sampling period, or a counter
        # period where the backend reads its counters apart (telemetry.counter_hz).
        hz = DEFAULT_HZ if session is None else float(session.hz)
        every = 1 if session is None else int(session.counter_every)
        self._period_ns = 1e9 / max(hz, 1e-3) * every
        ready_s = 2 * (every - 1) / max(hz, 1e-3)  # 0 where every sample can answer a figure
        self.pending: PendingSteps[StepReport] = PendingSteps(
            MAX_FIGURES_LAG if session is not None else 1, ready_s
        )
        self._final_wait_s = final_wait(hz)
        self.figures = self._figure_names(session, o.figures)
        if o.phase_times and o.figures is None and self.figures == THREAD_MODE_FIGURES:
            self.figures = (*THREAD_MODE_FIGURES, *ALERT_FIGURES)  # what the alerts read
        self.columns = figure_columns(self.figures)
        """The attribution columns asked of the session for :attr:`figures`."""
        self.max_figure_wait_s = o.max_figure_wait_s
        self._comm_device: Any = None
        self._phases: dict[str, _Phase] = {}
        self._step: int | None = None
        self._finished = False
        self._final_status = "running"  # how the run ended, once finish() has said it
        self.last: StepOutcome | None = None
        """Every rank: its last ended step (:class:`StepOutcome`)."""
        self.steps_ended = 0

    # -- setup ------------------------------------------------------------------------------
    @staticmethod
    def _figure_names(session: StepSession | None, figures: Sequence[str] | None) -> tuple[str, ...]:
        if figures is None:
            in_process = session is None or session.sampler_mode == "process"
            return STEP_FIGURE_KEYS if in_process else THREAD_MODE_FIGURES
        unknown = [f for f in figures if f not in STEP_FIGURE_KEYS]
        if unknown:
            raise ConfigError(
                f"unknown step figure(s) {unknown}; use names of telemetry.rank_vector.STEP_FIGURE_KEYS"
            )
        return tuple(figures)

    def _process_group(self, group: Any) -> tuple[Any, int, int]:
        """(torch or None, the group's size, this rank's place in it): 1 and the placement's
        rank without an initialised process group."""
        try:
            import torch
            import torch.distributed as tdist
        except ImportError:
            return None, 1, self.placement.rank
        if not tdist.is_available() or not tdist.is_initialized():
            return torch, 1, self.placement.rank
        return torch, tdist.get_world_size(group), tdist.get_rank(group)

    def _global_world_size(self) -> int:
        """The ranks the job's FLOPs are spread over: torch.distributed's world when initialised,
        else the placement's."""
        torch = self._torch
        if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            return int(torch.distributed.get_world_size())
        return self.placement.world_size

    def _rates(self, inputs: RateInputs) -> StepRates | None:
        name = units = None
        peak, precision = inputs.peak_tflops_per_gpu, inputs.precision
        if self.cuda and peak is None and self._torch is not None and self._torch.cuda.is_available():
            props = self._torch.cuda.get_device_properties(self._torch.cuda.current_device())
            name, units = props.name, props.multi_processor_count
        try:
            rates = StepRates.for_model(
                inputs.model,
                inputs.global_batch_size,
                self._global_world_size(),
                seq_length=inputs.seq_length,
                attention_flops=inputs.attention_flops,
                peak_tflops_per_gpu=peak,
                device_name=name,
                precision=precision,
                compute_units=units,
            )
        except ConfigError as exc:  # a rate error must not stop training; the rates stay absent
            log.warning("charllm: no throughput or MFU: %s", exc)
            return None
        if rates.peak_tflops_per_gpu is None and self.is_reporting_rank:  # MFU null: said once, how to fix
            log.warning(
                "charllm: no MFU: the peak TFLOP/s of %s at %s is not known; tokens/s and TFLOP/s "
                "are reported, MFU stays null. Give peak_tflops_per_gpu=<TFLOP/s of one device> "
                "to compute it",
                repr(name) if name else f"this {'CUDA device' if self.cuda else 'CPU'}",
                precision,
            )
        return rates

    # -- what a training loop calls ----------------------------------------------------------
    def timers(self, inner: Any = None) -> Any:
        """The object for Megatron-Core's ``config.timers``: marks forward / backward (and the
        pipeline's send/recv, the gradient syncs) and forwards every call to ``inner`` (the
        framework's own Timers) when there is one. With no microbatch or phase windows recorded
        it is ``inner`` itself (None stays None: megatron-core then calls no timers)."""
        if not self.marker.phases_on:
            return inner
        return TimersAdapter(self.marker, inner)

    def begin_step(self, step: int, num_microbatches: int | None = None) -> None:
        """A step begins (before zeroing gradients; on CUDA after the previous step's sync).
        ``num_microbatches``: this step's count when it differs from the last."""
        if num_microbatches is not None and num_microbatches != self.marker.num_microbatches:
            self.set_num_microbatches(num_microbatches)
        self._step = step
        self.marker.begin_step(step)

    def set_num_microbatches(self, n: int) -> None:
        """The microbatches of the steps from now on (a batch-size ramp changes it)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"num_microbatches={n!r} must be an integer >= 1")
        self.marker.num_microbatches = n
        self.marker._shape_labels = None  # the step-log shape depends on it: made again

    def phase(self, name: str) -> _Phase:
        """``with st.phase(name):`` marks a phase window of the current step (``optimizer``,
        ``data``, ...). ``forward`` / ``backward`` count as the step's k-th forward / backward,
        and make the microbatch windows, as Megatron-Core's timers do."""
        ph = self._phases.get(name)
        if ph is None:
            ph = self._phases[name] = _Phase(self.marker.phase(name))
        return ph

    @contextmanager
    def step(self, step: int, **end: Any) -> Iterator[None]:
        """``with st.step(i): ...`` = :meth:`begin_step` then :meth:`end_step` (``end``: its
        keywords, fixed up front; use the explicit calls to pass the loss)."""
        self.begin_step(step)
        yield
        self.end_step(**end)

    def end_step(
        self,
        loss: float | None = None,
        num_microbatches: int | None = None,
        grad_norm: float | None = None,
        *,
        loss_sum: float = 0.0,
        loss_tokens: float = 0.0,
    ) -> StepReport | None:
        """The step ended (after the optimizer). ``loss``: this rank's loss, averaged already
        (ranks without one pass None; the report's loss is the mean over those that have one),
        or ``loss_sum`` / ``loss_tokens``: summed token loss and token count (weighted over
        ranks; wins over ``loss``). Every rank of the group must call it (one all_gather).
        Returns this step's report on rank 0 (rates filled; telemetry figures None until they
        are due, when the observers get it), None elsewhere."""
        if self._step is None:
            raise RuntimeError("end_step() without begin_step()")
        step, self._step = self._step, None
        timing = self.marker.end_step()
        host = self._host.sample() if self._host is not None and timing.phases is not None else ()
        self._timings[step] = (timing.seconds, *(timing.phases or ()), *host)
        if self._rank_info and self.rank_infos is None:
            self._exchange_rank_info()
        self._request(timing, step)
        due = self.pending.due()
        figures = None
        if due is not None:
            wait_s = self.pending.wait_s(due, self._period_ns)
            if self.max_figure_wait_s is not None:
                wait_s = min(wait_s, self.max_figure_wait_s)
            figures = self._figures(due, wait_s)
        rows = self._exchange(
            pack_rank_vector(
                loss_sum=loss_sum,
                loss_tokens=loss_tokens,
                loss=loss,
                step_time_s=timing.seconds,
                figures=figures,
                timing=None if due is None else self._timings.pop(due[0].step, None),
                health=self._health() if due is not None and self.marker.sum_phases else None,
            )
        )
        head = combine_head(rows)
        if due is not None:
            self._report(due[0], rows)
        gn = _finite(grad_norm)
        report = StepReport(
            step=step,
            loss=head.loss,
            step_time_s=head.step_time_s,
            grad_norm=gn,
            num_microbatches=num_microbatches,
        )
        if self.rates is not None and self.is_reporting_rank:
            self.rates.fill(report)
        self.pending.add((report, timing.t_begin_mono_ns, timing.t_end_mono_ns), head.step_time_s)
        self.last = StepOutcome(step, head.loss, head.step_time_s, timing.seconds, gn)
        self.steps_ended += 1
        return report if self.is_reporting_rank else None

    def finish(
        self, status: str = "complete", timeout_s: float | None = None, *, close_session: bool = True
    ) -> str:
        """Training ended. ``complete``: wait for the last steps' figures (all within
        ``timeout_s``; None: a few sampling periods, 2-5 s), one more gather each, report them.
        Any other status (``interrupted``, ``terminated``, ``failed``) reports nothing more and
        gathers nothing (another rank may be gone). Then the session is closed with ``status``
        (``close_session``; its files are final before the observers' close uploads them), and
        the observers. Returns how the run ended as the manifest says it: the session's word,
        which wins over ``status`` (``terminated`` after a SIGTERM, ``disk_full``), so that a
        caller's own files (summary.json) say the same. Idempotent: a second call returns the
        first one's."""
        if self._finished:
            return self._final_status
        self._finished = True
        self._final_status = status
        try:
            if status == "complete":
                self._drain(self._final_wait_s if timeout_s is None else max(0.0, float(timeout_s)))
        finally:
            try:
                if close_session and self.session is not None:
                    self._final_status = self.session.close(status) or status
            finally:
                for i, obs in enumerate(self.observers):
                    try:
                        obs.close(self._final_status)
                    except Exception:
                        log.exception("charllm: observer %s failed to close", type(obs).__name__)
                        self._broken.add(i)
        return self._final_status

    @property
    def unmatched_marks(self) -> int:
        """Timer stops without their start (and marks outside a step), counted not recorded."""
        return int(self.marker.unmatched)

    # -- inside --------------------------------------------------------------------------------
    def _request(self, timing: StepTiming, step: int) -> None:
        """Ask now: the telemetry process computes the figures while the next steps run. The
        last step's are not held for later ones (none come): answered at once."""
        if self.session is None:
            return
        last = self.total_steps is not None and step >= self.total_steps - 1
        self.session.request_figures(
            timing.t_begin_mono_ns,
            timing.t_end_mono_ns,
            self.columns,
            batch=1 if last else self.pending.batch,
        )

    def _figures(self, due: tuple[StepReport, int, int], wait_s: float) -> Any:
        if self.session is None:
            return None
        return self.session.step_figures(due[1], due[2], wait_s=wait_s, figures=self.columns)

    def _drain(self, budget_s: float) -> None:
        """The last steps: their figures, one more gather each, all within one deadline (they are
        answered together); returns as soon as they are answered."""
        deadline = time.monotonic() + budget_s
        while self.pending.steps:
            last = self.pending.steps.popleft()
            figures = self._figures(last, max(0.0, deadline - time.monotonic()))
            timing = self._timings.pop(last[0].step, None)
            health = self._health() if self.marker.sum_phases else None
            rows = self._exchange(pack_rank_vector(figures=figures, timing=timing, health=health))
            self._report(last[0], rows)

    def _exchange(self, vector: list[float]) -> list[list[float]]:
        """Every rank's vector, on every rank: one all_gather (none with one rank)."""
        if self.world_size <= 1:
            return [vector]
        torch = self._torch
        if self._comm_device is None:
            self._comm_device = self._device_for(torch)
        mine = torch.tensor(vector, dtype=torch.float64, device=self._comm_device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        torch.distributed.all_gather(out, mine, group=self.group)
        rows: list[list[float]] = torch.stack(out).cpu().tolist()  # one device-to-host copy
        return rows

    def _health(self) -> tuple[float, float, float] | None:
        """The session's sampler health (its ``health`` property: a read of the shared block's
        counters in process mode) as HEALTH_FIELDS; None without a session, or where it cannot say."""
        session = self.session
        if session is None:
            return None
        try:
            counts = getattr(session, "health_counts", None)
            return counts() if counts is not None else health_counts(session.health)
        except Exception:  # health is a report, never a reason to fail a step; but say so once
            if not getattr(self, "_health_failed", False):
                self._health_failed = True
                log.warning(
                    "charllm: the sampler's health cannot be read; no sampler_health alerts", exc_info=True
                )
            return None

    def _exchange_rank_info(self) -> None:
        """Every rank's :func:`rank_facts`, once (one ``all_gather_object``); rank 0 hands them
        to the observers that take them. A failure leaves them unknown, never stops training."""
        mine = rank_facts(self.session, self.placement)
        infos = [mine]
        if self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            self._torch.distributed.all_gather_object(gathered, mine, group=self.group)
            infos = [g if isinstance(g, dict) else {} for g in gathered]
        self.rank_infos = infos
        for i, obs in enumerate(self.observers):
            fn = getattr(obs, "on_rank_info", None)
            if fn is None or i in self._broken:
                continue
            try:
                fn(infos)
            except Exception:
                log.exception("charllm: observer %s failed; it gets no more steps", type(obs).__name__)
                self._broken.add(i)

    def _device_for(self, torch: Any) -> Any:
        backend = str(torch.distributed.get_backend(self.group)).lower()
        if "nccl" in backend:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _report(self, report: StepReport, rows: list[list[float]]) -> None:
        """Rank 0: the step's cross-rank figures into its report, then to every observer. An
        observer with ``on_step_rows(report, rows)`` (the integrations' observer thread) puts
        the figures in itself, off the training thread, when it is the only observer; else they
        are put in here and it gets None (one thread writes the report, never two)."""
        if not self.is_reporting_rank:
            return
        observers = self.observers
        deferred = [getattr(obs, "on_step_rows", None) for obs in observers]
        applied = None in deferred or len(deferred) > 1
        if applied:
            apply_rank_figures(report, rows)
        for i, obs in enumerate(observers):
            if i in self._broken:
                continue
            try:
                take_rows = deferred[i]
                if take_rows is None:
                    obs.on_step(report)
                else:
                    take_rows(report, None if applied else rows)
            except Exception:  # an observer never stops training
                log.exception("charllm: observer %s failed; it gets no more steps", type(obs).__name__)
                self._broken.add(i)


def rank_facts(session: StepSession | None, placement: Placement) -> dict[str, Any]:
    """This rank's static facts, sent once (``StepTelemetry(rank_info=True)``): ``rank``,
    ``local_rank``, ``host``, and of its first device ``gpu_index``, ``gpu_uuid``, ``gpu_name``,
    ``backend`` and ``power_limit_w`` (W, one reading at the start; None where unknown)."""
    import socket

    from charllm_nemo.devices.contract import METRIC_INDEX

    info: dict[str, Any] = {
        "rank": placement.rank,
        "local_rank": placement.local_rank,
        "host": socket.gethostname(),
        "gpu_index": None,
        "gpu_uuid": None,
        "gpu_name": None,
        "backend": None,
        "power_limit_w": None,
    }
    devices = [] if session is None else list(session.backend.devices)
    if devices:
        ident = devices[0].identity
        info.update(gpu_index=ident.index, gpu_uuid=ident.uuid, gpu_name=ident.name, backend=ident.backend)
        try:
            info["power_limit_w"] = _finite(devices[0].read()[METRIC_INDEX["power_limit_w"]])
        except Exception:  # a device that cannot be read now: the limit stays unknown
            log.debug("no power limit for the rank facts", exc_info=True)
    return info
