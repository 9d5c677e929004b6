"""What PowerThermalCallback costs NeMo 2.7.3's own recipe, with the recipe's own logger.

``llm.llama3_8b.pretrain_recipe()`` shrunk to a tiny model on CPU (2 layers, hidden 64, seq 64,
byte tokenizer, MockDataModule global batch 4 / micro 1; tests/integrations/nemo_cpu.py's CPU
support), its log kept (NeMoLogger with the recipe's TensorBoardLogger, ``log_every_n_steps``
10, its TimingCallback) minus checkpointing, built with ``fdl.build(recipe)`` and run as the
recipe's ``llm.pretrain``. Two parts:

a. **training thread** (one process, the callback ON and OFF in ABBA blocks of one step; the
   telemetry session open in both arms): wall and CPU time (``time.thread_time``) inside the
   callback's step hooks (begin_step, optimizer phase, end_step, the loggers' queue put), the
   whole step's ON/OFF ratio, and the paired ABBA differences.
b. **whole step** (``--pairs K``): K pairs of processes, one with the callback (its telemetry
   process included), one without, alternating which goes first; each pair's ratio of median
   steps, their geometric mean and a bootstrap interval over pairs.

    .venv-nemo/bin/python bench/bench_nemo_callback.py --steps 400 --pairs 4
    .venv-nemo/bin/python bench/bench_nemo_callback.py --steps 400 --stop-child   # a. with the
        # telemetry process stopped in the OFF steps: its CPU counted in the ON arm only
    .venv-nemo/bin/python bench/bench_nemo_callback.py --device cuda --steps 200  # GPU (gpu_check)

Every figure is printed with its spread; on a shared machine absolute times move with the load
(printed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def is_on(step: int) -> bool:
    """ABBA: steps 0,3 | 4,7 | ... on; 1,2 | 5,6 | ... off (drift cancels within each block)."""
    return step % 4 in (0, 3)


def tiny_recipe(tmp: str, steps: int, global_batch: int, seq: int, device: str = "cpu") -> Any:
    """NeMo's llama3_8b pretrain recipe, shrunk (its log and TimingCallback kept): the tiny CPU
    model, or with ``device="cuda"`` a 4-layer, hidden-512 GPT on one GPU."""
    import nemo_run as run
    from nemo import lightning as nl
    from nemo.collections import llm
    from tests.integrations import nemo_cpu

    recipe = llm.llama3_8b.pretrain_recipe(
        name="tiny", dir=os.path.join(tmp, "nemo"), num_nodes=1, num_gpus_per_node=1
    )
    if device == "cuda":
        model_config = run.Config(
            llm.GPTConfig,
            num_layers=4,
            hidden_size=512,
            ffn_hidden_size=2048,
            num_attention_heads=8,
            seq_length=seq,
            vocab_size=nemo_cpu.VOCAB,
            make_vocab_size_divisible_by=128,
            share_embeddings_and_output_weights=False,
        )
    else:
        model_config = run.Config(nemo_cpu.tiny_gpt_config, seq_length=seq)
    recipe.model = run.Config(llm.GPTModel, config=model_config, tokenizer=run.Config(nemo_cpu.ByteTokenizer))
    recipe.optim = run.Config(nemo_cpu.cpu_optimizer)
    recipe.data = run.Config(
        nemo_cpu.MaskedMockDataModule, seq_length=seq, micro_batch_size=1, global_batch_size=global_batch
    )
    recipe.trainer.accelerator = "cpu" if device == "cpu" else "gpu"
    recipe.trainer.devices = 1
    recipe.trainer.max_steps = steps
    recipe.trainer.limit_val_batches = 0
    recipe.trainer.val_check_interval = steps + 1
    recipe.trainer.enable_checkpointing = False  # (dist_checkpointing syncs CUDA)
    if device == "cpu":
        recipe.trainer.strategy = run.Config(nemo_cpu.cpu_strategy)
    else:
        recipe.trainer.strategy = run.Config(nl.MegatronStrategy, ckpt_async_save=False)
    recipe.trainer.plugins = run.Config(nl.MegatronMixedPrecision, precision="32")
    recipe.log.ckpt = None
    recipe.log.log_dir = os.path.join(tmp, "nemo")
    recipe.resume = None
    return recipe


def clocks(times: dict[str, list[float]], warmup: int, arm: Any) -> tuple[Any, Any]:
    """First and last callbacks: a step from the first one's on_train_batch_start to the last
    one's on_train_batch_end, into ``times[arm(step)]``."""
    import lightning.pytorch as pl

    class StartClock(pl.Callback):  # type: ignore[misc]
        t0 = 0.0

        def on_train_batch_start(self, trainer: Any, *a: Any) -> None:
            self.t0 = time.perf_counter()

    class EndClock(pl.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            dt = time.perf_counter() - start.t0
            step = trainer.global_step - 1  # global_step counts the step just done
            if step >= warmup:
                times[arm(step)].append(dt)

    start = StartClock()
    return start, EndClock()


def interleaved_callback(
    out_dir: str,
    warmup: int,
    log_to: str,
    times: dict[str, list[float]],
    profile: Any = None,
    stop_child: bool = False,
) -> Any:
    from charllm_nemo.integrations.nemo import PowerThermalCallback

    on_prof = profile.enable if profile is not None else (lambda: None)
    off_prof = profile.disable if profile is not None else (lambda: None)

    clock, cpu = time.perf_counter, time.thread_time

    class Interleaved(PowerThermalCallback):  # type: ignore[misc]
        """The callback, doing its per-step work only on the ON steps; wall and CPU time inside
        its step hooks summed per step."""

        wall = busy = 0.0

        child: int | None = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            on = is_on(trainer.global_step)
            if self.child is not None:  # the telemetry process runs in the ON steps only
                os.kill(self.child, signal.SIGCONT if on else signal.SIGSTOP)
            for config, inner in self._timers_patched:
                config.timers = self._adapters[id(config)] if on else inner
            if on:
                t, c = clock(), cpu()
                on_prof()
                super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
                off_prof()
                self.wall, self.busy = clock() - t, cpu() - c

        def on_before_optimizer_step(self, *a: Any) -> None:
            t, c = clock(), cpu()
            on_prof()
            super().on_before_optimizer_step(*a)
            off_prof()
            self.wall += clock() - t
            self.busy += cpu() - c

        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            t, c = clock(), cpu()
            on = self._in_step
            on_prof()
            super().on_train_batch_end(trainer, *a)
            off_prof()
            if on and trainer.global_step - 1 >= warmup:
                times["hooks"].append(self.wall + clock() - t)
                times["hooks_cpu"].append(self.busy + cpu() - c)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            super().on_train_start(trainer, pl_module)
            self._adapters = {id(c): c.timers for c, _inner in self._timers_patched}
            if stop_child:
                self.child = self.telemetry.session.engine.pid
                self.telemetry.max_figure_wait_s = 0.0  # a stopped process answers late: never wait

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if self.child is not None:
                os.kill(self.child, signal.SIGCONT)
            super().on_train_end(trainer, pl_module)

    return Interleaved(backend="synthetic", out_dir=out_dir, hz=100, log_to=log_to)


def run_recipe(args: argparse.Namespace, tmp: str, extra: list[Any]) -> None:
    import fiddle as fdl

    recipe = tiny_recipe(tmp, args.steps, args.global_batch, args.seq, args.device)
    task = fdl.build(recipe)  # functools.partial(llm.pretrain, model=..., trainer=..., log=...)
    task.keywords["trainer"].callbacks.extend(extra)
    task()


def setup(tmp: str, device: str = "cpu") -> None:
    sys.path.insert(0, str(REPO))
    from tests.integrations import nemo_cpu

    if device == "cpu":
        nemo_cpu.enable(os.path.join(tmp, "nemorun"))
    else:
        os.environ["NEMORUN_HOME"] = os.path.join(tmp, "nemorun")
        nemo_cpu.drop_removed_optimizer_kwargs()  # NeMo 2.7.3 + megatron-core 0.16, GPU too


def part_a(args: argparse.Namespace) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="bench-nemo-")
    setup(tmp, args.device)
    times: dict[str, list[float]] = {"on": [], "off": [], "hooks": [], "hooks_cpu": []}
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
    cb = interleaved_callback(
        os.path.join(tmp, "run"), args.warmup, args.log_to, times, profile, args.stop_child
    )
    start, end = clocks(times, args.warmup, lambda s: "on" if is_on(s) else "off")
    run_recipe(args, tmp, [start, cb, end])
    if profile is not None:
        import pstats

        pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    on, off = times["on"], times["off"]
    blocks = zip(on[0::2], off[0::2], off[1::2], on[1::2], strict=False)
    pairs = [(a1 + a2 - b1 - b2) / 2 for a1, b1, b2, a2 in blocks]
    return {
        "on": on,
        "off": off,
        "pairs": pairs,
        "hooks": times["hooks"],
        "hooks_cpu": times["hooks_cpu"],
        "load": os.getloadavg()[0],
    }


