"""Stragglers and throttle cost in pipelines (issue #32): ranks are compared with the ranks doing
the same work (their stage); a rank alone in its stage straggles only on evidence beyond timing;
a throttle's cost is measured against a baseline that exists, and says which."""

from __future__ import annotations

import pytest

from charllm_nemo.alerts import AlertDetector, AlertsConfig, StageLayout
from charllm_nemo.errors import ConfigError
from tests.alerts.test_detect import _report

INFOS = [
    {"rank": r, "local_rank": r, "host": "node017", "gpu_index": r, "gpu_uuid": f"GPU-{r}",
     "gpu_name": "H200"}
    for r in range(4)
]  # fmt: skip
CFG = AlertsConfig(warmup_steps=1, straggler_steps=3)

# (step_s, fwd, bwd, opt, temp, power, clock, thermal_s, cap_s, pp_wait): a 0.1 s pipeline step
HEAVY = (0.1, 0.03, 0.05, 0.01, 60.0, 650.0, 1920.0, 0.0, 0.06, 0.01)  # 3 layers: busy 90 ms
LIGHT = (0.1, 0.012, 0.02, 0.004, 55.0, 450.0, 1960.0, 0.0, 0.02, 0.06)  # 1 layer + logits: waits 60 ms
HOT_HEAVY = (0.1, 0.037, 0.062, 0.012, 92.0, 520.0, 1536.0, 0.1, 0.05, 0.002)  # sw_thermal all the step
HOT_LIGHT = (0.1, 0.015, 0.025, 0.005, 92.0, 380.0, 1568.0, 0.1, 0.0, 0.05)
CAPPED_HEAVY = (0.1, 0.037, 0.062, 0.012, 65.0, 400.0, 1540.0, 0.0, 0.1, 0.002)  # a low power limit


def _detector(stages=None, n=2, cfg=CFG):
    det = AlertDetector(cfg, stages=stages)
    det.set_rank_info(INFOS[:n])
    return det


def _alerts(det, steps, kind=None):
    out = []
    for step, ranks in enumerate(steps):
        out += det.check(_report(step, ranks))
    return [a for a in out if a["kind"] == kind or (kind is None and a["kind"] != "thermal_imbalance")]


@pytest.mark.parametrize("stages", [StageLayout((0, 1), (3.0, 2.1)), StageLayout((0, 1)), None])
def test_a_stage_heavier_by_design_is_no_straggler(stages):
    # Stage 0 computes 2.5x stage 1 every step, as its layout says; without the layout too
    # (stages unknown: the ranks' pipeline waits say it is a pipeline).
    assert _alerts(_detector(stages), [[HEAVY, LIGHT]] * 30) == []


def test_a_hot_device_on_the_busy_stage_is_named_with_stage_reason_and_loss():
    det = _detector(StageLayout((0, 1), (3.0, 2.1)))
    alerts = _alerts(det, [[HEAVY, LIGHT]] * 3 + [[HOT_HEAVY, LIGHT]] * 4, "straggler")
    assert len(alerts) == 1
    s = alerts[0]
    assert (s["rank"], s["pp_stage"], s["step"], s["host"]) == (0, 0, 5, "node017")  # 3 steps from step 3
    assert s["compared_with"] == "unthrottled_clock" and s["lost_to"] == "sw_thermal"
    assert s["baseline_clock_mhz"] == 1960.0  # the unthrottled rank's clock this step
    assert s["lost_s"] == pytest.approx(0.111 * (1 - 1536 / 1960))
    assert s["excess"] == pytest.approx(1960 / 1536 - 1)
    assert s["pp_wait_s"] == 0.002 and s["peers_pp_wait_s"] == 0.06
    # per unit of its stage's work, against the other stage's
    assert s["excess_vs_work"] == pytest.approx((0.111 / (3 / 5.1)) / (0.036 / (2.1 / 5.1)) - 1)
    assert s["message"].startswith(
        "rank 0 (node017, GPU 0 GPU-0, stage 0 of 2) straggles at step 5: busy 0.1110 s"
    )
    assert "lost 24 ms to sw_thermal (100% of the step; clock 1536 MHz vs 1960 MHz" in s["message"]


def test_a_throttled_stage_the_others_do_not_wait_for_is_throttled_not_straggling():
    det = _detector(StageLayout((0, 1), (3.0, 2.1)))
    alerts = _alerts(det, [[HEAVY, HOT_LIGHT]] * 8)
    assert [a["kind"] for a in alerts] == ["throttle_onset"]  # and no straggler
    assert alerts[0]["rank"] == 1 and alerts[0]["pp_stage"] == 1


def test_a_low_power_limit_straggles_on_the_power_cap_without_a_throttle_alert():
    det = _detector(StageLayout((0, 1)))
    alerts = _alerts(det, [[CAPPED_HEAVY, LIGHT]] * 5)
    assert [a["kind"] for a in alerts] == ["straggler"]  # sw_power_cap alerts no throttle by default
    assert alerts[0]["lost_to"] == "sw_power_cap" and "to sw_power_cap" in alerts[0]["message"]


