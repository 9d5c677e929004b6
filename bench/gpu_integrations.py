"""The integrations part of bench/gpu_check.py (issue #24, "On a GPU"): each in a child process,
each reported with its exit code, the last lines of its output and what it measured, or why it
did not run.

1. ``nemo``: the NeMo 2 callback on a small GPT on the GPU (bench/bench_nemo_callback.py
   ``--device cuda``: ON/OFF interleaved, the hooks' cost); needs ``nemo.collections.llm`` in the
   image (NeMo's dependencies are far more than the device tool can carry).
2. ``mcore019``: megatron-core 0.19.x on the image's Python 3.12: ``charllm train`` tiny_gpt
   with telemetry, with the carried 0.19.2 wheel (and megatron-bridge 0.6.2's) installed into
   their own folder (``--mcore019``, bench/gpu_run.sh) ahead of 0.16.1 on the path.
3. ``bridge``: Megatron-Bridge's real ``pretrain`` with the callback (bench/gpu_bridge_pretrain.py)
   where ``megatron.bridge`` imports (its dependencies install only with a network and a
   matching image: the report says what failed to import).

In stub mode (no GPU, tests/bench/test_gpu_check.py) each part runs on CPU where it can, or
reports why not; its time budget is small.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _importable(module: str, env: dict[str, str]) -> str | None:
    """None when ``module`` imports in a child with ``env``, else the error's last line."""
    proc = subprocess.run(
        [sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True, timeout=300
    )
    if proc.returncode == 0:
        return None
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit {proc.returncode}"


def _run(cmd: list[str], env: dict[str, str], timeout_s: float, cwd: Path) -> dict[str, Any]:
    t = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=cwd)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = 124, f"timed out after {timeout_s:.0f} s: {exc}"
    lines = [ln for ln in out.splitlines() if ln.strip() and "Warning" not in ln and "warn(" not in ln]
    return {"rc": rc, "wall_s": round(time.monotonic() - t, 1), "tail": lines[-12:]}


def nemo(mode: str, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    missing = _importable("nemo.collections.llm", env)
    if missing is not None:
        return {"ran": False, "why": f"nemo.collections.llm does not import here: {missing}"}
    device = "cuda" if mode == "gpu" else "cpu"
    steps = "200" if mode == "gpu" else "24"
    res = _run(
        [
            sys.executable,
            str(REPO / "bench" / "bench_nemo_callback.py"),
            "--device",
            device,
            "--steps",
            steps,
        ],
        env,
        timeout_s,
        REPO,
    )
    res["ran"] = True
    res["figures"] = [
        ln for ln in res["tail"] if ln.startswith(("median", "ratio", "cost", "inside", "timers"))
    ]
    return res


def mcore019(
    mode: str, out_dir: Path, env: dict[str, str], site: str | None, timeout_s: float
) -> dict[str, Any]:
    if not site or not Path(site, "megatron", "core").is_dir():
        return {
            "ran": False,
            "why": "no megatron-core 0.19 folder given "
            "(--mcore019; bench/gpu_run.sh installs the carried wheel)",
        }
    env = dict(env, PYTHONPATH=os.pathsep.join([site, env.get("PYTHONPATH", "")]))
    version = subprocess.run(
        [
            sys.executable,
            "-c",
            "import megatron.core.package_info as p, sys; print(p.__version__, sys.version.split()[0])",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    run_dir = out_dir / "train_mcore019"
    cmd = [
        sys.executable,
        "-m",
        "charllm_nemo.cli",
        "train",
        "model=tiny_gpt",
        "batch.train_steps=6",
        f"telemetry.out_dir={run_dir}",
        "telemetry.overwrite=true",
    ]
    if mode == "gpu":
        cmd.append("launch.device=cuda")
    res = _run(cmd, env, timeout_s, REPO)
    res["ran"] = True
    res["version"] = (version.stdout or version.stderr).strip().splitlines()[-1:]
    summary = run_dir / "summary.json"
    if summary.exists():
        res["summary"] = json.loads(summary.read_text())
    return res


def bridge(
    mode: str, out_dir: Path, env: dict[str, str], site: str | None, timeout_s: float
) -> dict[str, Any]:
    if mode != "gpu":
        return {"ran": False, "why": "Bridge asserts CUDA at init: GPU only"}
    if site:  # the carried megatron-bridge 0.6.2 sits beside megatron-core 0.19 (bench/gpu_run.sh)
        env = dict(env, PYTHONPATH=os.pathsep.join([site, env.get("PYTHONPATH", "")]))
    missing = _importable("megatron.bridge.training.pretrain", env)
    if missing is not None:
        return {"ran": False, "why": f"megatron.bridge does not import here: {missing}"}
    run_dir = out_dir / "bridge_run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "1",
        str(REPO / "bench" / "gpu_bridge_pretrain.py"),
        str(run_dir),
    ]
    res = _run(cmd, env, timeout_s, out_dir)
    res["ran"] = True
    for line in res["tail"]:
        if line.startswith("BRIDGE_RESULT "):
            res["result"] = json.loads(line.split(" ", 1)[1])
    return res


def integrations(
    mode: str, out_dir: Path, env: dict[str, str], mcore019_site: str | None, timeout_s: float
) -> dict[str, Any]:
    """The three parts above; each bounded by ``timeout_s`` seconds."""
    report: dict[str, Any] = {}
    for name, part in (
        ("nemo", lambda: nemo(mode, env, timeout_s)),
        ("mcore019", lambda: mcore019(mode, out_dir, env, mcore019_site, timeout_s)),
        ("bridge", lambda: bridge(mode, out_dir, env, mcore019_site, timeout_s)),
    ):
        t = time.monotonic()
        try:
            report[name] = part()
        except Exception as exc:  # one part failing must not lose the others' figures
            report[name] = {"ran": False, "why": f"{type(exc).__name__}: {exc}"}
        print(
            f"gpu_check: integrations/{name}: {json.dumps(report[name])[:400]} "
            f"({time.monotonic() - t:.0f} s)",
            flush=True,
        )
    return report


if importlib.util.find_spec("charllm_nemo") is None:  # pragma: no cover - run from the repository
    sys.path.insert(0, str(REPO / "src"))
