"""Two gloo processes (spawned once for the module, tests/sinks/_two_ranks_worker.py):

* gather_to_rank0: every rank's figures reach rank 0 (gather, all_gather, a subgroup, padding);
* a short two-rank run wired as the training loop wires the sink logs both ranks' keys for
  every step through rank 0, equal to what the run directory gives."""

from __future__ import annotations

import importlib.util
import json
import math
import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest

from charllm_nemo.sinks.gather import gather_to_rank0
from charllm_nemo.sinks.keys import STEP_FIGURE_KEYS, STEP_KEY, pack_step_figures

from ._two_ranks_worker import STEPS, rank_figures, rank_main
from .wandb_reader import find_wandb_file, read_run

pytest.importorskip("torch")
HAVE_WANDB = importlib.util.find_spec("wandb") is not None


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, wandb_env: dict[str, str]) -> Path:
    tmp = tmp_path_factory.mktemp("two-ranks")
    env = wandb_env
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, 2, str(tmp), env, HAVE_WANDB)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    assert [p.exitcode for p in procs] == [0, 0]
    return tmp


def _load(tmp: Path, rank: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((tmp / f"rank{rank}.json").read_text())
    return data


def test_two_gloo_ranks_gather_to_rank0(two_ranks):
    r0, r1 = _load(two_ranks, 0), _load(two_ranks, 1)
    assert r1 == {"gather": None, "padded": None, "group": None, "all_gather": None}
    for key in ("gather", "all_gather"):
        rows = r0[key]
        assert len(rows) == 2 and all(len(v) == len(STEP_FIGURE_KEYS) for v in rows)
        for rank, row in enumerate(rows):
            expected = pack_step_figures(rank_figures(rank))
            for got, want in zip(row, expected, strict=True):
                assert (math.isnan(got) and math.isnan(want)) or got == want
    assert r0["padded"][1][0] == 1.0 and math.isnan(r0["padded"][1][2])
    assert r0["group"] == [[0.0], [2.0]]


def test_rank0_step_metrics_carry_both_ranks(two_ranks):
    m = _load(two_ranks, 0)["metrics"]
    assert m["trainer/global_step"] == 3
    assert m["rank/0/energy_j"] == 10.0 and m["rank/1/energy_j"] == 11.0
    assert m["rank/1/power_avg_w"] == 200.0
    assert m["rank/1/pcie_tx_bytes"] == 2**40 + 1
    assert "rank/1/temp_gpu_peak_c" not in m
    assert m["all/energy_j"] == 21.0
    assert m["all/power_mean_w"] == 150.0
    assert m["all/ranks_throttled"] == 1
    assert m["all/temp_spread_c"] == 0.0  # one rank knows its temperature


@pytest.mark.skipif(not HAVE_WANDB, reason="wandb not installed")
def test_two_ranks_log_every_rank_through_rank0(two_ranks):
    from charllm_nemo.telemetry.join import attribute_run
    from charllm_nemo.telemetry.reader import load_run

    run_dir = two_ranks / "run"
    run = read_run(find_wandb_file(run_dir / "wandb"), wait_s=10)
    assert run.exited
    history = [h for h in run.history if "all/ranks_reporting" in h]
    assert [h[STEP_KEY] for h in history] == list(range(STEPS))
    table = attribute_run(load_run(run_dir), ("step",))
    cols = table.to_pydict()
    stored = {(cols["rank"][i], cols["step"][i]): i for i in range(table.num_rows)}
    for h in history:
        assert h["all/ranks_reporting"] == 2
        for rank in (0, 1):
            i = stored[(rank, h[STEP_KEY])]
            for name in STEP_FIGURE_KEYS:
                want, key = cols[name][i], f"rank/{rank}/{name}"
                if want is None or (isinstance(want, float) and math.isnan(want)):
                    assert key not in h
                else:
                    # energy and power: live vs stored attribution, see test_wandb_offline.py
                    rel = 1e-3 if name in ("energy_j", "power_avg_w") else 1e-9
                    assert h[key] == pytest.approx(want, rel=rel, abs=1e-12), key
        assert h["rank/0/power_avg_w"] > h["rank/1/power_avg_w"]  # activity 0.8 vs 0.4
    assert any(a.type == "telemetry" for a in run.artifacts)


def test_one_process_without_a_process_group_gets_its_own_vector():
    import torch.distributed as dist

    assert not dist.is_initialized()
    got = gather_to_rank0([1.0, None, math.inf])
    assert got is not None and len(got) == 1
    assert got[0][0] == 1.0 and math.isnan(got[0][1]) and math.isnan(got[0][2])  # unknown -> NaN
    got = gather_to_rank0([1.0, None], width=3)
    assert got is not None and got[0][0] == 1.0 and all(math.isnan(v) for v in got[0][1:])
    with pytest.raises(ValueError, match="width"):
        gather_to_rank0([1.0, 2.0], width=1)
