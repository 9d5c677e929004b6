"""Secrets kept out of everything the project writes or uploads (docs/wandb.md, "Secrets").

One function, :func:`redact_secrets`, is applied to ``config.yaml`` (train/app.py), to every
``manifest.json`` (telemetry/session.py builds it redacted, so each rewrite stays so), and to
the W&B run config (sinks/wandb.py); the W&B artifact uploads those same files.

What counts as a secret:

* the value of a mapping key that :func:`is_secret_key` flags (``api_key``, ``hf_token``,
  ``HF_TOKEN``, ``password``, ``client_secret``, ``Authorization``, ...), whatever its type;
* in strings: ``NAME=value`` / ``--name=value`` / ``+extra.name=value`` (a Hydra override)
  where NAME is such a key; the ``user:password@`` part of a URL; a query parameter such as
  ``?token=...``; and values shaped like well-known tokens (Hugging Face ``hf_...``, GitHub
  ``ghp_...`` / ``github_pat_...``, ``sk-...`` API keys, Slack ``xox.-...``, AWS ``AKIA...``,
  ``Bearer ...``);
* in lists (an argv): the item after a ``--api-key``-style flag.

Names that merely contain "token" are not secrets: a key is split into words (at ``_ - .``,
spaces and camelCase) and ``token`` counts only as the last word, and not after a word that
makes it a tokenizer or model term (``pad_token``, ``max_token``): ``moe_token_dispatcher_type``,
``num_tokens``, ``tokens_per_s``, ``tokenizer`` and ``token_ids`` stay.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"
"""What a secret is replaced with."""

_SECRET_WORDS = frozenset(
    {
        "secret",
        "secrets",
        "password",
        "passwd",
        "pwd",
        "apikey",
        "credential",
        "credentials",
        "auth",
        "authorization",
        "cookie",
        "privatekey",
        "passphrase",
    }
)
_SECRET_PAIRS = frozenset(
    {("api", "key"), ("private", "key"), ("access", "key"), ("secret", "key"), ("session", "key")}
)
# "token" names a secret (hf_token, GITHUB_TOKEN, access_token) unless the word before it makes
# it a vocabulary or model term.
_TOKEN_TERMS = frozenset(
    {
        "pad",
        "eos",
        "bos",
        "unk",
        "sep",
        "cls",
        "mask",
        "special",
        "start",
        "end",
        "stop",
        "max",
        "min",
        "num",
        "n",
        "per",
        "first",
        "last",
        "next",
        "image",
        "video",
        "audio",
        "vision",
        "text",
        "dummy",
        "placeholder",
        "moe",
        "sink",
    }
)
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_WORD_SPLIT = re.compile(r"[^A-Za-z0-9]+")
_ASSIGNMENT = re.compile(r"^(?:--?|\+\+?|~)?(?P<name>[A-Za-z0-9_.\-]+)(?P<sep>[=:])(?P<value>.+)$", re.DOTALL)
_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]{0,31}://)[^/@\s]+@")
_QUERY_PARAM = re.compile(r"(?P<lead>[?&](?P<name>[A-Za-z0-9_.\-]{1,64})=)(?P<value>[^&#\s]+)")
_TOKEN_SHAPES = re.compile(
    r"\b(?:hf_[A-Za-z0-9]{30,}"
    r"|gh[pousr]_[A-Za-z0-9]{30,}"
    r"|github_pat_[A-Za-z0-9_]{30,}"
    r"|sk-[A-Za-z0-9_\-]{20,}"
    r"|xox[abprs]-[A-Za-z0-9\-]{10,}"
    r"|AKIA[0-9A-Z]{16})\b"
    r"|(?<=Bearer )[A-Za-z0-9._~+/\-]{16,}=*"
)


def _words(key: str) -> list[str]:
    return [w.lower() for w in _WORD_SPLIT.split(_CAMEL.sub("_", key)) if w]


def is_secret_key(key: str) -> bool:
    """Whether a config key, variable or option name names a secret (``api_key``, ``hf_token``,
    ``password``, ...), and not a name that merely contains "token" (``num_tokens``,
    ``moe_token_dispatcher_type``, ``pad_token``)."""
    words = _words(key)
    if any(w in _SECRET_WORDS for w in words):
        return True
    if any(pair in _SECRET_PAIRS for pair in itertools.pairwise(words)):
        return True
    return bool(words) and words[-1] == "token" and (len(words) == 1 or words[-2] not in _TOKEN_TERMS)


def _redact_text(s: str) -> str:
    if "hf_" in s or "gh" in s or "sk-" in s or "xox" in s or "AKIA" in s or "Bearer " in s:
        s = _TOKEN_SHAPES.sub(REDACTED, s)
    if "=" not in s and ":" not in s:
        return s  # the common case, and linear time on long strings
    if "@" in s and "://" in s:
        s = _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", s)
    if "?" in s and "=" in s:
        s = _QUERY_PARAM.sub(
            lambda m: m.group("lead") + REDACTED if is_secret_key(m.group("name")) else m.group(0), s
        )
    m = _ASSIGNMENT.match(s)
    if m and is_secret_key(m.group("name")):
        return s[: m.start("value")] + REDACTED
    return s


def redact_secrets(obj: Any) -> Any:
    """A copy of ``obj`` (mappings, lists, tuples, scalars) with every secret the module
    docstring lists replaced by ``<redacted>``; everything else kept as it is (the input is not
    changed). Linear in the size of ``obj``."""
    if isinstance(obj, Mapping):
        out: dict[Any, Any] = {}
        for k, v in obj.items():
            out[k] = REDACTED if isinstance(k, str) and is_secret_key(k) else redact_secrets(v)
        return out
    if isinstance(obj, (list, tuple)):
        items: list[Any] = []
        hide_next = False
        for item in obj:
            if hide_next and isinstance(item, str):
                items.append(REDACTED)
                hide_next = False
                continue
            hide_next = (
                isinstance(item, str)
                and item.startswith("-")
                and "=" not in item
                and is_secret_key(item.lstrip("-"))
            )
            items.append(redact_secrets(item))
        return type(obj)(items) if isinstance(obj, tuple) else items
    if isinstance(obj, str):
        return _redact_text(obj)
    return obj
