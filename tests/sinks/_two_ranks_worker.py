"""The rank processes of test_gather.py: a module with no test imports, so that a spawned child
imports only what a rank of the training loop would (torch, the sinks, the session).

Each rank first runs the gather checks (results to ``<out>/rank<r>.json``), then, with
``with_wandb``, a short run wired as the training loop wires the sink: its telemetry session
gives the figures of the previous step, every rank packs and gathers them, rank 0 alone logs
them (W&B offline); at the end every rank closes its session, a barrier, rank 0 finishes the
sink with the run directory."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

STEPS = 4
FAST = {"x_disable_stats": True, "console": "off", "x_disable_machine_info": True, "disable_git": True}


def rank_figures(rank: int) -> dict[str, float]:
    # Rank 1 does not know its temperature: NaN must travel as NaN and be omitted at the end.
    return {
        "energy_j": 10.0 + rank,
        "power_avg_w": 100.0 * (rank + 1),
        "power_peak_w": 150.0 * (rank + 1),
        "temp_gpu_peak_c": 60.0 if rank == 0 else math.nan,
        "throttle_any_limiting_s": 0.1 * rank,
        "pcie_tx_bytes": float(2**40 + rank),  # exact in float64
    }


def gather_checks(rank: int, out: str) -> None:
    import torch.distributed as dist

    from charllm_nemo.sinks import gather as g
    from charllm_nemo.sinks.keys import pack_step_figures, step_metrics, unpack_gathered

    result: dict[str, object] = {}
    vec = pack_step_figures(rank_figures(rank))
    got = g.gather_to_rank0(vec)
    result["gather"] = got
    result["padded"] = g.gather_to_rank0([float(rank)], width=3)  # NaN-filled to the width
    group = dist.new_group([0, 1])
    result["group"] = g.gather_to_rank0([float(rank) * 2], group=group)
    g._NO_GATHER.add("gloo")  # the all_gather path (backends without gather)
    result["all_gather"] = g.gather_to_rank0(vec)
    g._NO_GATHER.discard("gloo")
    if got is not None:
        result["metrics"] = step_metrics(3, summary={"loss": 2.0}, per_rank=unpack_gathered(got))
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def wandb_run(rank: int, world: int, run_dir: str) -> None:
    import torch.distributed as dist

    from charllm_nemo.sinks.config import LoggerConfig, build_sink
    from charllm_nemo.sinks.gather import gather_to_rank0
    from charllm_nemo.sinks.keys import pack_step_figures
    from charllm_nemo.telemetry.session import TelemetrySession

    config = {"model": {"name": "tiny_gpt"}, "parallel": {"name": "dp2", "tp": 1, "pp": 1, "dp": None}}
    session = TelemetrySession(
        run_dir,
        backend="synthetic",
        hz=250,
        rank=rank,
        world_size=world,
        config=config,
        backend_options={"activity": 0.8 - 0.4 * rank},
        handle_signals=False,
    ).start()
    cfg = LoggerConfig(name="wandb", project="two-ranks", settings=FAST)
    sink = build_sink(cfg, rank, run_dir=run_dir)  # rank 0: a sink; rank 1: None
    if sink is not None:
        sink.start(config, dict(session.store.manifest))  # a copy: the store updates its own at close
    pending: tuple[int, int, int, float] | None = None  # (step, t_begin, t_end, step time)

    def gather_and_log(wait_s: float) -> None:
        assert pending is not None
        step, t0, t1, seconds = pending
        rows = session.step_figures(t0, t1, wait_s=wait_s)  # None while the sampler lags
        gathered = gather_to_rank0(pack_step_figures(rows))  # every rank, same order
        if sink is not None and gathered is not None:
            sink.log_figures(step, {"loss": 5.0 - step, "step_time_s": seconds}, gathered)

    try:
        for step in range(STEPS):
            t0 = time.monotonic_ns()
            time.sleep(0.03)  # the step's work
            t1 = time.monotonic_ns()
            session.windows.record("step", "step", t0, t1, step=step)  # the loop's StepMarker does this
            if pending is not None:
                gather_and_log(wait_s=1.0)  # the loop waits 0 here; the test wants every step
            pending = (step, t0, t1, (t1 - t0) / 1e9)
        gather_and_log(wait_s=1.0)  # the last step, after a short wait
    finally:
        session.close()
        dist.barrier()  # every rank's files are final before rank 0 uploads them
        if sink is not None:
            sink.finish(Path(run_dir), timeout_s=30)


def rank_main(rank: int, world: int, tmp: str, env: dict[str, str], with_wandb: bool) -> None:
    os.environ.update(env)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        gather_checks(rank, tmp)
        if with_wandb:
            wandb_run(rank, world, f"{tmp}/run")
    finally:
        dist.destroy_process_group()