def part_b_child(args: argparse.Namespace) -> None:
    """One process of a pair: the recipe with the callback (``--arm on``) or without."""
    tmp = tempfile.mkdtemp(prefix="bench-nemo-")
    setup(tmp, args.device)
    times: dict[str, list[float]] = {"step": []}
    start, end = clocks(times, args.warmup, lambda s: "step")
    extra: list[Any] = [start]
    if args.arm == "on":
        from charllm_nemo.integrations.nemo import PowerThermalCallback

        extra.append(PowerThermalCallback(backend="synthetic", out_dir=os.path.join(tmp, "run"), hz=100))
    extra.append(end)
    run_recipe(args, tmp, extra)
    Path(args.json).write_text(json.dumps({"step": times["step"], "load": os.getloadavg()[0]}))


def part_b(args: argparse.Namespace) -> list[tuple[float, float, float]]:
    """(ratio, median ON, median OFF) per pair."""
    out = []
    tmp = tempfile.mkdtemp(prefix="bench-nemo-pairs-")
    for i in range(args.pairs):
        medians = {}
        for arm in ("on", "off") if i % 2 == 0 else ("off", "on"):
            path = os.path.join(tmp, f"{i}-{arm}.json")
            cmd = [sys.executable, __file__, "--arm", arm, "--json", path]
            cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            cmd += ["--global-batch", str(args.global_batch), "--seq", str(args.seq), "--device", args.device]
            subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
            medians[arm] = statistics.median(json.loads(Path(path).read_text())["step"])
        out.append((medians["on"] / medians["off"], medians["on"], medians["off"]))
        print(
            f"  pair {i}: ON {medians['on'] * 1e3:.2f} ms, OFF {medians['off'] * 1e3:.2f} ms, "
            f"ratio {out[-1][0]:.4f}",
            flush=True,
        )
    return out


