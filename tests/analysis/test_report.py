"""charllm report: a self-contained page, opened in a real headless browser."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from charllm_nemo.cli import main
from tests.analysis.helpers import constant_run
from tests.deadline import deadline

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _browser() -> str | None:
    found = next((b for b in map(shutil.which, BROWSERS) if b), None)
    if found is None and os.environ.get("CHARLLM_REQUIRE_BROWSER"):
        pytest.fail("no chromium on PATH but CHARLLM_REQUIRE_BROWSER is set (scripts/test.sh installs it)")
    return found


def _sweep(root: Path) -> Path:
    sweep = root / "sweep=demo"
    constant_run(sweep / "run=a", ranks=4, hosts=["n0", "n0", "n1", "n1"], temps=[50, 53, 60, 51])
    constant_run(sweep / "run=b", ranks=2, power_w=600.0, micro=2)
    (sweep / "sweep.json").write_text(
        json.dumps({"runs": [{"key": "c", "state": "out_of_memory", "overrides": ["model=toy"]}]})
    )
    return root


def test_report_is_self_contained_and_renders(tmp_path: Path) -> None:
    root = _sweep(tmp_path)
    html_path = tmp_path / "report.html"
    assert main(["report", str(root), "--out", str(tmp_path / "out"), "--html", str(html_path)]) == 0
    page = html_path.read_text()
    # Nothing outside the page: every image inline, no links, no scripts.
    assert not re.search(r"""(src|href)=["'](?!data:)""", page)
    assert "<script" not in page
    assert page.count("data:image/png;base64,") >= 4  # configs, heatmaps, excursions, timelines
    for text in (
        "SYNTHETIC device",
        "Sampling rate: 100 Hz",
        "Flagged windows",
        "out_of_memory",
        "Manifests",
    ):
        assert text in page, text
    browser = _browser()
    if browser is None:
        pytest.skip("no chromium here (scripts/test.sh installs it; CI runs this)")
    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--hide-scrollbars", "--window-size=1280,2400", f"--screenshot={shot}", html_path.as_uri()],
        capture_output=True, text=True, timeout=deadline(120),
    )  # fmt: skip
    assert shot.is_file(), proc.stderr[-2000:]
    import matplotlib.image as mpimg

    img = mpimg.imread(shot)
    assert img.shape[0] >= 2000 and img.shape[1] >= 1200
    # A rendered page, not a blank one: many distinct colours (text, figures, table borders).
    colours = np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 200
