"""A W&B server that is not there: training's end is bounded, said in one line, no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from charllm_nemo.sinks.wandb import server_problem
from tests.deadline import deadline


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the socket is: nothing listens there


def test_server_problem_says_why_or_nothing() -> None:
    port = _closed_port()
    problem = server_problem(f"http://127.0.0.1:{port}", env={})
    assert problem is not None and f"127.0.0.1:{port}" in problem and "refused" in problem.lower()
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert server_problem(f"http://127.0.0.1:{listening.getsockname()[1]}", env={}) is None
    # Behind a proxy the server is the proxy's business: not probed.
    assert server_problem(f"http://127.0.0.1:{port}", env={"HTTPS_PROXY": "http://proxy:3128"}) is None
    assert server_problem("http://127.0.0.1:99999", env={}) is not None  # no such port: said, not raised


def _run(script: str, env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def test_an_unreachable_server_logs_offline_and_ends_at_once(
    tmp_path: Path, wandb_env: dict[str, str]
) -> None:
    pytest.importorskip("wandb")
    env = dict(os.environ)
    env.pop("WANDB_MODE", None)  # online asked, with a key: the case that hung for 108 s
    env.update(WANDB_BASE_URL=f"http://127.0.0.1:{_closed_port()}", WANDB_API_KEY="x" * 40)
    script = f"""
        import logging, time
        from pathlib import Path
        from charllm_nemo.sinks.base import AsyncSink, exit_now_if_abandoned
        from charllm_nemo.sinks.config import LoggerConfig
        from charllm_nemo.sinks.wandb import WandbSink
        logging.basicConfig(level=logging.WARNING)
        d = Path({str(tmp_path)!r})
        sink = AsyncSink(
            WandbSink(
                LoggerConfig(name="wandb", mode="online", log_windows_table=False, upload_artifact=False),
                run_dir=d,
            ),
            finish_timeout_s=30,
        )
        sink.start({{"model": {{"name": "tiny_gpt"}}}}, {{"backend": "synthetic"}})
        for step in range(3):
            sink.log_step(step, {{"loss": 1.0}})
        sink.finish(d)
        print(sink.report.line())
        exit_now_if_abandoned(3)
    """
    rc, out, seconds = _run(script, env, timeout=deadline(120))
    assert rc == 0, out
    assert "W&B server unreachable: 127.0.0.1:" in out and "logs offline" in out
    assert "Traceback" not in out
    assert "sink WandbSink: finished" in out and "0 errors" in out and " 0 abandoned" in out
    assert list((tmp_path / "wandb").glob("offline-run-*")), "the metrics went to an offline run"
    assert seconds < deadline(30)  # measured here: ~4 s, against 108 s before


def test_a_hung_backend_does_not_hold_the_exit(tmp_path: Path) -> None:
    # wandb's own exit hook waits for its service, which waits for the hung request: a hook
    # that sleeps stands in for it. The process must end soon after finish_timeout_s.
    script = """
        import atexit, threading, time
        from charllm_nemo.sinks.base import AsyncSink, exit_now_if_abandoned

        class Hung:
            def start(self, config, manifest):
                threading.Event().wait()
            def log_step(self, step, metrics): pass
            def log_windows_table(self, rows): pass
            def finish(self, run_dir): pass

        atexit.register(time.sleep, 120)
        sink = AsyncSink(Hung(), finish_timeout_s=0.5, name="hung")
        sink.start({}, {})
        sink.finish(None)
        exit_now_if_abandoned(3)
    """
    rc, out, seconds = _run(script, dict(os.environ), timeout=deadline(60))
    assert rc == 3, out
    assert "sink hung: timed out" in out and "exiting without waiting for sink hung" in out
    assert seconds < 20
