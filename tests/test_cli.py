"""``charllm telemetry`` and ``charllm inspect``: a run directory written, then read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from charllm_nemo.cli import main, steps_range
from charllm_nemo.errors import ConfigError
from tests.deadline import deadline


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
    assert all(r[4] == "-" for r in rows)  # a step is in no microbatch
    assert all(float(r[6]) > 0 for r in rows)  # every step has its energy


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
    from charllm_nemo.cli import _how_it_ended as how_it_ended
    from charllm_nemo.telemetry.layout import scan_run

    def _how_it_ended(path: Path, manifests: dict[int, dict[str, str]]) -> list[str]:
        problems: list[str] = []
        lines = how_it_ended(scan_run(path), manifests, problems)
        assert problems == []
        return lines

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
    _, err = proc.communicate(timeout=deadline(60))
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


def test_verbose_before_train_reaches_every_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from charllm_nemo.train.worker import LOG_LEVEL_ENV

    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    # `charllm -v train ...` is train's (a config error here: exit 2), not argparse's "unrecognized".
    assert main(["-v", "train", "model=gpt5"]) == 2
    assert "unrecognized arguments" not in capsys.readouterr().err
    assert os.environ[LOG_LEVEL_ENV] == "INFO"  # the ranks read it (train/worker.py)


def test_rank_logging_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
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


# -- a run directory from someone else ------------------------------------------------------------


@pytest.fixture
def copied_run(run_dir: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run_dir, tmp_path / "run"))


def _inspect(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[list[str], str]:
    capsys.readouterr()
    assert main(["inspect", str(path), "--kind", "step", *extra]) == 0
    got = capsys.readouterr()
    return got.out.splitlines(), got.err


def _manifest(run: Path, data: object) -> Path:
    path = run / "rank=0" / "manifest.json"
    path.write_text(json.dumps(data))
    return path


def test_inspect_reads_a_manifest_of_the_wrong_shape_with_a_warning(
    copied_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each was a traceback (AttributeError on a list, TypeError sorting a list backend).
    path = _manifest(copied_run, ["not", "an", "object"])
    out, err = _inspect(copied_run, capsys)
    assert f"warning: {path}: file holds a JSON list, not an object; ignored" in err
    assert out[1] == "status: ? (rank 0)" and len(out) > 3  # the windows are still read
    _manifest(copied_run, {"status": 5, "backend": ["nvml"], "devices": "H200"})
    out, err = _inspect(copied_run, capsys)
    assert "field 'status' is int (5), expected string; ignored" in err
    assert "field 'backend' is list (['nvml']), expected string; ignored" in err
    assert out[0].endswith("backend ?") and out[1] == "status: ? (rank 0)"


def test_inspect_reads_bad_summary_and_steps_files_with_warnings(
    copied_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = copied_run / "summary.json"
    summary.write_text(
        json.dumps(
            {"status": "complete", "steps": 3, "step_time_s_median": "fast", "memory": {"peak_bytes": 1}}
        )
    )
    out, err = _inspect(copied_run, capsys)
    assert "training: complete after 3 step(s)" in out
    assert f"{summary}: field 'step_time_s_median' is string ('fast'), expected number or null" in err
    assert f"{summary}: field 'memory' does not hold" in err
    summary.write_bytes(b'{"status": "compl\xffete"}')
    out, err = _inspect(copied_run, capsys)
    assert "training: compl\ufffdete after ? step(s)" in out and "not UTF-8" in err
    summary.unlink()
    steps = copied_run / "steps.jsonl"
    steps.write_bytes(b'{"step": 0}\n{"step": "one"}\n\xff\n[1]\n{"step": 3, "lo')
    out, err = _inspect(copied_run, capsys)
    assert out[2] == (
        "training: no summary.json (rank 0 did not get to write it: killed?); steps.jsonl holds 1 step(s)"
    )
    assert f"{steps}:2: field 'step' is string ('one'), expected int; ignored" in err
    assert f"{steps}:3: bytes that are not UTF-8" in err
    assert f"{steps}:4: line holds a JSON list, not an object; ignored" in err
    assert f"{steps}:5: truncated last line; skipped" in err


def test_inspect_escapes_control_characters_from_files(
    copied_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = json.loads((copied_run / "rank=0" / "manifest.json").read_text())
    _manifest(copied_run, {**manifest, "status": "\x1b[2J\x1b[31mcomplete", "backend": "nvml\r"})
    (copied_run / "rank=\x1b[5m1").mkdir()
    out, err = _inspect(copied_run, capsys)
    assert "\x1b" not in "".join(out) + err and "\r" not in "".join(out) + err
    assert out[1] == "status: \\x1b[2J\\x1b[31mcomplete (rank 0)"
    assert out[0].endswith("backend nvml\\r")
    assert "rank=\\x1b[5m1: ignored: not a rank folder name" in err


def test_inspect_shows_the_microbatch_and_keeps_columns_with_long_phase_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from charllm_nemo.telemetry.store import RankStore, windows_to_table
    from charllm_nemo.telemetry.windows import WindowRecorder

    store = RankStore(tmp_path, 0, {"rank": 0, "backend": "synthetic"})
    rec = WindowRecorder()
    long_name = "a_phase_with_a_very_long_free_form_name"
    with rec.window("step", step=12):
        for mb in (0, 1):
            with (
                rec.window("microbatch", step=12, microbatch=mb),
                rec.window("phase", long_name, step=12, microbatch=mb),
            ):
                pass
        with rec.window("phase", "optimizer", step=12):
            pass
    store.write_segment("windows", windows_to_table(rec.drain()))
    store.close("complete")
    capsys.readouterr()
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if line.startswith("rank"))
    table = out[header:]
    assert len(table) == 1 + 6
    step_end = table[0].index("step") + len("step")
    mb_end = table[0].index(" mb") + len(" mb")
    rows = {(r.split()[1], r[step_end - 2 : step_end].strip(), r[mb_end - 1 : mb_end]) for r in table[1:]}
    # every row's step and microbatch sit under their headers, whatever the name's length
    assert rows == {
        ("step", "12", "-"),
        ("microbatch", "12", "0"),
        ("microbatch", "12", "1"),
        ("phase", "12", "0"),
        ("phase", "12", "1"),
        ("phase", "12", "-"),
    }
    assert long_name not in "\n".join(table) and long_name[:23] + "~" in table[2] + table[3]


# -- charllm telemetry --devices ----------------------------------------------------------------


def test_telemetry_samples_each_device_named_into_one_rank_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from charllm_nemo.telemetry.reader import load_run

    out = tmp_path / "run"
    args = ["telemetry", "--backend", "synthetic", "--seconds", "0.6", "--step-s", "0.2", "--devices", "0,3"]
    assert main([*args, "--out", str(out)]) == 0
    run = load_run(out)
    assert run.ranks == [0]  # one rank folder; the devices are the device_index column (docs/store.md)
    assert sorted(set(run.samples.column("device_index").to_pylist())) == [0, 3]
    assert [d["index"] for d in run.manifests[0]["devices"]] == [0, 3]
    table = capsys.readouterr().out.splitlines()
    header = next(line for line in table if line.startswith("rank"))
    assert " dev " in header
    dev_at = header.index(" dev ") + len(" dev")
    assert {line[dev_at - 1] for line in table[table.index(header) + 1 :]} == {"0", "3"}


def test_devices_lists_are_checked_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse
    from types import SimpleNamespace

    from charllm_nemo import cli
    from charllm_nemo.devices import factory

    assert cli.devices_list("all") == "all" and cli.devices_list("0,3") == [0, 3]
    for bad in ("0,0", "-1", "", "0;3", "gpu0"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a device list"):
            cli.devices_list(bad)

    class TwoGpus:  # what the factory gives on a host with GPUs 0 and 1
        name = "nvml"
        devices = (
            SimpleNamespace(identity=SimpleNamespace(index=0)),
            SimpleNamespace(identity=SimpleNamespace(index=1)),
        )
        closed = False

        def close(self) -> None:
            TwoGpus.closed = True

    monkeypatch.setattr(factory, "open_backend", lambda name="auto", indices=None, **kw: TwoGpus())
    assert cli.resolve_devices("auto", "all", {}) == ("nvml", [0, 1], {}) and TwoGpus.closed
    assert cli.resolve_devices("nvml", [1], {}) == ("nvml", [1], {})
    # auto would fall back to another device for an index the host lacks: an error instead
    with pytest.raises(ConfigError, match=r"--devices 0,3: 3 not on this host \(nvml sees 0, 1\)"):
        cli.resolve_devices("auto", [0, 3], {})
    assert cli.resolve_devices("synthetic", [0, 3], {"activity": "marks"}) == (
        "synthetic",
        [0, 3],
        {"activity": "marks", "count": 4},
    )
