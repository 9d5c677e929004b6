"""The CPU mirrors as real SLURM jobs on the single-node SLURM of scripts/local-slurm.sh
(scripts/test.sh starts it; these tests are skipped when it is not up): one job per
configuration, 2 tasks (ranks) each, through ``hydra/launcher=slurm_cpu_2ranks``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from charllm_nemo.telemetry.reader import load_run
from charllm_nemo.train.sweep_manifest import load_manifest

pytestmark = pytest.mark.xdist_group("slurm")  # one SLURM queue: these tests run in one worker
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "local-slurm.sh"
CHARLLM = [sys.executable, "-m", "charllm_nemo.cli"]
JOB_LIMIT_S = 600


@pytest.fixture(scope="module")
def slurm_env() -> Iterator[dict[str, str]]:
    """The environment of a client of the local SLURM (SLURM_CONF, the sacct stand-in on PATH)."""
    env = dict(os.environ)
    for line in subprocess.run(
        [str(SCRIPT), "env"], capture_output=True, text=True, check=True
    ).stdout.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.replace("$PATH", os.environ.get("PATH", ""))
    up = subprocess.run([str(SCRIPT), "status"], capture_output=True, text=True, env=env)
    if up.returncode != 0:
        pytest.skip("no local SLURM: scripts/local-slurm.sh start (scripts/test.sh does)")
    env.pop("SUBMITIT_EXECUTOR", None)
    env.pop("CHARLLM_WORKER_TARGET", None)
    yield env


def _sweep(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CHARLLM, "train", "-m", *args, "hydra/launcher=slurm_cpu_2ranks", f"sweep.dir={cwd}"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=JOB_LIMIT_S,
    )  # fmt: skip


def _jobs(env: dict[str, str]) -> int:
    out = subprocess.run(["squeue", "-t", "all", "-h", "-o", "%i"], env=env, capture_output=True, text=True)
    return len(out.stdout.split())


def _both_ranks_wrote_telemetry(run: Path) -> None:
    telemetry = load_run(run)
    assert telemetry.ranks == [0, 1], telemetry.problems
    assert telemetry.samples.num_rows > 0 and telemetry.windows.num_rows > 0


@pytest.mark.slow
def test_the_microbatch_mirror_runs_as_slurm_jobs_and_a_rerun_submits_nothing(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    first = _sweep(slurm_env, tmp_path, "+sweep=cpu_microbatch")
    assert first.returncode == 0, first.stderr[-3000:]
    sweep = tmp_path / "sweep=cpu_microbatch"
    manifest = load_manifest(sweep)
    assert manifest is not None
    assert {k: e.state for k, e in manifest.runs.items()} == {
        f"micro_batch_size-{m}": "done" for m in (1, 2, 4, 8)
    }
    job_ids = set()
    for key, entry in manifest.runs.items():
        assert entry.latest is not None and entry.latest.scheduler == "slurm"
        job_ids.add(entry.latest.job_id)
        run = sweep / f"run={key}" / "attempt=1"
        _both_ranks_wrote_telemetry(run)
        job = json.loads((run / "job.json").read_text())
        assert job["state"] == "done" and job["job_id"] == entry.latest.job_id and job["nodes"]
    assert len(job_ids) == 4  # one SLURM job per configuration

    before = _jobs(slurm_env)
    again = _sweep(slurm_env, tmp_path, "+sweep=cpu_microbatch")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "launching 0 of 4 configuration(s); left as they are: 4 done" in again.stderr
    assert _jobs(slurm_env) == before

    table = subprocess.run(
        [*CHARLLM, "sweep", "status", str(tmp_path)], env=slurm_env, capture_output=True, text=True
    )
    assert table.returncode == 0 and table.stdout.splitlines()[-1] == "4 done"


def _wait_running(attempt: Path, proc: subprocess.Popen[str], steps: int = 2) -> str:
    """The job id of ``attempt`` once its rank 0 has reported ``steps`` steps."""
    deadline = time.monotonic() + JOB_LIMIT_S
    while time.monotonic() < deadline:
        job, log = attempt / "job.json", attempt / "steps.jsonl"
        if job.is_file() and log.is_file() and len(log.read_text().splitlines()) >= steps:
            return str(json.loads(job.read_text())["job_id"])
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"{attempt} did not start")


@pytest.mark.slow
def test_scancel_is_a_failure_retried_on_request_and_sigterm_a_preemption_resumed_as_a_new_attempt(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    # Long enough to be caught running; every job of this test is stopped by the test.
    args = ["+sweep=cpu_optimization", "optim=base,recompute", "batch.train_steps=100000"]
    sweep = tmp_path / "sweep=cpu_optimization"
    base, recompute = sweep / "run=optim-base", sweep / "run=optim-recompute"

    def start() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*CHARLLM, "train", "-m", *args, "hydra/launcher=slurm_cpu_2ranks", f"sweep.dir={tmp_path}"],
            cwd=tmp_path, env=slurm_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    proc = start()
    subprocess.run(["scancel", _wait_running(base / "attempt=1", proc)], env=slurm_env, check=True)
    sigterm = _wait_running(recompute / "attempt=1", proc)
    subprocess.run(["scancel", "--signal=TERM", sigterm], env=slurm_env, check=True)
    _, err = proc.communicate(timeout=JOB_LIMIT_S)
    assert proc.returncode == 3, err[-3000:]  # EXIT_NOT_DONE
    manifest = load_manifest(sweep)
    assert manifest is not None
    assert manifest.runs["optim-base"].state == "failed"
    assert "CANCELLED" in str(manifest.runs["optim-base"].exit_reason)
    assert manifest.runs["optim-recompute"].state == "preempted"
    # the preempted attempt's telemetry is complete: every rank closed its store on SIGTERM
    preempted = recompute / "attempt=1"
    _both_ranks_wrote_telemetry(preempted)
    for rank in (0, 1):
        assert (
            json.loads((preempted / f"rank={rank}" / "manifest.json").read_text())["status"] == "terminated"
        )
    assert json.loads((preempted / "summary.json").read_text())["status"] == "terminated"

    # Again, without asking: the preempted configuration continues as attempt 2, the failed one waits.
    proc = start()
    job = _wait_running(recompute / "attempt=2", proc, steps=1)
    assert not (base / "attempt=2").exists()
    subprocess.run(["scancel", job], env=slurm_env, check=True)
    _, err = proc.communicate(timeout=JOB_LIMIT_S)
    assert "left as they are: 1 failed (sweep.retry_failed=true re-runs failed ones)" in err
    # Asked: the failed configuration runs again, as attempt 2, beside (not in) attempt 1.
    args.append("sweep.retry_failed=true")
    proc = start()
    job = _wait_running(base / "attempt=2", proc, steps=1)
    # recompute (cancelled in attempt 2: failed now) is retried too, as attempt 3: the array's
    # other job, still queued; cancel both at once (the array) to keep the test short
    subprocess.run(["scancel", job.split("_")[0]], env=slurm_env, check=True)
    _, err = proc.communicate(timeout=JOB_LIMIT_S)
    assert proc.returncode == 3, err[-3000:]
    manifest = load_manifest(sweep)
    assert manifest is not None
    assert [a.attempt for a in manifest.runs["optim-base"].attempts] == [1, 2]
    assert [a.attempt for a in manifest.runs["optim-recompute"].attempts] == [1, 2, 3]
    assert (base / "attempt=1" / "job.json").is_file() and (base / "attempt=2" / "job.json").is_file()
