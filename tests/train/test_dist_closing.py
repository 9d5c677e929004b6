"""train/dist.py's end of a run: every rank announces that its telemetry is closed and how its
run ended; rank 0 waits for the others at most a timeout, over the process group's real store."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from charllm_nemo.train.dist import closing_problems

TIMEOUT_S = 1.5


def test_every_rank_complete_is_no_problem() -> None:
    assert closing_problems({1: "complete", 2: "complete"}, 60.0) is None
    assert closing_problems({}, 60.0) is None


def test_failed_and_silent_ranks_are_named() -> None:
    line = closing_problems({1: "failed", 2: None, 3: "complete", 4: "terminated", 5: "failed"}, 60.0)
    assert line == (
        "rank(s) 1, 5 ended failed; rank(s) 4 ended terminated; "
        "rank(s) 2 had not closed their telemetry after 60 s"
    )


def test_many_silent_ranks_are_counted_not_listed() -> None:
    line = closing_problems(dict.fromkeys(range(1, 101)), 30.0)
    assert line == "rank(s) 1, 2, 3, 4, 5, 6, 7, 8 and 92 more had not closed their telemetry after 30 s"


def _rank(rank: int, port: int, rank1: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from charllm_nemo.train.dist import announce_closed, wait_for_ranks_closed

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank == 1:
            if rank1 != "silent":
                time.sleep(0.3)  # after rank 0 began to wait
                announce_closed(torch, 1, rank1)
            return  # no barrier: rank 1 leaves at once
        t0 = time.monotonic()
        statuses = wait_for_ranks_closed(torch, range(1, 2), TIMEOUT_S)
        waited = time.monotonic() - t0
        Path(out_dir, "rank0.json").write_text(json.dumps({"statuses": statuses, "waited_s": waited}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("rank1", "status"), [("complete", "complete"), ("failed", "failed"), ("silent", None)]
)
def test_rank0_hears_each_rank_or_gives_up_after_the_timeout(
    tmp_path: Path, rank1: str, status: str | None
) -> None:
    torch = pytest.importorskip("torch")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(port, rank1, str(tmp_path)), nprocs=2, join=True)
    r = json.loads((tmp_path / "rank0.json").read_text())
    assert r["statuses"] == {"1": status}
    if status is None:  # silent: the timeout, not the process group's ten minutes
        assert TIMEOUT_S <= r["waited_s"] < TIMEOUT_S + 5
    else:  # heard: it waited for rank 1's word (0.3 s), and went on at once, not at the timeout
        assert 0.2 <= r["waited_s"] < TIMEOUT_S


class _Report:
    def line(self) -> str:
        return "W&B: every step logged"


class _Sink:
    """Rank 0's sink as the loop sees it: finish() once the run directory is final."""

    report = _Report()

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def finish(self, run_dir: Path) -> None:
        Path(self.out_dir, "finished").write_text(str(run_dir))


def _loop_end(rank: int, port: int, out_dir: str) -> None:
    import contextlib
    import io

    import torch
    import torch.distributed as dist

    from charllm_nemo.train.config import TrainConfig
    from charllm_nemo.train.loop import _finish_sink

    cfg = TrainConfig()
    cfg.logger.name = "wandb"
    cfg.logger.finish_timeout_s = TIMEOUT_S
    cfg.telemetry.out_dir = out_dir
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank == 1:  # its telemetry failed to close (say, a full disk): it says so and leaves
            _finish_sink(None, cfg, 1, "failed", torch)
            return
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            _finish_sink(_Sink(out_dir), cfg, 0, "complete", torch)
        Path(out_dir, "rank0.err").write_text(err.getvalue())
    finally:
        dist.destroy_process_group()


def test_the_loop_names_a_failed_rank_and_still_finishes_wandb(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.spawn(_loop_end, args=(port, str(tmp_path)), nprocs=2, join=True)
    err = (tmp_path / "rank0.err").read_text()
    assert "charllm: rank(s) 1 ended failed; W&B gets the run directory as is" in err
    assert "W&B: every step logged" in err
    assert (tmp_path / "finished").read_text() == str(tmp_path)
