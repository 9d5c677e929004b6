"""WandbSink's parts that need no W&B run: secrets, mode, tags, shared mode, the artifact bound."""

from __future__ import annotations

import os
import types
from pathlib import Path
from typing import Any

import pytest

from charllm_nemo.redact import REDACTED
from charllm_nemo.sinks import wandb as wsink
from charllm_nemo.sinks.config import LoggerConfig
from charllm_nemo.sinks.wandb import (
    WandbSink,
    default_run_name,
    has_api_key,
    layout_tag,
    recipe_group,
    recipe_tags,
    resolve_mode,
    shared_run_id,
    telemetry_files,
)


def _netrc(tmp_path: Path, host: str, password: str = "k" * 40) -> Path:
    p = tmp_path / "netrc"
    p.write_text(f"machine {host}\n  login user\n  password {password}\n")
    p.chmod(0o600)
    return p


def test_an_api_key_is_found_in_the_environment_or_a_netrc_entry(tmp_path):
    none = str(tmp_path / "missing")
    assert not has_api_key({"NETRC": none, "HOME": str(tmp_path)})
    assert has_api_key({"WANDB_API_KEY": "x", "NETRC": none})
    assert has_api_key({"NETRC": str(_netrc(tmp_path, "api.wandb.ai"))})
    other = _netrc(tmp_path, "wandb.example.com")
    assert not has_api_key({"NETRC": str(other)})
    assert has_api_key({"NETRC": str(other), "WANDB_BASE_URL": "https://wandb.example.com"})


def test_the_mode_is_offline_without_a_key_and_offline_always_wins(tmp_path):
    nokey = {"NETRC": str(tmp_path / "missing"), "HOME": str(tmp_path)}
    key = {**nokey, "WANDB_API_KEY": "x"}
    mode, why = resolve_mode(None, nokey)
    assert mode == "offline" and why is not None and "wandb sync" in why
    assert resolve_mode("online", nokey)[0] == "offline"  # never prompt, never fail mid-run
    assert resolve_mode(None, key) == ("online", None)
    assert resolve_mode("auto", key) == ("online", None)
    assert resolve_mode("online", {**key, "WANDB_MODE": "offline"}) == ("offline", None)
    assert resolve_mode(None, {**key, "WANDB_MODE": "dryrun"}) == ("offline", None)
    assert resolve_mode(None, {**key, "WANDB_MODE": "disabled"}) == ("disabled", None)
    assert resolve_mode("offline", key) == ("offline", None)
    assert resolve_mode("disabled", key) == ("disabled", None)
    with pytest.raises(ValueError, match="online"):
        resolve_mode("shared", key)


def test_the_offline_reason_is_said_once(tmp_path, caplog):
    wsink._announced.clear()
    nokey = {"NETRC": str(tmp_path / "missing"), "HOME": str(tmp_path)}
    sink = WandbSink(LoggerConfig(name="wandb"), env=nokey)
    with caplog.at_level("WARNING", logger="charllm_nemo.sinks"):
        for _ in range(3):
            sink.init_kwargs({}, {})
    assert sum("no W&B API key" in m for m in caplog.messages) == 1


CONFIG = {
    "model": {"name": "llama3_70b"},
    "parallel": {
        "name": "llama3_70b_tp4pp4_vpp5_cp2",
        "tp": 4,
        "pp": 4,
        "cp": 2,
        "ep": 1,
        "vpp": 5,
        "dp": None,
    },
    "optim": {"name": "recompute"},
    "batch": {"precision": "bf16"},
    "telemetry": {"out_dir": "runs/sweep-20260101-000000/3"},
}


