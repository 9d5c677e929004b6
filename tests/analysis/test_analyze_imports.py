"""``charllm analyze --no-figures`` imports neither matplotlib nor pandas (issue #45: ~19 % of
the analysis's CPU time went to importing them); asked for figures, it draws them as before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.analysis.helpers import constant_run

PROBE = """
import json, sys
from charllm_nemo.cli import main
rc = main(["analyze", sys.argv[1], "--out", sys.argv[2], *sys.argv[3:]])
print(json.dumps({"rc": rc, "loaded": [m for m in ("pandas", "matplotlib") if m in sys.modules]}))
"""


def _probe(run: Path, out: Path, *extra: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(run), str(out), *extra], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_no_figures_imports_neither_matplotlib_nor_pandas(tmp_path: Path) -> None:
    constant_run(tmp_path / "run")
    got = _probe(tmp_path / "run", tmp_path / "out", "--no-figures")
    assert got == {"rc": 0, "loaded": []}
    assert (tmp_path / "out" / "ranks.parquet").is_file()
    assert not (tmp_path / "out" / "figures").exists()


def test_figures_still_drawn_when_asked(tmp_path: Path) -> None:
    constant_run(tmp_path / "run")
    got = _probe(tmp_path / "run", tmp_path / "out")
    assert got["rc"] == 0 and "matplotlib" in got["loaded"]  # type: ignore[operator]
    assert list((tmp_path / "out" / "figures").glob("*.png"))


POOL = """
import json, sys
import pyarrow as pa
first = pa.default_memory_pool().backend_name
import charllm_nemo.analysis.analyze  # noqa: F401
imported = pa.default_memory_pool().backend_name
from charllm_nemo.cli import main
rc = main(["analyze", sys.argv[1], "--out", sys.argv[2], "--no-figures"])
ran = pa.default_memory_pool().backend_name
print(json.dumps({"rc": rc, "first": first, "imported": imported, "ran": ran}))
"""


def test_the_analysis_sets_its_allocator_when_it_runs_not_when_imported(tmp_path: Path) -> None:
    # a user's process that imports the package keeps pyarrow's pool; an analysis takes the
    # system allocator (arrow_init.keep_freed_memory)
    constant_run(tmp_path / "run")
    argv = [sys.executable, "-c", POOL, str(tmp_path / "run"), str(tmp_path / "out")]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0 and got["imported"] == got["first"] and got["ran"] == "system", got
