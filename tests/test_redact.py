"""Secrets kept out of every file written and uploaded: which names and values are secrets,
and which ordinary names that contain "token" are not."""

from __future__ import annotations

import pytest

from charllm_nemo.redact import REDACTED, is_secret_key, redact_secrets


@pytest.mark.parametrize(
    "key",
    [
        "api_key",
        "WANDB_API_KEY",
        "apiKey",
        "hf_token",
        "HF_TOKEN",
        "token",
        "client_secret",
        "password",
        "db-passwd",
        "private_key",
        "aws_secret_access_key",
        "AccessKey",
        "Authorization",
        "auth",
        "secrets",
        # issue 33: names a list missed
        "wandb_key",
        "openai_key",
        "hf_key",
        "key",
        "db_pass",
        "DB_PASS",
        "oauth_token",
        "authToken",
        "aws_credentials",
        "session_cookie",
        "apikey",
    ],
)
def test_secret_keys_are_recognised(key):
    assert is_secret_key(key)


@pytest.mark.parametrize(
    "key",
    [
        "tokens_per_s",
        "num_tokens",
        "tokenizer",
        "loss_tokens",
        "author",
        "keyboard",
        "seq_length",
        "monkey",
        "passes",
        "api_version",
        "run_key",
        "sort_keys",
        "key_value_channels",
        "key_prefix",  # the integrations' prefix of metric keys (#40: the manifest redacted it)
        "moe_token_dispatcher_type",
        "tokenizer_type",
        "vocab_size",
        "num_passes",
        "authors",
    ],
)
def test_ordinary_keys_are_kept(key):
    assert not is_secret_key(key)


def test_redaction_reaches_nested_values_strings_and_argv_without_touching_the_rest():
    cfg = {
        "model": {"name": "m", "tokens_per_s": 5},
        "wandb": {"api_key": "abc", "nested": [{"token": {"deep": "x"}}, ("password", "kept-as-item")]},
        "env": {"WANDB_API_KEY": "k1", "PATH": "/usr/bin"},
        "argv": ["train", "--api-key", "k2", "--wandb-token=k3", "HF_TOKEN=k4", "lr=0.1", "--steps", "5"],
        "url": "https://user:k5@example.com/path",
        "n": 3,
        "none": None,
    }
    out = redact_secrets(cfg)
    assert out["model"] == {"name": "m", "tokens_per_s": 5}
    assert out["wandb"]["api_key"] == REDACTED
    assert out["wandb"]["nested"][0] == {"token": REDACTED}
    assert out["wandb"]["nested"][1] == ("password", "kept-as-item")  # a value, not a key
    assert out["env"] == {"WANDB_API_KEY": REDACTED, "PATH": "/usr/bin"}
    assert out["argv"] == [
        "train",
        "--api-key",
        REDACTED,
        f"--wandb-token={REDACTED}",
        f"HF_TOKEN={REDACTED}",
        "lr=0.1",
        "--steps",
        "5",
    ]
    assert out["url"] == f"https://{REDACTED}@example.com/path"
    assert (out["n"], out["none"]) == (3, None)
    assert cfg["wandb"]["api_key"] == "abc"  # a copy: the input is unchanged
    for secret in ("abc", "k1", "k2", "k3", "k4", "k5"):
        assert secret not in repr(out)