def test_layout_tags_and_group_come_from_the_recipe():
    assert layout_tag({"tp": 2, "pp": 1, "dp": None}, 2) == "tp2-pp1-dp1"
    assert layout_tag(CONFIG["parallel"], 64) == "tp4-pp4-dp2-cp2-vpp5"
    assert layout_tag({"tp": 2, "pp": 4, "ep": 4, "dp": 8}) == "tp2-pp4-dp8-ep4"
    assert layout_tag(None) is None
    assert recipe_group(CONFIG) == "sweep-20260101-000000"
    assert recipe_group({**CONFIG, "extra": {"sweep": "paper_optim"}}) == "paper_optim"
    assert recipe_group({"telemetry": {"out_dir": "runs/20260101-000000"}}) is None
    # a sweep recipe's job (docs/sweeps.md): <dir>/sweep=<name>/run=<key>/attempt=<n>
    job = {"telemetry": {"out_dir": "runs/sweeps/sweep=cpu_microbatch/run=3f2a/attempt=2"}}
    assert recipe_group(job) == "cpu_microbatch"
    assert recipe_group({"telemetry": {"out_dir": "runs/x/run=3f2a/attempt=1"}}) is None
    tags = recipe_tags(CONFIG, {"world_size": 64, "backend": "nvml", "synthetic": False})
    assert tags == [
        "tp4-pp4-dp2-cp2-vpp5",
        "model:llama3_70b",
        "parallel:llama3_70b_tp4pp4_vpp5_cp2",
        "optim:recompute",
        "precision:bf16",
        "backend:nvml",
        "sweep:sweep-20260101-000000",
    ]
    assert default_run_name(CONFIG, {"world_size": 64}) == "llama3_70b-tp4-pp4-dp2-cp2-vpp5-recompute"


def test_init_arguments_offline(tmp_path):
    env = {"NETRC": str(tmp_path / "missing"), "HOME": str(tmp_path), "WANDB_MODE": "offline"}
    sink = WandbSink(
        LoggerConfig(
            name="wandb", project="p", tags=["mine", "tp4-pp4-dp2-cp2-vpp5"], settings={"console": "off"}
        ),
        run_dir=tmp_path,
        env=env,
    )
    kw = sink.init_kwargs({**CONFIG, "extra": {"token": "t0ken"}}, {"world_size": 64, "config": {"dup": 1}})
    assert kw["mode"] == "offline"
    assert kw["dir"] == str(tmp_path)
    assert kw["group"] == "sweep-20260101-000000"
    assert kw["tags"][:2] == ["mine", "tp4-pp4-dp2-cp2-vpp5"] and len(set(kw["tags"])) == len(kw["tags"])
    assert kw["config"]["extra"]["token"] == REDACTED
    assert kw["config"]["manifest"] == {"world_size": 64}
    assert kw["settings"] == {"console": "off", "x_disable_meta": True}
    assert "id" not in kw


def test_shared_mode_needs_an_online_run_and_labels_each_writer(tmp_path):
    run_dir = tmp_path / "slurm-42.0"
    env = {"WANDB_API_KEY": "x", "SLURM_JOB_ID": "42", "NETRC": str(tmp_path / "missing")}
    shared = LoggerConfig(name="wandb", shared=True)
    primary = WandbSink(shared, primary=True, label="node0-a", run_dir=run_dir, env=env)
    secondary = WandbSink(shared, primary=False, label="node1-b", run_dir=run_dir, env=env)
    kp, ks = primary.init_kwargs(CONFIG, {}), secondary.init_kwargs(CONFIG, {})
    assert kp["mode"] == ks["mode"] == "shared"
    assert kp["id"] == ks["id"] == shared_run_id(run_dir, env)
    assert kp["settings"] == {"x_primary": True, "x_label": "node0-a", "x_disable_meta": True}
    assert ks["settings"] == {
        "x_primary": False,
        "x_label": "node1-b",
        "x_update_finish_state": False,
        "x_disable_meta": True,
    }
    offline = WandbSink(shared, run_dir=run_dir, env={**env, "WANDB_MODE": "offline"})
    assert offline.init_kwargs(CONFIG, {})["mode"] == "offline"


class _FakeArtifact:
    def __init__(self, **kw: Any) -> None:
        self.kw = kw
        self.files: list[tuple[str, str]] = []

    def add_file(self, path: str, name: str, policy: str) -> None:
        self.files.append((name, policy))


class _FakeRun:
    id = "abc123"

    def __init__(self, dir: str) -> None:
        self.dir = dir
        self.artifacts: list[_FakeArtifact] = []

    def log_artifact(self, art: _FakeArtifact) -> None:
        self.artifacts.append(art)


