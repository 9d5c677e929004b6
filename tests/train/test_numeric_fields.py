"""Every numeric field of a training config (telemetry.* aside: telemetry/config.py) refuses
nan, inf, negative numbers and, where it means nothing, zero: a problem naming the field, before
anything starts."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from charllm_nemo.train import app
from charllm_nemo.train.config import TrainConfig
from charllm_nemo.train.validate import ConfigProblems, validate

SECTIONS = ("model", "parallel", "optim", "batch", "data", "launch", "logger")
ZERO_OK = {
    "optim.min_lr",
    "optim.weight_decay",
    "optim.adam_beta1",
    "optim.adam_beta2",
    "optim.clip_grad",
    "optim.warmup_steps",
    "data.seed",
    "logger.artifact_max_mb",
    "logger.table_max_rows",
}


def _numeric_fields() -> list[tuple[str, str, type]]:
    """(section, field, int | float) for every numeric field, found from the dataclasses so that a
    field added later is checked too."""
    out = []
    for section in SECTIONS:
        for f in dataclasses.fields(getattr(TrainConfig(), section)):
            kind = str(f.type).replace(" ", "")
            if kind in ("int", "int|None"):
                out.append((section, f.name, int))
            elif kind in ("float", "float|None"):
                out.append((section, f.name, float))
    return out


FIELDS = _numeric_fields()


def _bad_values(section: str, name: str, kind: type) -> list[Any]:
    bad: list[Any] = [-1 if kind is int else -1.0]
    if f"{section}.{name}" not in ZERO_OK:
        bad.append(0 if kind is int else 0.0)
    if kind is float:
        bad += [math.nan, math.inf, -math.inf]
    return bad


CASES = [(s, n, v) for s, n, k in FIELDS for v in _bad_values(s, n, k)]


def test_the_fields_are_found() -> None:
    names = {f"{s}.{n}" for s, n, _ in FIELDS}
    assert {
        "model.num_layers",
        "optim.lr",
        "batch.train_steps",
        "launch.nproc",
        "logger.finish_timeout_s",
    } <= names
    assert len(FIELDS) >= 35


@pytest.mark.parametrize(("section", "name", "value"), CASES, ids=[f"{s}.{n}={v}" for s, n, v in CASES])
def test_a_meaningless_number_is_a_problem_naming_its_field(section: str, name: str, value: Any) -> None:
    cfg = TrainConfig()
    cfg.telemetry.out_dir = "/tmp/charllm-numeric-fields-never-made"
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigProblems) as exc:
        validate(cfg, device="cpu")
    assert any(
        p.startswith(f"{section}.{name}=") or f" {section}.{name}=" in p for p in exc.value.problems
    ), exc.value.problems


@pytest.mark.parametrize(
    "override", ["optim.lr=nan", "optim.clip_grad=inf", "optim.adam_beta2=1.0", "logger.finish_timeout_s=inf"]
)
def test_charllm_train_says_which_field_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str
) -> None:
    out = tmp_path / "run"
    assert app.main([override, f"telemetry.out_dir={out}"]) == app.EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert f"{override.split('=')[0]}=" in err and "Traceback" not in err
    assert not out.exists()
