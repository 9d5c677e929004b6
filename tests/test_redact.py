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
        "key",
        "passes",
        "api_version",
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
    import time

    t0 = time.perf_counter()
    redact_secrets({"a": "x" * 200_000, "b": "y:" * 50_000, "c": "http://" + "z" * 100_000 + "@"})
    assert time.perf_counter() - t0 < 0.5


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
