"""WandbSink end to end, offline: a two-rank run directory from real (synthetic-backend)
telemetry sessions, per-step figures logged through rank 0's sink, and the .wandb file read
back record by record (tests/sinks/wandb_reader.py): every key at every step, with the values
the run directory gives; the config without secrets; the windows table; the artifact."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from charllm_nemo.redact import REDACTED
from charllm_nemo.sinks.config import LoggerConfig, build_sink
from charllm_nemo.sinks.keys import (
    STEP_FIGURE_COLUMNS,
    STEP_FIGURE_KEYS,
    STEP_KEY,
    pack_step_figures,
    step_metrics,
    unpack_gathered,
)
from charllm_nemo.sinks.wandb import telemetry_files
from charllm_nemo.sinks.windows_table import windows_table_rows
from charllm_nemo.telemetry.join import attribute_run
from charllm_nemo.telemetry.reader import load_run
from charllm_nemo.telemetry.session import TelemetrySession
from charllm_nemo.telemetry.session_options import Placement, SessionOptions

from .wandb_reader import find_wandb_file, read_run

wandb = pytest.importorskip("wandb")

STEPS = 3
FAST = {"x_disable_stats": True, "console": "off", "x_disable_machine_info": True, "disable_git": True}
SECRETS = ("sk-live-0123456789", "hf_abcdefghijklmnop", "pw-hunter2", "wandb-key-777")


def _config(run_dir: Path) -> dict[str, Any]:
    return {
        "model": {"name": "tiny_gpt", "num_layers": 2},
        "parallel": {"name": "dp2", "tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": None},
        "optim": {"name": "base"},
        "batch": {"precision": "fp32", "global_batch_size": 4},
        "telemetry": {"out_dir": str(run_dir), "backend": "synthetic"},
        "extra": {
            "api_key": SECRETS[0],
            "hub": {"hf_token": SECRETS[1], "users": [{"name": "a", "password": SECRETS[2]}]},
            "tokens_per_sample": 64,  # a "token" word in a number's name: not a secret
            "big": "x" * 70_000,  # a record over two 32 KiB blocks: FIRST / MIDDLE / LAST
        },
    }


def _two_rank_run(run_dir: Path, config: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Two synthetic ranks marking the same 3 steps (2 microbatches of forward + backward, then
    optimizer); returns rank 0's view of each step (what the loop would log) and rank 0's
    manifest."""
    sessions = [
        TelemetrySession(
            run_dir,
            SessionOptions(backend="synthetic", hz=250, backend_options={"activity": 0.9 if r == 0 else 0.3}),
            placement=Placement(rank=r, world_size=2),
            config=config,
            handle_signals=False,
        ).start()
        for r in range(2)
    ]
    steps = []
    try:
        time.sleep(0.03)
        for step in range(STEPS):
            t = [time.monotonic_ns()]
            for _ in range(4):
                time.sleep(0.008)
                t.append(time.monotonic_ns())
            time.sleep(0.006)
            t_end = time.monotonic_ns()
            for s in sessions:
                w = s.windows
                w.record("step", "step", t[0], t_end, step=step)
                for mb in range(2):
                    a, b, c = t[2 * mb], t[2 * mb + 1], t[2 * mb + 2]
                    w.record("microbatch", "microbatch", a, c, step=step, microbatch=mb)
                    w.record("phase", "forward", a, b, step=step, microbatch=mb)
                    w.record("phase", "backward", b, c, step=step, microbatch=mb)
                w.record("phase", "optimizer", t[4], t_end, step=step)
            # every rank: its figures of the step -> one vector; rank 0 gets both (the gather)
            gathered = [pack_step_figures(s.step_figures(t[0], t_end, wait_s=1.0)) for s in sessions]
            summary = {"loss": 7.0 - step, "step_time_s": (t_end - t[0]) / 1e9, "tokens_per_s": 1000.0 + step}
            steps.append(
                {
                    "expected": step_metrics(step, summary=summary, per_rank=unpack_gathered(gathered)),
                    "summary": summary,
                    "gathered": gathered,
                }
            )
    finally:
        for s in sessions:
            s.close()
    manifest = json.loads((run_dir / "rank=0" / "manifest.json").read_text())
    manifest["env"] = {"WANDB_API_KEY": SECRETS[3], "SLURM_JOB_ID": "42"}
    manifest["argv"] = ["charllm", "train", "--api-key", SECRETS[3], f"token={SECRETS[1]}"]
    return steps, manifest


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory: pytest.TempPathFactory, wandb_env: dict[str, str]) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("wandb")
    env = wandb_env
    run_dir = tmp / "runs" / "sweep-demo" / "0"
    run_dir.mkdir(parents=True)
    config = _config(run_dir)
    steps, manifest = _two_rank_run(run_dir, config)
    cfg = LoggerConfig(name="wandb", project="charllm-test", tags=["ci"], settings=FAST)
    t0 = time.perf_counter()
    sink = build_sink(cfg, rank=0, run_dir=run_dir, env=env)
    assert sink is not None
    sink.start(config, manifest)
    for step, sent in enumerate(steps):
        # what the loop does on rank 0: the raw numbers; keys are built on the sink thread
        sink.log_figures(step, sent["summary"], sent["gathered"])
    sink.finish(run_dir, timeout_s=30)
    wall = time.perf_counter() - t0
    assert sink.report.finished, sink.report.line()
    path = find_wandb_file(run_dir / "wandb")
    return {
        "run_dir": run_dir,
        "steps": steps,
        "run": read_run(path, wait_s=10),
        "path": path,
        "wall_s": wall,
        "report": sink.report,
    }


