"""One rank's Prometheus endpoint in the tests: a free port, a synthetic session serving it, and
its scrape (the exposition text parsed and checked line by line)."""

from __future__ import annotations

import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

from charllm_nemo.telemetry.config import Placement, TelemetryConfig, open_session
from charllm_nemo.telemetry.session import TelemetrySession

LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(?:[A-Za-z_][A-Za-z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')
"""One sample line of the exposition format: name, optional labels, value."""

Series = dict[str, list[tuple[str, float]]]
"""Metric name -> [(labels text, value)], as :func:`parse` returns them."""


def parse(text: str) -> Series:
    """name -> [(labels text, value)], checking every line's syntax and that each series follows
    its family's HELP and TYPE."""
    typed: set[str] = set()
    out: Series = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert kind in ("gauge", "counter")
            typed.add(name)
            continue
        if line.startswith("# HELP "):
            continue
        m = LINE.match(line)
        assert m, line
        assert m.group(1) in typed, line
        out.setdefault(m.group(1), []).append((m.group(2) or "", float(m.group(3))))
    return out


def free_port() -> int:
    """A loopback port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str) -> Series:
    """The endpoint's metrics, parsed (:func:`parse`), with the exposition format's content type."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse(r.read().decode())


def serving_session(tmp_path: Path) -> tuple[TelemetrySession, str]:
    """A one-rank synthetic session (process sampler, run directory ``tmp_path/run``) exporting
    to Prometheus on a free port, and the URL of its metrics, once that answers."""
    port = free_port()
    cfg = TelemetryConfig(
        backend="synthetic",
        sampler="process",
        out_dir=str(tmp_path / "run"),
        export="prometheus",
        export_port=port,
    )
    session = open_session(cfg, Placement(0, 0, 1, 1, {"pp_stage": 0}))
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        wait_serving(url)
    except BaseException:
        session.close()
        raise
    return session, url


def scrape_at_step(url: str, step: int, seconds: float = 30) -> Series:
    """Scrapes ``url`` until its ``charllm_step`` is ``step`` or ``seconds`` have passed; the
    last scrape (the caller asserts on it)."""
    deadline = time.monotonic() + seconds
    s: Series = {}
    while time.monotonic() < deadline:
        s = scrape(url)
        if s.get("charllm_step", [("", -1)])[0][1] == step:
            break
        time.sleep(0.1)
    return s


def wait_serving(url: str, seconds: float = 60) -> None:
    """Waits until ``url`` answers (the telemetry process starts slowly on a loaded machine)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            scrape(url)
            return
        except urllib.error.URLError:
            assert time.monotonic() < deadline, "the endpoint did not come up"
            time.sleep(0.2)
