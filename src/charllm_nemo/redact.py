"""Secrets kept out of everything the project writes or uploads (docs/wandb.md, "Secrets").

One function, :func:`redact_secrets`, is applied to ``config.yaml`` (train/app.py), to every
``manifest.json`` (telemetry/session.py builds it redacted, so each rewrite stays so), and to
the W&B run config (sinks/wandb.py); the W&B artifact uploads those same files.

What counts as a secret:

* the value of a mapping key that :func:`is_secret_key` flags, by name pattern rather than a
  list (``*key*``: ``api_key``, ``wandb_key``, ``hf_key``, ``key``; ``*secret*``; ``*pass*``:
  ``password``, ``db_pass``; ``auth*``: ``Authorization``, ``oauth_token``; ``*token``;
  credentials, cookies), whatever its type;
* in strings: ``NAME=value`` / ``--name=value`` / ``+extra.name=value`` (a Hydra override)
  where NAME is such a key; the ``user:password@`` part of a URL; a query parameter such as
  ``?token=...``; and values shaped like well-known tokens (Hugging Face ``hf_...``, GitHub
  ``ghp_...`` / ``github_pat_...``, ``sk-...`` API keys, Slack ``xox.-...``, AWS ``AKIA...``,
  ``Bearer ...`` however short), and any standalone run of 32+ letters and digits with both
  kinds and high entropy (a W&B key is 40 hex digits), except under a digest's name
  (``git_commit``, ``sha256``, ...) and inside paths or dashed names;
* in lists (an argv): the item after a ``--api-key``-style flag.

Names that merely contain "key" are not secrets when the word before makes it an index
(``run_key``, ``sort_keys``) or the word after a layer (``key_value_channels``) or a part of
a key (``key_prefix``). Names that
merely contain "token" are not secrets: a key is split into words (at ``_ - .``,
spaces and camelCase) and ``token`` counts only as the last word, and not after a word that
makes it a tokenizer or model term (``pad_token``, ``max_token``): ``moe_token_dispatcher_type``,
``num_tokens``, ``tokens_per_s``, ``tokenizer`` and ``token_ids`` stay.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
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
        "pass",
        "pw",
        "apikey",
        "credential",
        "credentials",
        "cred",
        "creds",
        "auth",
        "authorization",
        "cookie",
        "privatekey",
        "passphrase",
    }
)
_SECRET_PARTS = ("secret", "passw", "passphrase", "credential", "cookie")
_KEY_PREFIXES = frozenset(
    {"api", "private", "access", "secret", "session", "wandb", "openai", "hf", "ssh", "license"}
)
# "key" is a secret (wandb_key, key) unless it names a lookup: a run's key, a sort key, a layer.
_KEY_TERMS = frozenset(
    {"run", "sort", "sweep", "group", "cache", "dict", "primary", "foreign", "partition", "query", "lookup",
     "row", "table", "join", "step", "window", "dropped", "shorthand", "env", "full", "hash", "sequence"}
)  # fmt: skip
# ... and "key" before one of these names a part of a key, not a secret: key_value_channels, and
# key_prefix (the integrations' prefix of metric keys, "charllm/")
_KEY_AFTER = frozenset({"value", "values", "layer", "padding", "channels", "func", "fn", "order", "prefix"})
_SAFE_KEYS = frozenset({"moe_token_dispatcher_type", "keyboard", "passes", "num_passes", "bypass"})
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
    r"|[rs]k_(?:live|test)_[A-Za-z0-9]{10,}"
    r"|AIza[0-9A-Za-z_\-]{30,}"
    r"|glpat-[A-Za-z0-9_\-]{20,}"
    r"|npm_[A-Za-z0-9]{30,}"
    r"|ya29\.[A-Za-z0-9_\-]{20,}"
    r"|ASIA[0-9A-Z]{16}"
    r"|gh[pousr]_[A-Za-z0-9]{30,}"
    r"|github_pat_[A-Za-z0-9_]{30,}"
    r"|sk-[A-Za-z0-9_\-]{20,}"
    r"|xox[abprs]-[A-Za-z0-9\-]{10,}"
    r"|AKIA[0-9A-Z]{16})\b"
    r"|(?<=Bearer )[A-Za-z0-9._~+/\-]+=*"
)
_SHAPE_HINTS = (
    "hf_",
    "gh",
    "sk-",
    "sk_",
    "rk_",
    "xox",
    "AKIA",
    "ASIA",
    "Bearer ",
    "AIza",
    "glpat",
    "npm_",
    "ya29",
)
"""Substrings one of :data:`_TOKEN_SHAPES` needs: the regex runs only where one is."""

_QUERY_SECRETS = frozenset({"sig", "signature", "sas", "x-amz-signature", "x-goog-signature", "code"})
"""URL query parameters that carry a secret whatever the key patterns say: an Azure SAS ``sig``,
the signature of an S3 / GCS presigned URL, an OAuth ``code``."""

# ``--api-key X`` / ``--password=X`` / ``HF_TOKEN=X`` inside a longer value (a command line kept
# as one string, a job comment): the word after a flag or assignment that names a secret.
_NAME = r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}"
_INLINE_LEAD = re.compile(
    rf"(?<![^\s\"'(;,=:])(?:(?:--?|\+\+?)(?P<flag>{_NAME})(?:=|[ \t]+)|(?P<name>{_NAME})=)"
)
_INLINE_VALUE = re.compile(r"[^\s\"'&;,)]+")

_MIN_SECRET_LEN = 32
_MIN_ENTROPY_BITS = 3.0
# A token standing alone (not inside a path, a file name or a dashed name such as a run's):
# 32+ letters and digits, nothing else.
_LONG_TOKEN = re.compile(r"(?<![A-Za-z0-9_\-./])[A-Za-z0-9]{32,}(?![A-Za-z0-9_\-./])")
_DIGEST_WORDS = frozenset(
    {"commit", "sha", "sha1", "sha256", "hash", "digest", "checksum", "revision", "uuid"}
)
_DIGEST_LAST = [[w] for w in _DIGEST_WORDS]
"""Keys whose hex values are digests, not keys (long high-entropy values are kept there)."""


def _words(key: str) -> list[str]:
    return [w.lower() for w in _WORD_SPLIT.split(_CAMEL.sub("_", key)) if w]


def is_secret_key(key: str) -> bool:
    """Whether a config key, variable or option name names a secret, by pattern: a word that is
    or ends in ``key`` (``api_key``, ``wandb_key``, ``hf_key``, ``key``, ``apikey``), contains
    ``secret``, ``passw`` / is ``pass`` or ``pwd`` (``db_pass``), starts with ``auth`` (not
    ``author``), names a credential or cookie, or ``token`` as the last word; except the known
    ordinary names (:data:`_SAFE_KEYS`, a ``token`` after a model term: ``num_tokens``,
    ``moe_token_dispatcher_type``, ``pad_token``; a ``key`` after an index term: ``run_key``,
    ``sort_keys``)."""
    if key.lower() in _SAFE_KEYS:
        return False
    words = _words(key)
    for i, w in enumerate(words):
        before = words[i - 1] if i else ""
        after = words[i + 1] if i + 1 < len(words) else ""
        if any(part in w for part in _SECRET_PARTS) or w in _SECRET_WORDS:
            return True
        if w.startswith("auth") and not w.startswith("author"):
            return True
        if (w in ("key", "keys") or (w.endswith("key") and w[:-3] in _KEY_PREFIXES)) and not (
            before in _KEY_TERMS or after in _KEY_AFTER
        ):
            return True
    if any(pair in _SECRET_PAIRS for pair in itertools.pairwise(words)):
        return True
    return bool(words) and words[-1] == "token" and (len(words) == 1 or words[-2] not in _TOKEN_TERMS)


def _is_high_entropy(tok: str) -> bool:
    """A long run of letters and digits with both kinds and many distinct symbols: an API key,
    not a word, a number or a path component."""
    if not (any(c.isdigit() for c in tok) and any(c.isalpha() for c in tok)):
        return False
    counts = Counter(tok)
    n = len(tok)
    return -sum(c / n * math.log2(c / n) for c in counts.values()) >= _MIN_ENTROPY_BITS


def _redact_text(s: str, shapes: bool = True) -> str:
    if any(h in s for h in _SHAPE_HINTS):
        s = _TOKEN_SHAPES.sub(REDACTED, s)
    if shapes and len(s) >= _MIN_SECRET_LEN:
        s = _LONG_TOKEN.sub(lambda m: REDACTED if _is_high_entropy(m.group(0)) else m.group(0), s)
    if "=" not in s and ":" not in s:
        return _redact_pairs(s)  # the common case, and linear time on long strings
    if "@" in s and "://" in s:
        s = _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", s)
    if "?" in s and "=" in s:
        s = _QUERY_PARAM.sub(
            lambda m: m.group("lead") + REDACTED if _secret_param(m.group("name")) else m.group(0), s
        )
    m = _ASSIGNMENT.match(s)
    if m and is_secret_key(m.group("name")):
        return s[: m.start("value")] + REDACTED
    return _redact_pairs(s)


def _secret_param(name: str) -> bool:
    return name.lower() in _QUERY_SECRETS or is_secret_key(name)


def _redact_pairs(s: str) -> str:
    """Every ``--flag value``, ``--flag=value`` or ``NAME=value`` inside ``s`` whose name is a
    secret's (a word followed by a space is a name only when written as a flag)."""
    if "-" not in s and "=" not in s:
        return s

    out: list[str] = []
    pos = 0
    for m in _INLINE_LEAD.finditer(s):  # leads only: "x=--api-key v" finds both x= and --api-key
        if m.start() < pos or not is_secret_key(m.group("flag") or m.group("name")):
            continue
        v = _INLINE_VALUE.match(s, m.end())
        if v is None or v.group(0) == REDACTED:
            continue
        out += [s[pos : m.end()], REDACTED]
        pos = v.end()
    return "".join(out) + s[pos:] if out else s


def redact_secrets(obj: Any) -> Any:
    """A copy of ``obj`` (mappings, lists, tuples, scalars) with every secret the module
    docstring lists replaced by ``<redacted>``; everything else kept as it is (the input is not
    changed). Linear in the size of ``obj``."""
    if isinstance(obj, Mapping):
        out: dict[Any, Any] = {}
        for k, v in obj.items():
            if isinstance(k, str) and is_secret_key(k):
                out[k] = REDACTED
            elif (
                isinstance(k, str)
                and isinstance(v, str)
                and _words(k)[-1:]
                and _words(k)[-1] in _DIGEST_WORDS
            ):
                out[k] = _redact_text(v, shapes=False)  # a git commit or checksum: hex, not a key
            else:
                out[k] = redact_secrets(v)
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
