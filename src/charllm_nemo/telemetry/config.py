"""The telemetry configuration of a rank, its validation, its placement, and the call that opens
its session.

Framework-free: nothing here imports ``charllm_nemo.train`` or a training framework. Every
training loop (``charllm train``, the NeMo / Lightning / Megatron-LM / Bridge integrations) fills
a :class:`TelemetryConfig`, says where the rank sits (:class:`Placement`) and calls
:func:`open_session`; the per-step API (``charllm_nemo.steps``) takes it from there.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from charllm_nemo.devices.synthetic_config import SyntheticConfig, synthetic_options, synthetic_problems
from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.placement import DEFAULT_COLLECTOR_SCHED, DEFAULT_NICE, DEFAULT_SAMPLER
from charllm_nemo.telemetry.sample_loop import DEFAULT_COUNTER_HZ, DEFAULT_HZ
from charllm_nemo.telemetry.session_options import (
    DEFAULT_DRIVER_BUFFERS,
    DEFAULT_OVERWRITE,
    ProcessOptions,
    SessionOptions,
    StoreOptions,
)
from charllm_nemo.telemetry.session_options import MEGATRON_LABELS as MEGATRON_LABELS
from charllm_nemo.telemetry.session_options import Placement as Placement

if TYPE_CHECKING:
    from charllm_nemo.telemetry.session import TelemetrySession

ATTENTION_FLOPS: tuple[str, ...] = ("full", "causal")
"""How MFU counts the attention score and context GEMMs (``telemetry.attention_flops``):
``full``, the whole ``s x s`` matrix (Narayanan et al. 2021, Megatron-LM's formula before
mid-2025, NVIDIA's published performance tables; our default, so that figures compare with
those tables and with earlier runs of this project); ``causal``, only the unmasked half (NeMo
2.7.3's ``nemo/utils/flops_formulas.py``, Megatron-LM's main branch since mid-2025). For
Llama-3 8B at 8192 tokens ``full`` reads about 12 % higher than ``causal``."""


@dataclass
class TelemetryConfig:
    """What a rank samples and records (Hydra group ``telemetry``; docs/config.md).

    Rates in Hz, ``cpu_peak_tflops`` in TFLOP/s. :func:`validate_telemetry` checks every field.
    """

    enabled: bool = True
    backend: str = "auto"  # auto | nvml | amdsmi | synthetic
    hz: float = DEFAULT_HZ
    # Cumulative counters (energy, violation times, PCIe/NVLink bytes) where the backend reads
    # them apart (NVML: the energy counter costs ~3 ms a read on an H200): null = the rate derived
    # from the measured cost of a read (at most 3 % of a core: every sample where reads are cheap);
    # a number = that rate (telemetry.hz or more: every sample whatever it costs).
    counter_hz: float | None = DEFAULT_COUNTER_HZ
    # Also store the driver's own sample buffers where a device keeps them (NVML: power, SM
    # clock, utilization at the driver's rate; buffered-NNNNNN.parquet; docs/store.md).
    driver_buffers: bool = DEFAULT_DRIVER_BUFFERS
    # Where sampling, storing and live figures run: auto = a telemetry process beside the rank
    # (no GIL shared with training; docs/telemetry.md), threads where none can start.
    sampler: str = DEFAULT_SAMPLER  # auto | thread | process
    # The telemetry process's nice value (0-19; 19 where a CPU is free: docs/telemetry.md).
    nice: int = DEFAULT_NICE
    collector_sched: str = DEFAULT_COLLECTOR_SCHED  # its collector thread: normal | idle | auto
    out_dir: str = "runs/${now:%Y%m%d-%H%M%S}"
    # out_dir may hold an earlier run: replace it (default: refuse to start).
    overwrite: bool = DEFAULT_OVERWRITE
    required: bool = False  # a full disk stops training (true) or only telemetry (false; docs/reliability.md)
    windows: list[str] = field(default_factory=lambda: ["step", "microbatch", "phase"])
    cpu_peak_tflops: float | None = None  # MFU on CPU only when set
    attention_flops: str = "full"  # full | causal: how MFU counts attention (ATTENTION_FLOPS)
    # Steps (numbered from 0) every rank records with the PyTorch profiler into
    # <out_dir>/traces/rank=<r>/step-NNNNNN.json, for charllm analyze's kernel breakdown
    # (train/profile.py, docs/analysis.md). A profiled step runs slower: pick few, after warm-up.
    profile_steps: list[int] = field(default_factory=list)
    # Heterogeneous synthetic devices, by global rank: cooling, power limit, injected throttle
    # windows, and whether they slow the training thread (devices/synthetic_config.py,
    # docs/devices.md). Read only where the backend is synthetic (named, or auto's fallback).
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    # Live export (docs/export.md), from the telemetry process: off | prometheus (an endpoint per
    # rank on export_host:export_port + local rank) | textfile (node_exporter's textfile folder).
    export: str = "off"
    export_host: str = "127.0.0.1"  # 0.0.0.0 (or the node's address) for a Prometheus elsewhere
    export_port: int = 9410  # rank with local rank L serves export_port + L
    export_textfile_dir: str | None = None  # textfile: node_exporter's --collector.textfile.directory
    export_interval_s: float = 5.0  # textfile / otlp: how often the file is rewritten / pushed
    export_otlp_endpoint: str = "http://127.0.0.1:4318/v1/metrics"  # otlp: the collector's OTLP/HTTP URL


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _choices(allowed: Sequence[object]) -> str:
    return "[" + ", ".join(str(a) for a in allowed) + "]"


def telemetry_problems(cfg: TelemetryConfig, *, check_out_dir: bool = True) -> list[str]:
    """Every problem of ``cfg``, one message each (``telemetry.<field>``, the value, the fix);
    empty when it is valid. Rates and ``cpu_peak_tflops`` must be finite and positive (nan would
    never compare, inf would sample without pause or end every wait at once). ``check_out_dir``:
    also check that the run directory can be made and written (a rank that only reads a config
    elsewhere skips it)."""
    from charllm_nemo.devices.factory import BACKEND_NAMES
    from charllm_nemo.telemetry.placement import collector_sched_problem, nice_problem, sampler_problem
    from charllm_nemo.telemetry.sample_loop import counter_hz_problem, hz_problem
    from charllm_nemo.telemetry.schema import WINDOW_KINDS

    problems: list[str] = []

    def one_of(name: str, allowed: Sequence[str]) -> None:
        value = getattr(cfg, name)
        if value not in allowed:
            problems.append(f"telemetry.{name}={value!r} is not valid; use one of {_choices(allowed)}")

    if not isinstance(cfg.enabled, bool):
        problems.append(f"telemetry.enabled={cfg.enabled!r} must be true or false")
    one_of("backend", BACKEND_NAMES)
    one_of("attention_flops", ATTENTION_FLOPS)
    # The session's own options, by the checks SessionOptions makes (each declared once).
    # The rates matter only to a sampler: a disabled telemetry keeps whatever they read.
    rates = (hz_problem(cfg.hz), counter_hz_problem(cfg.counter_hz)) if cfg.enabled else ()
    found = (
        sampler_problem(cfg.sampler),
        collector_sched_problem(cfg.collector_sched),
        nice_problem(cfg.nice),
    )
    problems.extend(p for p in (*found, *rates) if p is not None)
    p = cfg.cpu_peak_tflops
    if p is not None and (not _is_number(p) or not math.isfinite(p) or p <= 0):
        problems.append(
            f"telemetry.cpu_peak_tflops={p!r} must be a positive finite rate in TFLOP/s; e.g. "
            "telemetry.cpu_peak_tflops=1.5, or null for no MFU on CPU"
        )
    if not isinstance(cfg.driver_buffers, bool):
        problems.append(f"telemetry.driver_buffers={cfg.driver_buffers!r} must be true or false")
    if not isinstance(cfg.overwrite, bool):
        problems.append(f"telemetry.overwrite={cfg.overwrite!r} must be true or false")
    if not isinstance(cfg.required, bool):
        problems.append(f"telemetry.required={cfg.required!r} must be true or false")
    windows = cfg.windows
    if isinstance(windows, str) or not isinstance(windows, Sequence):
        problems.append(
            f"telemetry.windows={windows!r} must be a list of window kinds, a subset of "
            f"{_choices(WINDOW_KINDS)}"
        )
    else:
        unknown = [w for w in windows if w not in WINDOW_KINDS]
        if unknown:
            problems.append(
                f"telemetry.windows has unknown kinds {unknown}; use a subset of {_choices(WINDOW_KINDS)}"
            )
    steps = cfg.profile_steps
    if not isinstance(steps, (list, tuple)) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps
    ):
        problems.append(
            f"telemetry.profile_steps={steps!r} must be a list of step numbers >= 0 (from 0), "
            "e.g. telemetry.profile_steps=[5,6]"
        )
    problems.extend(synthetic_problems(cfg.synthetic))
    problems.extend(_export_problems(cfg))
    if not str(cfg.out_dir).strip():
        problems.append(
            "telemetry.out_dir is empty; give a run directory, e.g. telemetry.out_dir=runs/my-run"
        )
    elif check_out_dir:
        problem = out_dir_problem(str(cfg.out_dir))
        if problem:
            problems.append(problem)
    return problems


def _export_problems(cfg: TelemetryConfig) -> list[str]:
    """telemetry.export and its settings (docs/export.md)."""
    from charllm_nemo.telemetry.export.names import EXPORT_MODES

    problems: list[str] = []
    if cfg.export not in EXPORT_MODES:
        return [f"telemetry.export={cfg.export!r} is not valid; use one of {_choices(EXPORT_MODES)}"]
    port = cfg.export_port
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        problems.append(
            f"telemetry.export_port={port!r} is not a TCP port; give one in [1, 65535], e.g. 9410"
        )
    if not isinstance(cfg.export_host, str) or not cfg.export_host.strip():
        problems.append(
            f"telemetry.export_host={cfg.export_host!r} must be an address to listen on, e.g. 127.0.0.1 "
            "or 0.0.0.0"
        )
    i = cfg.export_interval_s
    if not _is_number(i) or not math.isfinite(i) or i <= 0:
        problems.append(f"telemetry.export_interval_s={i!r} must be a positive number of seconds, e.g. 5")
    if cfg.export == "otlp" and not str(cfg.export_otlp_endpoint).startswith(("http://", "https://")):
        problems.append(
            f"telemetry.export_otlp_endpoint={cfg.export_otlp_endpoint!r} is not an http(s) URL; give the "
            "collector's OTLP/HTTP metrics URL, e.g. http://127.0.0.1:4318/v1/metrics"
        )
    if cfg.export == "textfile":
        folder = cfg.export_textfile_dir
        if not folder or not str(folder).strip():
            problems.append(
                "telemetry.export=textfile needs telemetry.export_textfile_dir: node_exporter's "
                "--collector.textfile.directory, e.g. /var/lib/prometheus/node-exporter"
            )
        elif not Path(str(folder)).is_dir() or Path(str(folder)).is_symlink():
            problems.append(
                f"telemetry.export_textfile_dir={folder!r} is not a directory (a link is not followed); "
                "give node_exporter's textfile directory"
            )
    return problems


def export_options(cfg: TelemetryConfig, placement: Placement) -> dict[str, Any] | None:
    """What the telemetry process's exporter needs (None when telemetry.export=off)."""
    if cfg.export == "off":
        return None
    return {
        "mode": cfg.export,
        "host": cfg.export_host,
        "port": cfg.export_port,
        "textfile_dir": cfg.export_textfile_dir,
        "interval_s": cfg.export_interval_s,
        "otlp_endpoint": cfg.export_otlp_endpoint,
        "rank": placement.rank,
        "local_rank": placement.local_rank,
        "run": Path(str(cfg.out_dir)).name,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "parallel": {k: int(v) for k, v in placement.labels.items() if k in MEGATRON_LABELS},
    }


