"""Start the ranks of a run: spawn them locally, or read them from SLURM / torchrun.

``launcher=local`` spawns ``nproc`` worker processes (``python -m charllm_nemo.train.worker
<config.yaml>``) with the torch.distributed environment set, streams rank 0's output, keeps the
others' in ``<run>/logs/rank<N>.log``, stops every rank when one fails (and says which), and
forwards SIGTERM / SIGINT so that each rank's telemetry flushes before it exits.

``launcher=slurm`` and ``launcher=none`` run one rank in this process: the environment comes from
``SLURM_*`` (under ``srun``) or is already set (torchrun).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from charllm_nemo.errors import ConfigError, StoreError

# How long ranks get to exit (flush telemetry) after SIGTERM before they are killed.
TERMINATE_GRACE_S = 20.0
POLL_S = 0.05
DIST_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# -- device ---------------------------------------------------------------------------------------


def resolve_device(name: str) -> str:
    """``cpu`` or ``cuda`` for a configured ``launch.device``: ``auto`` means ``cuda`` when this
    host has an NVIDIA or AMD GPU driver with a device node, else ``cpu``. Cheap: no torch
    import (the launcher must not pay for it); force ``launch.device=cpu`` to override."""
    if name != "auto":
        return name
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return "cpu"
    nvidia = os.path.isdir("/proc/driver/nvidia/gpus") and bool(os.listdir("/proc/driver/nvidia/gpus"))
    amd = os.path.exists("/dev/kfd") and os.path.isdir("/dev/dri")
    return "cuda" if (nvidia or amd) else "cpu"


VISIBLE_DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def _amd_gpu_nodes(topology: Path) -> int:
    """KFD topology nodes with compute units (GPUs; CPU nodes have simd_count 0)."""
    count = 0
    for props in topology.glob("*/properties"):
        try:
            for line in props.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "simd_count" and int(value) > 0:
                    count += 1
        except (OSError, ValueError):
            continue
    return count


def local_gpu_count(
    environ: Mapping[str, str] | None = None,
    *,
    nvidia_dir: Path = Path("/proc/driver/nvidia/gpus"),
    kfd_topology: Path = Path("/sys/class/kfd/kfd/topology/nodes"),
) -> int | None:
    """GPUs a local launch on this host can use, without importing torch: the driver's devices
    (NVIDIA's ``/proc/driver/nvidia/gpus``, AMD's KFD topology nodes with compute units), no more
    than a ``*_VISIBLE_DEVICES`` list names. None when neither driver says (no count to check)."""
    physical: int | None = None
    if nvidia_dir.is_dir():
        physical = len(list(nvidia_dir.iterdir()))
    elif kfd_topology.is_dir():
        physical = _amd_gpu_nodes(kfd_topology)
    environ = os.environ if environ is None else environ
    for var in VISIBLE_DEVICE_VARS:
        value = environ.get(var)
        if value is not None:
            listed = 0 if value.strip() in ("", "-1") else len([v for v in value.split(",") if v.strip()])
            physical = listed if physical is None else min(listed, physical)
    return physical


def local_gpu_problem(nproc: int, gpus: int | None) -> str | None:
    """Why ``nproc`` ranks on ``launch.device=cuda`` cannot start on a host with ``gpus`` GPUs
    (``local_gpu_count``), if they cannot: one rank per GPU."""
    if gpus is None or nproc <= gpus:
        return None
    if gpus == 0:
        return (
            "launch.device=cuda but this host has no usable GPU (no driver device, or "
            "*_VISIBLE_DEVICES hides them all); set launch.device=cpu (or auto), or run on a GPU node"
        )
    return (
        f"launch.nproc={nproc} ranks with launcher=local, but this host has {gpus} GPU(s) (one rank per "
        f"GPU); set nproc <= {gpus}, or spread the ranks over nodes with launcher=slurm"
    )


# -- SLURM ---------------------------------------------------------------------------------------


def _split_top_level(s: str, sep: str = ",") -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p for p in (x.strip() for x in parts) if p]


def _expand_range(spec: str) -> list[str]:
    out: list[str] = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise ConfigError(f"cannot parse SLURM node range {item!r}")
            out.extend(f"{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
        else:
            out.append(item)
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list, in order: ``node[01-04,07]`` ->
    ``node01 node02 node03 node04 node07``; ``a1,b[2-3]`` -> ``a1 b2 b3``;
    ``r[1-2]-n[1-2]`` -> ``r1-n1 r1-n2 r2-n1 r2-n2``. Zero padding is kept."""
    hosts: list[str] = []
    for pattern in _split_top_level(nodelist):
        expanded = [""]
        for m in re.finditer(r"([^\[\]]+)|\[([^\]]*)\]", pattern):
            literal, spec = m.group(1), m.group(2)
            choices = [literal] if literal is not None else _expand_range(spec)
            expanded = [e + c for e in expanded for c in choices]
        if "[" in pattern and pattern.count("[") != pattern.count("]"):
            raise ConfigError(f"cannot parse SLURM node list {nodelist!r}")
        hosts.extend(expanded)
    return hosts


