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

Timing. Host (CPU runs): marks are taken as they happen with ``WindowRecorder.begin``/``end``
(so the recorder's listeners, e.g. the synthetic device, follow the phases live); microbatch
windows are added with ``record`` when their last backward ends. CUDA: every mark records a CUDA
event; at step end one ``torch.cuda.synchronize()`` resolves them, relative to an anchor event
recorded at step begin right after the previous step's sync, paired with ``time.monotonic_ns()``
then; all windows go in with ``record(..., timing="cuda_event")``. No per-microbatch sync.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
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


@dataclass(slots=True)
class _Mark:
    kind: str
    name: str
    microbatch: int | None
    chunk: int | None
    begin: Any  # host: ns (int); cuda: an Event
    end: Any = None
    wid: int | None = None


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
    windows (``forward-backward``, ...) return at once."""

    __slots__ = ("_marker", "_name", "_phase")

    def __init__(self, marker: StepMarker, name: str) -> None:
        self._marker = marker
        self._name = name
        self._phase = marker._classify(name)

    def start(self, barrier: bool = False) -> None:
        if self._phase is not None:
            self._marker._start(self._name, self._phase)

    def stop(self, barrier: bool = False) -> None:
        if self._phase is not None:
            self._marker._stop(self._name)


@dataclass
class _StepState:
    step: int
    wid: int | None
    t0_ns: int
    anchor: Any = None
    fwd_k: int = 0
    bwd_k: int = 0
    first_begin: dict[int, Any] = field(default_factory=dict)
    backwards_left: dict[int, int] = field(default_factory=dict)
    marks: list[_Mark] = field(default_factory=list)
    mb_spans: list[tuple[int, Any, Any]] = field(default_factory=list)


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
        self._open: dict[str, _Mark] = {}
        self._timers: dict[str, _Timer] = {}
        self._state: _StepState | None = None
        self._events: list[Any] = []
        self._next_event = 0
        self.unmatched = 0  # stops without a start, or marks outside a step (should stay 0)

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
    def _now(self) -> Any:
        if not self.cuda:
            return time.monotonic_ns()
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
        self._open.clear()
        anchor = self._now() if self.cuda else None
        t0 = time.monotonic_ns()
        wid = None
        if "step" in self.kinds and not self.cuda:
            wid = self.recorder.begin("step", step=step, t_mono_ns=t0)
        self._state = _StepState(step=step, wid=wid, t0_ns=t0, anchor=anchor)
        self._state.backwards_left = dict.fromkeys(range(self.num_microbatches), self.num_chunks)

    def phase(self, name: str) -> _Timer:
        """A free-form phase timer for the loop's own phases (``optimizer``)."""
        return self(f"charllm:{name}")

    def end_step(self) -> StepTiming:
        """Close the step; on CUDA synchronize once and resolve every mark of the step."""
        st = self._state
        if st is None:
            raise RuntimeError("end_step() without begin_step()")
        self._state = None
        if not self.cuda:
            t1 = time.monotonic_ns()
            if st.wid is not None:
                self.recorder.end(st.wid, t_mono_ns=t1)
            return StepTiming(st.step, st.wid, st.t0_ns, t1)
        import torch

        end_ev = self._now()
        torch.cuda.synchronize()
        t1_host = time.monotonic_ns()

        def to_ns(ev: Any) -> int:
            ms: float = st.anchor.elapsed_time(ev)
            return st.t0_ns + round(ms * 1e6)

        t1 = max(to_ns(end_ev), st.t0_ns)
        t1 = min(t1, t1_host)
        wid = None
        if "step" in self.kinds:
            wid = self.recorder.record("step", "step", st.t0_ns, t1, step=st.step, timing="cuda_event")
        if "microbatch" in self.kinds:
            for mb, b, e in st.mb_spans:
                self.recorder.record(
                    "microbatch",
                    "microbatch",
                    to_ns(b),
                    to_ns(e),
                    step=st.step,
                    microbatch=mb,
                    timing="cuda_event",
                    parent_id=wid,
                )
        if "phase" in self.kinds:
            for m in st.marks:
                if m.end is None:
                    continue
                labels = {"vpp_chunk": m.chunk} if m.chunk is not None else {}
                self.recorder.record(
                    "phase",
                    m.name,
                    to_ns(m.begin),
                    to_ns(m.end),
                    step=st.step,
                    microbatch=m.microbatch,
                    timing="cuda_event",
                    parent_id=wid,
                    **labels,
                )
        return StepTiming(st.step, wid, st.t0_ns, t1)

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

    def _start(self, name: str, phase: str) -> None:
        st = self._state
        if st is None:
            self.unmatched += 1
            return
        mb: int | None = None
        chunk: int | None = None
        if phase == "forward":
            mb, chunk = self._order[st.fwd_k % len(self._order)]
            st.fwd_k += 1
        elif phase == "backward":
            mb, fchunk = self._order[st.bwd_k % len(self._order)]
            chunk = self.num_chunks - 1 - fchunk
            st.bwd_k += 1
        t = self._now()
        if phase == "forward" and mb is not None and mb not in st.first_begin:
            st.first_begin[mb] = t
        vpp_chunk = chunk if self.num_chunks > 1 else None
        mark = _Mark("phase", phase, mb, vpp_chunk, t)
        if not self.cuda and self._record_phases:
            if vpp_chunk is None:
                mark.wid = self.recorder.begin("phase", phase, step=st.step, microbatch=mb, t_mono_ns=t)
            else:
                mark.wid = self.recorder.begin(
                    "phase", phase, step=st.step, microbatch=mb, t_mono_ns=t, vpp_chunk=vpp_chunk
                )
        self._open[name] = mark

    def _stop(self, name: str) -> None:
        mark = self._open.pop(name, None)
        st = self._state
        if mark is None or st is None:
            self.unmatched += 1
            return
        t = self._now()
        mark.end = t
        if self.cuda:
            st.marks.append(mark)
        elif mark.wid is not None:
            self.recorder.end(mark.wid, t_mono_ns=t)
        if mark.name == "backward" and mark.microbatch is not None:
            left = st.backwards_left.get(mark.microbatch, 1) - 1
            st.backwards_left[mark.microbatch] = left
            if left == 0 and mark.microbatch in st.first_begin:
                span = (mark.microbatch, st.first_begin[mark.microbatch], t)
                if self.cuda:
                    st.mb_spans.append(span)
                elif "microbatch" in self.kinds:
                    self.recorder.record(
                        "microbatch",
                        "microbatch",
                        span[1],
                        span[2],
                        step=st.step,
                        microbatch=span[0],
                        timing="host",
                        parent_id=st.wid,
                    )