def validate_telemetry(cfg: TelemetryConfig, *, check_out_dir: bool = True) -> None:
    """Raise :class:`~charllm_nemo.errors.ConfigError` listing every problem of ``cfg``
    (:func:`telemetry_problems`); return None when it is valid."""
    problems = telemetry_problems(cfg, check_out_dir=check_out_dir)
    if problems:
        raise ConfigError("; ".join(problems))


def out_dir_problem(out_dir: str) -> str | None:
    """Why the run directory cannot be made or written, if it cannot: a file in the way, or a
    folder this user may not write into (checked on the nearest folder that exists)."""
    try:
        return _out_dir_path_problem(out_dir)
    except OSError as exc:  # a name too long, a path through something that is not a folder
        return f"telemetry.out_dir={out_dir!r} cannot be used ({exc.strerror or exc}); give another directory"


def _out_dir_path_problem(out_dir: str) -> str | None:
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        return f"telemetry.out_dir={out_dir!r} is a file, not a directory; give a directory for the run"
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return (
            f"telemetry.out_dir={out_dir!r} cannot be made: {str(existing)!r} is a file; give another "
            "directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        return (
            f"telemetry.out_dir={out_dir!r} cannot be written: {str(existing)!r} is not writable by this "
            "user; give another directory, or fix its permissions"
        )
    # os.access answers for the permission bits only: root may "write" /proc or a read-only
    # mount, which then refuses the run's first folder after the model is built. One empty
    # folder made and removed at once asks the file system itself.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".charllm-probe-", dir=existing))
    except OSError as exc:
        return (
            f"telemetry.out_dir={out_dir!r} cannot be written: {str(existing)!r} refuses a new folder "
            f"({exc.strerror or exc}); give a directory on a writable file system"
        )
    return None


