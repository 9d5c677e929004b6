"""Tables, figures and an HTML report from run and sweep directories (docs/analysis.md).

``load`` finds runs and reads ranks through telemetry/layout.py; ``rank_tables`` and ``metrics``
reduce one rank with numpy; ``run_info``, ``run_summary`` and ``findings`` build the tables with
DuckDB SQL; ``analyze`` ties them together and writes them; ``figures*``, ``kernels`` and
``report`` draw and publish; ``commands`` is the ``charllm analyze`` / ``charllm report`` CLI;
``store_writer`` writes run directories from arrays (tests, benchmarks). Importing this package
imports none of DuckDB or matplotlib.

The public API (what a user or a script may import from here): :class:`Analysis`,
:func:`write_tables`, :func:`to_jsonable` (analyze.py; the entry point itself is
``charllm_nemo.analysis.analyze.analyze(path)``, not re-exported: its name is its module's);
:class:`Run`, :func:`find_runs`, :func:`open_run` (load.py); :func:`write_report` (report.py);
:func:`write_rank`, :func:`write_summary` (store_writer.py). Each is imported when first used.
"""

from __future__ import annotations

from typing import Any

from charllm_nemo._exports import lazy_attribute

_WHERE = {
    "Analysis": "analyze",
    "write_tables": "analyze",
    "to_jsonable": "analyze",
    "Run": "load",
    "find_runs": "load",
    "open_run": "load",
    "write_report": "report",
    "write_rank": "store_writer",
    "write_summary": "store_writer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _WHERE, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
