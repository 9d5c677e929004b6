"""One rank's telemetry session: backend + sampler + window marks + store, started and
stopped together. This is what training integrations (the Megatron-Core loop, later the NeMo
callback) hold.

    with TelemetrySession(out_dir, backend="auto", hz=100, rank=r, world_size=w) as tel:
        wid = tel.windows.begin("step", step=0)
        ...
        tel.windows.end(wid)
        figures = tel.step_figures(wid)   # None until the sampler has passed the step's end

The sampler runs in a thread up to 200 Hz and in a separate sampling process above it
(``sampler="auto"``; or ``"thread"`` / ``"process"``): a thread shares the GIL with training and
misses most deadlines at 1 kHz while the main thread runs Python (docs/benchmarks.md, part b).

Safe against a killed job: segments are flushed at least every second by a background thread;
SIGTERM (what SLURM sends before SIGKILL) and normal exit (atexit) flush everything and mark
the manifest complete / terminated.
"""

from __future__ import annotations

import atexit
import bisect
import logging
import os
import platform
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pyarrow as pa

import charllm_nemo
from charllm_nemo.devices.base import Backend
from charllm_nemo.devices.factory import open_backend
from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.sampler import Row, Sampler, rows_to_arrays, rows_to_table, validate_hz
from charllm_nemo.telemetry.sampler_process import ProcessSampler, resolve_sampler_mode
from charllm_nemo.telemetry.store import Flusher, RankStore, windows_to_table
from charllm_nemo.telemetry.windows import WindowRecorder

log = logging.getLogger("charllm_nemo.telemetry")

_ENV_KEYS = (
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_JOB_NODELIST",
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
)


def default_device_indices(local_rank: int, env: Mapping[str, str] | None = None) -> list[int]:
    """The device a rank drives: CUDA_VISIBLE_DEVICES[local_rank] when it lists integers
    (NVML and AMD SMI number devices physically), else ``local_rank``."""
    env_map: Mapping[str, str] = os.environ if env is None else env
    visible = env_map.get("CUDA_VISIBLE_DEVICES") or env_map.get("ROCR_VISIBLE_DEVICES") or ""
    items = [v.strip() for v in visible.split(",") if v.strip()]
    if items and all(v.isdigit() for v in items) and local_rank < len(items):
        return [int(items[local_rank])]
    return [local_rank]


