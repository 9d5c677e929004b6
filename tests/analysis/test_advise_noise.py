"""charllm advise under noise: no advice inside the measured noise, the same advice for repeats
of one configuration, never more work on a throttled stage, a slow device told from a heavy
stage, the work counted as the FLOP model counts it, and a re-run command that runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from charllm_nemo.analysis.advise import Advice, Measured, NoAdvice, measure_run
from charllm_nemo.analysis.advise_layout import layout_advice, layout_for
from charllm_nemo.analysis.advise_stats import GainInterval, repeats_for_gain
from tests.analysis.test_advise import _repeats, _rows, _summary

pytest.importorskip("duckdb")

TINY = {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256,
        "vocab_size": 1024, "seq_length": 64, "name": "tiny_gpt"}  # fmt: skip


def test_a_gain_within_the_step_noise_gets_no_change_and_the_repeats_that_would_resolve_it() -> None:
    # The pp2_uneven: tiny_gpt's 4 layers as [3, 1], both stages equally fast per unit
    # of work (the last holds the output layer, 1.14 layers of it), each stage's time varying
    # 10 % step to step over 6 steps. This draw's medians make [2, 2] look 3.5 % faster, which
    # was advised; the gain's interval holds 0.
    model = {**TINY, "num_layers": 4}
    head = 65536 / (53248 + 4096)
    rows = _rows([0.3, 0.1 * (1 + head)], step_s=0.6, steps=6, noise=0.10, seed=14)
    got = layout_advice({"run": "r", "pp": 2}, _summary([3, 1], m=4), {"model": model}, rows)
    assert isinstance(got, NoAdvice), got
    assert got.reason.startswith("no change: the expected gain is within the noise")
    assert "95% interval" in got.reason and "over the 6 steps of one run" in got.reason
    assert re.search(r"about \d+ runs of this configuration would resolve it", got.reason)
    assert "the best re-deal would be [2,2]" in got.reason
    # a real imbalance measured as noisily, three runs of it: advised, with its interval
    runs = []
    for k in range(3):
        slow = _rows([0.3 * 1.6, 0.1 * (1 + head)], step_s=0.8, steps=8, noise=0.10, seed=14 + k, run=f"s{k}")
        got = measure_run({"run": f"s{k}", "pp": 2}, _summary([3, 1], m=4), {"model": model}, slow)
        assert isinstance(got, Measured)
        runs.append(got)
    real = layout_for(runs)
    assert isinstance(real, Advice) and real.proposed == [2, 2], real
    assert real.gain_interval is not None and 0 < real.gain_interval[0] <= real.expected_gain
    assert real.confidence == 0.95
    # ... while one of them alone is not (its run-to-run variability is not measured)
    alone = layout_for(runs[:1])
    assert isinstance(alone, NoAdvice) and alone.reason.startswith("no change yet: one run shows the noise")
    assert (
        "the re-deal [2,2] is expected to gain" in alone.reason
        and "runs of this configuration" in alone.reason
    )


def test_repeats_for_a_gain() -> None:
    # one run, gain 4 % +- 6 %: more runs, each as noisy, resolve it
    n = repeats_for_gain(GainInterval(0.04, -0.02, 0.10, runs=1, steps=6))
    assert n is not None and n >= 3
    assert repeats_for_gain(GainInterval(-0.01, -0.05, 0.03, runs=1, steps=6)) is None


def _measured(seed: int, run: str, host: float = 1.0) -> Measured:
    # A truly imbalanced [4, 4]: stage 0's GPU runs each layer 1.8x slower (throttled 60 %),
    # 5 % step noise; the host's speed varies run to run.
    rows = _rows([0.4 * 1.8 * host, 0.4 * host], throttle=[0.6, 0.0], step_s=1.2 * host,
                 steps=8, noise=0.05, seed=seed, run=run)  # fmt: skip
    got = measure_run({"run": run, "pp": 2}, _summary([4, 4]), {"model": TINY}, rows)
    assert isinstance(got, Measured), got
    return got


def test_three_repeats_of_a_truly_imbalanced_layout_get_the_same_advice() -> None:
    runs = [_measured(seed, f"seed={seed}", host) for seed, host in ((1, 0.95), (2, 1.0), (3, 1.07))]
    # each alone: the same "no change yet" with the same provisional re-deal
    each = [layout_for([ms]) for ms in runs]
    assert all(isinstance(a, NoAdvice) and a.reason.startswith("no change yet: one run") for a in each), each
    proposals = {re.search(r"the re-deal (\[[0-9,]+\])", a.reason).group(1) for a in each}  # type: ignore[union-attr]
    assert len(proposals) == 1
    together = layout_for(runs)
    assert isinstance(together, Advice) and "[" + ",".join(map(str, together.proposed)) + "]" in proposals
    assert together.runs == ["seed=1", "seed=2", "seed=3"]
    assert together.proposed[0] < 4  # off the slow, throttled stage
    assert any("over 3 runs and their steps" in e for e in together.evidence)
    assert together.gain_interval is not None and together.gain_interval[0] > 0


def test_work_is_never_moved_onto_a_throttled_stage() -> None:
    # The case: [3, 1], stage 1 throttled 100 % at 96 °C, yet its one layer measured
    # fast (on a CPU its phases are short): the per-layer model would move two layers onto it
    # ([3, 1] -> [1, 3]). A throttled stage is never given more layers.
    rows = _rows([0.6, 0.1], throttle=[0.0, 1.0], temps=[60.0, 96.0], steps=8)
    got = layout_advice({"run": "r", "pp": 2}, _summary([3, 1]), {}, rows)
    assert isinstance(got, NoAdvice), got
    assert "throttled stage(s) [1] are not given more layers" in got.reason
    # without the throttle the same times are re-dealt onto stage 1
    free = layout_for(_repeats([0.6, 0.1], [3, 1]))
    assert isinstance(free, Advice) and free.proposed[1] > 1


def test_a_throttled_gpu_is_never_placed_on_a_heavier_stage() -> None:
    from charllm_nemo.analysis.advise_placement import best_assignment

    # GPU 0 (stage 0, 4 layers of work) is fast per unit of work but throttled: swapping it onto
    # the heavier stage 1 would shorten the pipeline, and is refused.
    assert best_assignment([4.0, 5.14], [1.0, 2.0], 8)[0] == [1, 0]
    assert best_assignment([4.0, 5.14], [1.0, 2.0], 8, [True, False])[0] == [0, 1]


def test_a_slow_device_is_told_from_a_heavy_stage() -> None:
    slow = layout_for(_repeats([0.72, 0.40], [4, 4], throttle=[0.6, 0.0]))
    assert isinstance(slow, Advice)
    line = next(e for e in slow.evidence if e.startswith("stage 0 is a slow device"))
    assert re.search(r"(79|80|81)% more time per unit of work", line)
    assert "throttled 60%" in line and "not given more work" in line
    heavy = layout_for(_repeats([0.60, 0.20], [6, 2]))
    assert isinstance(heavy, Advice) and heavy.proposed == [4, 4]
    assert any(e.startswith("stage 0 is a heavy stage: 6.00 layers of work") for e in heavy.evidence)
    assert not any("slow device" in e for e in heavy.evidence)


def test_the_work_of_each_stage_is_counted_as_the_flop_model_counts_it() -> None:
    from charllm_nemo.analysis.advise_work import work_model

    plain = work_model({"model": TINY})
    # tiny_gpt: logits 64 x 1024 MACs a token against a layer's 53,248 + 4,096 (full s x s core)
    assert plain.known and plain.head == pytest.approx(65536 / (53248 + 4096), rel=1e-6)
    assert plain.stages([5, 3]) == [5.0, pytest.approx(3 + plain.head)]
    assert "embedding lookup (first stage) and the loss (last stage)" in plain.describe()
    assert "0 FLOPs" in plain.describe()
    # full recomputation reruns each layer's forward: a third of its model FLOPs more
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    full = work_model({"model": TINY, "optim": recompute})
    assert full.recompute == pytest.approx(1 / 3) and full.recompute_first is None
    assert full.stages([4, 4]) == [pytest.approx(4 * 4 / 3), pytest.approx(4 * 4 / 3 + full.head)]
    # block: only the first k layers of each stage
    block = work_model({"model": TINY, "optim": {**recompute, "recompute_method": "block"}})
    assert block.recompute_first == 1 and block.stage(0, 4, 2) == pytest.approx(4 + 1 / 3)
    assert not work_model({}).known and "layers only" in work_model({}).describe()


def test_repeats_of_one_configuration_share_a_key() -> None:
    pytest.importorskip("hydra")
    from omegaconf import OmegaConf

    from charllm_nemo.analysis.advise_cmd import configuration_key
    from charllm_nemo.train.app import compose

    def config(*extra: str) -> dict[str, Any]:
        cfg = compose(["model=tiny_gpt", "parallel=pp2", "nproc=2", *extra])
        OmegaConf.update(cfg, "telemetry.out_dir", f"/tmp/{len(extra)}")
        out = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(out, dict)
        return out

    ms = _measured(1, "a")
    assert configuration_key(config(), ms) == configuration_key(config("data.seed=7"), ms)
    assert configuration_key(config(), ms) != configuration_key(config("batch.global_batch_size=8"), ms)


def test_the_rerun_command_of_a_sweep_run_runs_as_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A sweep's run records launch.launcher=slurm; its re-run command used to keep it, and
    # outside an allocation `charllm train ... launch.launcher=slurm` exits 2. The printed
    # command leaves the launcher to its default and validates as printed.
    pytest.importorskip("hydra")
    from omegaconf import OmegaConf

    from charllm_nemo.analysis.advise_cmd import rerun_overrides
    from charllm_nemo.cli import main
    from charllm_nemo.train.app import compose

    cfg = compose(
        ["model=tiny_gpt", "parallel=pp2_uneven", "nproc=2", "launcher=slurm", "batch.train_steps=7"]
    )
    OmegaConf.update(cfg, "telemetry.out_dir", "/shared/sweeps/x/run=pp2_uneven/attempt=1")
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict) and config["launch"]["launcher"] == "slurm"
    overrides, problem = rerun_overrides(
        config, ["parallel.pipeline_layout=[2,2]", "parallel.pipeline_layout_scheme=null"]
    )
    assert problem is None
    assert not any(o.startswith(("launch.launcher", "launcher=")) for o in overrides)
    command = "charllm train " + " ".join(shlex.quote(o) for o in overrides)
    words = shlex.split(command)
    capsys.readouterr()
    assert main([*words[1:], "dry_run=true", f"telemetry.out_dir={tmp_path / 'again'}"]) == 0
    out = capsys.readouterr().out
    assert "the configuration is valid;" in out and "nothing started" in out and "layers/stage=[2, 2]" in out


def test_one_run_must_hold_its_gain_in_each_quarter() -> None:
    import numpy as np

    from charllm_nemo.analysis.advise import layout_predictor
    from charllm_nemo.analysis.advise_stats import with_drift

    predict = layout_predictor([4.0, 4.0], [5.0, 3.0], 8)
    steady = np.tile([0.4, 0.6], (16, 1))
    drifting = steady.copy()
    drifting[8:, 1] = 0.4  # stage 1 slow for the first half of the run only
    step = np.full(16, 1.0)
    g = 1 - predict(np.array([0.4, 0.6]), 1.0)  # 9.4 %: 0.6 s -> 0.5 s on the slower stage
    narrow = GainInterval(g, g - 0.01, g + 0.01, runs=1, steps=16)
    kept = with_drift(narrow, [steady], [step], predict)  # every quarter the same: unchanged
    assert kept == narrow
    wide = with_drift(narrow, [drifting], [step], predict)
    assert wide is not None and wide.low < 0 < wide.high  # the quarters disagree
    assert with_drift(narrow, [steady[:7]], [step[:7]], predict) is None  # < 2 steps a quarter
    # a real imbalance in 6 measured steps: past the step noise, too short for its quarters
    short = layout_advice({"run": "r", "pp": 2}, _summary([4, 4]), {}, _rows([0.72, 0.40], steps=6))
    assert isinstance(short, NoAdvice) and short.reason.startswith("one run of 6 measured step(s): too few")
    assert "batch.train_steps=10 or more" in short.reason
