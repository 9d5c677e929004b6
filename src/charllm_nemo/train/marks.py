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

Timing. A timer's ``start`` / ``stop`` only append (timer, begin?, clock reading) to the step's
log: they run between two pieces of training work, when the CPU caches hold the training's data
and not this code, and there every line they touch costs (on a tiny CPU model here, a mark that
built and stored its window as it happened took 10-50 µs; noting it takes a few). At
:meth:`StepMarker.end_step` the log becomes the step's windows, recorded in one go. The clock
is ``time.monotonic_ns()`` on CPU runs (timing ``host``) and a CUDA event on GPU runs, resolved
at step end by one ``torch.cuda.synchronize()`` relative to an anchor event recorded at step
begin, right after the previous step's sync, paired with ``time.monotonic_ns()`` then (timing
``cuda_event``); no per-microbatch sync. The recorder's listeners (the synthetic device follows
the phases) are told of every begin and end as it happens. A session closed in the middle of a
step (SIGTERM, an exception) gets what the step marked so far (:meth:`StepMarker.flush_pending`);
a SIGKILL of the training process loses the windows of the step in progress.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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

    @property
    def seconds(self) -> float:
        return (self.t_end_mono_ns - self.t_begin_mono_ns) / 1e9


class _Timer:
    """What ``config.timers(name)`` returns: ``start``/``stop`` with mcore's signature. The
    timer's phase is classified once, when mcore first asks for the name; timers that are not
    windows (``forward-backward``, ...) return at once.

    ``start`` / ``stop`` run between two pieces of training work, when the caches hold the
    training's data and little of this code: they only append (timer, begin?, clock) to the
    step's log, and the windows are built from the log at step end. Both are spelled out, not
    calls of one helper: a call fewer per mark."""

    __slots__ = ("_marker", "_name", "_phase")

    def __init__(self, marker: StepMarker, name: str) -> None:
        self._marker = marker
        self._name = name
        self._phase = marker._classify(name)

    def start(self, barrier: bool = False) -> None:
        if self._phase is not None:
            m = self._marker
            if m._state is None:
                m.unmatched += 1
                return
            m._log.append((self, True, m._clock()))
            for fn in m._listeners:  # the recorder's (WindowRecorder.notify, one call less)
                fn("phase", self._phase, True)

    def stop(self, barrier: bool = False) -> None:
        if self._phase is not None:
            m = self._marker
            if m._state is None:
                m.unmatched += 1
                return
            m._log.append((self, False, m._clock()))
            for fn in m._listeners:  # the recorder's (WindowRecorder.notify, one call less)
                fn("phase", self._phase, False)


@dataclass
class _StepState:
    step: int
    t0_ns: int
    anchor: Any = None


@dataclass
class _Windows:
    """A step's log turned into windows: phases (name, microbatch, vpp chunk, begin, end) in the
    order they began, microbatch spans (microbatch, first forward begin, last backward end), and
    the phases begun and not ended (name, microbatch, vpp chunk, begin)."""

    phases: list[tuple[str, int | None, int | None, Any, Any]]
    spans: list[tuple[int, Any, Any]]
    still_open: list[tuple[str, int | None, int | None, Any]]


