"""Issue #32's done check for throttle-to-slowdown: a real `charllm train` on CPU gloo ranks with
rank 1's synthetic device poorly cooled (hot from the first steps), then `analyze`: the hot rank's
slowdown is above 0 in pipeline, tensor, data and expert parallel layouts, against a named baseline, and
the cool rank's is below it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from charllm_nemo.analysis.analyze import analyze

pytest.importorskip("megatron.core")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "model"), [("pp2", "tiny_gpt"), ("tp2", "tiny_gpt"), ("dp2", "tiny_gpt"), ("ep2", "tiny_moe")]
)
def test_the_hot_rank_is_slowed_in_every_layout(tmp_path: Path, layout: str, model: str) -> None:
    out = tmp_path / layout
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "train", f"model={model}", "telemetry=synthetic",
           f"telemetry.out_dir={out}", "batch.train_steps=10", "nproc=2", f"parallel={layout}",
           "batch.global_batch_size=8", "++telemetry.synthetic.devices.1.cooling=0.15",
           "++telemetry.synthetic.devices.1.tau_s=1.0"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    rows = {r["rank"]: r for r in analyze(out).tables["throttle_slowdown"].to_pylist()}
    hot, cool = rows[1], rows[0]
    assert hot["slowdown_vs_fastest"] > 0.05, hot
    assert hot["slowdown_baseline"] == "fastest_device_clock"
    assert cool["slowdown_vs_fastest"] < hot["slowdown_vs_fastest"]
    if layout in ("pp2", "tp2"):  # no data-parallel replica to compare time with
        assert hot["slowdown_vs_dp_peers"] is None
