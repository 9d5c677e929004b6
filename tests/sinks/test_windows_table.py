"""The W&B windows table built from a run directory that someone else's files may have spoiled."""

from __future__ import annotations

import json
from pathlib import Path

from charllm_nemo.sinks.windows_table import windows_table_rows
from charllm_nemo.telemetry.store import RankStore, windows_to_table
from charllm_nemo.telemetry.windows import WindowRecorder


def _rank(root: Path, rank: int, steps: int) -> None:
    store = RankStore(root, rank, {"rank": rank, "backend": "synthetic", "devices": [{"index": 0}]})
    rec = WindowRecorder()
    for step in range(steps):
        with rec.window("step", step=step), rec.window("phase", "forward", step=step, microbatch=0):
            pass
    store.write_segment("windows", windows_to_table(rec.drain()))
    store.close("complete")


def test_a_bad_manifest_neither_stops_the_table_nor_miscounts_its_rows(tmp_path: Path) -> None:
    _rank(tmp_path, 0, 3)
    _rank(tmp_path, 1, 4)
    # devices as a string was counted as 4 devices (its length); a list manifest was a traceback
    (tmp_path / "rank=1" / "manifest.json").write_text(json.dumps({"devices": "H200"}))
    rows, total = windows_table_rows(tmp_path, kinds=("phase",), max_rows=2)
    assert len(rows) == 2 and total == 3 + 4
    (tmp_path / "rank=1" / "manifest.json").write_text(json.dumps(["H200"]))
    rows, total = windows_table_rows(tmp_path, kinds=("phase",), max_rows=None)
    assert total == 7 and {r["rank"] for r in rows} == {0, 1}
