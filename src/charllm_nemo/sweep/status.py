"""Where each configuration of a sweep stands: its attempts' ``job.json`` and, where those cannot
tell, SLURM's word on the job (``scontrol show job``, else ``sacct``).

A rank 0 that ends normally writes the attempt's final state itself. What it cannot write:
a job cancelled (``scancel``: its ranks see SIGTERM, as on a preemption, so they write
``preempted``, and SLURM says CANCELLED: the attempt is ``failed``), killed (SIGKILL, a node
failure: ``job.json`` still says ``running`` while SLURM says the job ended), or killed for
memory (SLURM's OUT_OF_MEMORY). :func:`attempt_state` combines the two.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.filecheck import printable
from charllm_nemo.train.sweep_manifest import (
    FAILED,
    FINAL,
    JOB_FILE,
    MANIFEST,
    OUT_OF_MEMORY,
    PENDING,
    PREEMPTED,
    RUNNING,
    Attempt,
    RunEntry,
    SweepManifest,
    attempt_dir,
    format_table,
    load_manifest,
    read_json,
)
from charllm_nemo.train.sweep_manifest_check import checked_job

SLURM_ALIVE = frozenset(
    {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING",
     "SUSPENDED", "RESIZING", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD"}
)  # fmt: skip
SLURM_FINAL = {
    "CANCELLED": (FAILED, "cancelled (scancel or an administrator)"),
    "PREEMPTED": (PREEMPTED, "preempted by SLURM"),
    "TIMEOUT": (FAILED, "reached its time limit"),
    "OUT_OF_MEMORY": (OUT_OF_MEMORY, "killed by SLURM for exceeding its memory"),
    "NODE_FAIL": (FAILED, "a node failed"),
    "BOOT_FAIL": (FAILED, "a node failed to boot"),
    "DEADLINE": (FAILED, "reached its deadline"),
    "FAILED": (FAILED, "ended with a non-zero exit code"),
    "COMPLETED": (FAILED, "the job ended but rank 0 recorded no final state (killed?)"),
}
"""SLURM job states that end a job, and what they make of an attempt whose rank 0 did not (or,
for CANCELLED and OUT_OF_MEMORY, could not truly) record how it ended."""


def slurm_job_state(job_id: str) -> str | None:
    """SLURM's state of ``job_id`` (``RUNNING``, ``CANCELLED``, ...; an array task as
    ``<array job>_<task>``), or None when SLURM is not here or has forgotten the job."""
    if shutil.which("scontrol"):
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
        )
        for token in out.stdout.split():
            if token.startswith("JobState="):
                return token.split("=", 1)[1]
    if shutil.which("sacct"):
        out = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id],
            capture_output=True,
            text=True,
            timeout=30,
        )
        lines = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
        if lines:
            return lines[0]
    return None


def attempt_state(job: dict[str, object] | None, slurm_state: str | None) -> tuple[str, str | None]:
    """(state, exit reason) of an attempt from its ``job.json`` (None: rank 0 never started)
    and SLURM's state of its job (None: not a SLURM job, or SLURM does not know it)."""
    recorded = str(job.get("state")) if job else PENDING
    reason = job.get("exit_reason") if job else None
    reason = str(reason) if reason is not None else None
    if slurm_state is None or slurm_state in SLURM_ALIVE:
        return recorded, reason
    mapped, why = SLURM_FINAL.get(slurm_state, (FAILED, f"SLURM state {slurm_state}"))
    if slurm_state in ("CANCELLED", "OUT_OF_MEMORY", "PREEMPTED"):
        return mapped, f"{why} (SLURM: {slurm_state})"
    if recorded in FINAL:
        return recorded, reason
    return mapped, f"{why} (SLURM: {slurm_state})"


def refresh_attempt(
    sweep_dir: Path, key: str, attempt: Attempt, ask_slurm: bool = True, problems: list[str] | None = None
) -> Attempt:
    """``attempt`` brought up to date from its ``job.json`` and SLURM (in place; returned).
    ``job.json`` is read through the hardened layer and checked field by field; what is wrong
    with it is a line in ``problems``."""
    problems = [] if problems is None else problems
    path = attempt_dir(sweep_dir, key, attempt.attempt) / JOB_FILE
    job = checked_job(read_json(path, problems), path, problems)
    if job:
        for name in ("job_id", "scheduler", "nodes", "start", "end", "exit_code"):
            if job.get(name) is not None:
                setattr(attempt, name, job[name])
    scheduler = (job or {}).get("scheduler") or attempt.scheduler
    slurm = None
    if ask_slurm and attempt.job_id and scheduler == "slurm":
        slurm = slurm_job_state(str(attempt.job_id))
    if job is None and attempt.state not in (PENDING, RUNNING):
        return attempt  # decided earlier (e.g. predicted out of memory, never submitted)
    attempt.state, attempt.exit_reason = attempt_state(job, slurm)
    return attempt