def _run_dir(tmp_path: Path) -> Path:
    rd = tmp_path / "run"
    for r in (0, 1):
        (rd / f"rank={r}").mkdir(parents=True)
        (rd / f"rank={r}" / "manifest.json").write_text("{}")
        (rd / f"rank={r}" / "samples-000000.parquet").write_bytes(b"\0" * 50_000)
        (rd / f"rank={r}" / ".samples-000001.parquet.tmp").write_bytes(b"\0")  # a writer's temp file
    (rd / "config.yaml").write_text("model: x\n")
    (tmp_path / ".netrc").write_text("machine api.wandb.ai password k")
    (rd / "rank=0" / "notes.txt").symlink_to(tmp_path / ".netrc")  # never uploaded
    os.mkfifo(rd / "rank=1" / "pipe")  # nor read
    (rd / "wandb" / "offline-run-1" / "files").mkdir(parents=True)
    (rd / "wandb" / "offline-run-1" / "run-1.wandb").write_bytes(b"x")
    return rd


def test_the_artifact_holds_the_telemetry_files_and_respects_the_size_bound(tmp_path, caplog):
    rd = _run_dir(tmp_path)
    names = [f.relative_to(rd).as_posix() for f in telemetry_files(rd)]
    assert names == [
        "config.yaml",
        "rank=0/manifest.json",
        "rank=0/samples-000000.parquet",
        "rank=1/manifest.json",
        "rank=1/samples-000000.parquet",
    ]
    fake = types.SimpleNamespace(Artifact=_FakeArtifact)
    sink = WandbSink(LoggerConfig(name="wandb", artifact_max_mb=1.0))
    sink.run, sink._wandb = _FakeRun(str(rd / "wandb" / "offline-run-1" / "files")), fake
    assert sink.log_run_artifact(rd)
    art = sink.run.artifacts[0]
    assert art.kw["name"] == "telemetry-abc123" and art.kw["type"] == "telemetry"
    assert art.kw["metadata"]["ranks"] == ["rank=0", "rank=1"]
    assert [n for n, _ in art.files] == names and {p for _, p in art.files} == {"immutable"}

    small = WandbSink(LoggerConfig(name="wandb", artifact_max_mb=0.05))  # 0.05 MiB < the two 50 kB segments
    small.run, small._wandb = _FakeRun(str(rd / "wandb" / "offline-run-1" / "files")), fake
    with caplog.at_level("INFO", logger="charllm_nemo.sinks"):
        assert not small.log_run_artifact(rd)
    assert small.run.artifacts == []
    assert small.artifact_skipped is not None and "artifact_max_mb=0.05" in small.artifact_skipped
    assert any("artifact skipped" in m for m in caplog.messages)


def test_calls_before_start_raise_so_the_async_wrapper_counts_them():
    with pytest.raises(RuntimeError, match="start"):
        WandbSink(LoggerConfig(name="wandb")).log_step(0, {})


def test_shared_run_ids_differ_for_run_directories_that_end_alike(tmp_path):
    env = {"SLURM_JOB_ID": ""}
    a, b = tmp_path / "a" / "runs" / "x", tmp_path / "b" / "runs" / "x"
    assert shared_run_id(a, env) != shared_run_id(b, env)
    assert shared_run_id(a, env) == shared_run_id(tmp_path / "a" / "runs" / "x", env)  # every node alike


def test_a_linked_wandb_folder_in_the_run_is_refused_not_written_through(tmp_path) -> None:
    """``ln -s ELSEWHERE RUN/wandb``: wandb made its files in ELSEWHERE (it follows the link)."""
    pytest.importorskip("wandb")
    from charllm_nemo.errors import StoreError
    from charllm_nemo.sinks.wandb import WandbSink

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    (run / "wandb").symlink_to(elsewhere)
    env = {"HOME": str(tmp_path), "NETRC": str(tmp_path / "none"), "WANDB_MODE": "offline"}
    cfg = LoggerConfig(name="wandb", project="p", settings={"x_disable_stats": True, "console": "off"})
    sink = WandbSink(cfg, run_dir=run, env=env)
    with pytest.raises(StoreError, match="symbolic link"):
        sink.start({"model": {"name": "m"}}, {})
    assert list(elsewhere.iterdir()) == []
