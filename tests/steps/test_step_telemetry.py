"""StepTelemetry: the per-step API every training loop uses, on a real session and a real gloo
group; the Megatron-Core timers adapter against megatron-core's own Timers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from charllm_nemo.metrics.flops import ModelShape
from charllm_nemo.steps import (
    FunctionObserver,
    RateInputs,
    StepOptions,
    StepReport,
    StepsFileObserver,
    StepTelemetry,
)
from charllm_nemo.telemetry.config import Placement, TelemetryConfig, open_session
from charllm_nemo.telemetry.windows import WindowRecorder

TINY = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=1024,
                  seq_length=64)  # fmt: skip


def _microbatches(timers: Any, n: int) -> None:
    for _ in range(n):
        timers("forward-compute", log_level=2).start()
        timers("forward-compute", log_level=2).stop()
        timers("backward-compute", log_level=2).start()
        timers("backward-compute", log_level=2).stop()


def test_the_timers_adapter_marks_our_windows_and_keeps_megatron_cores_own_timers(monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    timers_mod = pytest.importorskip("megatron.core.timers")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # mcore's Timer syncs CUDA
    inner = timers_mod.Timers(log_level=2, log_option="max")
    rec = WindowRecorder()
    st = StepTelemetry(None, Placement(), options=StepOptions(num_microbatches=2), recorder=rec)
    timers = st.timers(inner=inner)
    st.begin_step(0)
    _microbatches(timers, 2)
    timers("interval-time", log_level=0).start()  # not one of our windows: theirs alone
    timers("interval-time", log_level=0).stop()
    st.end_step(loss=1.0)
    # Their timers measured what they always did ...
    assert inner("forward-compute").elapsed(reset=False) > 0
    assert inner("interval-time").elapsed(reset=False) > 0
    assert callable(timers.log) and timers.log == inner.log  # the rest is the inner object's
    # ... and ours made the step's windows: one step, two microbatches, four phases.
    names = rec.names.names
    kinds = sorted((names[r[3]], names[r[4]], max(r[6], -1)) for r in rec.drain_records())  # NULL: -1
    assert kinds == [("microbatch", "microbatch", 0), ("microbatch", "microbatch", 1),
                     ("phase", "backward", 0), ("phase", "backward", 1),
                     ("phase", "forward", 0), ("phase", "forward", 1),
                     ("step", "step", -1)]  # fmt: skip
    # A timer above the inner log level is mcore's dummy: still our window, theirs measures nothing.
    quiet = StepTelemetry(None, Placement(), recorder=WindowRecorder())
    t = quiet.timers(inner=timers_mod.Timers(log_level=0, log_option="max"))
    quiet.begin_step(0)
    _microbatches(t, 1)
    quiet.end_step()
    assert quiet.unmatched_marks == 0


def test_the_adapter_asks_the_inner_timers_until_megatron_has_made_the_timer(monkeypatch) -> None:
    # Megatron's Timers gives its dummy for a level above its own until a call at a lower level
    # makes the real timer; from then on it returns that timer for every level, and the adapter
    # keeps it per name. Any other Timers is asked on every call.
    torch = pytest.importorskip("torch")
    timers_mod = pytest.importorskip("megatron.core.timers")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    inner = timers_mod.Timers(log_level=1, log_option="max")
    st = StepTelemetry(None, Placement(), recorder=WindowRecorder())
    timers = st.timers(inner=inner)
    asked: list[tuple[Any, ...]] = []  # the inner Timers' calls, counted
    ask = type(inner).__call__.__get__(inner)
    monkeypatch.setattr(type(inner), "__call__", lambda self, *a, **k: asked.append(a) or ask(*a, **k))
    st.begin_step(0)
    dummy = timers("forward-compute", log_level=2)
    assert dummy._theirs is inner._dummy_timer
    assert timers("forward-compute", log_level=2) is dummy  # their dummy again: kept, not asked
    assert timers("backward-compute", log_level=2)._theirs is inner._dummy_timer
    assert len(asked) == 2
    real = timers("forward-compute", log_level=1)  # not kept for level 1: asked, the real one made
    assert real._theirs is inner._timers["forward-compute"]
    # the kept dummy answer for level 2 is not given once the name has its real timer
    assert timers("forward-compute") is real and timers("forward-compute", log_level=2) is real
    assert len(asked) == 3
    real.start()
    dummy.stop()  # one window: the open state is the name's, whichever wrapper marks it
    st.end_step()
    assert st.unmatched_marks == 0

    asked: list[str] = []

    class Theirs:
        def start(self, barrier: bool = False) -> None: ...
        def stop(self, barrier: bool = False) -> None: ...

    def other_timers(name: str, log_level: int | None = None) -> Theirs:
        asked.append(name)
        return Theirs()

    other = StepTelemetry(None, Placement(), recorder=WindowRecorder()).timers(inner=other_timers)
    for _ in range(3):
        other("forward-compute").start()
    assert asked == ["forward-compute"] * 3


def test_without_windows_the_timers_are_the_frameworks_own_or_none() -> None:
    inner = object()
    off = StepTelemetry(None, Placement())  # no session, no recorder: nothing is recorded
    assert off.timers(inner=inner) is inner and off.timers() is None
    steps_only = StepTelemetry(
        None, Placement(), options=StepOptions(windows=["step"]), recorder=WindowRecorder()
    )
    assert steps_only.timers(inner=inner) is inner


def test_every_step_reaches_the_observers_once_in_order_with_its_figures(tmp_path: Path) -> None:
    cfg = TelemetryConfig(out_dir=str(tmp_path), backend="synthetic", sampler="thread", hz=200.0)
    session = open_session(cfg, Placement(), handle_signals=False)
    seen: list[StepReport] = []
    st = StepTelemetry(
        session,
        Placement(),
        options=StepOptions(num_microbatches=2, total_steps=6),
        rates=RateInputs(TINY, 4, attention_flops="causal", peak_tflops_per_gpu=0.5),
        observers=[FunctionObserver(seen.append), StepsFileObserver(tmp_path / "steps.jsonl")],
    )
    timers = st.timers()
    returned = []
    import time

    for step in range(6):
        st.begin_step(step)
        _microbatches(timers, 2)
        time.sleep(0.02)  # 20 ms steps: reported a few steps late (steps.pending)
        with st.phase("optimizer"):
            pass
        report = st.end_step(loss=2.0 - step * 0.1, num_microbatches=2, grad_norm=math.inf)
        assert report is not None and report.step == step and report.energy_j is None
        returned.append(report)
    assert len(seen) < 6  # some are still waiting for their figures
    st.finish("complete")
    assert session._closed  # the session is closed once its steps are reported
    assert [r.step for r in seen] == list(range(6)) and seen == returned
    for r in seen:
        assert r.loss == pytest.approx(2.0 - r.step * 0.1) and r.grad_norm is None  # inf is no norm
        assert r.energy_j is not None and r.energy_j > 0 and r.ranks_reporting == 1
        assert r.power_peak_w is not None and r.power_avg_w is not None
        assert r.mfu is not None and r.mfu_attention == "causal"
        assert len(r.per_rank) == 1 and r.per_rank[0]["energy_j"] == r.energy_j
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines] == list(range(6))
    assert lines[0]["mfu_attention"] == "causal" and "per_rank" not in lines[0]


def test_a_failing_observer_is_dropped_and_training_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def broken(report: StepReport) -> None:
        calls.append(report.step)
        raise RuntimeError("observer bug")

    good: list[int] = []
    st = StepTelemetry(
        None,
        Placement(),
        observers=[FunctionObserver(broken), FunctionObserver(lambda r: good.append(r.step))],
    )
    for step in range(3):
        st.begin_step(step)
        st.end_step(loss=1.0)
    st.finish()
    assert calls == [0] and good == [0, 1, 2]
    assert "observer FunctionObserver failed" in caplog.text


def test_a_run_that_did_not_complete_reports_nothing_more_and_gathers_nothing() -> None:
    seen: list[int] = []
    closed: list[str] = []
    st = StepTelemetry(
        None, Placement(), observers=[FunctionObserver(lambda r: seen.append(r.step), closed.append)]
    )
    st.begin_step(0)
    st.end_step(loss=1.0)
    exchanged = []
    st._exchange = lambda v: exchanged.append(v) or [v]  # type: ignore[method-assign]
    st.finish("terminated")
    st.finish("complete")  # idempotent
    assert seen == [] and exchanged == [] and closed == ["terminated"]


def _rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One rank of a gloo group: three steps; rank 1 has no telemetry figures and no loss."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    calls = {"all_gather": 0, "other": 0}
    real = dist.all_gather

    def counting(*a: Any, **k: Any) -> Any:
        calls["all_gather"] += 1
        return real(*a, **k)

    dist.all_gather = counting
    for name in ("gather", "all_reduce", "broadcast", "reduce"):
        setattr(dist, name, lambda *a, _n=name, **k: calls.__setitem__("other", calls["other"] + 1))
    try:
        rows: list[dict[str, Any]] = []
        figures = {0: [{"energy_j": 5.0, "power_avg_w": 100.0, "power_peak_w": 150.0, "temp_gpu_peak_c": 60.0,
                        "throttle_any_limiting_s": 0.01}],
                   2: [{"energy_j": 7.0, "power_avg_w": 140.0, "power_peak_w": 210.0, "temp_gpu_peak_c": 65.0,
                        "throttle_any_limiting_s": 0.0}]}  # fmt: skip

        class FakeSession:  # the session surface StepTelemetry uses; rank 1 reports nothing
            hz, counter_every, sampler_mode = 100.0, 1, "process"

            def __init__(self) -> None:
                self.windows = WindowRecorder()
                self.rank = self.local_rank = rank
                self.world_size = world

            def request_figures(self, *a: Any, **k: Any) -> None:
                pass

            def step_figures(self, *a: Any, **k: Any) -> Any:
                return figures.get(rank)

            def close(self, status: str) -> None:
                pass

        st = StepTelemetry(FakeSession(), Placement(rank, rank, world), observers=[FunctionObserver(
            lambda r: rows.append(r.to_dict(per_rank=True)))])  # fmt: skip
        per_step = []
        for step in range(3):
            st.begin_step(step)
            before = calls["all_gather"]
            st.end_step(loss_sum=3.0 * (rank != 1), loss_tokens=2.0 * (rank != 1))
            per_step.append(calls["all_gather"] - before)
        st.finish()
        out = {
            "per_step": per_step,
            "other": calls["other"],
            "rows": rows,
            "loss": st.last.loss if st.last else None,
        }
        Path(out_dir, f"{rank}.json").write_text(json.dumps(out, default=str))
    finally:
        dist.all_gather = real
        dist.destroy_process_group()


def test_one_vector_per_rank_crosses_the_ranks_once_a_step_whatever_the_observers(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    world = 3
    torch.multiprocessing.spawn(
        _rank, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True
    )
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    for r in results:
        assert r["per_step"] == [1, 1, 1] and r["other"] == 0  # one all_gather a step, nothing else
        assert r["loss"] == pytest.approx(1.5)  # (3 + 3) / (2 + 2): every rank knows the loss
    rows = results[0]["rows"]
    assert results[1]["rows"] == [] == results[2]["rows"]  # observers run on rank 0 only
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows:
        assert row["ranks_reporting"] == 2 and row["energy_j"] == 12.0
        assert row["power_avg_w"] == 120.0 and row["power_peak_w"] == 210.0 and row["temp_gpu_peak_c"] == 65.0
        per_rank = row["per_rank"]
        assert [p["energy_j"] for p in per_rank][0::2] == [5.0, 7.0] and math.isnan(per_rank[1]["energy_j"])