def package_versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {
        "python": platform.python_version(),
        "charllm-nemo": charllm_nemo.__version__,
    }
    for dist in (
        "numpy",
        "pyarrow",
        "nvidia-ml-py",
        "amdsmi",
        "torch",
        "megatron-core",
        "nemo-toolkit",
        "wandb",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


class TelemetrySession:
    """Telemetry for one rank. Construct, then :meth:`start` (or use as a context manager).

    ``devices``: host device indices to sample; None = this rank's own device
    (see :func:`default_device_indices`) for a real backend, device 0 for synthetic.
    ``backend_options`` go to the backend (synthetic: ``activity``, ``params``, ``count``).
    ``live_window_s``: how many seconds of samples stay in memory for :meth:`step_figures`.
    ``sampler``: ``auto`` (a separate sampling process above 200 Hz, a thread up to it),
    ``thread`` or ``process``. In process mode the child opens the backend again by name; this
    process keeps its own handle for the device identities (and falls back to a thread on it
    if the sampling process cannot start).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        backend: str | Backend = "auto",
        hz: float = 100.0,
        rank: int = 0,
        local_rank: int = 0,
        world_size: int = 1,
        config: dict[str, Any] | None = None,
        devices: Sequence[int] | None = None,
        flush_interval_s: float = 0.5,
        live_window_s: float = 120.0,
        backend_options: dict[str, Any] | None = None,
        handle_signals: bool = True,
        sampler: str = "auto",
    ) -> None:
        self.hz = validate_hz(hz)
        mode = resolve_sampler_mode(sampler, self.hz)
        self.rank, self.local_rank, self.world_size = rank, local_rank, world_size
        self.out_dir = Path(out_dir)
        self.windows = WindowRecorder()
        self._handle_signals = handle_signals
        options = dict(backend_options or {})
        if mode == "process" and not isinstance(backend, str):
            if sampler == "process":
                raise ConfigError(
                    "telemetry.sampler='process' needs a backend name (the sampling process opens it "
                    "itself), not a Backend object; pass backend='nvml' / 'amdsmi' / 'synthetic' or "
                    "use sampler='thread'"
                )
            mode = "thread"
        if isinstance(backend, str):
            indices = devices
            if indices is None and backend != "synthetic":
                indices = default_device_indices(local_rank)
            self.backend = self._open_backend(backend, indices, options)
        else:
            self.backend = backend
        self.source = self.backend.name
        self.sampler: Sampler | ProcessSampler
        if mode == "process":
            # The backend the parent ended up with (auto resolved, index fallback applied); the
            # options went to it only if it was named or is synthetic (auto gives nvml / amdsmi none).
            named = backend == self.source or self.source == "synthetic"
            try:
                self.sampler = ProcessSampler(
                    self.source,
                    [d.identity.index for d in self.backend.devices],
                    options if named else {},
                    self.hz,
                    source=self.source,
                )
            except ConfigError as exc:
                if sampler == "process":
                    self.backend.close()
                    raise
                log.info("telemetry: sampling in a thread: %s", exc)
                mode = "thread"
        if mode == "thread":
            self.sampler = Sampler(self.backend.devices, self.hz, source=self.source)
        self.sampler_mode = mode
        marks = getattr(self.backend, "mark_activity", None)
        if marks is not None:
            self.windows.add_listener(marks)
            if isinstance(self.sampler, ProcessSampler):
                publish = self.sampler.publish_activity
                self.windows.add_listener(lambda _kind, _name, _begin: publish(marks.level()))
        self.store = RankStore(self.out_dir, rank, self._manifest(config))
        self._flusher = Flusher(self.flush, flush_interval_s)
        # Raw rows of the last live_window_s seconds, for step_figures: kept as the sampler's
        # tuples, so a live figure costs no Arrow round trip.
        n_dev = max(1, len(self.backend.devices))
        self._recent: deque[Row] = deque(maxlen=max(1024, int(live_window_s * self.hz * n_dev)))
        self._recent_lock = threading.Lock()
        self._pending: list[tuple[str, pa.Table]] = []
        self._closed = False
        self._started = False
        self._prev_sigterm: Any = None

    def _open_backend(self, name: str, indices: Sequence[int] | None, options: dict[str, Any]) -> Backend:
        try:
            return open_backend(name, indices, **options)
        except Exception:
            if name == "auto" and indices is not None:
                # auto with this rank's index found no such device: fall back to what exists.
                return open_backend(name, None, **options)
            raise

    def _manifest(self, config: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "kind": "charllm-nemo telemetry",
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "argv": list(sys.argv),
            "backend": self.source,
            "synthetic": self.source == "synthetic",
            "sampling_hz": self.hz,
            "sampler_mode": self.sampler_mode,
            "devices": [d.identity.to_dict() for d in self.backend.devices],
            "supported_metrics": {str(d.identity.index): d.supported_metrics() for d in self.backend.devices},
            "started_wall_ns": time.time_ns(),
            "started_mono_ns": time.monotonic_ns(),
            "versions": package_versions(),
            "env": {k: os.environ[k] for k in _ENV_KEYS if k in os.environ},
            "config": config or {},
        }

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> TelemetrySession:
        if self._started:
            return self
        self._started = True
        self.sampler.start()
        if isinstance(self.sampler, ProcessSampler) and not self.sampler.running:
            self._fall_back_to_thread()
        self._flusher.start()
        atexit.register(self._atexit)
        if self._handle_signals and threading.current_thread() is threading.main_thread():
            self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __enter__(self) -> TelemetrySession:
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close("complete" if exc_type is None else "failed")

    def close(self, status: str = "complete") -> None:
        """Stop sampling, flush everything (open windows too, with a null end) and finalize
        the manifest. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.sampler.stop()
        self._flusher.stop()
        self._flusher.flush_once()
        open_rows = self.windows.open_windows()
        if open_rows:
            self.store.write_segment("windows", windows_to_table(open_rows))
        self.store.close(
            status,
            {
                "sampler": self.sampler.health.to_dict(),
                "sampler_mode": self.sampler_mode,
                "flusher": {
                    "flushes": self._flusher.flushes,
                    "errors": self._flusher.errors,
                    "flush_ms_max": self._flusher.flush_ns_max / 1e6,
                    "interval_s": self._flusher.interval_s,
                },
                "windows_recorded": self.windows.total_recorded,
                "windows_open_at_close": len(open_rows),
            },
        )
        try:
            self.backend.close()
        except Exception:
            log.exception("backend close failed")
        if self._prev_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._prev_sigterm)
            self._prev_sigterm = None
        atexit.unregister(self._atexit)

    def _fall_back_to_thread(self) -> None:
        """The sampling process did not start: sample in a thread on this process's backend."""
        failed = self.sampler
        reason = failed.health.stop_reason
        failed.stop()
        log.warning(
            "telemetry: the sampling process did not start (%s); sampling in a thread instead", reason
        )
        self.sampler = Sampler(self.backend.devices, self.hz, source=self.source)
        self.sampler_mode = "thread"
        self.store.manifest["sampler_mode"] = "thread"
        self.store.manifest["sampler_process_error"] = reason
        self.store.write_manifest()
        self.sampler.start()

    def _atexit(self) -> None:
        self.close("complete")

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        prev = self._prev_sigterm
        self.close("terminated")
        if callable(prev):
            prev(signum, frame)
        else:
            # Default action: die by SIGTERM so the exit status says so.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    # -- flushing --------------------------------------------------------------------------
    def flush(self) -> None:
        """Write what was sampled and marked since the last flush (the flusher calls this)."""
        # Taken and remembered under one lock: live_rows() never sees a row in neither place.
        with self._recent_lock:
            rows = self.sampler.take_rows()
            self._recent.extend(rows)
        if rows:
            self._pending.append(("samples", rows_to_table(rows, self.source)))
        done = self.windows.drain()
        if done:
            self._pending.append(("windows", windows_to_table(done)))
        while self._pending:
            kind, table = self._pending[0]
            self.store.write_segment(kind, table)  # raises on a full disk: kept for the next try
            self._pending.pop(0)

    # -- live figures ----------------------------------------------------------------------
    def live_rows(self, since_mono_ns: int = 0) -> list[Row]:
        """Sampler rows still in memory (flushed recently or not yet) from ``since_mono_ns``."""
        with self._recent_lock:
            rows = list(self._recent) + self.sampler.peek_rows()
        first = bisect.bisect_left(rows, since_mono_ns, key=lambda r: r[0])
        return rows[first:]

    def step_figures(
        self,
        t_begin_mono_ns: int,
        t_end_mono_ns: int,
        wait_s: float = 0.0,
        figures: Collection[str] | None = None,
    ) -> list[dict[str, Any]] | None:
        """Attribution of one window for each device on this rank, or None while the sampler has
        not yet taken a sample at or after ``t_end_mono_ns`` (ask again next step, or pass
        ``wait_s`` to wait up to that long). Never blocks when ``wait_s`` is 0. ``figures``: the
        attribution columns wanted (None = all); fewer figures cost less on the training thread."""
        from charllm_nemo.telemetry.attribution import attribute_windows

        deadline = time.monotonic() + wait_s
        while self.sampler.last_t_mono_ns < t_end_mono_ns:
            if not self.sampler.running or time.monotonic() >= deadline:
                if self.sampler.running:
                    return None
                break
            time.sleep(min(0.002, 1.0 / self.hz))
        # Two periods before the window: every sample inside has its predecessor in the slice, so
        # counter ticks inside are found as in the stored run (the first sample of a slice is
        # never a tick), and live figures equal those computed later.
        arrays = rows_to_arrays(self.live_rows(t_begin_mono_ns - 2 * self.sampler.period_ns))
        out = []
        win = {
            "t_begin_mono_ns": np.array([t_begin_mono_ns], np.int64),
            "t_end_mono_ns": np.array([t_end_mono_ns], np.int64),
        }
        for dev in self.backend.devices:
            idx = dev.identity.index
            mask = arrays["device_index"] == idx
            per_dev = {k: v[mask] for k, v in arrays.items()}
            result = attribute_windows(per_dev, win, figures=figures)
            row = {k: (v[0].item() if hasattr(v[0], "item") else v[0]) for k, v in result.items()}
            row["device_index"] = idx
            out.append(row)
        return out