SLURM_PORT_BASE, SLURM_PORT_SPAN = 10000, 20000
"""``launch.master_port`` auto under SLURM: a port in [10000, 30000), below Linux's ephemeral range."""


def slurm_master_port(environ: Mapping[str, str]) -> int:
    """The rendezvous port every task of this job step computes alike: from SLURM_JOB_ID and
    SLURM_STEP_ID, so that jobs (and concurrent steps) sharing a node do not collide as they
    would on one fixed port."""
    job = environ.get("SLURM_JOB_ID", "0")
    step = environ.get("SLURM_STEP_ID", "0")
    job_n = int(job) if job.isdigit() else sum(job.encode())
    step_n = int(step) if step.isdigit() else 0
    return SLURM_PORT_BASE + (8 * job_n + step_n) % SLURM_PORT_SPAN


def slurm_rank_env(environ: Mapping[str, str], master_port: int | None) -> dict[str, str]:
    """torch.distributed variables for this srun task: RANK=SLURM_PROCID, WORLD_SIZE=SLURM_NTASKS,
    LOCAL_RANK=SLURM_LOCALID, MASTER_ADDR=first host of SLURM_JOB_NODELIST (SLURM_NODELIST),
    MASTER_PORT=``master_port`` (None: :func:`slurm_master_port`). A MASTER_ADDR / MASTER_PORT
    already in the environment wins."""
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID") if k not in environ]
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if nodelist is None and "MASTER_ADDR" not in environ:
        missing.append("SLURM_JOB_NODELIST")
    if missing:
        raise ConfigError(
            f"launch.launcher=slurm but {', '.join(missing)} is not set: start the ranks with "
            "`srun ... charllm train launcher=slurm ...`, or use launcher=local (one host) or "
            "launcher=none (torchrun)"
        )
    _check_counts(environ, ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "MASTER_PORT"))
    env = {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "LOCAL_RANK": environ["SLURM_LOCALID"],
        "MASTER_ADDR": environ.get("MASTER_ADDR") or expand_nodelist(nodelist or "")[0],
        "MASTER_PORT": environ.get("MASTER_PORT")
        or str(slurm_master_port(environ) if master_port is None else master_port),
    }
    if "SLURM_NODEID" in environ:
        env["GROUP_RANK"] = environ["SLURM_NODEID"]
    return env


def _check_counts(environ: Mapping[str, str], keys: Sequence[str]) -> None:
    """ConfigError naming every one of ``keys`` present in ``environ`` that is not a whole
    number (>= 1 for sizes, >= 0 otherwise): a launcher's variable garbled, not a traceback."""
    bad = []
    for key in keys:
        value = environ.get(key)
        if value is None:
            continue
        least = 1 if key in ("SLURM_NTASKS", "WORLD_SIZE", "MASTER_PORT") else 0
        if not value.strip().isdigit() or int(value) < least:
            bad.append(f"{key}={value!r}")
    if bad:
        raise ConfigError(
            f"{', '.join(bad)} must be whole numbers (sizes and ports >= 1): the launcher's environment is "
            "not what srun / torchrun set; check the job script"
        )


def torchrun_rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The torch.distributed variables torchrun (or a compatible launcher) set; ConfigError
    naming the missing ones."""
    missing = [k for k in DIST_ENV_KEYS if not environ.get(k)]
    if missing:
        raise ConfigError(
            f"launch.launcher=none but {', '.join(missing)} is not set: run under torchrun "
            "(`torchrun --nproc-per-node N -m charllm_nemo.cli train launcher=none ...`), or use "
            "launcher=local"
        )
    _check_counts(environ, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))
    return {k: environ[k] for k in DIST_ENV_KEYS}


# -- local spawn ---------------------------------------------------------------------------------


def free_port(preferred: int, host: str = "127.0.0.1") -> int:
    """``preferred`` if it can be bound on ``host`` now, else (or for 0) a free port the OS picks. Like
    torch's TCPStore, the probe sets SO_REUSEADDR: a port left in TIME_WAIT by a previous run
    counts as free, one that something listens on does not."""
    if preferred:  # 0: no preference
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, preferred))
                return preferred
            except OSError:
                pass
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    # Linux: the child gets SIGTERM if the launcher dies without forwarding (e.g. SIGKILL).
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class RankFailure:
    rank: int
    returncode: int
    log_path: Path | None


def _describe(rc: int) -> str:
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-rc).name}"
    return f"exit code {rc}"


TAIL_BYTES = 64 * 1024
"""Most bytes of a failed rank's log read for its last lines (the log itself may be gigabytes)."""


def _tail(path: Path | None, lines: int = 20) -> str:
    from charllm_nemo.telemetry.layout import read_tail

    if path is None:
        return ""
    with contextlib.suppress(OSError, StoreError):  # a log missing, a link, not a file: no tail
        data = read_tail(path, TAIL_BYTES)
        text = data.decode(errors="replace").splitlines()
        if len(data) == TAIL_BYTES:  # begun inside a line (or at a log's first): not shown cut
            text = text[1:]
        return "\n".join("    " + line for line in text[-lines:])
    return ""


