"""PowerThermalBridgeCallback by contract: Megatron-Bridge 0.6's own ``callbacks.py`` (from its
wheel, which scripts/test.sh fetches with ``pip download --no-deps`` into
``.cache/megatron-bridge``; nothing of it is stubbed, it imports only the standard library at
run time) registers the callback and fires its events around megatron-core's real schedules
driven as Bridge's ``train_step`` drives them (tests/integrations/_mcore_loops.py). Bridge itself
cannot run here: it needs Python >= 3.12, megatron-core >= 0.18 and CUDA (bench/gpu_check.py
runs its real ``pretrain`` on a GPU)."""

from __future__ import annotations

import os
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from tests.integrations.conftest import require_or_skip
from tests.integrations.test_megatron_lm import REPO, load_run, run_loop, windows

pytest.importorskip("megatron.core")

BRIDGE_VERSION = "0.6.2"
CALLBACKS = "megatron/bridge/training/callbacks.py"


def bridge_callbacks_py() -> Path:
    """Bridge's callbacks.py, from its wheel in the repository's .cache (scripts/test.sh downloads
    it at set-up: a test fetches nothing)."""
    cache = Path(os.environ.get("CHARLLM_CACHE", REPO / ".cache")) / "megatron-bridge"
    target = cache / BRIDGE_VERSION / CALLBACKS
    if target.exists():
        return target
    wheels = sorted(cache.glob(f"megatron_bridge-{BRIDGE_VERSION}-*.whl"))
    if not wheels:
        require_or_skip(
            f"no megatron-bridge {BRIDGE_VERSION} wheel in {cache}; scripts/test.sh downloads it "
            f"(pip download --no-deps --python-version 3.12 --only-binary=:all: "
            f"megatron-bridge=={BRIDGE_VERSION} -d {cache})"
        )
    with zipfile.ZipFile(wheels[-1]) as zf:
        zf.extract(CALLBACKS, cache / BRIDGE_VERSION)
    return target


def test_bridge_callback_manager_drives_the_callback(tmp_path: Path, wandb_env: dict[str, str]) -> None:
    callbacks_py = bridge_callbacks_py()
    steps, microbatches = 3, 4
    result = run_loop(tmp_path, "bridge", steps, str(callbacks_py), log_to="wandb")
    # Bridge's CallbackManager.add found our hooks by their event names (no subclassing)
    assert result["registered"] == [
        "on_train_end",
        "on_train_start",
        "on_train_step_end",
        "on_train_step_start",
    ]
    kinds: Counter[tuple[str, str]] = windows(tmp_path / "run")
    assert kinds[("step", "step")] == steps
    assert kinds[("microbatch", "microbatch")] == steps * microbatches
    assert kinds[("phase", "forward")] == kinds[("phase", "backward")] == steps * microbatches
    assert kinds[("phase", "optimizer")] == steps  # Bridge's timers("optimizer")
    assert {"forward-compute", "backward-compute", "optimizer"} <= set(result["asked"])
    assert result["timers_restored"]  # Bridge's Timers back in state and in the model config
    import json

    rows = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    assert [r["loss"] for r in rows] == pytest.approx(result["losses"])  # from context.loss_dict
    assert all(r["grad_norm"] == 1.5 for r in rows)  # context.grad_norm
    assert all(r["energy_j"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    manifest = load_run(tmp_path / "run").manifests[0]
    assert manifest["config"]["integration"]["framework"] == "megatron-bridge"
    # log_to="wandb" (#40: the sink was never started): every step's per-rank and cross-rank
    # keys, read back from the offline W&B run
    from tests.sinks.wandb_steps import assert_every_step_in_wandb

    assert_every_step_in_wandb(tmp_path / "run")