def test_redaction_is_linear_on_long_strings():
    """Ten times the input costs about ten times as long (a quadratic pattern would cost 100x):
    a ratio of the best of three runs each, so a loaded machine does not decide the verdict."""
    import time

    def cost(n: int) -> float:
        data = {"a": "x" * n, "b": "y:" * (n // 4), "c": "http://" + "z" * (n // 2) + "@", "d": "a1" * n}
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            redact_secrets(data)
            best = min(best, time.perf_counter() - t0)
        return best

    assert cost(200_000) / max(cost(20_000), 1e-6) < 40


@pytest.mark.parametrize(
    "key",
    [
        "moe_token_dispatcher_type",
        "moe_token_dispatcher",
        "moe_token_drop_policy",
        "token_ids",
        "pad_token",
        "eos_token",
        "max_token",
        "num_token",
        "tokens",
        "image_token",
    ],
)
def test_names_that_merely_contain_token_are_kept(key: str) -> None:
    # "moe_token_dispatcher_type" was redacted in the W&B config: a training setting lost
    assert not is_secret_key(key)


@pytest.mark.parametrize("key", ["access_token", "GITHUB_TOKEN", "wandb-token", "id_token", "hfToken"])
def test_names_ending_in_token_are_secrets(key: str) -> None:
    assert is_secret_key(key)


def test_overrides_urls_query_strings_and_token_shaped_values_are_redacted() -> None:
    hf = "hf_" + "a1B2" * 9
    argv = [
        "charllm",
        "train",
        "+extra.hf_token=s1",
        "++extra.db_password=s2",
        "data.path=s3://user:s4@bucket/x",
        "extra.hub=" + hf,
        "model.moe_token_dispatcher=allgather",
    ]
    out = redact_secrets(
        {
            "argv": argv,
            "url": "https://host/api?user=me&token=s5&x=1",
            "note": "curl -H Bearer abcdefghijklmnopqrstuvwxyz012345 host",
            "github": "ghp_" + "x" * 36,
            "aws": "AKIAABCDEFGHIJKLMNOP",
            "commit": "0123456789abcdef0123456789abcdef01234567",  # a git hash is not a key
        }
    )
    assert out["argv"] == [
        "charllm",
        "train",
        f"+extra.hf_token={REDACTED}",
        f"++extra.db_password={REDACTED}",
        f"data.path=s3://{REDACTED}@bucket/x",
        f"extra.hub={REDACTED}",
        "model.moe_token_dispatcher=allgather",
    ]
    assert out["url"] == f"https://host/api?user=me&token={REDACTED}&x=1"
    assert out["note"] == f"curl -H Bearer {REDACTED} host"
    assert out["github"] == REDACTED and out["aws"] == REDACTED
    assert out["commit"] == "0123456789abcdef0123456789abcdef01234567"
    text = repr(out)
    for secret in ("s1", "s2", "s4", "s5", hf, "abcdefghijklmnop"):
        assert secret not in text


WANDB_KEY = "0123456789abcdef0123456789abcdef01234567"  # 40 hex: the shape of a W&B API key


def test_values_shaped_like_secrets_are_redacted_wherever_they_are() -> None:
    out = redact_secrets(
        {
            "note": "Authorization: Bearer abc123",  # a short bearer token
            "plain": "Bearer x9",
            "loose": WANDB_KEY,
            "argv": ["train", "+extra.anything=" + WANDB_KEY, "--x", "sk-proj-" + "Ab1" * 8],
            "high": "zQ8rT2mK9vLp4XwN7bYc1HdJ6sGf3AeU",
            "url": "postgres://admin:hunter2@db:5432/x",
            "git_commit": WANDB_KEY,  # a digest, under a digest's name: kept
            "path": "/cache/models--x/snapshots/" + WANDB_KEY + "/config.json",  # inside a path: kept
            "tokens_per_s": 1234.5,
            "model": {"moe_token_dispatcher_type": "alltoall", "num_tokens": 4096, "run_key": "a-b-1"},
        }
    )
    assert out["note"].startswith("Authorization:") and out["note"].endswith(REDACTED)
    assert out["plain"] == f"Bearer {REDACTED}"
    assert out["loose"] == REDACTED and out["high"] == REDACTED
    assert out["argv"][1] == f"+extra.anything={REDACTED}" and REDACTED in out["argv"][3]
    assert out["url"] == f"postgres://{REDACTED}@db:5432/x"
    assert out["git_commit"] == WANDB_KEY and WANDB_KEY in out["path"]
    assert out["model"] == {"moe_token_dispatcher_type": "alltoall", "num_tokens": 4096, "run_key": "a-b-1"}
    assert "hunter2" not in repr(out) and "abc123" not in repr(out)


def test_ordinary_long_values_are_kept() -> None:
    kept = {
        "name": "llama3_70b-tp4-pp4-dp2-cp2-vpp5-recompute",
        "dir": "/scratch/runs/sweep-20260101-000000/run-000017",
        "word": "a" * 40,  # one symbol: no entropy
        "n": "12345678901234567890123456789012345",  # digits only
        "model": "meta-llama/Meta-Llama-3-70B-Instruct",
    }
    assert redact_secrets(kept) == kept


SECRETS = {"wandb_key": "w1", "openai_key": "o1", "hf_key": "h1", "key": "k1", "db_pass": "p1"}


def test_config_yaml_keeps_none_of_them(tmp_path) -> None:
    from charllm_nemo.train import app
    from charllm_nemo.train.config_io import save_train_config

    overrides = [f"+extra.{k}={v}" for k, v in SECRETS.items()] + ["+extra.auth=Bearer shorty"]
    cfg = app.load(["model=tiny_gpt", *overrides])
    text = save_train_config(cfg, tmp_path / "config.yaml").read_text()
    for value in [*SECRETS.values(), "shorty"]:
        assert value not in text
    assert "moe_token_dispatcher_type" in text or "tiny" in text


def test_manifest_and_wandb_config_keep_none_of_them(tmp_path) -> None:
    from charllm_nemo.sinks.config import LoggerConfig
    from charllm_nemo.sinks.wandb import WandbSink
    from charllm_nemo.telemetry.session import TelemetrySession
    from charllm_nemo.telemetry.session_options import SessionOptions

    config = {"model": {"name": "m", "moe_token_dispatcher_type": "alltoall"}, "extra": dict(SECRETS)}
    session = TelemetrySession(
        tmp_path / "run", SessionOptions(backend="synthetic", hz=50, sampler="thread"), config=config
    )
    session.close("complete")
    manifest = (tmp_path / "run" / "rank=0" / "manifest.json").read_text()
    env = {"NETRC": str(tmp_path / "missing"), "HOME": str(tmp_path), "WANDB_MODE": "offline"}
    sink = WandbSink(LoggerConfig(name="wandb", project="p"), run_dir=tmp_path, env=env)
    kw = sink.init_kwargs({**config, "argv": ["--wandb-key", WANDB_KEY]}, {"config": config, "argv": ["x"]})
    text = repr(kw["config"]) + manifest
    for value in [*SECRETS.values(), WANDB_KEY]:
        assert f"'{value}'" not in text and f'"{value}"' not in text
    assert kw["config"]["model"]["moe_token_dispatcher_type"] == "alltoall"


SHAPES = {
    "+extra.creds=": "c0rrect-h0rse",
    "sig=": "AbCdEf1234%2Bxyz%3D",
    "--api-key ": "Zq9ApiValue77",
    "": "sk_live_51HqLyjWDarjtT1zdp7dcAB",
    " ": "AIzaSyA1234567890abcdefghijklmnopqrstu",
}
"""Secrets a shape gives away (issue 43): a Hydra override of ``creds``, an Azure SAS signature,
an API key after its flag inside one value, Stripe and Google keys standing alone."""


def test_secret_shapes_are_redacted_in_overrides_urls_flags_and_provider_keys() -> None:
    out = redact_secrets(
        {
            "argv": [
                "train",
                "+extra.creds=c0rrect-h0rse",
                "data.url=https://a.blob.core.windows.net/c?sv=1&sig=AbCdEf1234%2Bxyz%3D&se=2",
            ],
            "cmd": "python pretrain.py --api-key Zq9ApiValue77 --seed 3",
            "stripe": "sk_live_51HqLyjWDarjtT1zdp7dcAB",
            "note": "maps key AIzaSyA1234567890abcdefghijklmnopqrstu here",
            "extra": {"creds": "plain"},
            "kept": "model=tiny --seed 3 the key is here sort_keys=True tokens_per_s=5",
        }
    )
    text = repr(out)
    for secret in [*SHAPES.values(), "plain"]:
        assert secret not in text, secret
    assert out["kept"] == "model=tiny --seed 3 the key is here sort_keys=True tokens_per_s=5"
    assert out["cmd"] == f"python pretrain.py --api-key {REDACTED} --seed 3"
    assert "sv=1" in out["argv"][2] and "se=2" in out["argv"][2]


def test_config_yaml_manifest_and_wandb_keep_no_secret_shape(tmp_path) -> None:
    from charllm_nemo.sinks.config import LoggerConfig
    from charllm_nemo.sinks.wandb import WandbSink
    from charllm_nemo.telemetry.session import TelemetrySession
    from charllm_nemo.telemetry.session_options import SessionOptions
    from charllm_nemo.train import app
    from charllm_nemo.train.config_io import save_train_config

    cfg = app.load(
        ["model=tiny_gpt", "+extra.creds=c0rrect-h0rse", "+extra.cmd='run --api-key Zq9ApiValue77'"]
    )
    text = save_train_config(cfg, tmp_path / "config.yaml").read_text()
    config = {"extra": {"url": "https://a/c?sig=AbCdEf1234%2Bxyz%3D", "k": "sk_live_51HqLyjWDarjtT1zdp7dcAB"}}
    session = TelemetrySession(
        tmp_path / "run", SessionOptions(backend="synthetic", hz=50, sampler="thread"), config=config
    )
    session.close("complete")
    text += (tmp_path / "run" / "rank=0" / "manifest.json").read_text()
    env = {"NETRC": str(tmp_path / "missing"), "HOME": str(tmp_path), "WANDB_MODE": "offline"}
    kw = WandbSink(LoggerConfig(name="wandb", project="p"), run_dir=tmp_path, env=env).init_kwargs(
        {**config, "argv": ["--api-key", "Zq9ApiValue77", "maps=AIzaSyA1234567890abcdefghijklmnopqrstu"]}, {}
    )
    text += repr(kw["config"])
    for secret in SHAPES.values():
        assert secret not in text, secret
    # W&B's own metadata (the command line, every SLURM_* variable: SLURM_JOB_COMMENT) is off
    assert kw["settings"]["x_disable_meta"] is True


_WANDB_CHILD = """
import sys
from pathlib import Path
from charllm_nemo.sinks.config import LoggerConfig
from charllm_nemo.sinks.wandb import WandbSink
run = Path(sys.argv[1])
env = {"HOME": str(run), "NETRC": str(run / "none"), "WANDB_MODE": "offline"}
cfg = LoggerConfig(name="wandb", project="p", upload_artifact=False, log_windows_table=False,
                   settings={"x_disable_stats": True, "console": "off"})
sink = WandbSink(cfg, run_dir=run, env=env)
sink.start({"model": {"name": "m"}}, {"argv": sys.argv})
sink.finish(run)
"""


def test_wandb_files_hold_no_job_comment_nor_command_line_secret(tmp_path) -> None:
    """W&B's own metadata copied the process's command line (``--api-key X``) and every SLURM_*
    variable (``SLURM_JOB_COMMENT``) into the run's files, whatever the config's redaction."""
    import os
    import subprocess
    import sys

    pytest.importorskip("wandb")
    env = {**os.environ, "SLURM_JOB_COMMENT": "deploy-pw-Qx7Zr2", "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, "-c", _WANDB_CHILD, str(tmp_path), "--api-key", "Zq9ApiValue77"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = [p for p in (tmp_path / "wandb").rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)
    for p in files:
        raw = p.read_bytes()
        assert b"deploy-pw-Qx7Zr2" not in raw and b"Zq9ApiValue77" not in raw, p