def test_the_run_is_offline_complete_and_grouped_by_the_sweep(offline_run):
    run = offline_run["run"]
    assert offline_run["path"].parent.name.startswith("offline-run-")
    assert run.exited
    assert run.project == "charllm-test"
    assert run.group == "sweep-demo"
    assert {
        "ci",
        "tp1-pp1-dp2",
        "model:tiny_gpt",
        "optim:base",
        "backend:synthetic",
        "synthetic",
        "sweep:sweep-demo",
    } <= set(run.tags)
    r = offline_run["report"]
    assert (r.dropped, r.errors) == (0, 0)
    assert offline_run["wall_s"] < 10


def test_every_rank_key_at_every_step_equals_the_run_directory(offline_run):
    run_dir = offline_run["run_dir"]
    history = [h for h in offline_run["run"].history if STEP_KEY in h and "rank/0/energy_j" in h]
    assert [h[STEP_KEY] for h in history] == list(range(STEPS))
    table = attribute_run(load_run(run_dir), ("step",))
    cols = table.to_pydict()
    stored = {(cols["rank"][i], cols["step"][i]): i for i in range(table.num_rows)}
    for h in history:
        for rank in (0, 1):
            i = stored[(rank, h[STEP_KEY])]
            for name in STEP_FIGURE_KEYS:
                want = cols[STEP_FIGURE_COLUMNS[name]][i]
                key = f"rank/{rank}/{name}"
                if name == "energy_bound_j":
                    # A live bound comes from another slice of samples and may lack the
                    # counter's envelope (its tick after the step comes later), so it need not
                    # equal the stored one (docs/attribution.md); both bound the same truth, so
                    # the two energies lie within the sum of the two bounds.
                    live, e_live = h.get(key), h.get(f"rank/{rank}/energy_j")
                    e_stored = cols[STEP_FIGURE_COLUMNS["energy_j"]][i]
                    if live is not None and want is not None and not math.isnan(want):
                        assert live >= 0 and abs(e_live - e_stored) <= live + want + 1e-9, key
                    continue
                if want is None or (isinstance(want, float) and math.isnan(want)):
                    assert key not in h  # unknown: omitted, not 0
                else:
                    # Energy (and power = energy / duration): the live figures
                    # (TelemetrySession.step_figures, over the samples in memory) and the stored
                    # run's attribution differ by up to ~3e-5 relative: the energy counter's first
                    # sample in the live slice does not count as a tick. Every other figure is equal.
                    rel = 1e-3 if name in ("energy_j", "power_avg_w") else 1e-9
                    assert h[key] == pytest.approx(want, rel=rel, abs=1e-12), key
        # the synthetic devices report power, energy, temperatures, clocks and PCIe
        for rank in (0, 1):
            for name in (
                "energy_j",
                "power_avg_w",
                "power_peak_w",
                "temp_gpu_peak_c",
                "clock_sm_avg_mhz",
                "throttle_any_limiting_s",
                "pcie_tx_bytes",
            ):
                assert f"rank/{rank}/{name}" in h
        # rank 0 ran at 0.9 activity, rank 1 at 0.3
        assert h["rank/0/power_avg_w"] > h["rank/1/power_avg_w"]


def test_the_aggregates_and_throughput_match_what_was_logged(offline_run):
    history = [h for h in offline_run["run"].history if "all/energy_j" in h]
    assert len(history) == STEPS
    for h, sent in zip(history, offline_run["steps"], strict=True):
        assert h["all/ranks_reporting"] == 2
        assert h["all/energy_j"] == pytest.approx(h["rank/0/energy_j"] + h["rank/1/energy_j"])
        p0, p1 = h["rank/0/power_avg_w"], h["rank/1/power_avg_w"]
        assert h["all/power_mean_w"] == pytest.approx((p0 + p1) / 2)
        assert (h["all/power_max_w"], h["all/power_min_w"]) == (pytest.approx(p0), pytest.approx(p1))
        t0, t1 = h["rank/0/temp_gpu_peak_c"], h["rank/1/temp_gpu_peak_c"]
        assert h["all/temp_max_c"] == pytest.approx(max(t0, t1))
        assert h["all/temp_spread_c"] == pytest.approx(abs(t0 - t1))
        assert "all/ranks_throttled" in h
        assert h["train/loss"] == 7.0 - h[STEP_KEY]
        assert h["perf/tokens_per_s"] == 1000.0 + h[STEP_KEY]
        for k, v in sent["expected"].items():  # every key arrived, unchanged
            assert h[k] == pytest.approx(v, rel=1e-12), k


