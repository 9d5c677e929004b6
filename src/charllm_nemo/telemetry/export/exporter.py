"""The live exporter of one rank: it lives in the rank's telemetry process.

The collector (telemetry/process/collector.py) hands it, on every tick, the sample chunks and
window records it took from the shared block; the exporter keeps the newest device values
(:class:`~charllm_nemo.telemetry.export.state.ExportState`) and, once the samples have passed a
step window's end by two figure periods, that step's figures: one ``figures_of_windows`` call for
all steps then due, the same attribution the live figures and the analysis use. Throughput and
MFU come from the step's duration and three constants the training process publishes once in
the shared block (tokens per step, FLOPs per step per device, peak FLOP/s per device:
``TelemetrySession.publish_step_rates``). Nothing of it runs on the training thread.

Two outputs: ``prometheus``, an HTTP endpoint per rank (``telemetry.export_port`` + the local
rank, on ``telemetry.export_host``) served by a stdlib ``ThreadingHTTPServer`` on a daemon
thread; ``textfile``, a ``charllm-rank<N>.prom`` file in node_exporter's textfile directory,
rewritten atomically every ``telemetry.export_interval_s``.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from charllm_nemo.telemetry.export.names import EXPORT_MODES
from charllm_nemo.telemetry.export.state import CONTENT_TYPE, ExportState
from charllm_nemo.telemetry.process.mark_ring import MAX_HOLD_NS
from charllm_nemo.telemetry.schema import WINDOW_LABELS
from charllm_nemo.telemetry.windows import NULL, RECORD_FIELDS, RECORD_WINDOW

log = logging.getLogger("charllm_nemo.telemetry.export")

STEP_FIGURES: tuple[str, ...] = ("energy_j", "power_avg_w", "throttle_any_limiting_s", "power_swing_w")
_KIND, _STEP = RECORD_FIELDS.index("kind"), RECORD_FIELDS.index("step")
_T0, _T1 = RECORD_FIELDS.index("t_begin_mono_ns"), RECORD_FIELDS.index("t_end_mono_ns")
_LABEL0 = RECORD_FIELDS.index(WINDOW_LABELS[0])
_STEP_CODE = 0  # "step" is the first seeded name of every NameTable (telemetry/windows.py)
MAX_SERVED = 1024
BATCH_NS = 500_000_000  # steps nobody asked figures for: computed together, at most this late
PARALLEL_LABELS: tuple[str, ...] = tuple(x for x in WINDOW_LABELS if x != "vpp_chunk")


def write_textfile(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically without following a link: a temporary beside it,
    created with O_EXCL | O_NOFOLLOW (a link planted there fails the open), then renamed over
    ``path`` (rename replaces a link at ``path`` itself, never writes through it). node_exporter
    reads only ``*.prom``, so it never sees the ``.tmp``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class Exporter:
    """One rank's exporter. ``options``: the session's export options (mode, host, port,
    textfile_dir, interval_s, rank, local_rank, run, slurm_job_id); ``devices``: the backend's
    devices (their identity gives gpu, UUID and modelName); ``period_ns``: how often samples
    that can answer a figure arrive (a step's figures wait two of these past its end)."""

    def __init__(self, options: Mapping[str, Any], devices: Sequence[Any], period_ns: int) -> None:
        self.mode = str(options["mode"])
        if self.mode not in EXPORT_MODES[1:]:
            raise ValueError(f"telemetry.export={self.mode!r} is not valid; use one of {list(EXPORT_MODES)}")
        idents = [d.identity for d in devices]
        labels = {
            "run": options.get("run"),
            "slurm_job_id": options.get("slurm_job_id"),
            "dl_rank": options.get("rank"),
            "local_rank": options.get("local_rank"),
        }
        self.state = ExportState(
            [(i.index, i.uuid, i.name) for i in idents],
            labels,
            str(options.get("host_label") or socket.gethostname()),
        )
        self.state.set_parallel(dict(options.get("parallel") or {}))  # the step windows may update them
        self.period_ns = max(1, int(period_ns))
        self.interval_ns = int(float(options.get("interval_s", 5.0)) * 1e9)
        self._pending: list[tuple[int, int, int]] = []  # step, t_begin, t_end
        self._served: dict[tuple[int, int], list[tuple[int, list[float]]]] = {}  # (t0, t1) -> answer
        self._next_write = 0
        self.server: ThreadingHTTPServer | None = None
        self.address: tuple[str, int] | None = None
        self.textfile: Path | None = None
        self.otlp: Any = None
        if self.mode == "otlp":
            from charllm_nemo.telemetry.export.otlp import OtlpPusher

            endpoint = str(options["otlp_endpoint"])
            self.otlp = OtlpPusher(self.state, endpoint, float(options.get("interval_s", 5.0)))
        elif self.mode == "prometheus":
            port = int(options["port"]) + int(options.get("local_rank") or 0)
            self.server = _server(str(options.get("host", "127.0.0.1")), port, self.state)
            self.address = self.server.server_address[:2]  # type: ignore[assignment]
            threading.Thread(target=self.server.serve_forever, name="charllm-export", daemon=True).start()
        elif self.mode == "textfile":
            self.textfile = (
                Path(str(options["textfile_dir"])) / f"charllm-rank{int(options.get('rank') or 0)}.prom"
            )

    # -- the collector's hook ----------------------------------------------------------------
    def update(
        self,
        collector: Any,
        samples: Sequence[Mapping[str, np.ndarray[Any, Any]]],
        records: Sequence[np.ndarray[Any, Any]],
        rates: tuple[float, float, float] = (0.0, 0.0, 0.0),
        final: bool = False,
    ) -> None:
        """Take this tick's new samples and records; compute the steps the samples have passed
        (``final``: every step left, the samples end here). Never raises: a failure is logged."""
        t0 = time.thread_time_ns()
        rates = rates_nan_to_zero(rates)
        try:
            for chunk in samples:
                self.state.take_samples(chunk)
            for recs in records:
                self._take_records(recs)
            # A step the training loop asked figures for (collector.serve) takes that answer; one
            # nobody asked for is computed once the samples are past it by the longest a request
            # waits for its batch (and BATCH_NS more, to batch them), all such steps in one call.
            last, wait = collector._last_t, max(2 * self.period_ns, MAX_HOLD_NS + self.period_ns)
            served = [p for p in self._pending if (p[1], p[2]) in self._served]
            # a call costs about the same for one window as for ten: wait until the oldest is
            # BATCH_NS overdue, then take every step due
            oldest = min((p[2] for p in self._pending if (p[1], p[2]) not in self._served), default=None)
            batch_due = final or (oldest is not None and oldest + wait + BATCH_NS <= last)
            due = [p for p in self._pending if final or (batch_due and p[2] + wait <= last)]
            due = [p for p in due if (p[1], p[2]) not in self._served]
            if served or due:
                done = {*served, *due}
                self._pending = [p for p in self._pending if p not in done]
                answers = [self._served.pop((p[1], p[2])) for p in served]
                if due:
                    answers += collector.figures_of_windows([(p[1], p[2]) for p in due], STEP_FIGURES)
                cols = collector.columns
                for (step, b, e), per_device in zip([*served, *due], answers, strict=True):
                    figs = {idx: dict(zip(cols, values, strict=True)) for idx, values in per_device}
                    self.state.take_step(step, (e - b) / 1e9, figs, rates)
            if len(self._served) > MAX_SERVED:  # answers to windows that were not steps
                for key in list(self._served)[: len(self._served) - MAX_SERVED]:
                    del self._served[key]
            if self.textfile is not None and time.monotonic_ns() >= self._next_write:
                self._next_write = time.monotonic_ns() + self.interval_ns
                self.write()
        except Exception:
            log.exception("live export update failed")
        self.state.update_s += (time.thread_time_ns() - t0) / 1e9

    def served(
        self, t0: int, t1: int, per_device: list[tuple[int, list[float]]], figures: Sequence[str] | None
    ) -> None:
        """The collector answered a figure request: keep it if it holds the step figures."""
        if figures is None or all(f in figures for f in STEP_FIGURES):
            self._served[(t0, t1)] = per_device

    def _take_records(self, recs: np.ndarray[Any, Any]) -> None:
        steps = recs[(recs[:, 0] == RECORD_WINDOW) & (recs[:, _KIND] == _STEP_CODE)]
        if steps.shape[0] == 0:
            return
        last = steps[-1, _LABEL0 : _LABEL0 + len(PARALLEL_LABELS)].tolist()
        self.state.set_parallel({k: int(v) for k, v in zip(PARALLEL_LABELS, last, strict=True) if v != NULL})
        self._pending.extend((int(r[_STEP]), int(r[_T0]), int(r[_T1])) for r in steps.tolist())

    def write(self) -> None:
        """Write the textfile now (textfile mode)."""
        if self.textfile is not None:
            try:
                write_textfile(self.textfile, self.state.render(count_scrape=False))
            except OSError as exc:
                log.error("telemetry.export=textfile: cannot write %s (%s)", self.textfile, exc)

    def close(self) -> None:
        """The last values out (textfile), the endpoint closed."""
        self.write()
        if self.otlp is not None:
            self.otlp.close()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def _server(host: str, port: int, state: ExportState) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404, "only /metrics is served here")
                return
            body = state.render()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return  # a scrape every few seconds is not worth a log line

    ThreadingHTTPServer.daemon_threads = True
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class Server(ThreadingHTTPServer):
        address_family = family
        allow_reuse_address = True

    try:
        return Server((host, port), Handler)
    except OSError as exc:  # the port named: two jobs on one node take the same ports
        raise OSError(exc.errno, f"port {port} on {host}: {exc.strerror or exc}") from exc


def taken_ports(host: str, first_port: int, count: int) -> list[tuple[int, int, str]]:
    """(local rank, port, why) for each of the ``count`` ports from ``first_port`` that cannot be
    listened on at ``host`` now (another job on the node holds it): checked by binding and closing
    at once, as the launcher does before starting ranks, so the console says it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    out = []
    for local_rank in range(count):
        port = first_port + local_rank
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            try:
                s.bind((host, port))
            except OSError as exc:
                out.append((local_rank, port, exc.strerror or str(exc)))
    return out


def rates_nan_to_zero(values: Sequence[float]) -> tuple[float, float, float]:
    """The three published rates, NaN or negative read as 0 (unknown)."""
    out = [float(v) if math.isfinite(float(v)) and float(v) > 0 else 0.0 for v in values[:3]]
    return out[0], out[1], out[2]
