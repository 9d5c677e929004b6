"""The charllm sweeper through ``charllm train -m +sweep=<name>`` with Hydra's basic launcher
(ranks are tests/train/_fake_worker.py: no torch), and the full-size recipes planned and turned
into sbatch scripts without submitting anything."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from charllm_nemo.train import app
from charllm_nemo.train.sweep_manifest import load_manifest

TRAIN_TESTS = Path(__file__).resolve().parents[1] / "train"


@pytest.fixture
def fake_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHARLLM_WORKER_TARGET", "_fake_worker:run")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TRAIN_TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("CHARLLM_FAKE_MODE", "ok")
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)


def _attempts(sweep: Path) -> dict[str, list[tuple[int, str]]]:
    m = load_manifest(sweep)
    assert m is not None
    return {k: [(a.attempt, a.state) for a in e.attempts] for k, e in m.runs.items()}


def test_a_sweep_resumes_skips_done_and_retries_failed_only_when_asked(
    tmp_path: Path, fake_worker: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["-m", "+sweep=cpu_microbatch", f"sweep.dir={tmp_path}", "batch.micro_batch_size=1,2"]
    sweep = tmp_path / "sweep=cpu_microbatch"
    monkeypatch.setenv("CHARLLM_FAKE_MODE", "fail:0:3")  # rank 0 of every job exits with 3
    assert app.main(args) == 3  # EXIT_NOT_DONE
    assert _attempts(sweep) == {
        "micro_batch_size-1": [(1, "failed")],
        "micro_batch_size-2": [(1, "failed")],
    }
    job = json.loads((sweep / "run=micro_batch_size-1" / "attempt=1" / "job.json").read_text())
    assert job["exit_code"] == 3 and job["scheduler"] == "none" and job["exit_reason"] == "exit code 3"

    monkeypatch.setenv("CHARLLM_FAKE_MODE", "ok")
    capsys.readouterr()
    assert app.main(args) != 0  # failed ones are left alone: still not done
    assert "launching 0 of 2 configuration(s); left as they are: 2 failed" in capsys.readouterr().err
    assert app.main([*args, "sweep.retry_failed=true"]) == 0
    assert _attempts(sweep) == {
        "micro_batch_size-1": [(1, "failed"), (2, "done")],
        "micro_batch_size-2": [(1, "failed"), (2, "done")],
    }
    # each attempt is its own run directory: the failed one's files stay where they were
    run = sweep / "run=micro_batch_size-2"
    assert json.loads((run / "attempt=1" / "job.json").read_text())["state"] == "failed"
    assert not (run / "attempt=1" / "fake" / "rank0.json").exists()
    assert sorted(p.name for p in (run / "attempt=2" / "fake").iterdir()) == ["rank0.json", "rank1.json"]
    assert app.main(args) == 0  # all done: nothing runs
    assert "launching 0 of 2 configuration(s); left as they are: 2 done" in capsys.readouterr().err
    # other fixed overrides would mix two different sweeps in one directory
    assert app.main([*args, "batch.train_steps=7"]) != 0
    assert "give the same overrides to resume it" in capsys.readouterr().err


# -- the full-size recipes, planned and turned into SLURM requests, submitting nothing ----------


def test_full_size_recipes_plan_every_configuration_and_keep_those_that_cannot_fit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc = app.main(
        [
            "-m",
            "+sweep=paper_parallelism_h200",
            "hydra/launcher=slurm_h200_4x8",
            "dry_run=true",
            f"sweep.dir={tmp_path}",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    verdicts = {
        line.split(":")[0]: line.split(":")[1].split(";")[0].strip()
        for line in out.splitlines()
        if line.startswith("layout-")
    }
    assert len(verdicts) == 11
    assert verdicts["layout-llama3_70b_tp4pp4"] == "valid"
    assert verdicts["layout-gpt3_175b_fsdp"] == "out_of_memory_predicted"  # planned peak ~164 GiB > 140
    assert verdicts["layout-gpt3_175b_tp8pp8"] == "failed"  # 64 GPUs a replica, 32 in the job
    assert "sweep paper_parallelism_h200: 11 configuration(s) for 32 rank(s); nothing submitted" in out
    assert not (tmp_path / "sweep=paper_parallelism_h200").exists()  # a dry run writes nothing
    for name, preset, n in [
        ("paper_parallelism_h100", "slurm_h100_8x8", 11),
        ("paper_optimization_h200", "slurm_h200_4x8", 16),
        ("paper_microbatch_h200", "slurm_h200_4x8", 16),
    ]:
        assert app.main(["-m", f"+sweep={name}", f"hydra/launcher={preset}", "dry_run=true"]) == 0
        assert f"sweep {name}: {n} configuration(s)" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(p.stem for p in (app.find_conf_dir() / "sweep").glob("cpu_*.yaml")))
def test_every_cpu_sweep_configuration_is_valid_on_cpu(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A CPU mirror runs all its configurations on 2 CPU ranks: its own overrides must not undo a
    +layout= preset's model (cpu_parallelism's EP2 got tiny_gpt) nor ask for what the CPU cannot do
    (cpu_optimization's distributed optimizer)."""
    assert app.main(["-m", f"+sweep={name}", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    verdicts = [line for line in out.splitlines() if "; estimated peak" in line]
    assert verdicts and all(": valid;" in line for line in verdicts), out


def _launcher(cls: Any, overrides: list[str], tmp_path: Path) -> Any:
    """The sweep launcher ``cls`` as Hydra makes it for ``overrides``: the composed config's
    launcher parameters, its submitit folder under ``tmp_path``, the config set."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    app.register_resolvers()
    with initialize_config_dir(config_dir=str(app.find_conf_dir()), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    params: dict[str, Any] = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)  # type: ignore[assignment]
    params.pop("_target_")
    params["submitit_folder"] = str(tmp_path / "submitit" / "%j")
    launcher = cls(**params)
    launcher.config = cfg
    return launcher


def _sbatch_script(overrides: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The sbatch script the preset's launcher would submit for one job (map_array intercepted)."""
    import submitit

    from hydra_plugins.charllm_sweeps.launchers import CharllmSlurmLauncher

    launcher = _launcher(CharllmSlurmLauncher, overrides, tmp_path)
    scripts: list[str] = []

    def fake_map_array(executor: Any, fn: Any, *iterables: Any) -> list[Any]:
        scripts.append(
            executor._executor._make_submission_file_text("python -m submitit.core._submit X", "uid")
        )
        return []

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", fake_map_array)
    launcher.launch([["optim=base"]], initial_job_idx=0)
    assert len(scripts) == 1
    return scripts[0]


def test_the_h200_preset_asks_slurm_for_4_nodes_of_8_gpus_with_one_task_per_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _sbatch_script(
        [
            "+sweep=paper_optimization_h200",
            "hydra/launcher=slurm_h200_4x8",
            f"sweep.dir={tmp_path}",
            "hydra.launcher.partition=gpu",
            "hydra.launcher.account=proj42",
            "hydra.launcher.qos=high",
            "hydra.launcher.constraint=h200",
            "hydra.launcher.timeout_min=90",
            "+hydra.launcher.additional_parameters.mail-type=END",
        ],
        tmp_path,
        monkeypatch,
    )
    for line in [
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj42",
        "#SBATCH --qos=high",
        "#SBATCH --constraint=h200",
        "#SBATCH --time=90",
        "#SBATCH --exclusive",
        "#SBATCH --mail-type=END",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --job-name=paper_optimization_h200",
    ]:
        assert line in script, f"{line} not in the sbatch script:\n{script}"
    assert "srun" in script


def test_the_h100_preset_asks_for_8_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = _sbatch_script(
        ["+sweep=paper_parallelism_h100", "hydra/launcher=slurm_h100_8x8", f"sweep.dir={tmp_path}"],
        tmp_path,
        monkeypatch,
    )
    assert "#SBATCH --nodes=8" in script and "#SBATCH --ntasks-per-node=8" in script
    assert "#SBATCH --gpus-per-node=8" in script
    assert "--partition" not in script and "--account" not in script  # unset: the cluster's default


def test_an_attempt_that_never_reached_a_scheduler_runs_again(tmp_path: Path, fake_worker: None) -> None:
    from charllm_nemo.train.sweep_manifest import Attempt

    args = ["-m", "+sweep=cpu_microbatch", f"sweep.dir={tmp_path}", "batch.micro_batch_size=1,2"]
    sweep = tmp_path / "sweep=cpu_microbatch"
    assert app.main(args) == 0
    # the sweep process died after recording attempt 2 as pending, before any job existed
    m = load_manifest(sweep)
    assert m is not None
    m.runs["micro_batch_size-1"].attempts.append(Attempt(attempt=2))
    m.runs["micro_batch_size-1"].state = "pending"
    m.save(sweep)
    assert app.main(args) == 0
    assert _attempts(sweep)["micro_batch_size-1"] == [(1, "done"), (2, "pending"), (3, "done")]
    assert _attempts(sweep)["micro_batch_size-2"] == [(1, "done")]


def test_the_wait_for_a_sweeps_jobs_says_how_many_ended_and_how_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The launchers' own poll loop (SLURM's and submitit_local's are one) over two jobs that end on
    # the 2nd and 4th poll: progress lines name the stage, the count ended and the states left.
    import submitit
    from hydra.core.utils import JobReturn

    from hydra_plugins.charllm_sweeps import launchers

    class Job:
        def __init__(self, job_id: str, ends_after: int) -> None:
            self.job_id, self.polls, self.ends_after = job_id, 0, ends_after

        @property
        def state(self) -> str:
            return "RUNNING" if self.polls else "PENDING"

        def done(self) -> bool:
            self.polls += 1
            return self.polls >= self.ends_after

        def results(self) -> list[JobReturn]:
            return [JobReturn()]

    def fake_map_array(executor: Any, fn: Any, *iterables: Any) -> list[Any]:
        return [Job("7_0", 2), Job("7_1", 4)]

    monkeypatch.setenv("CHARLLM_PROGRESS_EVERY_S", "0")  # every stage and count, at once
    monkeypatch.setattr(launchers, "POLL_S", 0.0)
    monkeypatch.setattr(submitit.AutoExecutor, "map_array", fake_map_array)
    overrides = ["+sweep=cpu_microbatch", "hydra/launcher=local_2ranks", f"sweep.dir={tmp_path}"]
    launcher = _launcher(launchers.CharllmLocalLauncher, overrides, tmp_path)
    launcher.launch([["batch.micro_batch_size=1"], ["batch.micro_batch_size=2"]], initial_job_idx=0)
    err = capsys.readouterr().err
    assert "charllm sweep: submitting 2 job(s) to submitit_local" in err
    assert "charllm sweep: waiting for the jobs on submitit_local: 0/2 ended" in err
    assert "waiting for the jobs on submitit_local: 1/2 ended (RUNNING 1)" in err
    assert "waiting for the jobs on submitit_local: 2/2 ended" in err and "so far" in err
