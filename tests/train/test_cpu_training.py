"""Real Megatron-Core training on CPU over gloo: 1 and 2 processes, TP / PP / EP / DP.

Each test starts its ranks as subprocesses (tests/train/_cpu_rank.py) with the torch.distributed
variables a launcher would set and a free port, and checks what they recorded: losses, labels
and the step / microbatch / phase windows. Tiny shapes: a test costs the ranks' import time
(~3-5 s) plus well under a second of training.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from tests.deadline import deadline

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from charllm_nemo.telemetry.placement import resolve_collector_sched
from charllm_nemo.train.config import ModelConfig, TrainConfig
from charllm_nemo.train.plan import plan_stage_activations, plan_stage_memory
from charllm_nemo.train.validate import validate

WORKER = Path(__file__).with_name("_cpu_rank.py")
TIMEOUT_S = deadline(50)  # 150 s at the default factor; scaled on a crowded machine (tests/deadline.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiny_cfg(**parallel: Any) -> TrainConfig:
    """tiny_gpt: 4 layers, hidden 64, seq 64, vocab 1024 (GPT-3 style: GeLU, LayerNorm, learned
    positions), fp32, 3 steps of 4 sequences, telemetry windows on, no session."""
    cfg = TrainConfig()
    cfg.model = ModelConfig(name="tiny_gpt", num_layers=4, position_embedding="learned_absolute")
    cfg.batch.global_batch_size = 4
    cfg.batch.micro_batch_size = 1
    cfg.batch.train_steps = 3
    cfg.launch.device = "cpu"
    cfg.telemetry.enabled = False
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def run_ranks(cfg: TrainConfig, nproc: int, tmp_path: Path) -> list[dict[str, Any]]:
    """Run ``nproc`` ranks of ``cfg`` with ``tmp_path/run`` as the run directory; returns each
    rank's result (RankResult + windows)."""
    cfg.telemetry.out_dir = str(tmp_path / "run")
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(asdict(cfg)))
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        out = tmp_path / f"rank{rank}.json"
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(cfg_path), str(out)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                out,
                log,
            )
        )
    try:
        for p, _, _ in procs:
            p.wait(timeout=TIMEOUT_S)
    finally:
        for p, _, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    for rank, (p, _, _) in enumerate(procs):
        if p.returncode != 0:
            tail = (tmp_path / f"rank{rank}.log").read_text()[-4000:]
            pytest.fail(f"rank {rank} exited with {p.returncode}:\n{tail}")
    return [json.loads(out.read_text()) for _, out, _ in procs]


def windows(
    result: dict[str, Any], kind: str, name: str | None = None, step: int | None = None
) -> list[dict]:
    rows = [w for w in result["windows"] if w["kind"] == kind and (name is None or w["name"] == name)]
    if step is not None:
        rows = [w for w in rows if w["step"] == step]
    return sorted(rows, key=lambda w: w["t_begin_mono_ns"])


def assert_finite_losses(results: list[dict[str, Any]], steps: int) -> None:
    for r in results:
        assert r["steps"] == steps
        assert len(r["losses"]) == steps
        assert all(loss is not None and math.isfinite(loss) for loss in r["losses"]), r["losses"]
        # Untrained over a 1024-token vocabulary: cross-entropy near ln(1024) = 6.93.
        assert all(5.0 < loss < 9.0 for loss in r["losses"])
        assert r["unmatched_marks"] == 0
    # The loss is reduced over all ranks: every rank reports the same value.
    assert all(r["losses"] == results[0]["losses"] for r in results)


def assert_memory_plan_matches(cfg: TrainConfig, results: list[dict[str, Any]]) -> None:
    """The dry run's per-stage parameters (metrics/memory.py) are what megatron-core allocated on
    each rank: its 2-D parameters, less the learned position embedding (stage 0, not counted)."""
    layout = validate(cfg, world_size=len(results), device="cpu")
    stages = plan_stage_memory(cfg, layout)
    m = cfg.model
    positions = (m.max_position_embeddings or m.seq_length) * m.hidden_size
    for r in results:
        stage = r["labels"]["pp_stage"] or 0
        extra = positions if (stage == 0 and m.position_embedding == "learned_absolute") else 0
        assert r["num_matrix_parameters"] == stages[stage].parameters + extra, (stage, r["labels"])