def refresh(
    manifest: SweepManifest, sweep_dir: Path, ask_slurm: bool = True, problems: list[str] | None = None
) -> SweepManifest:
    """Every configuration's latest attempt refreshed; each entry's state is its latest
    attempt's (an entry with no attempt keeps its own: pending, or out_of_memory_predicted)."""
    for entry in manifest.runs.values():
        latest = entry.latest
        if latest is None:
            continue
        if latest.state not in FINAL or latest.state == PREEMPTED:
            refresh_attempt(sweep_dir, entry.key, latest, ask_slurm, problems)
        # A requeued job (preemption) writes attempts the sweeper did not create: adopt them.
        _adopt_requeued(sweep_dir, entry, ask_slurm, problems)
        entry.state, entry.exit_reason = entry.attempts[-1].state, entry.attempts[-1].exit_reason
    return manifest


def _adopt_requeued(sweep_dir: Path, entry: RunEntry, ask_slurm: bool, problems: list[str] | None) -> None:
    known = {a.attempt for a in entry.attempts}
    for folder in sorted((sweep_dir / f"run={entry.key}").glob("attempt=*")):
        try:
            n = int(folder.name.split("=", 1)[1])
        except ValueError:
            continue
        if n not in known and 0 < n < 10**6 and (folder / JOB_FILE).is_file():
            entry.attempts.append(
                refresh_attempt(sweep_dir, entry.key, Attempt(attempt=n, state=RUNNING), ask_slurm, problems)
            )
    entry.attempts.sort(key=lambda a: a.attempt)


HEADER = ("run", "state", "attempt", "job", "nodes", "start", "end", "exit reason")


def status_lines(manifest: SweepManifest) -> list[str]:
    """``charllm sweep status``'s table: one line per configuration, then a count per state."""
    rows = []
    for entry in manifest.runs.values():
        a = entry.latest
        rows.append(
            (
                entry.key,
                entry.state,
                str(a.attempt) if a else "-",
                str(a.job_id) if a and a.job_id else "-",
                str(a.nodes) if a and a.nodes else "-",
                _short(a.start) if a else "-",
                _short(a.end) if a else "-",
                entry.exit_reason or "",
            )
        )
    counts: dict[str, int] = {}
    for entry in manifest.runs.values():
        counts[entry.state] = counts.get(entry.state, 0) + 1
    lines = [f"sweep {manifest.name}: {len(manifest.runs)} configuration(s) in {manifest.directory}"]
    lines += format_table(rows, HEADER)
    # Every cell comes from sweep.json / job.json: no escape sequence reaches the terminal.
    lines = [printable(line, 2000) for line in lines]
    lines.append(printable(", ".join(f"{n} {state}" for state, n in sorted(counts.items())), 2000))
    return lines


def sweep_status(folder: Path, ask_slurm: bool = True) -> tuple[list[str], list[str]]:
    """``charllm sweep status``'s lines for the sweep in ``folder`` and the warnings met
    reading it (each naming the file and the field, escaped for a terminal). A sweep.json that
    cannot be read at all, or is another tool's, gives no line and a warning."""
    problems: list[str] = []
    try:
        manifest = load_manifest(folder, problems)
    except ConfigError as exc:  # another tool's sweep.json: the other sweeps are still listed
        problems.append(str(exc))
        manifest = None
    lines: list[str] = []
    if manifest is None:
        problems.append(f"{folder / MANIFEST}: no readable sweep manifest; sweep not listed")
    else:
        refresh(manifest, folder, ask_slurm, problems)
        lines = status_lines(manifest)
    return lines, [printable(p, 2000) for p in dict.fromkeys(problems)]


def _short(iso: str | None) -> str:
    """``2026-12-04T21:03:07+00:00`` -> ``12-04 21:03:07`` (UTC)."""
    if not iso or not isinstance(iso, str):
        return "-"
    return iso[5:19].replace("T", " ")
