#!/usr/bin/env python
"""Train random CPU configs that validation accepts: what validation lets through must train.

Validation (charllm_nemo.train.validate) runs before any process group; megatron-core checks
more at model build and at the first step, on every rank. This draws configs from the CPU
models' fields, the CPU layouts, recomputation and batch sizes, keeps those validation accepts
for their world size, trains each for two steps (``charllm train``, synthetic telemetry) and
reports every one that failed, with its command line and last error. Exit 1 when any failed.

    .venv/bin/python scripts/train_random_configs.py --runs 24 --seed 1      # ~4 min on 2 cores
    .venv/bin/python scripts/train_random_configs.py --runs 16 --max-ranks 4

It found, on 2026-12-04, that an MoE model with tensor parallelism needs sequence parallelism
and that top-1 routing needs the softmax before the choice; both are now handled.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYOUT_RANKS = {
    "single": 1,
    "tp2": 2,
    "pp2": 2,
    "pp2_vpp2": 2,
    "pp2_uneven": 2,
    "pp2_alternating": 2,
    "dp2": 2,
    "ep2": 2,
    "tp2pp2": 4,
    "pp4": 4,
}
"""The CPU layouts drawn from, with the ranks each runs on."""


def draw(rng: random.Random, max_ranks: int) -> tuple[list[str], int]:
    """One random config as ``charllm train`` overrides, and its world size."""
    layout = rng.choice([n for n, ranks in LAYOUT_RANKS.items() if ranks <= max_ranks])
    model = rng.choice(["tiny_gpt", "tiny_moe"])
    optim = rng.choice(["base", "recompute"])
    overrides = [
        f"model={model}",
        f"parallel={layout}",
        f"optim={optim}",
        f"model.num_layers={rng.choice([2, 3, 4, 5, 6, 8])}",
        f"model.num_attention_heads={rng.choice([2, 4, 8])}",
        f"model.num_query_groups={rng.choice(['null', 1, 2, 4])}",
        f"model.hidden_size={rng.choice([32, 64, 96])}",
        f"model.seq_length={rng.choice([16, 48, 64, 100])}",
        "model.max_position_embeddings=128",
        f"model.swiglu={rng.choice(['true', 'false'])}",
        f"model.position_embedding={rng.choice(['rope', 'learned_absolute'])}",
        f"model.normalization={rng.choice(['LayerNorm', 'RMSNorm'])}",
        f"model.untie_embeddings={rng.choice(['true', 'false'])}",
        f"batch.micro_batch_size={rng.choice([1, 2, 3])}",
        f"batch.global_batch_size={rng.choice([2, 4, 6, 8, 12])}",
    ]
    if model == "tiny_moe":
        overrides.append(f"model.moe_router_topk={rng.choice([1, 2])}")
    if optim == "recompute":
        overrides.append(f"optim.recompute_method={rng.choice(['uniform', 'block'])}")
        overrides.append(f"optim.recompute_num_layers={rng.choice([1, 2])}")
    world = LAYOUT_RANKS[layout]
    return [*overrides, f"nproc={world}"], world


def accepted(rng: random.Random, max_ranks: int, tries: int = 10_000) -> tuple[list[str], int]:
    """A random config that validation accepts on CPU for its world size."""
    from charllm_nemo.train import app
    from charllm_nemo.train.validate import ConfigProblems, validate

    for _ in range(tries):
        overrides, world = draw(rng, max_ranks)
        try:
            validate(app.load(overrides), world_size=world, device="cpu")
        except ConfigProblems:
            continue
        return overrides, world
    raise RuntimeError(f"no config validation accepts in {tries} draws")


def last_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "Error" in line or "error" in line]
    return lines[-1].strip() if lines else (stderr.strip().splitlines() or ["(no output)"])[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="configs to train (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-ranks", type=int, choices=(1, 2, 4), default=2, help="largest world size drawn")
    ap.add_argument(
        "--out", type=Path, default=None, help="where the run directories go (default: a temp dir)"
    )
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    out = args.out or Path(tempfile.mkdtemp(prefix="random-configs-"))
    charllm = [sys.executable, "-m", "charllm_nemo.cli", "train"]
    failed: list[tuple[list[str], str]] = []
    for i in range(args.runs):
        overrides, world = accepted(rng, args.max_ranks)
        run = [*overrides, "batch.train_steps=2", "logger=none", "telemetry.backend=synthetic"]
        t0 = time.monotonic()
        proc = subprocess.run(
            [*charllm, *run, f"telemetry.out_dir={out / str(i)}"], capture_output=True, text=True, timeout=600
        )
        verdict = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
        took = time.monotonic() - t0
        print(f"[{i + 1}/{args.runs}] {verdict} in {took:.1f} s, {world} rank(s): {' '.join(run)}")
        if proc.returncode:
            failed.append((run, last_error(proc.stderr)))
            print(f"    {failed[-1][1]}")
        sys.stdout.flush()
    print(f"{args.runs - len(failed)} of {args.runs} accepted configs trained; run directories under {out}")
    for run, error in failed:
        print(f"  failed: charllm train {' '.join(run)}\n    {error}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
