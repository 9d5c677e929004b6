"""``telemetry.export=otlp``: the same series pushed to an OpenTelemetry collector (OTLP/HTTP,
JSON encoding, ``POST <endpoint>``) every ``telemetry.export_interval_s``, from a daemon thread
of the telemetry process. Standard library only (no opentelemetry SDK): the payload is the
OTLP ``ExportMetricsServiceRequest`` in its JSON mapping.

The rank's identity goes on the resource with nemo-lens' attribute for the rank (``dl.rank``)
and OpenTelemetry's semantic conventions (``service.name``, ``host.name``); the device and the
parallel ranks go on each data point. Gauges stay gauges; counters become cumulative monotonic
sums, named as in the Prometheus exposition (dcgm's names).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from collections.abc import Mapping
from typing import Any

from charllm_nemo.telemetry.export.state import ExportState

log = logging.getLogger("charllm_nemo.telemetry.export")

SERVICE_NAME = "charllm-nemo"
TIMEOUT_S = 5.0


def _value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}  # int64 is a string in OTLP's JSON mapping
    return {"stringValue": str(v)}


def attributes(values: Mapping[str, Any]) -> list[dict[str, Any]]:
    """OTLP key-value list of the values that are not None or empty."""
    return [{"key": k, "value": _value(v)} for k, v in values.items() if v is not None and str(v) != ""]


def resource_attributes(rank_labels: Mapping[str, Any], host: str) -> dict[str, Any]:
    """The rank's resource: ``dl.rank`` (nemo-lens), ``service.name`` and ``host.name`` (OTel
    semantic conventions), and ours."""
    return {
        "service.name": SERVICE_NAME,
        "host.name": host,
        "dl.rank": rank_labels.get("dl_rank"),
        "local_rank": rank_labels.get("local_rank"),
        "run": rank_labels.get("run"),
        "slurm.job_id": rank_labels.get("slurm_job_id"),
    }


def payload(state: ExportState, start_ns: int, now_ns: int | None = None) -> dict[str, Any]:
    """One ExportMetricsServiceRequest (JSON mapping) of every series ``state`` holds now."""
    now = str(now_ns if now_ns is not None else time.time_ns())
    metrics: dict[str, dict[str, Any]] = {}
    for fam, idx, value in state.points():
        point: dict[str, Any] = {"timeUnixNano": now, "asDouble": value}
        if idx is not None:
            point["attributes"] = attributes(state.device_attributes(idx))
        m = metrics.get(fam.name)
        if m is None:
            m = {"name": fam.name, "description": fam.help}
            if fam.type == "counter":
                m["sum"] = {"aggregationTemporality": 2, "isMonotonic": True, "dataPoints": []}
            else:
                m["gauge"] = {"dataPoints": []}
            metrics[fam.name] = m
        if fam.type == "counter":
            point["startTimeUnixNano"] = str(start_ns)
            m["sum"]["dataPoints"].append(point)
        else:
            m["gauge"]["dataPoints"].append(point)
    resource = {"attributes": attributes(resource_attributes(state.rank_labels, state.host))}
    scope = {"scope": {"name": "charllm_nemo.telemetry.export"}, "metrics": list(metrics.values())}
    return {"resourceMetrics": [{"resource": resource, "scopeMetrics": [scope]}]}


class OtlpPusher:
    """Pushes ``state`` to ``endpoint`` every ``interval_s`` on a daemon thread, and once more at
    :meth:`close`. A failed push is logged (the first, then every 100th) and retried next time."""

    def __init__(self, state: ExportState, endpoint: str, interval_s: float) -> None:
        self.state, self.endpoint, self.interval_s = state, endpoint, interval_s
        self.start_ns = time.time_ns()
        self.pushed = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="charllm-otlp", daemon=True)
        self._thread.start()

    def push(self) -> bool:
        body = json.dumps(payload(self.state, self.start_ns)).encode()
        req = urllib.request.Request(
            self.endpoint, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
                r.read()
            self.pushed += 1
            return True
        except OSError as exc:
            if self.failed % 100 == 0:
                log.warning("telemetry.export=otlp: push to %s failed (%s); retrying", self.endpoint, exc)
            self.failed += 1
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.push()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT_S + 1)
        self.push()
