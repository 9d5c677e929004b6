"""MegatronLMTelemetry around megatron-core's real schedules, driven as Megatron-LM's
``train_step`` drives them (tests/integrations/_mcore_loops.py; the megatron-core wheel has
no ``megatron/training`` to run Megatron-LM's own loop). Runs in the main .venv (megatron-core
0.16, no NeMo)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from charllm_nemo.telemetry.reader import load_run
from tests.deadline import deadline

pytest.importorskip("megatron.core")

LOOP = Path(__file__).with_name("_mcore_loops.py")
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_loop(tmp_path: Path, mode: str, steps: int, *extra: str, log_to: str = "trainer") -> dict[str, Any]:
    """Run tests/integrations/_mcore_loops.py ``mode`` in a fresh process (one gloo rank), the
    integration with ``log_to``."""
    out = tmp_path / "result.json"
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    env["CHARLLM_TEST_LOG_TO"] = log_to
    env["MASTER_PORT"] = str(_free_port())
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(LOOP), mode, str(tmp_path / "run"), str(steps), str(out), *extra],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=deadline(300),
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def windows(run_dir: Path) -> Counter[tuple[str, str]]:
    w = load_run(run_dir).windows.to_pylist()
    return Counter((x["kind"], x["name"]) for x in w)


@pytest.mark.parametrize("mode", ["timers", "explicit"])
def test_megatron_lm_loop_gets_step_microbatch_and_phase_windows(
    tmp_path: Path, mode: str, wandb_env: dict[str, str]
) -> None:
    steps, microbatches = 3, 4
    # the explicit loop logs to charllm's W&B sink (offline): #40, it was never started
    log_to = "wandb" if mode == "explicit" else "trainer"
    mode_name = "megatron-lm-explicit" if mode == "explicit" else "megatron-lm"
    result = run_loop(tmp_path, mode_name, steps, log_to=log_to)
    kinds = windows(tmp_path / "run")
    assert kinds[("step", "step")] == steps
    assert kinds[("microbatch", "microbatch")] == steps * microbatches
    assert kinds[("phase", "forward")] == kinds[("phase", "backward")] == steps * microbatches
    assert kinds[("phase", "optimizer")] == steps
    assert kinds[("phase", "grad-sync")] == steps
    # Megatron-LM's own Timers was asked for every name (its logs keep working), and got back
    assert {"forward-backward", "optimizer", "forward-compute", "backward-compute"} <= set(result["asked"])
    assert result["forwards_attributes"] and result["timers_restored"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["energy_j"] > 0 and r["power_avg_w"] > 0 for r in rows)
    assert all(r["tokens_per_s"] is not None and r["tokens_per_s"] > 0 for r in rows)
    if mode == "explicit":  # the step() handle carries the loss into the report
        assert [r["loss"] for r in rows] == pytest.approx(result["losses"])
    else:  # the timers know no loss
        assert all(r["loss"] is None for r in rows)
    manifest = load_run(tmp_path / "run").manifests[0]
    assert manifest["config"]["integration"]["framework"] == "megatron-lm"
    if log_to == "wandb":  # every step's per-rank and cross-rank keys, read back from the W&B run
        from tests.sinks.wandb_steps import assert_every_step_in_wandb

        assert_every_step_in_wandb(tmp_path / "run")
    else:
        assert not (tmp_path / "run" / "wandb").exists()
