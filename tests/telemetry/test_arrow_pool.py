"""The telemetry process's pyarrow allocates from jemalloc, which gives freed pages back (issue 48).

With pyarrow's default mimalloc, the pages of past compactions' merges stayed in mimalloc's
reservation and the telemetry process's resident memory crept up (docs/soak.md, "The
bound per process"). The training process starts its telemetry process with
``ARROW_DEFAULT_MEMORY_POOL=jemalloc`` unless the user chose a pool; the training process's
own pool is not touched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from charllm_nemo.telemetry.process.child import arrow_pool_env
from charllm_nemo.telemetry.session import TelemetrySession
from charllm_nemo.telemetry.session_options import SessionOptions

JEMALLOC = "jemalloc" in pa.supported_memory_backends()


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


def test_the_environment_asks_jemalloc_unless_the_user_chose_a_pool() -> None:
    assert arrow_pool_env({}) == ({"ARROW_DEFAULT_MEMORY_POOL": "jemalloc"} if JEMALLOC else {})
    assert arrow_pool_env({"ARROW_DEFAULT_MEMORY_POOL": "system"}) == {}


@pytest.mark.skipif(not JEMALLOC, reason="this pyarrow was built without jemalloc")
def test_with_that_environment_the_parquet_writer_allocates_from_jemalloc() -> None:
    """In a fresh interpreter, as the telemetry process is: the variable is read when pyarrow is
    imported, and the store's writes then come from jemalloc."""
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    env |= arrow_pool_env(env)
    code = (
        "import io, pyarrow as pa, pyarrow.parquet as pq\n"
        "from charllm_nemo.telemetry.store import warm_up_parquet_writer\n"
        "warm_up_parquet_writer()\n"
        "pq.write_table(pa.table({'x': list(range(100_000))}), io.BytesIO())\n"
        "pool = pa.default_memory_pool()\n"
        "print(pool.backend_name, pool.max_memory() > 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["jemalloc", "True"]


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("chosen", [None, "system"])
def test_the_telemetry_process_is_started_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chosen: str | None
) -> None:
    if chosen:
        monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", chosen)
    else:
        monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL", raising=False)
    backend_here = pa.default_memory_pool().backend_name
    with TelemetrySession(tmp_path, SessionOptions(backend="synthetic"), handle_signals=False) as tel:
        assert tel.sampler_mode == "process"
        child = _environ(tel.sampler.pid)
    want = chosen or ("jemalloc" if JEMALLOC else None)
    assert child.get("ARROW_DEFAULT_MEMORY_POOL") == want
    assert os.environ.get("ARROW_DEFAULT_MEMORY_POOL") == chosen  # the training process's own:
    assert pa.default_memory_pool().backend_name == backend_here  # untouched