def assert_sane_nesting(r: dict[str, Any], n_micro: int, steps: int) -> None:
    """Every step has one microbatch window per microbatch and a forward and a backward phase per
    microbatch, all inside the step; a microbatch window spans its forward begin to its
    backward end; phases and microbatches are children of their step."""
    step_rows = windows(r, "step")
    assert [w["step"] for w in step_rows] == list(range(steps))
    for st in step_rows:
        s = st["step"]
        b0, b1 = st["t_begin_mono_ns"], st["t_end_mono_ns"]
        assert b0 < b1
        mbs = windows(r, "microbatch", step=s)
        assert sorted(w["microbatch"] for w in mbs) == list(range(n_micro))
        fwd = windows(r, "phase", "forward", step=s)
        bwd = windows(r, "phase", "backward", step=s)
        assert sorted(w["microbatch"] for w in fwd) == list(range(n_micro))
        assert sorted(w["microbatch"] for w in bwd) == list(range(n_micro))
        for w in [*mbs, *fwd, *bwd, *windows(r, "phase", "optimizer", step=s)]:
            assert b0 <= w["t_begin_mono_ns"] <= w["t_end_mono_ns"] <= b1, w
            assert w["parent_id"] == st["window_id"]
        by_mb = {w["microbatch"]: w for w in mbs}
        for f, b in zip(
            sorted(fwd, key=lambda w: w["microbatch"]),
            sorted(bwd, key=lambda w: w["microbatch"]),
            strict=True,
        ):
            m = by_mb[f["microbatch"]]
            assert m["t_begin_mono_ns"] == f["t_begin_mono_ns"]
            assert m["t_end_mono_ns"] == b["t_end_mono_ns"]
            assert f["t_end_mono_ns"] <= b["t_begin_mono_ns"]
        # Compute phases of one rank never overlap each other.
        compute = sorted([*fwd, *bwd], key=lambda w: w["t_begin_mono_ns"])
        for a, b in itertools.pairwise(compute):
            assert a["t_end_mono_ns"] <= b["t_begin_mono_ns"]
        opt = windows(r, "phase", "optimizer", step=s)
        assert len(opt) == 1 and opt[0]["t_begin_mono_ns"] >= compute[-1]["t_end_mono_ns"]


def test_single_process_tiny_gpt_windows_and_loss(tmp_path: Path) -> None:
    cfg = tiny_cfg()
    (r,) = run_ranks(cfg, 1, tmp_path)
    assert_finite_losses([r], 3)
    assert r["num_microbatches"] == 4
    assert_sane_nesting(r, 4, 3)
    assert all(w["timing"] == "host" for w in r["windows"])
    assert {w["pp_stage"] for w in r["windows"]} == {0}
    s = r["summaries"]
    assert [x["step"] for x in s] == [0, 1, 2]
    assert all(x["step_time_s"] > 0 for x in s)
    assert s[0]["energy_j"] is None  # no telemetry session: no energy, not a made-up number


