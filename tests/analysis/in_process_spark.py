"""The part of a pyspark ``SparkSession`` that ``--engine spark`` uses
(``sparkContext.parallelize(tasks, slices).map(f).collect()``), run in this process: each task
and each result goes through pickle, as they travel to and from Spark's Python workers. For the
tests that need no JVM; tests/analysis/test_spark.py runs the engine on real Spark too."""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable
from typing import Any


class _Slices:
    def __init__(
        self, context: InProcessContext, slices: list[list[Any]], fn: Callable[[Any], Any] | None
    ) -> None:
        self.context, self.slices, self.fn = context, slices, fn

    def map(self, fn: Callable[[Any], Any]) -> _Slices:
        assert self.fn is None, "the engine maps once"
        self.context.mapped.append(fn)
        return _Slices(self.context, self.slices, fn)

    def collect(self) -> list[Any]:
        assert self.fn is not None
        fn = pickle.loads(pickle.dumps(self.fn))
        return [pickle.loads(pickle.dumps(fn(pickle.loads(pickle.dumps(t))))) for s in self.slices for t in s]


class InProcessContext:
    """``parallelize`` into ``slices`` as Spark does (contiguous, in order); ``mapped``: every
    function the engine mapped over tasks."""

    def __init__(self, parallelism: int) -> None:
        self.defaultParallelism = parallelism
        self.mapped: list[Callable[[Any], Any]] = []
        self.slice_counts: list[int] = []

    def parallelize(self, data: list[Any], slices: int) -> _Slices:
        assert 1 <= slices <= max(1, len(data))
        self.slice_counts.append(slices)
        bounds = [len(data) * i // slices for i in range(slices + 1)]
        return _Slices(self, [data[a:b] for a, b in itertools.pairwise(bounds)], None)


class InProcessSpark:
    def __init__(self, parallelism: int = 2) -> None:
        self.sparkContext = InProcessContext(parallelism)