class StepMarker:
    """Turns one rank's step and mcore timer calls into windows on a :class:`WindowRecorder`.

    ``kinds``: which window kinds to record (``telemetry.windows``). ``cuda``: time with CUDA
    events (GPU runs). ``num_microbatches`` per step and ``num_chunks`` (virtual pipeline chunks
    on this rank) give the schedule order; ``group_size`` is mcore's
    ``microbatch_group_size_per_vp_stage``.
    """

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
        self.recorder = recorder
        self.kinds = frozenset(kinds)
        self._record_phases = "phase" in self.kinds
        self.cuda = cuda
        self.num_microbatches = num_microbatches
        self.num_chunks = num_chunks
        self._order = schedule_order(num_microbatches, num_chunks, group_size)
        self._log: list[tuple[_Timer, bool, Any]] = []  # the step's marks: (timer, begin?, clock)
        self._clock: Callable[[], Any] = self._cuda_event if cuda else time.monotonic_ns
        self._timers: dict[str, _Timer] = {}
        self._state: _StepState | None = None
        self._events: list[Any] = []
        self._next_event = 0
        self.unmatched = 0  # stops without a start, or marks outside a step (should stay 0)
        self._listeners = recorder.listeners  # the live list: listeners added later are seen
        recorder.add_pending_source(self.flush_pending)

    # -- config.timers protocol -----------------------------------------------------------------
    def __call__(self, name: str, log_level: int | None = None) -> _Timer:
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = _Timer(self, name)
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
        self._log.clear()
        anchor = self._clock() if self.cuda else None
        self._state = _StepState(step=step, t0_ns=time.monotonic_ns(), anchor=anchor)
        if self._listeners:
            self.recorder.notify("step", "step", True)

    def phase(self, name: str) -> _Timer:
        """A free-form phase timer for the loop's own phases (``optimizer``)."""
        return self(f"charllm:{name}")

    def end_step(self) -> StepTiming:
        """Close the step and record its windows from its log; on CUDA synchronize once first
        and resolve every mark of the step."""
        st = self._state
        if st is None:
            raise RuntimeError("end_step() without begin_step()")
        self._state = None
        if not self.cuda:
            t1 = time.monotonic_ns()
            if self._listeners:
                self.recorder.notify("step", "step", False)
            return StepTiming(st.step, self._record_step(st, t1, int, "host"), st.t0_ns, t1)
        import torch

        end_ev = self._clock()
        torch.cuda.synchronize()
        t1_host = time.monotonic_ns()

        def to_ns(ev: Any) -> int:
            ms: float = st.anchor.elapsed_time(ev)
            return st.t0_ns + round(ms * 1e6)

        t1 = min(max(to_ns(end_ev), st.t0_ns), t1_host)
        wid = self._record_step(st, t1, to_ns, "cuda_event")
        return StepTiming(st.step, wid, st.t0_ns, t1)

    def _windows(self) -> _Windows:
        """The step's log as windows: each stop pairs with its timer's open start; the k-th
        forward (backward) of the step is the schedule's k-th (with the chunk order reversed);
        a microbatch spans its first forward begin to its last backward end."""
        order, n_order, n_chunks = self._order, len(self._order), self.num_chunks
        fwd_k = bwd_k = 0
        first_begin: dict[int, Any] = {}
        backwards_left = dict.fromkeys(range(self.num_microbatches), n_chunks)
        open_: dict[str, tuple[int, str, int | None, int | None, Any]] = {}
        phases: list[tuple[int, str, int | None, int | None, Any, Any]] = []
        spans: list[tuple[int, Any, Any]] = []
        for pos, (timer, is_begin, t) in enumerate(self._log):
            phase = timer._phase
            assert phase is not None
            if is_begin:
                mb: int | None = None
                chunk: int | None = None
                if phase == "forward":
                    mb, chunk = order[fwd_k % n_order]
                    fwd_k += 1
                    first_begin.setdefault(mb, t)
                elif phase == "backward":
                    mb, fchunk = order[bwd_k % n_order]
                    chunk = n_chunks - 1 - fchunk
                    bwd_k += 1
                open_[timer._name] = (pos, phase, mb, chunk if n_chunks > 1 else None, t)
                continue
            begun = open_.pop(timer._name, None)
            if begun is None:
                self.unmatched += 1
                continue
            phases.append((*begun, t))
            mb = begun[2]
            if phase == "backward" and mb is not None:
                left = backwards_left.get(mb, 1) - 1
                backwards_left[mb] = left
                if left == 0 and mb in first_begin:
                    spans.append((mb, first_begin[mb], t))
        phases.sort(key=lambda p: p[0])
        still_open = sorted(open_.values(), key=lambda p: p[0])
        return _Windows([p[1:] for p in phases], spans, [p[1:] for p in still_open])

    def _record_step(self, st: _StepState, t1: int | None, to_ns: Any, timing: str) -> int | None:
        """Record the step's windows (step, microbatches, phases) with times ``to_ns(clock)``, in
        one go. ``t1`` None: the step is still running (:meth:`flush_pending`); it and its phases
        still open become open windows."""
        w = self._windows()
        self._log.clear()
        children: list[tuple[str, str, int, int, int | None, int | None]] = []
        if "microbatch" in self.kinds:
            children += [("microbatch", "microbatch", to_ns(b), to_ns(e), mb, None) for mb, b, e in w.spans]
        if self._record_phases:
            children += [("phase", name, to_ns(b), to_ns(e), mb, chunk) for name, mb, chunk, b, e in w.phases]
        wid = self.recorder.record_step(
            st.step, st.t0_ns, t1, children, timing=timing, step_window="step" in self.kinds
        )
        if t1 is None and self._record_phases:
            for name, mb, chunk, b in w.still_open:
                labels = {} if chunk is None else {"vpp_chunk": chunk}
                self.recorder.begin("phase", name, step=st.step, microbatch=mb, t_mono_ns=b, **labels)
        return wid

    def flush_pending(self) -> None:
        """Hand the recorder what the step in progress has marked so far (host timing only; the
        session calls this at close, e.g. on SIGTERM): the phases and microbatches that ended as
        finished windows, the step and the phases still open as open ones (NULL end). The step
        then records nothing more."""
        st = self._state
        if st is None or self.cuda:
            return
        self._state = None
        self._record_step(st, None, int, "host")

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
