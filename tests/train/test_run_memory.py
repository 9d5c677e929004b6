"""A run of weeks costs the same memory in hour 300 as in minute 5 (issue 48).

``charllm train``'s rank 0 grew by ~1.6 KB a step (every step's report kept for summary.json's
medians) and every rank by ~0.2 KB (every step's loss and times kept in its result). This drives
rank 0 as the trainer builds it (``_step_telemetry``: its observers, summary.json's rows and
steps.jsonl) for 3,000 steps of the step API in-process and counts, with tracemalloc, what
stays allocated between step 1,500 and step 3,000: past the warm-up (the rings of the last
1,000 steps full, the medians' sketch in use) it must not grow with the steps. Counted bytes,
not time or RSS: the machine's load cannot change them. No telemetry session: its buffers hold
the last seconds of samples, which grow with time until full, not with steps (the soak
benchmark, bench/bench_soak.py, watches whole processes for hours). docs/soak.md states the
bound per process; this test holds its first line: what charllm keeps per step.
"""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

from charllm_nemo.steps import quantiles
from charllm_nemo.train.config import TrainConfig
from charllm_nemo.train.dist import DistInfo
from charllm_nemo.train.loop import RankResult, _step_telemetry

STEPS = 3000
FROM_STEP = 1500
BYTES_PER_STEP = 64
"""What may stay allocated per step past the warm-up (B, averaged over 1,500 steps): new buckets
of the medians' sketch as step times reach values not seen before, dict resizes. The old code
kept ~1.6 KB a step on rank 0."""


def test_rank_zero_keeps_no_memory_per_step_after_warm_up(tmp_path: Path) -> None:
    assert quantiles.EXACT_VALUES < FROM_STEP  # the sketch, not the exact values, by then
    cfg = TrainConfig()
    cfg.logger.name = "none"  # no console line a step
    cfg.telemetry.out_dir = str(tmp_path)
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device="cpu", backend="gloo")
    result = RankResult(rank=0, world_size=1, device="cpu")
    bundle = SimpleNamespace(config=SimpleNamespace(), chunks=[object()])
    layout = SimpleNamespace(layers_per_virtual_stage=[cfg.model.num_layers])
    st = _step_telemetry(cfg, dist, layout, None, None, [], bundle, 1, None, result, False)
    assert len(st.observers) == 2  # summary.json's rows, steps.jsonl
    sizes = {}
    tracemalloc.start(1)
    try:
        for step in range(STEPS):
            if step in (FROM_STEP, STEPS - 1):
                gc.collect()
                sizes[step] = tracemalloc.get_traced_memory()[0]
            st.begin_step(step)
            with st.phase("optimizer"):
                pass
            st.end_step(loss=2.0, grad_norm=1.0)
            assert st.last is not None
            result.record(st.last)
    finally:
        tracemalloc.stop()
        st.finish("complete")
    grown = sizes[STEPS - 1] - sizes[FROM_STEP]
    per_step = grown / (STEPS - 1 - FROM_STEP)
    assert per_step < BYTES_PER_STEP, f"{per_step:.0f} B a step stayed allocated after warm-up"
    # what the bound keeps still says what it must: every step counted, the last ones kept
    assert result.steps == STEPS and len(result.losses) == 1000
    summary = result.to_dict()
    assert [r["step"] for r in summary["summaries"]] == list(range(STEPS - 1000, STEPS))
