"""The Megatron-Core ``config.timers`` adapter: our marks, and the framework's own timers kept.

Megatron-Core's schedules call ``config.timers(name, log_level=...)`` and ``.start()`` /
``.stop()`` on what it returns, around every microbatch's ``forward-compute`` and
``backward-compute``, the pipeline's send/recv and the gradient all-reduces. Megatron-LM, NeMo 2
and Megatron-Bridge put their own ``Timers`` there, whose logs users read. :class:`TimersAdapter`
goes in its place: each call marks our window (charllm_nemo.steps.marks) and is forwarded to
the inner Timers, so its timing logs keep working; every other attribute (``log``, ``write``,
...) is the inner object's.
"""

from __future__ import annotations

from typing import Any


class ForwardingTimer:
    """One name's timer: the inner timer's ``start`` then our mark; our mark then the inner
    ``stop`` (our window lies inside theirs, their barrier outside it). Anything else
    (``elapsed``, ``reset``, ``active_time``) is the inner timer's.

    The mark is :class:`~charllm_nemo.steps.marks.MarkTimer`'s, spelled out here on ``ours``'s
    state rather than called: a Python call fewer per mark, ~24 marks a step (part a of
    bench/bench_nemo_callback.py measures the adapter). ``ours`` keeps the open state, so every
    wrapper of one name (one per inner timer) shares it."""

    __slots__ = ("_m", "_ours", "_their_start", "_their_stop", "_theirs")

    def __init__(self, ours: Any, theirs: Any) -> None:
        self._ours = ours
        self._m = ours._m
        self._theirs = theirs
        self._their_start, self._their_stop = theirs.start, theirs.stop

    def start(self, barrier: bool = False) -> None:
        self._their_start(barrier=barrier)
        m, ours = self._m, self._ours
        serial = m._serial
        if not serial:
            m.unmatched += 1
            return
        ours._open_in = serial
        m._log.extend((ours._k_begin, m._clock()))
        for fn in m._listeners:
            fn("phase", ours._phase, True)

    def stop(self, barrier: bool = False) -> None:
        m, ours = self._m, self._ours
        serial = m._serial
        if not serial or ours._open_in != serial:
            m.unmatched += 1
        else:
            ours._open_in = 0
            m._log.extend((ours._k_end, m._clock()))
            for fn in m._listeners:
                fn("phase", ours._phase, False)
        self._their_stop(barrier=barrier)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._theirs, name)


_NOT_OURS = object()  # a name that is not one of our windows: the inner timer untouched


class TimersAdapter:
    """What goes in ``TransformerConfig.timers``: ``adapter(name, log_level)`` is a timer that
    marks our window (``marker(name)``) and forwards to ``inner(name, log_level)`` when there is
    an inner Timers; without one it is our timer alone. Names that are not windows
    (``forward-backward``, ``interval-time``, ...) get the inner timer untouched. ``inner`` is
    fixed at construction.

    The inner Timers decides its timer by name and level; once Megatron-Core's ``Timers`` has
    made a name's timer (it is in its ``_timers`` registry) it returns that one for every level,
    so from then on the answer is kept per name and the inner Timers is not asked again (one
    Python call fewer per ``config.timers`` call, ~26 a step; its check that a later level
    equals the first one is skipped). Before that, a level above its log level gives its dummy
    timer for as long as no call at a lower level has made the real one: that answer is kept
    per (name, level) and given while the name is not in the registry (NeMo's recipes run every
    window's timer at a level above theirs: without this the inner Timers was asked every call,
    ~0.04 ms a step of part a's ~0.2 ms adapter cost). Any other Timers is asked every call."""

    def __init__(self, marker: Any, inner: Any = None) -> None:
        self.marker = marker
        self.inner = inner
        self._fixed: dict[str, Any] = {}  # name -> what every call of it returns from now on
        self._wrapped: dict[str, Any] = {}  # name -> its ForwardingTimer, or _NOT_OURS
        registry = getattr(inner, "_timers", None)  # Megatron-Core's Timers: name -> its real timer
        self._registry: dict[str, Any] | None = registry if isinstance(registry, dict) else None
        self._dummy = getattr(inner, "_dummy_timer", None) if self._registry is not None else None
        self._dummies: dict[tuple[str, int | None], Any] = {}  # (name, level) -> answer for their dummy

    def __call__(self, name: str, log_level: int | None = None) -> Any:
        fixed = self._fixed.get(name)
        if fixed is not None:
            return fixed
        answer = self._dummies.get((name, log_level))
        if answer is not None and name not in self._registry:  # type: ignore[operator]
            return answer
        return self._ask(name, log_level)

    def _ask(self, name: str, log_level: int | None) -> Any:
        inner = self.inner
        if inner is None:  # the marker keeps one timer per name
            timer = self._fixed[name] = self.marker(name, log_level)
            return timer
        theirs = inner(name, log_level) if log_level is not None else inner(name)
        wrapped = self._wrapped.get(name)
        if wrapped is _NOT_OURS:
            answer = theirs
        elif wrapped is not None and wrapped._theirs is theirs:
            answer = wrapped
        else:
            answer = self._wrap(name, log_level, theirs)
        registry = self._registry
        if registry is not None:
            if registry.get(name) is theirs:
                self._fixed[name] = answer
            elif theirs is self._dummy and self._dummy is not None:
                self._dummies[(name, log_level)] = answer
        return answer

    def _wrap(self, name: str, log_level: int | None, theirs: Any) -> Any:
        """The first call of a name (or a new inner timer for it: a level may give a dummy)."""
        ours = self.marker(name, log_level)
        if getattr(ours, "_phase", None) is None:  # not one of our windows
            self._wrapped[name] = _NOT_OURS
            return theirs
        wrapped = self._wrapped[name] = ForwardingTimer(ours, theirs)
        return wrapped

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(f"{type(self).__name__} has no {name!r} (and no inner Timers to forward to)")
        return getattr(inner, name)
