"""Run directories: a generated name is never shared, a named one is held while its run goes on."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from charllm_nemo.errors import ConfigError
from charllm_nemo.train import app
from charllm_nemo.train.config_io import load_train_config
from tests.deadline import deadline


def test_a_generated_name_that_is_taken_gets_a_suffix(tmp_path: Path) -> None:
    base = tmp_path / "runs" / "20261204-203000"
    made = [app.claim_run_dir(base, fresh_name=True) for _ in range(3)]
    assert [p.name for p in made] == ["20261204-203000", "20261204-203000-2", "20261204-203000-3"]
    assert all(p.is_dir() for p in made)
    # A name the user gave is theirs: no suffix (an earlier run in it is refused elsewhere).
    assert app.claim_run_dir(base, fresh_name=False) == base


def test_two_runs_started_in_the_same_second_get_their_own_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_worker: None
) -> None:
    # The same run id for both, as two launches within one second of the clock get; started
    # together, each must train into a directory of its own, its config.yaml its own.
    monkeypatch.setenv("CHARLLM_RUN_ID", "same-second")
    argv = [sys.executable, "-m", "charllm_nemo.train.app", "nproc=1"]
    procs = [
        subprocess.Popen([*argv, f"model.num_layers={n}"], cwd=tmp_path, stderr=subprocess.PIPE)
        for n in (2, 4)
    ]
    errs = [p.communicate(timeout=deadline(120))[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    runs = sorted((tmp_path / "runs").iterdir())
    assert [r.name for r in runs] == ["same-second", "same-second-2"]
    layers = set()
    for run in runs:
        saved = load_train_config(run / "config.yaml")
        assert saved.telemetry.out_dir == f"runs/{run.name}"  # what the ranks were given
        assert (run / "fake" / "rank0.json").is_file()
        layers.add(saved.model.num_layers)
    assert layers == {2, 4}
    for err in errs:  # each says where its own run went
        assert err.count("run directory runs/same-second") == 1


def test_a_named_directory_in_use_by_a_running_run_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_worker: None
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    held = os.open(out, os.O_RDONLY | os.O_DIRECTORY)  # as a running launcher holds it
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for extra in ([], ["telemetry.overwrite=true"]):
            assert app.main(["nproc=1", f"telemetry.out_dir={out}", *extra]) == app.EXIT_CONFIG_ERROR
            assert "is in use by another run that is still going" in capsys.readouterr().err
            assert list(out.iterdir()) == []  # no config.yaml of a run that never started
    finally:
        os.close(held)
    assert app.main(["nproc=1", f"telemetry.out_dir={out}"]) == 0  # released: free again
    assert (out / "fake" / "rank0.json").is_file()


@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_run_directory_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    monkeypatch.chdir(tmp_path)
    assert app.main([f"telemetry.out_dir='{value}'"]) == app.EXIT_CONFIG_ERROR
    assert "telemetry.out_dir is empty" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match=r"telemetry\.out_dir is empty"):
        cfg = app.load([])
        cfg.telemetry.out_dir = value
        app.run(cfg)


def test_ctrl_c_in_an_in_process_rank_is_130_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class Loop:  # stands in for charllm_nemo.train.loop: the rank is interrupted mid-run
        @staticmethod
        def run_rank(cfg: object) -> None:
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "charllm_nemo.train.loop", Loop)
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "9"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert app.main(["launcher=none", f"telemetry.out_dir={tmp_path / 'run'}"]) == 130
    assert "interrupted (Ctrl-C)" in capsys.readouterr().err
