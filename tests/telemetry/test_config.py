"""The telemetry configuration: validation that names the field, placement, open_session."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.config import (
    Placement,
    TelemetryConfig,
    open_session,
    telemetry_problems,
    validate_telemetry,
)


def _ok(tmp_path) -> TelemetryConfig:
    return TelemetryConfig(out_dir=str(tmp_path / "run"))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hz", math.nan),
        ("hz", math.inf),
        ("hz", 0.0),
        ("hz", -5.0),
        ("counter_hz", math.nan),
        ("counter_hz", math.inf),  # accepted before: read the counters with every sample silently
        ("counter_hz", 0.0),
        ("counter_hz", -1.0),
        ("driver_buffers", "yes"),
        ("cpu_peak_tflops", math.nan),  # accepted before: MFU nan on every step
        ("cpu_peak_tflops", math.inf),  # accepted before: MFU 0 on every step
        ("cpu_peak_tflops", 0.0),
        ("cpu_peak_tflops", -2.0),
        ("nice", -1),
        ("nice", 20),
        ("nice", 1.5),
        ("attention_flops", "half"),
        ("backend", "gpu"),
        ("sampler", "fork"),
        ("collector_sched", "fifo"),
        ("windows", ["step", "layer"]),
        ("windows", "step"),
        ("out_dir", "  "),
    ],
)
def test_every_field_rejects_what_makes_no_sense_naming_it(tmp_path, field: str, value: object) -> None:
    cfg = replace(_ok(tmp_path), **{field: value})
    problems = telemetry_problems(cfg)
    assert len(problems) == 1 and f"telemetry.{field}" in problems[0], problems
    with pytest.raises(ConfigError, match=f"telemetry\\.{field}"):
        validate_telemetry(cfg)


def test_the_defaults_and_the_edges_of_the_ranges_are_valid(tmp_path) -> None:
    validate_telemetry(replace(_ok(tmp_path), enabled=False, hz=math.nan, counter_hz=-1.0))  # no sampler
    validate_telemetry(_ok(tmp_path))
    validate_telemetry(replace(_ok(tmp_path), hz=1000.0, counter_hz=None, nice=19, cpu_peak_tflops=0.5))
    validate_telemetry(replace(_ok(tmp_path), hz=1.0, windows=[], attention_flops="causal"))


def test_train_validation_reports_the_telemetry_problems_too(tmp_path) -> None:
    from charllm_nemo.train.config import TrainConfig
    from charllm_nemo.train.validate import ConfigProblems, validate

    cfg = TrainConfig()
    cfg.telemetry = replace(_ok(tmp_path), cpu_peak_tflops=math.nan, counter_hz=math.inf)
    with pytest.raises(ConfigProblems) as err:
        validate(cfg, world_size=1, device="cpu")
    text = str(err.value)
    assert "telemetry.cpu_peak_tflops=nan" in text and "telemetry.counter_hz=inf" in text


def test_a_placement_comes_from_torchrun_or_srun_or_defaults_to_one_process() -> None:
    torchrun = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert Placement.from_env(torchrun) == Placement(5, 1, 8, 4)
    srun = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2(x2)"}
    assert Placement.from_env(srun) == Placement(3, 1, 4, 2)
    assert Placement.from_env({}, tp_rank=0) == Placement(0, 0, 1, 1, {"tp_rank": 0})
    with pytest.raises(ConfigError, match=r"RANK='x'"):
        Placement.from_env({"RANK": "x"})
    with pytest.raises(ConfigError, match=r"placement\.rank=8 is not below placement\.world_size=8"):
        Placement(8, 0, 8)
    with pytest.raises(ConfigError, match=r"placement\.world_size=0"):
        Placement(0, 0, 0)


def test_open_session_starts_a_rank_session_with_its_placement_and_labels(tmp_path) -> None:
    from charllm_nemo.telemetry.reader import load_run

    cfg = replace(_ok(tmp_path), backend="synthetic", sampler="thread", hz=50.0)
    placement = Placement(0, 0, 1, 1, {"tp_rank": 0, "pp_stage": 0, "not_a_label": 3})
    session = open_session(cfg, placement, run_config={"model": "tiny"}, handle_signals=False)
    try:
        assert session.rank == 0 and session.hz == 50.0 and session.sampler_mode == "thread"
        session.windows.end(session.windows.begin("step", step=0))
    finally:
        session.close("complete")
    run = load_run(cfg.out_dir)
    assert run.manifests[0]["config"] == {"model": "tiny"}
    (window,) = run.windows.to_pylist()
    assert (window["tp_rank"], window["pp_stage"]) == (0, 0)
    with pytest.raises(ConfigError, match=r"telemetry\.hz"):
        open_session(replace(cfg, hz=math.nan), placement)
    with pytest.raises(ConfigError, match=r"telemetry\.enabled=false"):
        open_session(replace(cfg, enabled=False), placement)


def _megatron_rank(rank: int, init_file: str, out_dir: str) -> None:
    import json
    import os

    import torch
    from megatron.core import parallel_state as ps

    os.environ.pop("RANK", None)  # the placement comes from torch.distributed and parallel_state
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        assert Placement.from_megatron().labels == {}  # before the model-parallel groups: no labels
        ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
        p = Placement.from_megatron()
        with open(f"{out_dir}/{rank}.json", "w") as f:
            json.dump([p.rank, p.world_size, p.labels], f)
    finally:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def test_a_megatron_placement_carries_the_ranks_parallel_coordinates(tmp_path) -> None:
    import json

    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    torch.multiprocessing.spawn(
        _megatron_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True
    )
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    labels = {"pp_stage": 0, "dp_rank": 0, "ep_rank": 0, "cp_rank": 0}
    assert got == [[0, 2, {**labels, "tp_rank": 0}], [1, 2, {**labels, "tp_rank": 1}]]


def test_the_telemetry_yaml_files_hold_the_dataclass_defaults() -> None:
    # one declaration of each default (TelemetryConfig): telemetry=default lists them for Hydra's
    # overrides and must agree; off / synthetic inherit it and change one key each
    import os
    from dataclasses import asdict

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from charllm_nemo.telemetry.config import TelemetryConfig

    conf = os.path.join(os.path.dirname(__file__), "..", "..", "conf")
    declared = asdict(TelemetryConfig())
    with initialize_config_dir(config_dir=os.path.abspath(conf), version_base=None):
        for option, changed in (
            ("default", {}),
            ("off", {"enabled": False}),
            ("synthetic", {"backend": "synthetic"}),
        ):
            got = OmegaConf.to_container(compose("train", overrides=[f"telemetry={option}"]).telemetry)
            assert isinstance(got, dict)
            got.pop("out_dir")  # the run id, resolved at launch
            want = {k: v for k, v in {**declared, **changed}.items() if k != "out_dir"}
            assert got == want, option
