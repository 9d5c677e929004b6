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
    (``elapsed``, ``reset``, ``active_time``) is the inner timer's. The four methods are bound
    once (a mark runs between two pieces of training work: every lookup there costs)."""

    __slots__ = ("_our_start", "_our_stop", "_ours", "_their_start", "_their_stop", "_theirs")

    def __init__(self, ours: Any, theirs: Any) -> None:
        self._ours = ours
        self._theirs = theirs
        self._our_start, self._our_stop = ours.start, ours.stop
        self._their_start, self._their_stop = theirs.start, theirs.stop

    def start(self, barrier: bool = False) -> None:
        self._their_start(barrier=barrier)
        self._our_start()

    def stop(self, barrier: bool = False) -> None:
        self._our_stop()
        self._their_stop(barrier=barrier)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._theirs, name)


_NOT_OURS = object()  # a name that is not one of our windows: the inner timer untouched


class TimersAdapter:
    """What goes in ``TransformerConfig.timers``: ``adapter(name, log_level)`` is a timer that
    marks our window (``marker(name)``) and forwards to ``inner(name, log_level)`` when there is
    an inner Timers; without one it is our timer alone. Names that are not windows
    (``forward-backward``, ``interval-time``, ...) get the inner timer untouched. The inner
    Timers is asked every call (it decides its timer by name and level); what we wrap it in is
    made once per name and inner timer."""

    def __init__(self, marker: Any, inner: Any = None) -> None:
        self.marker = marker
        self.inner = inner
        self._wrapped: dict[str, Any] = {}  # name -> its ForwardingTimer, or _NOT_OURS

    def __call__(self, name: str, log_level: int | None = None) -> Any:
        inner = self.inner
        if inner is None:
            return self.marker(name, log_level)
        theirs = inner(name, log_level) if log_level is not None else inner(name)
        wrapped = self._wrapped.get(name)
        if wrapped is not None:
            if wrapped is _NOT_OURS:
                return theirs
            if wrapped._theirs is theirs:
                return wrapped
        return self._wrap(name, log_level, theirs)

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
