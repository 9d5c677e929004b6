"""Live export of a rank's telemetry to Prometheus (an endpoint, or node_exporter's textfile
directory), from the rank's telemetry process: dcgm-exporter's names for the device series, our
own ``charllm_*`` series for the step figures (docs/export.md)."""

from __future__ import annotations

__all__ = ["EXPORT_MODES", "metric_names"]

from charllm_nemo.telemetry.export.names import EXPORT_MODES, metric_names
