"""The plan (train/plan.py) and the GPU memory check every rank makes before building the model."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from charllm_nemo.errors import ConfigError
from charllm_nemo.train import app, plan
from charllm_nemo.train.dist import DistInfo
from charllm_nemo.train.plan import (
    RankMemory,
    check_gpu_memory,
    memory_line,
    memory_report,
    memory_verdict,
    plan_stage_activations,
    plan_stage_memory,
)
from charllm_nemo.train.validate import validate

GiB = 2**30


def test_no_verdict_when_everything_fits_or_nobody_can_tell() -> None:
    assert memory_verdict([]) == (None, None)
    assert memory_verdict([RankMemory(0, 0, None, None, None)]) == (None, None)
    assert memory_verdict([RankMemory(0, 0, 40 * GiB, 79 * GiB, 80 * GiB)]) == (None, None)


def test_the_rank_short_by_the_most_is_named() -> None:
    ranks = [
        RankMemory(0, 0, 76 * GiB, 79 * GiB, 80 * GiB),  # fits (tight)
        RankMemory(1, 1, 76 * GiB, 70 * GiB, 80 * GiB),  # 6 GiB short
        RankMemory(2, 0, 80 * GiB, 60 * GiB, 80 * GiB),  # 20 GiB short: another job on its GPU
        RankMemory(3, 1, None, None, None),  # could not tell
    ]
    error, warning = memory_verdict(ranks)
    assert warning is None
    assert error is not None
    assert error.startswith(
        "rank 2 (pipeline stage 0) needs at least 80.0 GiB for its weights, gradients and optimizer "
        "state before any activation, but its GPU has 60.0 GiB free of 80.0 GiB (2 rank(s) short;"
    )
    assert error.endswith(
        "Use the distributed optimizer (optim.use_distributed_optimizer=true), more pipeline stages "
        "(parallel.pp) or tensor parallelism (parallel.tp), more GPUs"
    )
    error, _ = memory_verdict(ranks, distributed_optimizer=True)
    assert error is not None and "use_distributed_optimizer" not in error


def test_a_tight_rank_is_warned_about() -> None:
    error, warning = memory_verdict(
        [RankMemory(0, 0, 30 * GiB, 79 * GiB, 80 * GiB), RankMemory(1, 3, 75 * GiB, 79 * GiB, 80 * GiB)]
    )
    assert error is None
    assert warning == (
        "rank 1 (pipeline stage 3): weights, gradients and optimizer state take 75.0 GiB of its "
        "GPU's 79.0 GiB free; activations may not fit"
    )


def test_an_estimated_peak_over_free_memory_is_warned_about() -> None:
    # The state fits everywhere; with the activations, ranks 1 and 2 do not: the tightest is named.
    ranks = [
        RankMemory(0, 0, 30 * GiB, 79 * GiB, 80 * GiB, activations=40 * GiB),  # fits: 70 of 79
        RankMemory(1, 1, 30 * GiB, 79 * GiB, 80 * GiB, activations=55 * GiB),  # 85 of 79
        RankMemory(2, 2, 30 * GiB, 60 * GiB, 80 * GiB, activations=40 * GiB),  # 70 of 60: tightest
    ]
    error, warning = memory_verdict(ranks)
    assert error is None
    assert warning == (
        "rank 2 (pipeline stage 2) will likely run out of memory: its estimated peak is 70.0 GiB "
        "(30.0 GiB of weights, gradients and optimizer state, 40.0 GiB of activations), its GPU has "
        "60.0 GiB free (2 rank(s) over; `dry_run=true` prints the estimate per stage). Use activation "
        "recomputation (optim=recompute, or optim.recompute_granularity=selective), a smaller "
        "batch.micro_batch_size, or more tensor / pipeline parallelism (parallel.tp, parallel.pp)"
    )
    # Estimated to fit: no warning, even with the state above TIGHT_SHARE of free memory.
    fits = RankMemory(0, 0, 75 * GiB, 79 * GiB, 80 * GiB, activations=3 * GiB)
    assert memory_verdict([fits]) == (None, None)
    # The state alone too large stays an error, whatever the activations.
    error, _ = memory_verdict([RankMemory(0, 0, 85 * GiB, 79 * GiB, 80 * GiB, activations=1 * GiB)])
    assert error is not None and error.startswith("rank 0 (pipeline stage 0) needs at least 85.0 GiB")


def _gpt3_tp8pp8(*overrides: str) -> tuple[Any, Any]:
    cfg = app.load(
        ["model=gpt3_175b", "parallel=gpt3_175b_tp8pp8", "batch.global_batch_size=1536", *overrides]
    )
    cfg.launch.device = "cuda"
    return cfg, validate(cfg, world_size=1024, device="cuda")


class _FakeTorch:
    """What check_gpu_memory uses of torch: this GPU's memory, and an all_gather_object whose
    other ranks report ``others``."""

    def __init__(self, free: int, total: int, others: list[RankMemory]) -> None:
        self.cuda = SimpleNamespace(mem_get_info=lambda: (free, total))
        self.distributed = SimpleNamespace(all_gather_object=self._gather)
        self.others = others
        self.sent: list[Any] = []

    def _gather(self, out: list[Any], obj: Any) -> None:
        self.sent.append(obj)
        out[:] = [obj, *self.others][: len(out)]


def test_every_rank_fails_together_when_a_gpu_cannot_hold_its_stage() -> None:
    cfg, layout = _gpt3_tp8pp8("optim.use_distributed_optimizer=false")  # 46.9 GiB on stage 0
    need = plan_stage_memory(cfg, layout)[0].total_bytes
    acts = plan_stage_activations(cfg, layout, "te")[0].total_bytes
    dist = DistInfo(rank=0, world_size=2, local_rank=0, device="cuda", backend="nccl", pp_rank=0)
    ok = _FakeTorch(80 * GiB, 80 * GiB, [RankMemory(1, 1, need, 80 * GiB, 80 * GiB)])
    check_gpu_memory(cfg, layout, dist, ok, "te")
    assert ok.sent == [RankMemory(0, 0, need, 80 * GiB, 80 * GiB, acts)]
    # The other rank's GPU is short: this rank, whose own GPU fits, fails too, naming that one.
    short = _FakeTorch(80 * GiB, 80 * GiB, [RankMemory(1, 1, need, 40 * GiB, 80 * GiB)])
    with pytest.raises(ConfigError, match=r"^rank 1 \(pipeline stage 1\) needs at least 46\.9 GiB"):
        check_gpu_memory(cfg, layout, dist, short)
    # With the distributed optimizer (a GPU run's default) the same GPUs hold it.
    cfg, layout = _gpt3_tp8pp8()
    check_gpu_memory(cfg, layout, dist, _FakeTorch(40 * GiB, 80 * GiB, []))


def test_a_rank_that_cannot_tell_still_takes_part() -> None:
    cfg, layout = _gpt3_tp8pp8()
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device="cuda", backend="nccl")
    fake = _FakeTorch(0, 0, [])
    fake.cuda = SimpleNamespace()  # no mem_get_info: e.g. a runtime without it
    check_gpu_memory(cfg, layout, dist, fake)
    need = plan_stage_memory(cfg, layout)[0].total_bytes
    acts = plan_stage_activations(cfg, layout, "local")[0].total_bytes
    assert fake.sent == [RankMemory(0, 0, need, None, None, acts)]


def test_the_estimated_peak_is_warned_about_on_rank_0_only(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GPT-3 175B, tp8 pp8, no recomputation: stage 0 keeps 8 microbatches of 12 layers; with
    # megatron-core's local attention (s x s scores) that does not fit next to the state in
    # 60 GiB free. The run goes on (an estimate), and rank 0 says what to change.
    cfg, layout = _gpt3_tp8pp8()
    need = plan_stage_memory(cfg, layout)[0].total_bytes
    acts = plan_stage_activations(cfg, layout, "local")[0].total_bytes
    assert need < 60 * GiB < need + acts
    for rank in (1, 0):
        dist = DistInfo(rank=rank, world_size=1, local_rank=0, device="cuda", backend="nccl")
        with caplog.at_level("WARNING", logger="charllm_nemo.train"):
            check_gpu_memory(cfg, layout, dist, _FakeTorch(60 * GiB, 80 * GiB, []), "local")
        warned = [r.getMessage() for r in caplog.records if "will likely run out of memory" in r.getMessage()]
        assert len(warned) == (1 if rank == 0 else 0)
    # The warning says what each recomputation setting would bring the peak to.
    assert warned[0].endswith(
        "Its estimated peak with optim.recompute_granularity=selective: 42.3 GiB (fits); "
        "with optim=recompute: 22.1 GiB (fits)"
    )
    # Advice that cannot be worked out is left out; the warning (and the run) go on.
    caplog.clear()
    monkeypatch.setattr(plan, "recompute_estimates", lambda *a: 1 / 0)
    with caplog.at_level("WARNING", logger="charllm_nemo.train"):
        check_gpu_memory(cfg, layout, dist, _FakeTorch(60 * GiB, 80 * GiB, []), "local")
    (message,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert message.endswith("more tensor / pipeline parallelism (parallel.tp, parallel.pp)")
    monkeypatch.undo()
    # Selective recomputation drops the scores: the same GPU then holds the estimate.
    cfg, layout = _gpt3_tp8pp8("optim.recompute_granularity=selective")
    caplog.clear()
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device="cuda", backend="nccl")
    with caplog.at_level("WARNING", logger="charllm_nemo.train"):
        check_gpu_memory(cfg, layout, dist, _FakeTorch(60 * GiB, 80 * GiB, []), "local")
    assert not caplog.records


def test_the_dry_run_gives_the_highest_peak_under_each_recomputation_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Planned for GPU nodes from a host without TransformerEngine (as here): the local layers'
    # estimate, and last the one for TE layers, which keep no s x s scores (as selective does).
    monkeypatch.setattr(plan, "layer_implementation", lambda device: "local")
    cfg, layout = _gpt3_tp8pp8()
    assert plan.describe_plan(cfg, layout)[-2:] == [
        "  the highest peak, stage 0's, with optim.recompute_granularity=selective: 42.3 GiB; "
        "with optim=recompute: 22.1 GiB",
        "  with TransformerEngine layers instead (GPU nodes that have it): the highest peak, "
        "stage 0's, 42.3 GiB",
    ]
    # Selective already: only full recomputation keeps less; full already: nothing does.
    cfg, layout = _gpt3_tp8pp8("optim.recompute_granularity=selective")
    last = plan.describe_plan(cfg, layout)[-2]
    assert last == "  the highest peak, stage 0's, with optim=recompute: 22.1 GiB"
    cfg, layout = _gpt3_tp8pp8("optim=recompute")
    assert "the highest peak, stage 0's, with" not in "\n".join(plan.describe_plan(cfg, layout))
    # Where TE imports, its estimate is the plan's own: no second line.
    monkeypatch.setattr(plan, "layer_implementation", lambda device: "te")
    cfg, layout = _gpt3_tp8pp8()
    assert not any("TransformerEngine layers instead" in line for line in plan.describe_plan(cfg, layout))


def test_the_memory_report_and_its_line() -> None:
    ranks = [(50 * GiB, 17 * GiB, 0, 30 * GiB), (None, None, 1, None), (61 * GiB, 16 * GiB, 1, 44 * GiB)]
    report = memory_report("cuda_max_allocated", ranks)
    assert report == {
        "measure": "cuda_max_allocated",
        "peak_bytes": [50 * GiB, None, 61 * GiB],
        "plan_bytes": [17 * GiB, None, 16 * GiB],
        "activation_bytes": [30 * GiB, None, 44 * GiB],
        "pp_stage": [0, 1, 1],
    }
    assert memory_line(report) == (
        "memory: peak 61.0 GiB (cuda_max_allocated) on rank 2 (pipeline stage 1); its stage's "
        "weights, gradients and optimizer state: 16.0 GiB, activations (estimated): 44.0 GiB, "
        "together 60.0 GiB"
    )
    assert memory_line(memory_report("max_rss", [(None, 1, 0, None)])) is None
    # A summary.json from before the estimate (no activation_bytes) still reads.
    del report["activation_bytes"]
    assert memory_line(report) == (
        "memory: peak 61.0 GiB (cuda_max_allocated) on rank 2 (pipeline stage 1); its stage's "
        "weights, gradients and optimizer state: 16.0 GiB"
    )