def launch_local(
    config_path: str | os.PathLike[str],
    nproc: int,
    *,
    run_dir: str | os.PathLike[str],
    master_port: int | None = None,
    worker_argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    grace_s: float = TERMINATE_GRACE_S,
) -> int:
    """Spawn ``nproc`` ranks of ``worker_argv`` (default ``python -m charllm_nemo.train.worker
    <config_path>``) and wait. Returns 0 when all succeed; else the failing rank's exit code
    (128 + signal for a signal), after terminating the others; 128 + signum when the launcher
    itself got SIGTERM / SIGINT (forwarded to every rank, which then has ``grace_s`` to exit)."""
    from charllm_nemo.telemetry.write import anchor, open_dir

    run_dir = Path(run_dir)
    logs = run_dir / "logs"
    anchor(run_dir)  # RUN/logs a planted link: refused (StoreError), never written through
    logs_fd = open_dir(logs)
    argv = (
        list(worker_argv)
        if worker_argv is not None
        else [
            sys.executable,
            "-m",
            "charllm_nemo.train.worker",
            str(config_path),
        ]
    )
    # Auto (None): a port the OS gives free now. A fixed default would be one that every run on
    # the host prefers: two starting together could both find it free, and one rank 0 would
    # then fail to bind it (EADDRINUSE) seconds later, after importing torch.
    port = free_port(0 if master_port is None else master_port)
    if master_port is not None and port != master_port:
        print(f"charllm train: MASTER_PORT {master_port} is busy; using {port}", file=sys.stderr)
    base = dict(os.environ if env is None else env)
    if nproc > 1 and "OMP_NUM_THREADS" not in base:
        base["OMP_NUM_THREADS"] = "1"  # as torchrun does: N ranks must not each take every core

    procs: list[subprocess.Popen[bytes]] = []
    log_paths: list[Path | None] = []
    files = []
    received: list[int] = []
    deadline: list[float] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        if not deadline:
            deadline.append(time.monotonic() + grace_s)
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signum)

    in_main = threading.current_thread() is threading.main_thread()
    previous: dict[signal.Signals, Any] = {}
    if in_main:
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, forward)
    try:
        for rank in range(nproc):
            rank_env = dict(base)
            rank_env.update(
                RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(nproc),
                GROUP_RANK="0",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            if rank == 0:
                out = None  # rank 0 streams to the launcher's console
                log_paths.append(None)
            else:
                path = logs / f"rank{rank}.log"
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
                # relative to the checked folder's descriptor: a link at the name is refused too
                out = os.fdopen(os.open(path.name, flags, 0o644, dir_fd=logs_fd), "wb")
                files.append(out)
                log_paths.append(path)
            procs.append(
                subprocess.Popen(
                    argv,
                    env=rank_env,
                    stdout=out,
                    stderr=subprocess.STDOUT if out is not None else None,
                    # Own session: a Ctrl-C reaches only the launcher, which forwards it once.
                    start_new_session=True,
                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
                )
            )
        failure = _wait(procs, log_paths, received, deadline, grace_s)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait()
        for f in files:
            f.close()
        os.close(logs_fd)
        if in_main:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    if received:
        print(
            f"charllm train: got {signal.Signals(received[0]).name}; forwarded it to {nproc} rank(s)",
            file=sys.stderr,
        )
        return 128 + received[0]
    if failure is not None:
        where = f" (log: {failure.log_path})" if failure.log_path else ""
        print(
            f"charllm train: rank {failure.rank} failed with {_describe(failure.returncode)}{where}",
            file=sys.stderr,
        )
        tail = _tail(failure.log_path)
        if tail:
            print(f"  last lines of rank {failure.rank}:\n{tail}", file=sys.stderr)
        rc = failure.returncode
        return rc if rc > 0 else 128 + (-rc if rc < 0 else 1)
    return 0


def _wait(
    procs: list[subprocess.Popen[bytes]],
    log_paths: list[Path | None],
    received: list[int],
    deadline: list[float],
    grace_s: float,
) -> RankFailure | None:
    """Wait for every rank; on the first failure terminate the rest and return it. A failure
    is looked for before the all-exited check: ranks that all exit between two polls (one rank
    rejecting its config at once, say) still report theirs."""
    failure: RankFailure | None = None
    while True:
        codes = [p.poll() for p in procs]
        if failure is None and not received:
            for rank, c in enumerate(codes):
                if c not in (None, 0):
                    failure = RankFailure(rank, c, log_paths[rank])
                    for p in procs:
                        if p.poll() is None:
                            with contextlib.suppress(ProcessLookupError):
                                p.terminate()
                    deadline.append(time.monotonic() + grace_s)
                    break
        if all(c is not None for c in codes):
            return failure
        if deadline and time.monotonic() > deadline[0]:
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
        time.sleep(POLL_S)
