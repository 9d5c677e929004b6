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