def bootstrap(values: list[float], stat: Any, n: int = 4000) -> tuple[float, float]:
    rng = random.Random(0)
    got = sorted(stat([values[rng.randrange(len(values))] for _ in values]) for _ in range(n))
    return got[int(0.025 * n)], got[int(0.975 * n)]


def bootstrap_ratio(on: list[float], off: list[float], n: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    ratios = []
    for _ in range(n):
        a = [on[rng.randrange(len(on))] for _ in on]
        b = [off[rng.randrange(len(off))] for _ in off]
        ratios.append(statistics.median(a) / statistics.median(b))
    ratios.sort()
    return ratios[int(0.025 * n)], ratios[int(0.975 * n)]


def geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def report_a(args: argparse.Namespace, a: dict[str, Any]) -> None:
    on, off, pairs = a["on"], a["off"], a["pairs"]
    print(
        f"a. llama3_8b recipe shrunk (CPU, global batch {args.global_batch}, seq {args.seq}), log_to="
        f"{args.log_to!r} with the recipe's TensorBoard logger; {len(on)} ON / {len(off)} OFF steps after "
        f"{args.warmup} warm-up, ABBA in one process"
        + ("; the telemetry process stopped in the OFF steps" if args.stop_child else "")
        + f"; load average {a['load']:.1f} on {os.cpu_count()} CPUs"
    )
    for key, what in (("hooks", "wall"), ("hooks_cpu", "training-thread CPU")):
        xs = sorted(a[key])
        lo, hi = bootstrap(xs, statistics.median)
        print(
            f"inside the callback's step hooks, {what}: median {statistics.median(xs) * 1e3:.3f} ms "
            f"[{lo * 1e3:.3f}, {hi * 1e3:.3f}] a step, mean {statistics.fmean(xs) * 1e3:.3f} ms, "
            f"p90 {xs[int(0.9 * len(xs))] * 1e3:.3f} ms"
        )
    med_on, med_off = statistics.median(on), statistics.median(off)
    lo, hi = bootstrap_ratio(on, off)
    print(f"median step: ON {med_on * 1e3:.2f} ms, OFF {med_off * 1e3:.2f} ms")
    print(f"ratio ON/OFF (medians) {med_on / med_off:.4f}  bootstrap 95% [{lo:.4f}, {hi:.4f}]")
    lo, hi = bootstrap(pairs, statistics.median)
    print(
        f"cost per step: ABBA block differences, median {statistics.median(pairs) * 1e3:+.3f} ms "
        f"[{lo * 1e3:+.3f}, {hi * 1e3:+.3f}], {len(pairs)} blocks"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--log-to", default="trainer", choices=["trainer", "none"])
    ap.add_argument("--pairs", type=int, default=0, help="part b: process pairs (0: part a only)")
    ap.add_argument("--profile", action="store_true", help="part a: cProfile the step hooks")
    ap.add_argument(
        "--stop-child",
        action="store_true",
        help="part a: SIGSTOP the telemetry process in the OFF steps (its CPU in the ON arm only)",
    )
    ap.add_argument("--skip-a", action="store_true", help="part b only")
    ap.add_argument("--arm", choices=["on", "off"], help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        part_b_child(args)
        return
    if not args.skip_a:
        report_a(args, part_a(args))
    if args.pairs:
        print(
            f"b. whole step, {args.pairs} process pairs (callback with its telemetry process / none), "
            f"{args.steps} steps each"
        )
        rows = part_b(args)
        ratios = [r for r, _a, _b in rows]
        lo, hi = bootstrap(ratios, geomean)
        print(
            f"ratio ON/OFF over process pairs: geometric mean {geomean(ratios):.4f} [{lo:.4f}, {hi:.4f}]; "
            f"load average {os.getloadavg()[0]:.1f}"
        )


if __name__ == "__main__":
    main()
