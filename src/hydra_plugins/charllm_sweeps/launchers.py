"""hydra-submitit-launcher's launchers, as the sweep presets (conf/hydra/launcher/) use them:
the same submission (one job per configuration, an array of them; every option of
``submitit_slurm`` / ``submitit_local``), plus two things the ``charllm`` sweeper needs:

* each job's id is reported as soon as it is submitted (``on_submitted``), so that the manifest
  names the job while it is queued and ``charllm sweep status`` can ask SLURM about it;
* a job that ends without a result (cancelled, killed) does not abort the wait for the others:
  its JobReturn carries the error, the sweeper reads the state from the attempt and SLURM;
* jobs are polled every :data:`POLL_S` seconds (SLURM through ``sacct`` only for jobs without a
  result file): submitit alone checks SLURM ever more rarely as a job ages (every half of its
  age, up to 10 minutes), so a cancelled job would keep the sweep waiting long after it ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher import submitit_launcher as base

from charllm_nemo.progress import Progress

Submitted = Callable[[list[tuple[list[str], str, str]]], None]
POLL_S = 3.0
RESULT_GRACE_S = 3
"""How long a job that SLURM says has ended may take to show its result file (submitit waits 15 s
per task: a cancelled 8-task job would hold the sweep for 2 minutes, twice)."""


class _Reporting:
    """Mixin over :class:`base.BaseSubmititLauncher`: see the module's docstring."""

    on_submitted: Submitted | None = None
    _EXECUTOR: str

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        executor_cls = submitit.AutoExecutor
        jobs_seen: list[Any] = []
        original_map_array = executor_cls.map_array

        def map_array(executor: Any, fn: Any, *iterables: Any) -> Any:
            where = "SLURM" if self._EXECUTOR == "slurm" else "submitit_local"
            with Progress("charllm sweep") as progress:
                # A sweep's submission and wait last minutes: say what it does and how far
                progress.stage(f"submitting {len(iterables[0])} job(s) to {where}")
                jobs = original_map_array(executor, fn, *iterables)
                jobs_seen.extend(jobs)
                if self.on_submitted is not None:
                    overrides = iterables[0]
                    scheduler = "slurm" if self._EXECUTOR == "slurm" else "local"
                    self.on_submitted(
                        [(list(o), str(j.job_id), scheduler) for o, j in zip(overrides, jobs, strict=True)]
                    )
                progress.stage(f"waiting for the jobs on {where}", total=len(jobs), unit="ended")
                waiting = list(jobs)
                while waiting:
                    # One sacct call for every job submitted (the watcher is shared), then the cached
                    # states: done(force_check=True) does not pass the force on to a multi-task
                    # job's tasks, which would wait for submitit's own, ever slower, schedule.
                    if jobs and hasattr(jobs[0], "watcher"):
                        jobs[0].watcher.update()
                    waiting = [j for j in waiting if not j.done()]
                    progress.update(len(jobs) - len(waiting), job_states(waiting))
                    if waiting:
                        time.sleep(POLL_S)
            for job in jobs:
                for one in [job, *getattr(job, "_sub_jobs", [])]:
                    one._results_timeout_s = RESULT_GRACE_S
            return jobs

        # The base class builds its executor and calls map_array inside launch(); wrapping the
        # class's method for this call keeps every option it passes without copying its code.
        executor_cls.map_array = map_array  # type: ignore[method-assign,assignment]
        try:
            try:
                return super().launch(job_overrides, initial_job_idx)  # type: ignore[misc,no-any-return]
            except Exception:
                pass
        finally:
            executor_cls.map_array = original_map_array  # type: ignore[method-assign]
        returns = []
        for job in jobs_seen:
            ret = JobReturn()
            try:
                ret = job.results()[0]
            except Exception as exc:  # this job's error; the others are still waited for
                ret.status = JobStatus.FAILED
                ret._return_value = exc
            returns.append(ret)
        return returns


def job_states(jobs: Sequence[Any]) -> str:
    """``RUNNING 2, PENDING 1`` for the jobs still waited for (submitit's cached states)."""
    counts: dict[str, int] = {}
    for job in jobs:
        try:
            state = str(job.state)
        except Exception:  # a state submitit cannot tell yet
            state = "UNKNOWN"
        counts[state] = counts.get(state, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


class CharllmSlurmLauncher(_Reporting, base.SlurmLauncher):  # type: ignore[misc]
    """``submitit_slurm`` that reports job ids (conf/hydra/launcher/slurm_*.yaml)."""

    _EXECUTOR = "slurm"


class CharllmLocalLauncher(_Reporting, base.LocalLauncher):  # type: ignore[misc]
    """``submitit_local`` that reports job ids (conf/hydra/launcher/local_*.yaml)."""

    _EXECUTOR = "local"
