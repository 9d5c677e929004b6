"""Telemetry for one rank: sample the accelerator, mark windows, store, attribute.

The public API (what a user or an integration may import from here; docs/architecture.md says
how the parts fit):

* :class:`TelemetrySession` (session.py): one rank's telemetry, started and closed together;
  its ``windows`` (:class:`WindowRecorder`, windows.py) take the loop's marks, and
  ``request_figures`` / ``step_figures`` give a window's figures live.
* :func:`load_run` / :class:`RunData` (reader.py): a run directory read back;
  :func:`attribute_run` (join.py): its windows attributed.
* :func:`attribute_windows` (attribution.py): a window's figures from samples: energy (J),
  average and peak power (W), temperatures (°C), clocks (MHz), throttle time (s), traffic (bytes).
* :data:`METRICS`, :data:`Reading`, :data:`THROTTLE_BITS` (schema.py): what a sample holds, in
  which units.
* :class:`SamplerHealth` (sample_loop.py): how sampling went; :data:`DISK_FULL` (store.py): the
  status of a run whose store hit a full disk.
* :class:`Engine`, :class:`ThreadEngine` (engine.py), :class:`ProcessEngine`
  (process/engine.py): where sampling, storing and live figures run.
* :data:`STEP_FIGURE_KEYS`, :func:`pack_step_figures`, :func:`unpack_step_figures`
  (rank_vector.py): the vector that carries a rank's figures of a step across ranks (energy J,
  power W, temperature °C, clocks MHz, throttle s), derived from the figure table (figures.py).

Imported lazily: ``import charllm_nemo.telemetry`` loads none of them (the telemetry process
imports its light modules from here before numpy or pyarrow).
"""

from __future__ import annotations

from typing import Any

from charllm_nemo._exports import lazy_attribute

_WHERE = {
    "TelemetrySession": "session",
    "WindowRecorder": "windows",
    "load_run": "reader",
    "RunData": "reader",
    "attribute_run": "join",
    "attribute_windows": "attribution",
    "METRICS": "schema",
    "Reading": "schema",
    "THROTTLE_BITS": "schema",
    "SamplerHealth": "sample_loop",
    "DISK_FULL": "store",
    "Engine": "engine",
    "ThreadEngine": "engine",
    "ProcessEngine": "process.engine",
    "STEP_FIGURE_KEYS": "rank_vector",
    "pack_step_figures": "rank_vector",
    "unpack_step_figures": "rank_vector",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _WHERE, name)