def test_single_process_with_synthetic_telemetry_session(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow.parquet")
    cfg = tiny_cfg()
    cfg.telemetry.enabled = True
    cfg.telemetry.backend = "synthetic"
    cfg.telemetry.collector_sched = "auto"  # (default normal) the loop passes its ranks and threads
    (r,) = run_ranks(cfg, 1, tmp_path)
    assert_finite_losses([r], 3)
    # Live figures come one step late, each waited for a bounded time (the last one longer): on a
    # loaded machine some never come. A step either has them, consistent, or says it has none.
    for s in r["summaries"]:
        assert "sampling_gap" in s and "coverage" in s
        if s["ranks_reporting"] != 1:
            assert s["ranks_reporting"] == 0 and s["energy_j"] is None, s
            continue
        assert s["energy_j"] is not None and s["energy_j"] > 0
        assert s["power_avg_w"] is not None and s["power_avg_w"] > 0
        # Energy is power x time: the average power over the step gives back its energy.
        assert s["energy_j"] == pytest.approx(s["power_avg_w"] * s["step_time_s"], rel=0.05)
    # The store has what the live path may have missed: every step the samples bracket has its
    # energy (none made up for one they do not), and the sample taken at stop brackets its end.
    from charllm_nemo.telemetry.join import attribute_run
    from charllm_nemo.telemetry.reader import load_run

    run = load_run(tmp_path / "run")
    steps = attribute_run(run, ("step",)).to_pylist()
    t = sorted(run.samples["t_mono_ns"].to_pylist())
    assert [w["step"] for w in steps] == [0, 1, 2] and t[-1] >= max(w["t_end_mono_ns"] for w in steps)
    bracketed = [w for w in steps if t[0] <= w["t_begin_mono_ns"]]
    assert bracketed and all(w["energy_j"] > 0 for w in bracketed), steps
    assert all(math.isnan(w["energy_j"]) for w in steps if w not in bracketed)
    rank_dir = tmp_path / "run" / "rank=0"
    sched = json.loads((rank_dir / "manifest.json").read_text())["collector_sched"]
    assert sched["setting"] == "auto" and "1 kept busy by 1 local rank(s)" in sched["why"]
    assert sched["policy"] == resolve_collector_sched("auto", 1, 1)[0]  # one rank, one thread
    wins = pa.read_table(sorted(rank_dir.glob("windows-*.parquet"))).to_pylist()
    kinds = {(w["kind"], w["name"]) for w in wins}
    assert {
        ("step", "step"),
        ("microbatch", "microbatch"),
        ("phase", "forward"),
        ("phase", "backward"),
        ("phase", "optimizer"),
    } <= kinds
    assert list(rank_dir.glob("samples-*.parquet"))
    # Rank 0's per-step figures: streamed to steps.jsonl step by step, all of them in summary.json.
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["steps"] == 3
    assert list(summary["setup_s"]) == ["init", "telemetry", "model"]
    assert all(0 < s < TIMEOUT_S for s in summary["setup_s"].values())
    lines = (tmp_path / "run" / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == summary["per_step"] == r["summaries"]


def test_tp2(tmp_path: Path) -> None:
    cfg = tiny_cfg(tp=2)
    results = run_ranks(cfg, 2, tmp_path)
    assert_finite_losses(results, 3)
    assert_memory_plan_matches(cfg, results)
    assert sorted(r["labels"]["tp_rank"] for r in results) == [0, 1]
    for r in results:
        assert_sane_nesting(r, 4, 3)  # TP ranks run every microbatch together


def test_pp2_1f1b_interleaving_visible(tmp_path: Path) -> None:
    cfg = tiny_cfg(pp=2)
    results = run_ranks(cfg, 2, tmp_path)
    assert_finite_losses(results, 3)
    assert_memory_plan_matches(cfg, results)  # the tied output layer's copy on the last stage too
    # Every rank's peak beside its stage's plan, gathered at the end, in rank 0's summary.json.
    memory = json.loads((tmp_path / "run" / "summary.json").read_text())["memory"]
    layout = validate(cfg, world_size=2, device="cpu")
    stages = plan_stage_memory(cfg, layout)
    assert memory["measure"] == "max_rss" and memory["pp_stage"] == [0, 1]
    assert memory["plan_bytes"] == [s.total_bytes for s in stages]
    assert memory["activation_bytes"] == [a.total_bytes for a in plan_stage_activations(cfg, layout, "local")]
    assert all(peak > 100 * 2**20 for peak in memory["peak_bytes"])  # torch's own RSS, at least
    assert results[1]["memory"] == memory  # every rank has the same report
    by_stage = {r["labels"]["pp_stage"]: r for r in results}
    assert sorted(by_stage) == [0, 1]
    for r in results:
        assert_sane_nesting(r, 4, 3)
    for step in range(3):
        # 1F1B with 2 stages and 4 microbatches: stage 0 runs one warmup forward, then alternates
        # (F0 F1 B0 F2 B1 F3 B2 B3); the last stage alternates from the start (F0 B0 F1 B1 ...).
        order = {
            stage: [
                (w["name"][0].upper(), w["microbatch"])
                for w in windows(r, "phase", step=step)
                if w["name"] in ("forward", "backward")
            ]
            for stage, r in by_stage.items()
        }
        assert order[0] == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
        assert order[1] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
        # ... so on stage 0 the windows of microbatches 0 and 1 overlap.
        mb = {w["microbatch"]: w for w in windows(by_stage[0], "microbatch", step=step)}
        assert mb[1]["t_begin_mono_ns"] < mb[0]["t_end_mono_ns"]
    # Pipeline send/recv is visible as phases on both stages.
    for r in results:
        names = {w["name"] for w in windows(r, "phase")}
        assert any(n.startswith("pp-") for n in names), names


def test_ep2_tiny_moe(tmp_path: Path) -> None:
    cfg = tiny_cfg(ep=2)
    cfg.model = ModelConfig(
        name="tiny_moe",
        num_layers=2,
        num_query_groups=2,
        swiglu=True,
        normalization="RMSNorm",
        position_embedding="rope",
        untie_embeddings=True,
        num_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher="allgather",
    )
    results = run_ranks(cfg, 2, tmp_path)
    assert_finite_losses(results, 3)
    assert_memory_plan_matches(cfg, results)  # half the experts on each rank, the router on both
    assert sorted(r["labels"]["ep_rank"] for r in results) == [0, 1]
    # EP is carved out of DP: the two ranks are also two data-parallel ranks.
    assert sorted(r["labels"]["dp_rank"] for r in results) == [0, 1]
    for r in results:
        assert_sane_nesting(r, 2, 3)  # 4 sequences / (1 per microbatch * dp 2)


def test_dp2(tmp_path: Path) -> None:
    results = run_ranks(tiny_cfg(), 2, tmp_path)
    assert_finite_losses(results, 3)
    assert sorted(r["labels"]["dp_rank"] for r in results) == [0, 1]
    for r in results:
        assert r["num_microbatches"] == 2
        assert_sane_nesting(r, 2, 3)
        assert windows(r, "phase", "grad-sync"), "the DP gradient all-reduce is a phase"
    # Step time is the max over ranks: both ranks agree.
    assert results[0]["step_times_s"] == results[1]["step_times_s"]
    # The per-step summaries (summary.json's) are kept by rank 0 alone.
    by_rank = {r["rank"]: r for r in results}
    assert len(by_rank[0]["summaries"]) == 3 and by_rank[1]["summaries"] == []


def test_pp2_vpp2_interleaved(tmp_path: Path) -> None:
    # 4 layers over 2 stages x 2 virtual chunks: one layer per chunk. Each microbatch runs a
    # forward and a backward on both chunks of a rank; the windows carry the chunk.
    cfg = tiny_cfg(pp=2, vpp=2)
    results = run_ranks(cfg, 2, tmp_path)
    assert_finite_losses(results, 3)
    assert_memory_plan_matches(cfg, results)
    for r in results:
        for step in range(3):
            for name in ("forward", "backward"):
                rows = windows(r, "phase", name, step=step)
                assert sorted((w["microbatch"], w["vpp_chunk"]) for w in rows) == [
                    (mb, c) for mb in range(4) for c in (0, 1)
                ]
            mbs = windows(r, "microbatch", step=step)
            assert sorted(w["microbatch"] for w in mbs) == list(range(4))
        # Batched p2p over gloo swapped activations and gradients here (cpu.py): grad norms came
        # out ~15x too large (~30 instead of ~2 for this model), then NaN.
        assert all(g is not None and g < 6.0 for g in r["grad_norms"]), r["grad_norms"]