def test_the_step_axis_is_defined_for_every_key(offline_run):
    metrics = offline_run["run"].metrics
    assert any(m.name == STEP_KEY for m in metrics)
    assert any(m.glob_name == "*" and m.step_metric == STEP_KEY for m in metrics)


def test_the_config_has_the_training_config_and_manifest_but_no_secrets(offline_run):
    cfg = offline_run["run"].config
    assert cfg["model"]["name"] == "tiny_gpt"
    assert cfg["parallel"]["name"] == "dp2"
    assert cfg["manifest"]["backend"] == "synthetic"
    assert cfg["manifest"]["world_size"] == 2
    assert cfg["manifest"]["versions"]["wandb"] == wandb.__version__
    assert "config" not in cfg["manifest"]  # the config is at the top, not twice
    assert cfg["extra"]["api_key"] == REDACTED
    assert cfg["extra"]["hub"]["hf_token"] == REDACTED
    assert cfg["extra"]["hub"]["users"][0] == {"name": "a", "password": REDACTED}
    assert cfg["extra"]["tokens_per_sample"] == 64
    assert len(cfg["extra"]["big"]) == 70_000  # read back across blocks
    assert cfg["manifest"]["env"] == {"WANDB_API_KEY": REDACTED, "SLURM_JOB_ID": "42"}
    assert cfg["manifest"]["argv"] == ["charllm", "train", "--api-key", REDACTED, f"token={REDACTED}"]
    raw = offline_run["path"].read_bytes()
    for secret in SECRETS:
        assert secret.encode() not in raw


def test_the_windows_table_is_logged_with_every_microbatch_and_phase(offline_run):
    run, run_dir = offline_run["run"], offline_run["run_dir"]
    rows, total = windows_table_rows(run_dir)
    assert total == 2 * STEPS * (2 + 4 + 1)  # ranks x steps x (microbatches + fwd/bwd + optimizer)
    logged = [h for h in run.history if "telemetry/windows/_type" in h]
    assert len(logged) == 1 and logged[0]["telemetry/windows/_type"] == "table-file"
    assert logged[0]["telemetry/windows/nrows"] == total
    table_file = next(Path(run_dir / "wandb").rglob("telemetry/windows_*.table.json"))
    data = json.loads(table_file.read_text())
    assert data["columns"][:5] == ["rank", "step", "microbatch", "kind", "name"]
    assert len(data["data"]) == total
    first = dict(zip(data["columns"], data["data"][0], strict=True))
    assert first["rank"] == 0 and first["step"] == 0 and first["kind"] == "microbatch"
    assert first["energy_j"] == pytest.approx(rows[0]["energy_j"])
    assert any(a.type == "run_table" for a in run.artifacts)


def test_the_run_directory_is_an_artifact_without_wandb_own_folder(offline_run):
    run, run_dir = offline_run["run"], offline_run["run_dir"]
    arts = [a for a in run.artifacts if a.type == "telemetry"]
    assert len(arts) == 1
    art = arts[0]
    assert art.name == f"telemetry-{run.run_id}"
    paths = sorted(c.path for c in art.manifest.contents)
    assert paths == sorted(f.relative_to(run_dir).as_posix() for f in telemetry_files(run_dir))
    assert "rank=0/manifest.json" in paths and "rank=1/manifest.json" in paths
    assert any(p.startswith("rank=1/samples-") for p in paths)
    assert not any(p.startswith("wandb/") for p in paths)


def test_a_bounded_table_reads_only_the_ranks_it_needs_and_still_counts_all(offline_run):
    run_dir = offline_run["run_dir"]
    all_rows, total = windows_table_rows(run_dir, max_rows=None)
    assert total == len(all_rows) == 2 * STEPS * 7
    rows, counted = windows_table_rows(run_dir, max_rows=5)
    assert counted == total  # rank 1 counted from its windows, not attributed
    assert rows == all_rows[:5] and {r["rank"] for r in rows} == {0}
    # within a rank: by step, then begin time, a microbatch before its phases
    first_step = [(r["kind"], r["name"]) for r in all_rows[:7]]
    assert first_step == [
        ("microbatch", "microbatch"),
        ("phase", "forward"),
        ("phase", "backward"),
        ("microbatch", "microbatch"),
        ("phase", "forward"),
        ("phase", "backward"),
        ("phase", "optimizer"),
    ]
