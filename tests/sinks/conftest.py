"""Fixtures for the sinks: a W&B environment that is offline, keyless and inside a temporary
folder, so that no test can reach W&B or write to the home directory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def wandb_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Offline W&B with no credentials; every wandb folder (staging, cache, settings) under a
    temporary folder; quiet. Set in os.environ for the session (spawned ranks inherit it) and
    returned."""
    home = tmp_path_factory.mktemp("wandb-home")
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_ARTIFACT_DIR": str(home / "artifacts"),
        "NETRC": str(home / "no-netrc"),
    }
    mp = pytest.MonkeyPatch()
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_DIR", "WANDB_RUN_ID"):
        mp.delenv(var, raising=False)
    for k, v in env.items():
        mp.setenv(k, v)
    yield env
    mp.undo()
