"""``charllm telemetry`` and ``charllm inspect``: a run directory written, then read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from charllm_nemo.cli import main, steps_range


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "run"
    args = ["telemetry", "--backend", "synthetic", "--seconds", "1", "--step-s", "0.2", "--out", str(out)]
    assert main(args) == 0
    return out


def test_inspect_prints_every_step_and_how_the_run_ended(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert main(["inspect", str(run_dir), "--kind", "step"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{run_dir}: 1 rank(s), ") and out[0].endswith("backend synthetic")
    assert out[1] == "status: complete (rank 0)"
    assert not any(line.startswith("training:") for line in out)  # no training in this run
    rows = [line.split() for line in out if line.split()[:2] == ["0", "step"]]
    assert [int(r[3]) for r in rows] == list(range(len(rows))) and len(rows) >= 3
    assert all(float(r[5]) > 0 for r in rows)  # every step has its energy


def test_inspect_picks_steps_and_ranks(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["inspect", str(run_dir), "--kind", "step", "--steps", "1:3"]) == 0
    rows = [
        line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:2] == ["0", "step"]
    ]
    assert [r[3] for r in rows] == ["1", "2"]
    assert main(["inspect", str(run_dir), "--rank", "5"]) == 2  # no such rank: said, not an empty table
    assert f"--rank 5: not in {run_dir}; ranks present: [0]" in capsys.readouterr().err
    assert main(["inspect", str(run_dir / "rank=0" / "manifest.json")]) == 2
    assert "manifest.json is not a directory" in capsys.readouterr().err
    assert steps_range("7") == (7, 8) and steps_range("10:") == (10, None) and steps_range(":4") == (None, 4)
    with pytest.raises(SystemExit) as bad:
        main(["inspect", str(run_dir), "--steps", "1-3"])
    assert bad.value.code == 2 and "'1-3' is not a step range" in capsys.readouterr().err


def test_inspect_says_what_a_training_run_reported(tmp_path: Path) -> None:
    from charllm_nemo.cli import _how_it_ended

    manifests = {0: {"status": "interrupted"}, 1: {"status": "killed"}}
    (tmp_path / "steps.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    lines = _how_it_ended(tmp_path, manifests)
    assert lines == [
        "status: interrupted (rank 0), killed (rank 1)",
        "training: no summary.json (rank 0 did not get to write it: killed?); steps.jsonl holds 2 step(s)",
    ]
    summary = {
        "status": "interrupted",
        "steps": 2,
        "step_time_s_median": 0.025,
        "tokens_per_s_median": 10240.0,
    }
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "energy_j_median": None}))
    assert _how_it_ended(tmp_path, manifests)[1] == (
        "training: interrupted after 2 step(s); median step 25.0 ms, 10240 tokens/s"
    )
    many = {r: {"status": "complete"} for r in range(16)}
    assert _how_it_ended(tmp_path, many)[0] == "status: complete (16 ranks)"
    # A run that reached its end also has every rank's memory: the highest peak is named.
    memory = {
        "measure": "cuda_max_allocated",
        "peak_bytes": [3 << 30, 5 << 30],
        "plan_bytes": [1 << 30, 2 << 30],
    }
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "memory": {**memory, "pp_stage": [0, 1]}}))
    assert _how_it_ended(tmp_path, manifests)[2] == (
        "memory: peak 5.0 GiB (cuda_max_allocated) on rank 1 (pipeline stage 1); its stage's weights, "
        "gradients and optimizer state: 2.0 GiB"
    )


def test_inspect_into_a_closed_pipe_stops_quietly(run_dir: Path) -> None:
    # `charllm inspect RUN | head`: the reader leaves early; no traceback, SIGPIPE's exit code.
    proc = subprocess.Popen(
        [sys.executable, "-m", "charllm_nemo.cli", "inspect", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # before the child has written anything
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141, err.decode()
    assert b"Traceback" not in err


def test_telemetry_refuses_an_earlier_run_unless_told_to_replace_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    args = ["telemetry", "--backend", "synthetic", "--seconds", "0.3", "--step-s", "0.1", "--out", str(out)]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0


@pytest.fixture
def logging_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """What configure_logging changes (the root's handlers, the package's level) is put back."""
    import logging

    monkeypatch.setattr(logging.root, "handlers", list(logging.root.handlers))
    pkg = logging.getLogger("charllm_nemo")
    monkeypatch.setattr(pkg, "level", pkg.level)


def test_verbose_before_train_reaches_every_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], logging_restored: None
) -> None:
    from charllm_nemo.train.worker import LOG_LEVEL_ENV

    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    # `charllm -v train ...` is train's (a config error here: exit 2), not argparse's "unrecognized".
    assert main(["-v", "train", "model=gpt5"]) == 2
    assert "unrecognized arguments" not in capsys.readouterr().err
    assert os.environ[LOG_LEVEL_ENV] == "INFO"  # the ranks read it (train/worker.py)


def test_rank_logging_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, logging_restored: None
) -> None:
    import logging

    from charllm_nemo.train.worker import LOG_LEVEL_ENV, configure_logging

    pkg = logging.getLogger("charllm_nemo")
    pkg.setLevel(logging.NOTSET)
    monkeypatch.setenv(LOG_LEVEL_ENV, "loud")  # not a level: logging left alone
    configure_logging()
    assert pkg.level == logging.NOTSET
    monkeypatch.setenv(LOG_LEVEL_ENV, "info")
    configure_logging()
    assert pkg.level == logging.INFO