def test_throttled_from_the_first_step_its_cost_is_against_the_unthrottled_clock():
    det = _detector(StageLayout((0, 1)))
    (a,) = _alerts(det, [[HOT_HEAVY, LIGHT]] * 3, "throttle_onset")
    assert a["step"] == 0 and a["rank"] == 0
    assert a["baseline"] == "unthrottled_clock" and a["cost_vs_own"] is None  # it has no own steps
    assert a["cost"] == pytest.approx(1960 / 1536 - 1) and a["lost_s"] == pytest.approx(
        0.111 * (1 - 1536 / 1960)
    )
    assert a["fastest_rank"] is None  # no rank does its work: no "fastest rank" of another stage
    assert "+28% (24 ms lost) against the unthrottled clock (its 1536 MHz vs 1960 MHz" in a["message"]
    # every rank throttled: the last step that had an unthrottled rank gives the clock
    det = _detector(StageLayout((0, 1)))
    both = [[HEAVY, LIGHT], [HEAVY, LIGHT], [HOT_HEAVY, HOT_LIGHT]]
    onsets = _alerts(det, both, "throttle_onset")
    assert [o["rank"] for o in onsets] == [0, 1] and onsets[0]["baseline"] == "unthrottled_clock"
    assert "the unthrottled ranks' median clock at step 1" in onsets[0]["message"]
    # nothing to compare with at all: said, no number made up
    det = _detector(StageLayout((0, 1)))
    o = _alerts(det, [[HOT_HEAVY, HOT_LIGHT]], "throttle_onset")[0]
    assert o["baseline"] is None and o["cost"] is None and "no unthrottled baseline yet" in o["message"]


def test_a_throttled_rank_with_unthrottled_steps_of_its_own_after_the_warm_up():
    det = _detector(StageLayout((0, 1)))
    (a,) = _alerts(det, [[HEAVY, LIGHT]] * 4 + [[HOT_HEAVY, LIGHT]], "throttle_onset")
    assert a["baseline"] == "own_unthrottled_steps" and a["baseline_s"] == pytest.approx(0.09)
    assert a["cost"] == pytest.approx(0.111 / 0.09 - 1)  # steps 1-3: the warm-up step 0 is left out


def test_with_replicas_of_a_stage_its_ranks_are_each_others_peers():
    # pp2 x dp2: ranks 0, 1 in stage 0 (heavy by design), ranks 2, 3 in stage 1
    det = _detector(StageLayout.megatron(4, 2, [3, 1], logits_layers=1.1), n=4)
    assert det.stages is not None and det.stages.stage_of_rank == (0, 0, 1, 1)
    assert _alerts(det, [[HEAVY, HEAVY, LIGHT, LIGHT]] * 10) == []
    # +30 % and its peer waits for it, with no telemetry why and no host reading: held, not
    # blamed on its device (issue #41: clocks, temperatures and throttle alike are not the device)
    slow_light = (0.1, 0.016, 0.026, 0.005, 45.0, 450.0, 1960.0, 0.0, 0.02, 0.05)
    assert _alerts(det, [[HEAVY, HEAVY, LIGHT, slow_light]] * 4, "straggler") == []
    assert det.held == 1 and det.held_last.startswith("rank 3 held its peers at step 3")
    # with its device's evidence (sw_thermal, a lower clock) it is the straggler, against its stage
    hot_light = (0.1, 0.016, 0.026, 0.005, 92.0, 380.0, 1500.0, 0.1, 0.0, 0.05)
    alerts = _alerts(det, [[HEAVY, HEAVY, LIGHT, hot_light]] * 4, "straggler")
    assert len(alerts) == 1 and alerts[0]["rank"] == 3 and alerts[0]["compared_with"] == "same_stage_peers"
    assert alerts[0]["peers"] == [2] and "over its stage's peers' median" in alerts[0]["message"]
    det = _detector(StageLayout.megatron(4, 2, [3, 1]), n=4)
    (a,) = _alerts(det, [[HEAVY, HOT_HEAVY, LIGHT, LIGHT]], "throttle_onset")
    assert a["baseline"] == "same_stage_peers" and a["fastest_rank"] == 0
    assert a["cost"] == pytest.approx(0.111 / 0.09 - 1)


def test_the_stage_layout():
    lay = StageLayout.megatron(8, 4, [2, 2, 2, 1], logits_layers=1.5)
    assert lay.stage_of_rank == (0, 0, 1, 1, 2, 2, 3, 3) and lay.stages == 4
    assert lay.work == (2.0, 2.0, 2.0, 2.5) and lay.work_share(3) == pytest.approx(2.5 / 8.5)
    assert StageLayout.megatron(2, 2).work is None and StageLayout((0, 1)).work_share(0) is None
    with pytest.raises(ConfigError, match=r"parallel\.pp=3"):
        StageLayout.megatron(4, 3)
    with pytest.raises(ConfigError, match="one positive number per stage"):
        StageLayout((0, 1), (1.0,))


def test_the_ranks_facts_may_carry_their_stage():
    det = AlertDetector(CFG)  # no layout given: each rank's facts say its stage
    det.set_rank_info([{**INFOS[r], "pp_stage": r // 2} for r in range(4)])
    assert _alerts(det, [[HEAVY, HEAVY, LIGHT, LIGHT]] * 10) == []
    (a,) = _alerts(det, [[HEAVY, HOT_HEAVY, LIGHT, LIGHT]], "throttle_onset")
    assert a["pp_stage"] == 0 and a["baseline"] == "same_stage_peers" and "stage 0 of 2" in a["message"]
