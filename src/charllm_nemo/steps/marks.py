"""Step, microbatch and phase marks of one rank, fed by Megatron-Core's own timer calls.

Megatron-Core's schedules call ``config.timers(name, log_level=...).start()`` / ``.stop()``
around each microbatch's ``forward-compute`` and ``backward-compute``, around pipeline
send/recv (``forward-recv``, ``forward-send-backward-recv``, ...) and around the gradient
all-reduces in ``finalize_model_grads`` (``all-grads-sync``, ...). :class:`StepMarker` is the
object put in ``TransformerConfig.timers``: its per-name timers turn those calls into windows.

What becomes a window (docs/training-internals.md has the picture):

* ``step``: from :meth:`StepMarker.begin_step` to :meth:`StepMarker.end_step` (zero-grad,
  forward/backward of every microbatch, grad sync, optimizer).
* ``phase`` ``forward`` / ``backward``: one per microbatch (and per virtual pipeline chunk, label
  ``vpp_chunk``), with the microbatch index. The k-th forward of the step is the schedule's k-th
  forward: microbatch k without interleaving, ``get_schedule_table``'s k-th entry with it; the
  k-th backward likewise (with the chunk order reversed, as mcore runs backward).
* ``microbatch``: from the first forward begin to the last backward end of that microbatch on
  this rank. Under 1F1B (PP > 1) microbatch windows of one rank overlap: stage 0 runs the
  forwards of microbatches 0..pp-1 before the backward of microbatch 0. Phases are the exact,
  non-overlapping record; the microbatch window is their span.
* other ``phase`` names: ``pp-<mcore p2p timer name>`` (pipeline send/recv, waiting included),
  ``grad-sync`` (``all-grads-sync``), ``embedding-grad-sync``, ``layernorm-grad-sync``,
  ``optimizer`` (marked by the loop around ``optimizer.step()``).

Parents: a phase's and a microbatch's ``parent_id`` is its step's window; a phase's microbatch is
its ``microbatch`` column (overlapping microbatch windows cannot all be on the recorder's stack).

Timing. A timer's ``start`` / ``stop`` only append (key, clock reading) to the step's flat log
(telemetry/steplog.py): they run between two pieces of training work, when the CPU caches hold
the training's data and not this code, and there every line they touch costs (on a tiny CPU
model here, a mark that built and stored its window as it happened took 10-50 µs; noting it
takes a few; see :class:`MarkTimer`). At
:meth:`StepMarker.end_step` the log
becomes the step's windows, in one go: in the telemetry process when the session has one (the
training thread only copies the log into the shared mark ring), else here. The clock
is ``time.monotonic_ns()`` on CPU runs (timing ``host``) and a CUDA event on GPU runs, resolved
at step end by one ``torch.cuda.synchronize()`` relative to an anchor event recorded at step
begin, right after the previous step's sync, paired with ``time.monotonic_ns()`` read just
before it (timing ``cuda_event``); no per-microbatch sync. The recorder's listeners (the
synthetic device follows the phases) are told of every begin and end as it happens. A session
closed in the middle of a step (SIGTERM, an exception) gets what the step marked so far
(:meth:`StepMarker.flush_pending`); a SIGKILL of the training process loses the windows of the
step in progress.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from charllm_nemo.telemetry import steplog
from charllm_nemo.telemetry.steplog import KIND_MICROBATCH, KIND_PHASE, StepLog, mark_key
from charllm_nemo.telemetry.windows import WindowRecorder

P2P_TIMERS: frozenset[str] = frozenset(
    {
        "forward-recv",
        "forward-send",
        "backward-recv",
        "backward-send",
        "forward-send-backward-recv",
        "backward-send-forward-recv",
        "forward-send-forward-recv",
        "backward-send-backward-recv",
        "forward-backward-send-forward-backward-recv",
    }
)
GRAD_SYNC_TIMERS: dict[str, str] = {
    "all-grads-sync": "grad-sync",
    "embedding-grads-all-reduce": "embedding-grad-sync",
    "non-tensor-parallel-grads-all-reduce": "layernorm-grad-sync",
    "conditional-embedder-grads-all-reduce": "embedding-grad-sync",
}


def schedule_order(num_microbatches: int, num_chunks: int, group_size: int | None) -> list[tuple[int, int]]:
    """(microbatch, chunk) of the k-th forward of a step, k = 0 .. n*chunks-1 (mcore's order)."""
    if num_chunks <= 1:
        return [(k, 0) for k in range(num_microbatches)]
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    table = get_schedule_table(num_microbatches, num_chunks, group_size or 1)
    return [(int(mb), int(chunk)) for mb, chunk in table]


@dataclass
class StepTiming:
    """What :meth:`StepMarker.end_step` returns: the step's window id (None when step windows
    are off) and its CLOCK_MONOTONIC bounds in ns."""

    step: int
    window_id: int | None
    t_begin_mono_ns: int
    t_end_mono_ns: int
    phases: tuple[float, ...] | None = None  # PHASE_GROUPS seconds, when the marker sums them

    @property
    def seconds(self) -> float:
        return (self.t_end_mono_ns - self.t_begin_mono_ns) / 1e9


PHASE_GROUPS: tuple[str, ...] = ("forward_s", "backward_s", "optimizer_s", "pp_wait_s", "grad_sync_s")
"""A step's phase time summed by group (s): ``forward``, ``backward``, ``optimizer``, pipeline
send/recv (``pp-*``, waiting included) and gradient syncs (``*grad-sync``)."""


def phase_group(name: str) -> int | None:
    """The index in :data:`PHASE_GROUPS` of a phase name; None for a phase in none."""
    if name == "forward":
        return 0
    if name == "backward":
        return 1
    if name == "optimizer":
        return 2
    if name.startswith("pp-"):
        return 3
    if name.endswith("grad-sync"):
        return 4
    return None


def sum_phases(log: list[Any], group_of_code: dict[int, int | None], names: list[str]) -> tuple[float, ...]:
    """A step's flat mark log (``[key, t_ns, ...]``, every stop after its start: MarkTimer logs
    no other) summed into :data:`PHASE_GROUPS` seconds. ``group_of_code`` caches each name
    code's group (filled here)."""
    sums = [0.0] * len(PHASE_GROUPS)
    began: dict[int, int] = {}
    for j in range(0, len(log) - 1, 2):
        key, t = log[j], log[j + 1]
        timer = key >> 1
        if key & 1:
            began[timer] = t
            continue
        t0 = began.pop(timer, None)
        if t0 is None:
            continue
        code = timer >> 16
        g = group_of_code.get(code, -1)
        if g == -1:
            g = group_of_code[code] = phase_group(names[code]) if code < len(names) else None
        if g is not None:
            sums[g] += (t - t0) / 1e9
    return tuple(sums)


class MarkTimer:
    """What ``config.timers(name)`` returns: ``start``/``stop`` with mcore's signature.
    ``phase`` None: not a window (``forward-backward``, ...): both return at once.

    ``start`` / ``stop`` run between two pieces of training work, when the caches hold the
    training's data and little of this code: they only append (key, clock) to the step's flat
    log, and the windows are made from the log at step end. A stop is logged only while its
    timer is open in this step (else it is counted in ``unmatched``), so that whoever makes the
    windows never meets one. Both are spelled out, not calls of one helper: a call fewer per
    mark."""

    __slots__ = ("_k_begin", "_k_end", "_m", "_open_in", "_phase")

    def __init__(self, marker: StepMarker, phase: str | None, key_begin: int, key_end: int) -> None:
        self._m = marker
        self._phase = phase
        self._k_begin = key_begin
        self._k_end = key_end
        self._open_in = 0  # the serial of the step in which the timer was started

    def start(self, barrier: bool = False) -> None:
        if self._phase is not None:
            m = self._m
            serial = m._serial
            if not serial:
                m.unmatched += 1
                return
            self._open_in = serial
            m._log.extend((self._k_begin, m._clock()))
            for fn in m._listeners:  # the recorder's (WindowRecorder.notify, one call less)
                fn("phase", self._phase, True)

    def stop(self, barrier: bool = False) -> None:
        if self._phase is not None:
            m = self._m
            serial = m._serial
            if not serial or self._open_in != serial:
                m.unmatched += 1
                return
            self._open_in = 0
            m._log.extend((self._k_end, m._clock()))
            for fn in m._listeners:  # the recorder's (WindowRecorder.notify, one call less)
                fn("phase", self._phase, False)


@dataclass
class _StepState:
    step: int
    t0_ns: int
    anchor: Any = None


class StepMarker:
    """Turns one rank's step and mcore timer calls into windows on a :class:`WindowRecorder`.

    ``kinds``: which window kinds to record (``telemetry.windows``). ``cuda``: time with CUDA
    events (GPU runs). ``num_microbatches`` per step and ``num_chunks`` (virtual pipeline chunks
    on this rank) give the schedule order; ``group_size`` is mcore's
    ``microbatch_group_size_per_vp_stage``.

    ``marker(name)`` is the name's :class:`MarkTimer`, made the first time. ``_log``: the step's
    flat ``[key, clock, ...]``; ``_listeners``: the recorder's, told of every begin / end;
    ``_clock``: what a mark reads (``time.monotonic_ns``, or the next CUDA event); ``_serial``:
    the step in progress (0 between steps); ``unmatched``: marks outside a step or stops without
    their start, counted, not logged.
    """

    HOST_CLOCK: Callable[[], int] | None = time.monotonic_ns  # what ``_clock`` is on host timing

    def __init__(
        self,
        recorder: WindowRecorder,
        *,
        num_microbatches: int,
        num_chunks: int = 1,
        group_size: int | None = None,
        kinds: tuple[str, ...] | list[str] = ("step", "microbatch", "phase"),
        cuda: bool = False,
    ) -> None:
        self._log: list[Any] = []
        self._timers: dict[str, MarkTimer] = {}
        self._serial = 0
        self.unmatched = 0
        if num_microbatches < 1 or num_chunks < 1:  # a step's window ids are reserved per microbatch
            raise ValueError(f"num_microbatches={num_microbatches} and num_chunks={num_chunks} must be >= 1")
        self.recorder = recorder
        self.kinds = frozenset(kinds)
        self._record_phases = "phase" in self.kinds
        self.cuda = cuda
        self.num_microbatches = num_microbatches
        self.num_chunks = num_chunks
        order = schedule_order(num_microbatches, num_chunks, group_size) if num_chunks > 1 else []
        self._order_flat: tuple[int, ...] = tuple(v for pair in order for v in pair)
        self._kinds_mask = (KIND_MICROBATCH if "microbatch" in self.kinds else 0) | (
            KIND_PHASE if self._record_phases else 0
        )
        self._host = recorder.names.code("host")
        self._cuda_timing = recorder.names.code("cuda_event")
        self._clock: Any = self._cuda_event if cuda else self.HOST_CLOCK
        self._state: _StepState | None = None
        self._steps_begun = 0  # the serial of the step in progress is this (0 between steps)
        self._events: list[Any] = []
        self._next_event = 0
        self._listeners: list[Any] = recorder.listeners  # the live list: listeners added later are seen
        self._shape_labels: tuple[int, ...] | None = None  # the labels self._shape was made with
        self._shape: list[int] = []
        self.sum_phases = False  # StepTiming.phases: the step's PHASE_GROUPS sums (alerts ask for them)
        self._group_of_code: dict[int, int | None] = {}
        recorder.add_pending_source(self.flush_pending)

    # -- config.timers protocol ---------------------------------------------------------------
    def __call__(self, name: str, log_level: int | None = None) -> MarkTimer:
        timer = self._timers.get(name)
        if timer is None:
            timer = self._new_timer(name)
        return timer

    def _new_timer(self, name: str) -> MarkTimer:
        """The timer of a name mcore asks for the first time: its phase is classified once;
        timers that are not windows (``forward-backward``, ...) do nothing."""
        phase = self._classify(name)
        code = 0 if phase is None else self.recorder.names.code(phase)
        index = len(self._timers)
        timer = MarkTimer(self, phase, mark_key(code, index, True), mark_key(code, index, False))
        self._timers[name] = timer
        return timer

    @property
    def phases_on(self) -> bool:
        return "phase" in self.kinds or "microbatch" in self.kinds

    # -- clock ----------------------------------------------------------------------------------
    def _cuda_event(self) -> Any:
        """Record the next of the step's reusable CUDA events (the clock of a CUDA run)."""
        import torch

        if self._next_event == len(self._events):
            self._events.append(torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]
        ev = self._events[self._next_event]
        self._next_event += 1
        ev.record()
        return ev

    # -- step -----------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Call right before zeroing grads; on CUDA right after the previous step's sync."""
        self._next_event = 0
        self._log = []
        # The host clock first, then the anchor: a time resolved from an event is then never
        # ahead of the host clock, and the clamp of the step's end (end_step) never cuts a mark.
        t0 = time.monotonic_ns()
        anchor = self._clock() if self.cuda else None
        self._state = _StepState(step=step, t0_ns=t0, anchor=anchor)
        self._steps_begun += 1
        self._serial = self._steps_begun
        for fn in self._listeners:  # (WindowRecorder.notify, one call less)
            fn("step", "step", True)

    def phase(self, name: str) -> Any:
        """A free-form phase timer for the loop's own phases (``optimizer``)."""
        return self(f"charllm:{name}")

    def end_step(self) -> StepTiming:
        """Close the step and record its windows from its log; on CUDA synchronize once first
        and resolve every mark of the step."""
        st = self._state
        if st is None:
            raise RuntimeError("end_step() without begin_step()")
        self._state = None
        self._serial = 0
        if not self.cuda:
            t1 = time.monotonic_ns()
            for fn in self._listeners:
                fn("step", "step", False)
            sums = (
                sum_phases(self._log, self._group_of_code, self.recorder.names.names)
                if self.sum_phases
                else None
            )
            return StepTiming(st.step, self._record_step(st, t1, self._host), st.t0_ns, t1, sums)
        import torch

        end_ev = self._clock()
        torch.cuda.synchronize()
        t1_host = time.monotonic_ns()
        log = self._log
        anchor, t0 = st.anchor, st.t0_ns
        log[1::2] = [t0 + round(anchor.elapsed_time(ev) * 1e6) for ev in log[1::2]]
        t1 = min(max(t0 + round(anchor.elapsed_time(end_ev) * 1e6), t0), t1_host)
        sums = sum_phases(log, self._group_of_code, self.recorder.names.names) if self.sum_phases else None
        return StepTiming(st.step, self._record_step(st, t1, self._cuda_timing), t0, t1, sums)

    def _record_step(self, st: _StepState, t1: int | None, timing: int) -> int | None:
        """Record the step's windows from its log (times in ns by now): send the log to the
        telemetry process when the recorder has a log sink, else make the windows here. ``t1``
        None: the step is still running (:meth:`flush_pending`); it and its phases still open
        become open windows (made here). Returns the step window's id."""
        rec, log = self.recorder, self._log
        self._log = []
        if not self.kinds:  # telemetry off (the loop still times its steps): nothing to record
            return None
        n_ids = steplog.ids_needed(len(log), self.num_microbatches, self._kinds_mask)
        wid = parent = None
        if "step" not in self.kinds:
            first = rec.reserve_ids(n_ids)
        elif t1 is None:  # the step begun as an open window, its finished children under it
            parent = rec.begin("step", step=st.step, t_mono_ns=st.t0_ns)
            first = rec.reserve_ids(n_ids)
        else:  # the step's own id, then its children's
            wid = rec.reserve_ids(1 + n_ids)
            first = wid + 1
        wall_offset, labels = rec.wall_offset(st.t0_ns), rec.label_values
        if rec.log_sink is not None and t1 is not None:  # steplog.pack's pieces, as they are
            if labels is not self._shape_labels:  # (the labels are set once, before the steps)
                self._shape_labels = labels
                self._shape = steplog.shape(
                    self.num_microbatches, self.num_chunks, self._kinds_mask, labels, self._order_flat
                )
            head = steplog.head(st.step, st.t0_ns, t1, wall_offset, timing, wid, parent, first)
            rec.ship_step_log(head, self._shape, log)
            return wid
        slog = StepLog(
            st.step, st.t0_ns, t1, wall_offset, timing, wid, parent, first,
            self.num_microbatches, self.num_chunks, self._kinds_mask, labels, self._order_flat, log,
        )  # fmt: skip
        records, still_open = steplog.step_records(slog)
        rec.emit_records(records)
        if t1 is None and self._record_phases:
            names = rec.names.names
            for code, mb, chunk, b in still_open:
                vpp = {} if chunk is None else {"vpp_chunk": chunk}
                rec.begin("phase", names[code], step=st.step, microbatch=mb, t_mono_ns=b, **vpp)
        return wid if t1 is not None else parent

    def flush_pending(self) -> None:
        """Hand the recorder what the step in progress has marked so far (host timing only; the
        session calls this at close, e.g. on SIGTERM): the phases and microbatches that ended as
        finished windows, the step and the phases still open as open ones (NULL end). The step
        then records nothing more."""
        st = self._state
        if st is None or self.cuda:
            return
        self._state = None
        self._serial = 0
        self._record_step(st, None, self._host)

    # -- timer callbacks ------------------------------------------------------------------------
    def _classify(self, name: str) -> str | None:
        if name == "forward-compute":
            return "forward"
        if name == "backward-compute":
            return "backward"
        if name in P2P_TIMERS:
            return f"pp-{name}"
        if name in GRAD_SYNC_TIMERS:
            return GRAD_SYNC_TIMERS[name]
        if name.startswith("charllm:"):
            return name[len("charllm:") :]
        return None  # forward-backward (the whole schedule) and anything unknown: not a window
