"""The job side of a sweep: where a job finds itself, which attempt it is, and what it records
for each way a rank can end (the rank itself replaced by a function)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from charllm_nemo.errors import ConfigError
from charllm_nemo.train.app import compose
from charllm_nemo.train.config import TrainConfig
from charllm_nemo.train.sweep_job import restart_count, run_sweep_job, where_am_i


def test_a_job_outside_submitit_launches_its_ranks_itself() -> None:
    scheduler, job_id, rank, _, env = where_am_i({})
    assert (scheduler, job_id, rank, env) == ("none", None, 0, {})
    assert restart_count({"SLURM_RESTART_COUNT": "2"}) == 2 and restart_count({}) == 0


def _job_cfg(tmp_path: Path) -> object:
    cfg = compose(["+sweep=cpu_microbatch", f"sweep.dir={tmp_path}", "sweep.run_key=k", "sweep.attempt=2"])
    return cfg


def _record(run_dir: Path, attempt: int) -> dict[str, object]:
    data = json.loads((run_dir / f"attempt={attempt}" / "job.json").read_text())
    assert isinstance(data, dict)
    return data


@pytest.mark.parametrize(
    ("outcome", "state", "code"),
    [
        (0, "done", 0),
        (143, "preempted", 143),  # the local launcher's ranks stopped by SIGTERM
        (5, "failed", 5),
        (SystemExit(143), "preempted", 143),  # an in-process rank unwound by SIGTERM
        (SystemExit(-1), "preempted", -1),  # submitit's exit after checkpoint and requeue
        (ConfigError("rank 0 (pipeline stage 0) needs at least 90 GiB ..."), "out_of_memory", 2),
        (ConfigError("parallel.tp=3 does not divide ..."), "failed", 2),
        (RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"), "out_of_memory", 1),
    ],
)
def test_rank_0_records_how_the_attempt_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, outcome: object, state: str, code: int
) -> None:
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # a requeued job: attempt 2 + 1
    run_dir = tmp_path / "run=k"
    seen: list[TrainConfig] = []

    def rank(cfg: TrainConfig) -> int:
        seen.append(cfg)
        assert _record(run_dir, 3)["state"] == "running"
        if isinstance(outcome, BaseException):
            raise outcome
        assert isinstance(outcome, int)
        return outcome

    dcfg = _job_cfg(tmp_path)
    if isinstance(outcome, BaseException) and not isinstance(outcome, ConfigError):
        with pytest.raises(type(outcome)):
            run_sweep_job(dcfg, run_dir, rank)  # type: ignore[arg-type]
    else:
        assert run_sweep_job(dcfg, run_dir, rank) == code  # type: ignore[arg-type]
    record = _record(run_dir, 3)
    assert record["state"] == state and record["exit_code"] == code and record["end"]
    assert record["scheduler"] == "none" and record["attempt"] == 3
    # the rank ran the configuration into the attempt's folder, with the launcher for where it is
    assert seen[0].telemetry.out_dir == str(run_dir / "attempt=3")
    assert seen[0].launch.launcher == "local" and seen[0].batch.train_steps == 2
    assert OmegaConf.select(OmegaConf.structured(seen[0]), "sweep") is None
