"""Launchers: SLURM node lists and rank variables, torchrun variables, the local spawner."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from charllm_nemo.errors import ConfigError, StoreError
from charllm_nemo.train.launch import (
    expand_nodelist,
    free_port,
    launch_local,
    slurm_rank_env,
    torchrun_rank_env,
)
from tests.deadline import deadline


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("gpu-a[009-011],gpu-b7", ["gpu-a009", "gpu-a010", "gpu-a011", "gpu-b7"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("n[1-3],m5,k[01,03]", ["n1", "n2", "n3", "m5", "k01", "k03"]),
        ("nid[00998-01001]", ["nid00998", "nid00999", "nid01000", "nid01001"]),
        ("host.example.org", ["host.example.org"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[04-01]", "node[a-c]", "node[01-03"])
def test_expand_nodelist_rejects_malformed_ranges(bad: str) -> None:
    with pytest.raises(ConfigError, match="cannot parse SLURM node"):
        expand_nodelist(bad)


def test_slurm_rank_env() -> None:
    env = slurm_rank_env(
        {
            "SLURM_PROCID": "13",
            "SLURM_NTASKS": "16",
            "SLURM_LOCALID": "5",
            "SLURM_NODEID": "1",
            "SLURM_JOB_NODELIST": "gpu[07-08]",
        },
        master_port=29600,
    )
    assert env == {
        "RANK": "13",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "5",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "29600",
        "GROUP_RANK": "1",
    }


def test_the_automatic_slurm_port_is_the_same_on_every_task_and_differs_between_jobs() -> None:
    from charllm_nemo.train.launch import slurm_master_port

    task = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "a1"}
    job = {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0"}
    ports = {slurm_rank_env({**task, **job, "SLURM_PROCID": r}, None)["MASTER_PORT"] for r in ("0", "1")}
    assert ports == {str(slurm_master_port(job))}
    assert 10000 <= slurm_master_port(job) < 30000
    assert slurm_master_port(job) != slurm_master_port({**job, "SLURM_JOB_ID": "123457"})
    assert slurm_master_port(job) != slurm_master_port({**job, "SLURM_STEP_ID": "1"})  # two srun steps
    assert slurm_rank_env({**task, **job}, 29600)["MASTER_PORT"] == "29600"  # set: used as is


def test_slurm_rank_env_respects_a_preset_master() -> None:
    base = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODELIST": "a[1-2]"}
    assert slurm_rank_env(base, 1)["MASTER_ADDR"] == "a1"  # SLURM_NODELIST also works
    env = slurm_rank_env({**base, "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "4000"}, 1)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.9", "4000")


def test_slurm_rank_env_outside_srun() -> None:
    with pytest.raises(
        ConfigError,
        match=r"launch.launcher=slurm but SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, "
        r"SLURM_JOB_NODELIST is not set: start the ranks with `srun",
    ):
        slurm_rank_env({}, 29511)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "abc", "SLURM_LOCALID": "0"}, "SLURM_NTASKS='abc'"),
        ({"SLURM_PROCID": "-1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, "SLURM_PROCID='-1'"),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "0", "SLURM_LOCALID": "x"},
            "SLURM_NTASKS='0', SLURM_LOCALID='x'",
        ),
    ],
)
def test_a_garbled_slurm_environment_is_named_not_a_traceback(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=f"^{named} must be whole numbers"):
        slurm_rank_env({**env, "SLURM_JOB_NODELIST": "n1"}, 29511)


def test_a_garbled_torchrun_environment_is_named_not_a_traceback() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "two", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    with pytest.raises(ConfigError, match=r"^WORLD_SIZE='two' must be whole numbers"):
        torchrun_rank_env(env)


def test_torchrun_rank_env() -> None:
    full = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
        "X": "y",
    }
    assert torchrun_rank_env(full) == {k: v for k, v in full.items() if k != "X"}
    with pytest.raises(ConfigError, match=r"launch\.launcher=none but MASTER_ADDR, MASTER_PORT is not set"):
        torchrun_rank_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})


def test_free_port_prefers_the_configured_one_unless_busy() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        busy = s.getsockname()[1]
        s.listen()
        other = free_port(busy)
        assert other != busy
    assert free_port(other) == other


# -- the local spawner with a tiny Python worker (no charllm import: fast) -------------------------

SCRIPT = """
import os, sys, time, pathlib
rank = int(os.environ["RANK"]); out = pathlib.Path(sys.argv[1])
(out / f"env{rank}").write_text(" ".join(os.environ[k] for k in
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")))
mode = sys.argv[2]
if mode == "fail_now":
    sys.exit(3)
if mode == "fail" and rank == 2:
    time.sleep(0.2); print("boom from rank 2"); sys.exit(5)
if mode == "fail":
    try:
        time.sleep(60)
    finally:
        (out / f"stopped{rank}").write_text("x")
"""


def _spawn(tmp_path: Path, mode: str, nproc: int = 3, port: int = 29533) -> int:
    worker = tmp_path / "w.py"
    worker.write_text(SCRIPT)
    return launch_local(
        tmp_path / "config.yaml",
        nproc,
        run_dir=tmp_path,
        master_port=port,
        worker_argv=[sys.executable, str(worker), str(tmp_path), mode],
        grace_s=5.0,
    )


def test_spawn_sets_the_distributed_environment(tmp_path: Path) -> None:
    port = free_port(29533)
    assert _spawn(tmp_path, "ok", port=port) == 0
    for rank in range(3):
        assert (tmp_path / f"env{rank}").read_text() == f"{rank} 3 {rank} 127.0.0.1 {port}"
    assert (tmp_path / "logs" / "rank1.log").exists() and not (tmp_path / "logs" / "rank0.log").exists()


def test_a_linked_logs_folder_in_the_run_is_refused_not_written_through(tmp_path: Path) -> None:
    """``ln -s ELSEWHERE RUN/logs`` before a run: rank1.log was created in ELSEWHERE."""
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    (tmp_path / "logs").symlink_to(elsewhere)
    with pytest.raises(StoreError, match="symbolic link"):
        _spawn(tmp_path, "ok", nproc=2, port=free_port(29533))
    assert list(elsewhere.iterdir()) == []


def test_a_failing_rank_stops_the_others_and_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t0 = time.monotonic()
    rc = _spawn(tmp_path, "fail", nproc=3)
    assert rc == 5
    assert time.monotonic() - t0 < deadline(10)  # the ranks sleeping 60 s were terminated, not waited for
    err = capsys.readouterr().err
    assert "rank 2 failed with exit code 5" in err and "rank2.log" in err
    assert "boom from rank 2" in err  # the tail of the failing rank's log
    # SIGTERM reached the survivors: Python's default handler kills without finally blocks, so
    # no "stopped" marker here (the charllm worker installs a handler; see test_app).
    assert not (tmp_path / "stopped0").exists()


@pytest.mark.parametrize("nproc", [1, 2])
def test_ranks_that_all_fail_before_the_first_poll_are_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], nproc: int
) -> None:
    # Every rank exits at once (a config a rank rejects): by the launcher's first look they are
    # all gone. That is a failure, not a success.
    assert _spawn(tmp_path, "fail_now", nproc=nproc, port=free_port(29533)) == 3
    assert "rank 0 failed with exit code 3" in capsys.readouterr().err


def test_a_failed_ranks_log_tail_reads_only_the_end_and_never_through_a_link(tmp_path: Path) -> None:
    from charllm_nemo.train.launch import TAIL_BYTES, _tail

    log = tmp_path / "rank0.log"
    with log.open("w") as f:
        f.write("x" * 200 + "\n")
        f.write(("." * 1000 + "\n") * (4 * TAIL_BYTES // 1000))  # a log 4x what is read
        f.write("".join(f"line {i}\n" for i in range(30)))
    tail = _tail(log).splitlines()
    assert [t.strip() for t in tail] == [f"line {i}" for i in range(10, 30)]
    short = tmp_path / "short.log"
    short.write_text("only\nthree\nlines\n")
    assert _tail(short).split() == ["only", "three", "lines"]  # the first line of a short log kept
    link = tmp_path / "linked.log"
    link.symlink_to(log)
    assert _tail(link) == ""  # not followed
    assert _tail(tmp_path / "missing.log") == "" and _tail(None) == ""
