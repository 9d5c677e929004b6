"""scripts/train_random_configs.py: random configs that validation accepts, trained for real."""

from __future__ import annotations

import random
from pathlib import Path
from types import ModuleType

import pytest

from tests.load_script import load_script


def _script() -> ModuleType:
    return load_script("scripts/train_random_configs.py")


def test_drawn_configs_are_those_validation_accepts_for_their_world() -> None:
    from charllm_nemo.train import app
    from charllm_nemo.train.validate import validate

    script = _script()
    rng = random.Random(3)
    for _ in range(5):
        overrides, world = script.accepted(rng, max_ranks=4)
        assert f"nproc={world}" in overrides
        validate(app.load(overrides), world_size=world, device="cpu")  # raises if not


def test_one_random_config_trains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("megatron.core")
    rc = _script().main(["--runs", "1", "--seed", "0", "--max-ranks", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "1 of 1 accepted configs trained" in out
    assert (tmp_path / "0" / "summary.json").exists()
