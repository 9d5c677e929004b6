"""`charllm train ... logger=wandb` end to end, offline: the .wandb file read back holds every
rank's figures and the aggregates for every step, equal to what the run directory says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from charllm_nemo.telemetry.join import attribute_run
from charllm_nemo.telemetry.reader import load_run
from tests.deadline import deadline
from tests.sinks.wandb_reader import find_wandb_file, read_run

pytest.importorskip("wandb")
pytest.importorskip("megatron.core")

STEPS = 4


def _single_rank_env() -> dict[str, str]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


@pytest.mark.parametrize("nproc", [1, 2])
def test_train_logs_every_rank_through_rank0(tmp_path, wandb_env, nproc):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "train", "model=tiny_gpt", "logger=wandb",
           "+logger.settings={console: 'off', x_disable_stats: true}",
           "telemetry.backend=synthetic", f"telemetry.out_dir={out}", f"batch.train_steps={STEPS}",
           f"nproc={nproc}", f"parallel={'dp2' if nproc == 2 else 'single'}",
           f"batch.global_batch_size={4 * nproc}"]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=deadline(300), env={**os.environ, **wandb_env}
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    wb = read_run(find_wandb_file(out / "wandb"), wait_s=10)
    assert wb.exited
    rows = [r for r in wb.history if "perf/step_time_s" in r]
    # and, at the end, the per-microbatch windows table
    assert any("telemetry/windows/_type" in r for r in wb.history)
    steps = sorted(int(r["trainer/global_step"]) for r in rows)
    assert steps == list(range(STEPS))
    by_step = {int(r["trainer/global_step"]): r for r in rows}

    summary = json.loads((out / "summary.json").read_text())
    run = load_run(out)
    figures = attribute_run(run, ("step",))
    table = {
        (r, s): e
        for r, s, e in zip(
            figures.column("rank").to_pylist(),
            figures.column("step").to_pylist(),
            figures.column("energy_j").to_pylist(),
            strict=True,
        )
    }
    for step in range(STEPS):
        row = by_step[step]
        per_step = summary["per_step"][step]
        # Live figures are best effort: the loop does not hold training for a telemetry process
        # that answers late (a loaded host), it drops them; it waits for the last steps' only.
        # Whatever arrived must equal what the stored run gives.
        reporting = [rank for rank in range(nproc) if f"rank/{rank}/energy_j" in row]
        assert len(reporting) == per_step["ranks_reporting"]
        if step == STEPS - 1:
            assert reporting == list(range(nproc))
        for rank in reporting:
            for key in ("energy_j", "power_avg_w", "power_peak_w", "temp_gpu_peak_c", "clock_sm_avg_mhz"):
                assert f"rank/{rank}/{key}" in row, (step, rank, key)
            # the live figure W&B got equals the figure computed later from the run directory
            assert row[f"rank/{rank}/energy_j"] == pytest.approx(table[(rank, step)], rel=1e-9)
        if reporting:
            assert row["all/energy_j"] == pytest.approx(per_step["energy_j"], rel=1e-9)
            assert row["all/energy_j"] == pytest.approx(sum(row[f"rank/{r}/energy_j"] for r in reporting))
            assert row["all/power_max_w"] >= row["all/power_min_w"]
        assert row["perf/tokens_per_s"] == pytest.approx(per_step["tokens_per_s"], rel=1e-9)
        assert row["train/loss"] == pytest.approx(per_step["loss"], rel=1e-9)
    # config: the resolved training config plus the manifest, no secrets
    assert wb.config["model"]["name"] == "tiny_gpt"
    assert "devices" in json.dumps(wb.config)


@pytest.mark.parametrize("failure", ["hang", "raise"])
def test_training_finishes_on_time_when_wandb_hangs_or_raises(tmp_path, wandb_env, failure):
    # wandb's Run.log never returns (or raises) in the child: the steps must not wait for it, the
    # end of training waits at most logger.finish_timeout_s, and the drops are reported.
    out = tmp_path / "run"
    code = (
        "import sys, time, wandb.sdk.wandb_run as r\n"
        f"mode = {failure!r}\n"
        "def log(self, *a, **k):\n"
        "    if mode == 'hang':\n"
        "        time.sleep(3600)\n"
        "    raise ConnectionError('W&B unreachable')\n"
        "r.Run.log = log\n"
        "from charllm_nemo.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    # launcher=none: this process is the rank (as under torchrun), so the patched wandb is the one used
    args = ["train", "launcher=none", "model=tiny_gpt", "logger=wandb", "logger.queue_size=2",
            "logger.finish_timeout_s=3", "logger.upload_artifact=false",
            "+logger.settings={console: 'off', x_disable_stats: true}",
            "telemetry.backend=synthetic", f"telemetry.out_dir={out}", "batch.train_steps=8"]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=deadline(300),
        env={**os.environ, **wandb_env, "WANDB_SILENT": "false", **_single_rank_env()},
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8  # training ran to the end ...
    assert elapsed < deadline(120)  # ... on time: nothing waited on the hour-long log call
    report = [line for line in proc.stderr.splitlines() if "sink wandb:" in line]
    assert report, proc.stderr[-3000:]
    if failure == "hang":
        assert "timed out" in report[-1] and " 0 dropped" not in report[-1]
    else:
        assert " 0 errors" not in report[-1]
