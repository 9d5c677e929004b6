"""The sweep directory's pieces without a scheduler: run keys, the manifest, how an attempt's
state follows from its job.json and SLURM's word, and the table."""

from __future__ import annotations

from pathlib import Path

import pytest

from charllm_nemo.errors import ConfigError
from charllm_nemo.sweep.status import attempt_state, refresh, status_lines
from charllm_nemo.train.sweep_manifest import (
    Attempt,
    SweepManifest,
    done_runs,
    load_manifest,
    run_key,
    write_json,
)


def test_a_run_key_depends_on_the_swept_values_only_not_their_order_or_placement() -> None:
    a = run_key(["optim=recompute", "batch.micro_batch_size=2"])
    assert a == "micro_batch_size-2__optim-recompute"
    assert run_key(["batch.micro_batch_size=2", "optim=recompute", "sweep.attempt=3"]) == a
    assert run_key(["+layout=llama3_70b_tp4pp4"]) == "layout-llama3_70b_tp4pp4"
    assert run_key([]) == "default"
    # Characters a path (or a Hive partition) should not hold are dropped; long keys stay unique.
    assert "/" not in run_key(["data.path=/a/b c"])
    long_a = run_key([f"k{i}=v{i}" for i in range(30)])
    long_b = run_key([f"k{i}=v{i}" for i in range(31)])
    assert len(long_a) <= 80 and long_a != long_b


def test_the_manifest_round_trips_and_refuses_a_foreign_file(tmp_path: Path) -> None:
    m = SweepManifest(name="s", directory=str(tmp_path), matrix={"optim": ["base", "recompute"]})
    e = m.entry(["optim=base"])
    e.attempts.append(Attempt(attempt=1, state="done", job_id="7_0", scheduler="slurm"))
    e.state = "done"
    m.save(tmp_path)
    back = load_manifest(tmp_path)
    assert back is not None and back.runs["optim-base"].attempts[0].job_id == "7_0"
    assert back.entry(["optim=base"]).next_attempt() == 2
    assert done_runs(tmp_path) == {"optim-base": tmp_path / "run=optim-base" / "attempt=1"}
    write_json(tmp_path / "sweep.json", {"schema": "something-else"})
    with pytest.raises(ConfigError, match=r"sweep\.dir"):
        load_manifest(tmp_path)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (
            b'{"schema": "charllm-sweep/1", "name": "s", "runs": [{"key": "k\xff", "attempts": []}]}',
            "runs[0].key",
        ),
        (b'{"schema": "charllm-sweep/1", "name": "s", "runs": {"k": {"key": "k"}}}', "'runs' is object"),
    ],
)
def test_a_manifest_that_is_no_record_of_its_sweep_is_refused_not_read_empty(
    tmp_path: Path, raw: bytes, field: str
) -> None:
    """Bytes that are not UTF-8, or ``runs`` not a list: ConfigError naming the file, the field
    and the fix. Read as an empty sweep (as before), a resumed sweep (the sweeper's
    load_manifest) would have written an empty manifest over the configurations' states."""
    (tmp_path / "sweep.json").write_bytes(raw)
    with pytest.raises(ConfigError) as exc:
        load_manifest(tmp_path)
    assert str(exc.value).startswith(f"{tmp_path / 'sweep.json'}: ") and field in str(exc.value)
    assert "restore the file" in str(exc.value)
    assert (tmp_path / "sweep.json").read_bytes() == raw


@pytest.mark.parametrize(
    ("recorded", "slurm", "state"),
    [
        ({"state": "running"}, "RUNNING", "running"),
        ({"state": "done"}, "COMPLETED", "done"),
        # scancel: the ranks see SIGTERM and record "preempted"; SLURM knows it was a cancel.
        ({"state": "preempted"}, "CANCELLED", "failed"),
        # SIGTERM alone (a preemption's signal): the job fails in SLURM, the ranks know why.
        ({"state": "preempted"}, "FAILED", "preempted"),
        # rank 0 was killed before it could record an end
        ({"state": "running"}, "COMPLETED", "failed"),
        ({"state": "running"}, "OUT_OF_MEMORY", "out_of_memory"),
        (None, "PENDING", "pending"),
        (None, "CANCELLED", "failed"),
        ({"state": "failed"}, None, "failed"),
    ],
)
def test_an_attempts_state_combines_its_job_file_and_slurm(
    recorded: dict[str, str] | None, slurm: str | None, state: str
) -> None:
    assert attempt_state(recorded, slurm)[0] == state


def test_refresh_reads_job_files_and_adopts_a_requeued_attempt(tmp_path: Path) -> None:
    m = SweepManifest(name="s", directory=str(tmp_path))
    e = m.entry(["optim=base"])
    e.attempts.append(Attempt(attempt=1, state="pending", scheduler="none"))
    run = tmp_path / "run=optim-base"
    write_json(
        run / "attempt=1" / "job.json", {"state": "preempted", "scheduler": "none", "exit_reason": "x"}
    )
    # the requeued job (SLURM_RESTART_COUNT=1) wrote attempt 2 on its own
    write_json(run / "attempt=2" / "job.json", {"state": "done", "scheduler": "none", "job_id": "9"})
    refresh(m, tmp_path, ask_slurm=False)
    assert [a.state for a in e.attempts] == ["preempted", "done"]
    assert e.state == "done" and e.latest is not None and e.latest.job_id == "9"
    table = status_lines(m)
    assert table[1].split() == ["run", "state", "attempt", "job", "nodes", "start", "end", "exit", "reason"]
    assert table[2].split()[:4] == ["optim-base", "done", "2", "9"]
    assert table[-1] == "1 done"
