"""Medians over a run of any length in bounded memory: exact while few, a sketch after.

A run of weeks has millions of steps; keeping every step's figures for ``summary.json``'s
medians grew rank 0 by ~1.6 KB a step (issue 48). :class:`MedianSketch` keeps the values
themselves (8 bytes each) up to :data:`EXACT_VALUES`, so short runs get the exact median, then
moves them into a logarithmic histogram (the DDSketch idea: Masson, Rim and Lee, VLDB 2019):
bucket ``k`` holds the values ``v`` with ``gamma**(k-1) < |v| <= gamma**k``, ``gamma =
(1 + a) / (1 - a)``, and is read back as ``2 * gamma**k / (gamma + 1)``, within relative
error ``a`` (:data:`RELATIVE_ERROR`) of every value in it. The median's two middle order
statistics are each read that way, so the median given is within ``a`` (relative) of the exact
one for values of one sign; zero is counted exactly.

Memory: at most :data:`EXACT_VALUES` floats, then at most :data:`MAX_BUCKETS` buckets per sign
(2,048 buckets span 9 decades at a = 0.5 %). Past that the smallest-magnitude buckets are
merged; a median that falls into a merged bucket has no stated error, and
:meth:`MedianSketch.median` says so (``bounded`` False).
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

RELATIVE_ERROR = 0.005
"""The sketch's worst-case relative error of a median (0.5 %), once past :data:`EXACT_VALUES`."""

EXACT_VALUES = 1024
"""Values kept as they are (exact medians) before the sketch takes over: 8 KiB per field."""

MAX_BUCKETS = 2048
"""Buckets per sign at most; the smallest-magnitude ones are merged past it."""

_GAMMA = (1 + RELATIVE_ERROR) / (1 - RELATIVE_ERROR)
_LOG_GAMMA = math.log(_GAMMA)


@dataclass(frozen=True)
class Median:
    """A median and how far it can be from the exact one: ``exact`` (computed from every
    value), else ``relative_error`` bounds it (``bounded``), or nothing does (``bounded`` False:
    the middle values fell where :data:`MAX_BUCKETS` merged buckets)."""

    value: float
    exact: bool
    bounded: bool = True


class MedianSketch:
    """The median of a stream of finite floats (NaN and infinities are the caller's to skip),
    in bounded memory (module doc). ``add`` is O(1); ``median`` sorts what is kept."""

    __slots__ = ("_exact", "_merged_below", "_neg", "_pos", "_zeros", "count")

    def __init__(self) -> None:
        self._exact: array[float] | None = array("d")
        self._pos: dict[int, int] = {}
        self._neg: dict[int, int] = {}  # keyed by the magnitude's bucket
        self._zeros = 0
        self._merged_below: list[int | None] = [None, None]  # per sign (pos, neg): merged keys end here
        self.count = 0

    @property
    def exact(self) -> bool:
        """Whether every value added is still kept (the median is exact)."""
        return self._exact is not None

    def add(self, value: float) -> None:
        self.count += 1
        if self._exact is not None:
            self._exact.append(value)
            if len(self._exact) > EXACT_VALUES:
                kept, self._exact = self._exact, None
                for v in kept:
                    self._bucket(v)
            return
        self._bucket(value)

    def _bucket(self, v: float) -> None:
        if v == 0.0:
            self._zeros += 1
            return
        store, side = (self._pos, 0) if v > 0 else (self._neg, 1)
        key = math.ceil(math.log(abs(v)) / _LOG_GAMMA)
        floor = self._merged_below[side]
        if floor is not None and key < floor:
            key = floor
        store[key] = store.get(key, 0) + 1
        if len(store) > MAX_BUCKETS:
            low = sorted(store)[:2]  # the two smallest magnitudes become one bucket
            store[low[1]] += store.pop(low[0])
            self._merged_below[side] = low[1]

    def median(self) -> Median | None:
        """The median (the mean of the two middle values for an even count); None when empty."""
        n = self.count
        if n == 0:
            return None
        if self._exact is not None:
            values = sorted(self._exact)
            mid = n // 2
            return Median(values[mid] if n % 2 else (values[mid - 1] + values[mid]) / 2, True)
        lo, lo_ok = self._at_rank((n - 1) // 2)
        hi, hi_ok = self._at_rank(n // 2)
        return Median((lo + hi) / 2, False, lo_ok and hi_ok)

    def _at_rank(self, rank: int) -> tuple[float, bool]:
        """The value of order statistic ``rank`` (0-based), read from its bucket, and whether
        its error is bounded (not a merged bucket)."""
        seen = 0
        for key in sorted(self._neg, reverse=True):  # most negative first
            seen += self._neg[key]
            if rank < seen:
                return -self._value(key), key != self._merged_below[1]
        seen += self._zeros
        if rank < seen:
            return 0.0, True
        for key in sorted(self._pos):
            seen += self._pos[key]
            if rank < seen:
                return self._value(key), key != self._merged_below[0]
        raise AssertionError("rank beyond the count")  # count is every value added

    @staticmethod
    def _value(key: int) -> float:
        return 2.0 * _GAMMA**key / (_GAMMA + 1.0)
