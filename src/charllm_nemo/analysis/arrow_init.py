"""pyarrow without pandas: the analysis builds Arrow arrays and tables, never pandas objects, but
pyarrow imports pandas (when installed: ~0.5-1 s of CPU, more under load) the first time any
array is built, to ask whether the input is a pandas object.

:func:`settle_pandas_check` lets pyarrow make that first check while the import of pandas is
refused, so pyarrow records "no pandas integration needed" and goes on with plain arrays.
This is pyarrow's own path for a machine without pandas; the refusal lasts only for that one
check, and a later explicit pandas call (``Table.to_pandas``) imports pandas as usual (pyarrow
retries the import when it is asked for pandas outright). Called when the analysis modules are
imported, and in their worker processes, which import the same modules.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import sys
from collections.abc import Sequence
from types import ModuleType

import pyarrow as pa


class _RefusePandas(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> None:
        if fullname == "pandas" or fullname.startswith("pandas."):
            raise ImportError("pandas is not needed by charllm's analysis", name=fullname)


def settle_pandas_check() -> None:
    """Make pyarrow's one-time "is pandas there?" check now, with pandas refused (nothing to do
    when pandas is already imported: pyarrow then uses it as usual)."""
    if "pandas" in sys.modules:
        return
    finder = _RefusePandas()
    sys.meta_path.insert(0, finder)
    try:
        pa.array([0])  # the first array: pyarrow tries pandas once, here, and remembers
    finally:
        sys.meta_path.remove(finder)


_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters
_KEEP_BYTES = 64 * 2**20
"""Freed memory glibc keeps for reuse (above it, it is returned to the system)."""


def keep_freed_memory() -> None:
    """Let the analysis reuse the memory it frees instead of faulting in fresh pages for every
    array: Arrow's buffers come from the system allocator (pyarrow's default, mimalloc, returns
    freed pages to the system, and the next column read faults them in again), and glibc keeps
    freed blocks up to :data:`_KEEP_BYTES` (arrays up to 32 MiB from its heap, the heap not
    trimmed below that). Measured on a 32-rank hour (docs/benchmarks.md): a third of the
    analysis's CPU time was the kernel's, zeroing pages; this leaves a tenth. Only allocation
    policy changes, never a value; a platform without glibc keeps its defaults. Called when an
    analysis runs (:func:`~charllm_nemo.analysis.analyze.analyze` and its worker processes),
    never at import: a user's process that imports the package keeps its own allocators."""
    pa.set_memory_pool(pa.system_memory_pool())
    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)  # glibc's largest: 32 MiB on 64-bit
    mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES)
    mallopt(_M_TOP_PAD, _KEEP_BYTES)