def session_options(cfg: TelemetryConfig, placement: Placement, *, rank_threads: int = 1) -> SessionOptions:
    """The one place a config becomes :class:`SessionOptions`: its sampling, storing and
    telemetry-process fields, the synthetic devices' options for this rank (``auto`` hands them
    to its synthetic fallback only) and the live exporter's settings (:func:`export_options`).
    ``rank_threads``: the CPU threads the rank keeps busy (``collector_sched=auto`` reads it). A
    bad value raises ConfigError naming the field."""
    synthetic = cfg.backend in ("synthetic", "auto")
    return SessionOptions(
        backend=cfg.backend,
        hz=cfg.hz,
        counter_hz=cfg.counter_hz,
        sampler=cfg.sampler,
        backend_options=synthetic_options(cfg.synthetic, placement.rank) if synthetic else {},
        store=StoreOptions(overwrite=cfg.overwrite, driver_buffers=cfg.driver_buffers),
        process=ProcessOptions(
            nice=cfg.nice,
            collector_sched=cfg.collector_sched,
            rank_threads=rank_threads,
            export=export_options(cfg, placement),
        ),
    )


def open_session(
    cfg: TelemetryConfig,
    placement: Placement,
    *,
    run_config: Mapping[str, Any] | Any | None = None,
    rank_threads: int = 1,
    validate: bool = True,
    handle_signals: bool = True,
) -> TelemetrySession:
    """Open and start this rank's telemetry session from ``cfg`` (validated first unless
    ``validate=False``, for a caller that validated the whole config already) and ``placement``.

    ``run_config``: the run's whole configuration (a mapping or a dataclass), written into the
    manifest. ``rank_threads``: the CPU threads the rank keeps busy (1 on a GPU, its intra-op
    threads on a CPU; ``telemetry.collector_sched=auto`` reads it). The session's options come
    from :func:`session_options`. ``handle_signals``: the session installs its SIGTERM handler
    (False where the host owns SIGTERM). ``telemetry.overwrite`` is passed through: a launcher
    that cleared the run directory before any rank could write should pass a config with
    ``overwrite=False`` (a rank folder holding files then is another job's). Raises ConfigError
    when ``cfg.enabled`` is false: there is nothing to open.
    """
    from charllm_nemo.telemetry.session import TelemetrySession

    if validate:
        validate_telemetry(cfg)
    if not cfg.enabled:
        raise ConfigError(
            "telemetry.enabled=false: no session to open; check cfg.enabled before open_session"
        )
    config: dict[str, Any] | None
    if run_config is None:
        config = {"telemetry": asdict(cfg)}
    elif is_dataclass(run_config) and not isinstance(run_config, type):
        config = asdict(run_config)
    elif isinstance(run_config, Mapping):
        config = dict(run_config)
    else:
        raise ConfigError(f"run_config={run_config!r}: give a mapping or a dataclass instance")
    options = session_options(cfg, placement, rank_threads=rank_threads)
    session = TelemetrySession(
        cfg.out_dir, options, placement=placement, config=config, handle_signals=handle_signals
    )
    return session.start()
