"""One job of a sweep (``charllm train -m +sweep=<name> ...``), wherever it runs.

The sweeper (hydra_plugins/charllm_sweeps) gives each job ``sweep.run_key`` and
``sweep.attempt``; Hydra's job directory is ``<sweep dir>/run=<key>``. Here the job:

* picks how its ranks start from where it finds itself: a SLURM job through submitit
  (``launcher=slurm``: each task one rank, ranks and rendezvous from ``SLURM_*``), a
  ``submitit_local`` job (``launcher=none``: each task one rank, from submitit's job environment),
  or Hydra's basic launcher (``launcher=local``: this process spawns ``nproc`` ranks);
* writes its run into ``run=<key>/attempt=<n>/``, n being the sweeper's number plus SLURM's
  restart count (a requeued job is a new attempt: it never writes into the killed one's folder);
* has rank 0 record the attempt in ``job.json``: ``running`` at start, then ``done``, ``failed``,
  ``preempted`` (SIGTERM, or submitit's preemption / time-limit signal: the ranks' telemetry is
  flushed as the exception unwinds them) or ``out_of_memory``, with the exit reason.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from charllm_nemo.errors import CharllmError
from charllm_nemo.train.config import TrainConfig
from charllm_nemo.train.sweep_manifest import (
    DONE,
    FAILED,
    JOB_FILE,
    OUT_OF_MEMORY,
    PREEMPTED,
    RUNNING,
    now_iso,
    read_json,
    write_json,
)

EXIT_CONFIG_ERROR = 2
PREEMPT_CODES = {143: "SIGTERM (preemption, or scancel)", -1: "submitit's preemption / time-limit signal"}


def restart_count(environ: dict[str, str] | os._Environ[str]) -> int:
    """How often SLURM has requeued this job (0 outside SLURM)."""
    value = environ.get("SLURM_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def where_am_i(
    environ: dict[str, str] | os._Environ[str],
) -> tuple[str, str | None, int, str, dict[str, str]]:
    """(scheduler, job id, global rank, node list, rank environment) of this process:
    ``slurm`` (submitit's SLURM executor), ``local`` (``submitit_local``) or ``none`` (Hydra's
    basic launcher: this process launches the ranks)."""
    executor = environ.get("SUBMITIT_EXECUTOR")
    if executor == "slurm":
        import submitit

        env = submitit.JobEnvironment()
        nodes = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or socket.gethostname()
        return "slurm", str(env.job_id), int(env.global_rank), nodes, {}
    if executor == "local":
        import submitit

        from charllm_nemo.train.launch import slurm_master_port

        env = submitit.JobEnvironment()
        job_id = str(env.job_id)
        rank_env = {
            "RANK": str(env.global_rank),
            "WORLD_SIZE": str(env.num_tasks),
            "LOCAL_RANK": str(env.local_rank),
            "MASTER_ADDR": "127.0.0.1",
            # Every task of the job computes the same port from the job's id (its pid here).
            "MASTER_PORT": str(slurm_master_port({"SLURM_JOB_ID": job_id})),
        }
        return "local", job_id, int(env.global_rank), socket.gethostname(), rank_env
    return "none", None, 0, socket.gethostname(), {}


def _is_out_of_memory(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    return "outofmemory" in text or "out of memory" in text or "needs at least" in text


def run_sweep_job(dcfg: DictConfig, run_dir: Path, run: Callable[[TrainConfig], int]) -> int:
    """Run one attempt of one configuration (``dcfg`` holds the ``sweep`` node) into
    ``run_dir/attempt=<n>`` with ``run`` (train/app.py's); returns its exit code."""
    from charllm_nemo.train.config_io import train_config_from

    environ = os.environ
    scheduler, job_id, rank, nodes, rank_env = where_am_i(environ)
    attempt = int(OmegaConf.select(dcfg, "sweep.attempt") or 1) + restart_count(environ)
    out_dir = run_dir / f"attempt={attempt}"
    launcher = {"slurm": "slurm", "local": "none", "none": "local"}[scheduler]
    dcfg = OmegaConf.merge(dcfg, {"telemetry": {"out_dir": str(out_dir)}, "launch": {"launcher": launcher}})  # type: ignore[assignment]
    with open_dict(dcfg):
        dcfg.pop("sweep", None)
    os.environ.update(rank_env)
    record: dict[str, Any] = {
        "key": run_dir.name.split("=", 1)[-1],
        "attempt": attempt,
        "state": RUNNING,
        "scheduler": scheduler,
        "job_id": job_id,
        "nodes": nodes,
        "start": now_iso(),
        "end": None,
        "exit_code": None,
        "exit_reason": None,
    }
    job_file = out_dir / JOB_FILE
    if rank == 0:
        write_json(job_file, record)

    def finish(state: str, code: int, reason: str | None) -> None:
        if rank != 0:
            return
        latest = read_json(job_file) or record
        latest.update(state=state, end=now_iso(), exit_code=code, exit_reason=reason)
        write_json(job_file, latest)

    try:
        rc = run(train_config_from(dcfg))
    except SystemExit as exc:  # SIGTERM unwinding the rank (train/worker.py), or submitit's exit
        code = exc.code if isinstance(exc.code, int) else 1
        why = PREEMPT_CODES.get(code)
        finish(PREEMPTED if why else FAILED, code, why or f"exit {code}")
        raise
    except CharllmError as exc:
        print(f"charllm train: {exc}", file=sys.stderr, flush=True)
        finish(OUT_OF_MEMORY if _is_out_of_memory(exc) else FAILED, EXIT_CONFIG_ERROR, str(exc)[:500])
        return EXIT_CONFIG_ERROR
    except Exception as exc:
        finish(OUT_OF_MEMORY if _is_out_of_memory(exc) else FAILED, 1, f"{type(exc).__name__}: {exc}"[:500])
        raise
    if rc == 0:
        finish(DONE, 0, None)
    elif rc in PREEMPT_CODES:
        finish(PREEMPTED, rc, PREEMPT_CODES[rc])
    else:
        finish(FAILED, rc, f"exit code {rc}" + (" (configuration error)" if rc == EXIT_CONFIG_ERROR else ""))
    return rc
