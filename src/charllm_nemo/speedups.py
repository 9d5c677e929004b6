"""Where the training thread's hot paths once ran in C: they are Python now, everywhere.

``charllm_nemo._hot`` (C twins of Megatron-Core's timer calls, the synthetic device's mark
listener and the mark ring's writer) was removed: it saved ~47-49 us a step in a tiny_gpt-shaped
replay (bench/bench_step_marks.py, 4 microbatches, 2026-12-04: 77 / 66 us with it against 124 /
115 us without, in two pairs of runs), 0.05 % of a 100 ms step, below the 0.1 % the project asks
of code that costs a second implementation (issue #26). This module remains only for
``train/marks.py``, which chooses its timer base class by :data:`hot`; it goes once that module
stops importing it.
"""

from __future__ import annotations

from types import ModuleType

hot: ModuleType | None = None
"""Always None: no C module."""

IN_C: bool = False
"""Whether the training thread's hot paths run in C: never."""
