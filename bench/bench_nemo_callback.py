"""What PowerThermalCallback costs NeMo 2.7.3's own recipe, with the recipe's own logger.

``llm.llama3_8b.pretrain_recipe()`` shrunk to a tiny model on CPU (2 layers, hidden 64, seq 64,
byte tokenizer, MockDataModule global batch 4 / micro 1; tests/integrations/nemo_cpu.py's CPU
support), its log kept (NeMoLogger with the recipe's TensorBoardLogger, ``log_every_n_steps``
10, its TimingCallback) minus checkpointing, built with ``fdl.build(recipe)`` and run as the
recipe's ``llm.pretrain``. Two parts:

a. **training thread** (one process, the callback ON and OFF in ABBA blocks of one step; the
   telemetry session open in both arms): wall and CPU time (``time.thread_time``) inside the
   callback's step hooks (begin_step, optimizer phase, end_step, the loggers' queue put), and
   in megatron-core's ``config.timers`` calls (the callback's timers adapter in the ON steps,
   NeMo's own Timers in the OFF steps, both behind the same timing proxy: the difference is
   what the adapter adds); **hooks + adapter** a step; the whole step's ON/OFF ratio, and the
   paired ABBA differences.
b. **whole step across processes** (``--pairs K``): K rounds of processes, one with the
   callback (its telemetry process included) and one without (with ``--compare-threads`` also
   one with the callback's threads as before #40: an observer thread woken every report and an
   alert thread of its own), the order rotated each round; each round's ratio of median steps,
   the median over rounds with a bootstrap interval (and the geometric mean); per thread of
   the training process, wakeups a second (voluntary context switches, /proc/self/task/*/status,
   over the measured steps: bench/thread_wakeups.py) and CPU, and the telemetry process's CPU.

    .venv-nemo/bin/python bench/bench_nemo_callback.py --steps 400 --pairs 4 --compare-threads
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


def clocks(times: dict[str, list[float]], warmup: int, arm: Any, after_step: Any = None) -> tuple[Any, Any]:
    """First and last callbacks: a step from the first one's on_train_batch_start to the last
    one's on_train_batch_end, into ``times[arm(step)]``; ``after_step(step)`` then, if given."""
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
            if after_step is not None:
                after_step(step)

    start = StartClock()
    return start, EndClock()


class TimedTimers:
    """megatron-core's ``config.timers`` behind a proxy that adds the wall and training-thread
    CPU time of every call (``timers(name)``, the timer's ``start`` / ``stop``) to ``acc``. Put
    around the adapter in the ON steps and around NeMo's Timers in the OFF steps: the proxy
    costs both arms the same, so the difference is the adapter's."""

    def __init__(self, target: Any, acc: list[float], profile: Any = None) -> None:
        self._target, self._acc, self._profile = target, acc, profile

    def __call__(self, name: str, *a: Any, **k: Any) -> Any:
        prof = self._profile
        t, c = time.perf_counter(), time.thread_time()
        if prof is not None:
            prof.enable()
        timer = self._target(name, *a, **k)
        if prof is not None:
            prof.disable()
        self._acc[0] += time.perf_counter() - t
        self._acc[1] += time.thread_time() - c
        return _TimedTimer(timer, self._acc, prof)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


class _TimedTimer:
    def __init__(self, timer: Any, acc: list[float], profile: Any = None) -> None:
        self._timer, self._acc, self._profile = timer, acc, profile

    def start(self, *a: Any, **k: Any) -> Any:
        prof = self._profile
        t, c = time.perf_counter(), time.thread_time()
        if prof is not None:
            prof.enable()
        out = self._timer.start(*a, **k)
        if prof is not None:
            prof.disable()
        self._acc[0] += time.perf_counter() - t
        self._acc[1] += time.thread_time() - c
        return out

    def stop(self, *a: Any, **k: Any) -> Any:
        prof = self._profile
        t, c = time.perf_counter(), time.thread_time()
        if prof is not None:
            prof.enable()
        out = self._timer.stop(*a, **k)
        if prof is not None:
            prof.disable()
        self._acc[0] += time.perf_counter() - t
        self._acc[1] += time.thread_time() - c
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._timer, name)


def interleaved_callback(
    out_dir: str,
    warmup: int,
    log_to: str,
    times: dict[str, list[float]],
    profile: Any = None,
    stop_child: bool = False,
    without_model: bool = False,
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
            for config, _inner in self._timers_patched:
                config.timers = self._timed[id(config)][0 if on else 1]
            self.timers_acc[0] = self.timers_acc[1] = 0.0
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
            if trainer.global_step - 1 >= warmup:
                arm = "on" if on else "off"
                times[f"timers_{arm}"].append(self.timers_acc[0])
                times[f"timers_cpu_{arm}"].append(self.timers_acc[1])

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            super().on_train_start(trainer, pl_module)
            self.timers_acc = [0.0, 0.0]
            self._timed = {
                id(c): (TimedTimers(c.timers, self.timers_acc, profile), TimedTimers(inner, self.timers_acc))
                for c, inner in self._timers_patched
            }
            if without_model:  # what a real device costs: no model follows the marks
                self.telemetry.session.windows.listeners.clear()
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
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "on",
            "off",
            "hooks",
            "hooks_cpu",
            "timers_on",
            "timers_off",
            "timers_cpu_on",
            "timers_cpu_off",
        )
    }
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
    cb = interleaved_callback(
        os.path.join(tmp, "run"),
        args.warmup,
        args.log_to,
        times,
        profile,
        stop_child=args.stop_child,
        without_model=args.without_model,
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
        **{k: times[k] for k in ("timers_on", "timers_off", "timers_cpu_on", "timers_cpu_off")},
        "load": os.getloadavg()[0],
    }


def part_b_child(args: argparse.Namespace) -> None:
    """One process of a round: the recipe with the callback (``--arm on``; ``on-before``: its
    threads as before #40) or without (``off``); its step times, and per thread of this process
    the wakeups and CPU over the measured steps (and the telemetry process's CPU)."""
    sys.path.insert(0, str(REPO / "bench"))
    import thread_wakeups

    tmp = tempfile.mkdtemp(prefix="bench-nemo-")
    setup(tmp, args.device)
    times: dict[str, list[float]] = {"step": []}
    marks: dict[str, Any] = {}
    cb: Any = None

    def after_step(step: int) -> None:
        # from the first measured step to the last: the callback's threads are alive in between
        if step in (args.warmup - 1, args.steps - 1):
            key = "before" if step == args.warmup - 1 else "after"
            marks[key] = thread_wakeups.snapshot()
            pid = getattr(getattr(getattr(cb, "telemetry", None), "session", None), "engine", None)
            pid = getattr(pid, "pid", None)
            marks[f"child_{key}"] = _process_cpu_s(pid) if pid else None

    start, end = clocks(times, args.warmup, lambda s: "step", after_step)
    extra: list[Any] = [start]
    if args.arm in ("on", "on-before"):
        from charllm_nemo.integrations import _observer_thread
        from charllm_nemo.integrations import nemo as nemo_callback
        from charllm_nemo.integrations.nemo import PowerThermalCallback

        if args.arm == "on-before":  # the threads as they were: woken every report, two of them
            _observer_thread.BATCH = 1
            nemo_callback.MERGE_ALERTS = False
        cb = PowerThermalCallback(backend="synthetic", out_dir=os.path.join(tmp, "run"), hz=100)
        extra.append(cb)
    extra.append(end)
    run_recipe(args, tmp, extra)
    rows = thread_wakeups.rates(marks["before"], marks["after"])
    wall = marks["after"][0] - marks["before"][0]
    child = None
    if marks.get("child_before") is not None and marks.get("child_after") is not None:
        child = (marks["child_after"] - marks["child_before"]) / wall
    Path(args.json).write_text(
        json.dumps({"step": times["step"], "load": os.getloadavg()[0], "threads": rows, "child_cpu": child})
    )


def _process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (/proc/<pid>/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


_DIST_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
)


def part_b(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Per arm, one result per round (the arms' order rotated each round)."""
    arms = ["off", "on-before", "on"] if args.compare_threads else ["off", "on"]
    out: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    tmp = tempfile.mkdtemp(prefix="bench-nemo-pairs-")
    for i in range(args.pairs):
        order = arms[i % len(arms) :] + arms[: i % len(arms)]
        for arm in order:
            path = os.path.join(tmp, f"{i}-{arm}.json")
            cmd = [sys.executable, __file__, "--arm", arm, "--json", path]
            cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            cmd += ["--global-batch", str(args.global_batch), "--seq", str(args.seq), "--device", args.device]
            # a fresh process: none of part a's process-group variables (its port is still held)
            env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
            if proc.returncode != 0:
                raise RuntimeError(f"{arm} process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
            got = json.loads(Path(path).read_text())
            got["median"] = statistics.median(got["step"])
            out[arm].append(got)
        line = ", ".join(f"{a} {out[a][-1]['median'] * 1e3:.2f} ms" for a in arms)
        print(
            f"  round {i} ({' > '.join(order)}): median step {line}; load {out[arms[-1]][-1]['load']:.1f}",
            flush=True,
        )
    return out


def report_b(args: argparse.Namespace, rounds: dict[str, list[dict[str, Any]]]) -> None:
    off = rounds["off"]
    for arm in [a for a in rounds if a != "off"]:
        ratios = [r["median"] / o["median"] for r, o in zip(rounds[arm], off, strict=True)]
        lo, hi = bootstrap(ratios, statistics.median)
        glo, ghi = bootstrap(ratios, geomean)
        print(
            f"whole step {arm}/off over {len(ratios)} rounds: median {statistics.median(ratios):.4f} "
            f"[{lo:.4f}, {hi:.4f}], geometric mean {geomean(ratios):.4f} [{glo:.4f}, {ghi:.4f}]; "
            f"per round {', '.join(f'{x:.3f}' for x in ratios)}"
        )
    for arm, results in rounds.items():
        names = sorted({row["name"] for r in results for row in r["threads"]})
        print(f"threads of the training process, {arm} (median over rounds):")
        total = [sum(row["wakeups_per_s"] for row in r["threads"]) for r in results]
        for name in names:
            ws = [sum(x["wakeups_per_s"] for x in r["threads"] if x["name"] == name) for r in results]
            cpu = [sum(x["cpu_share"] for x in r["threads"] if x["name"] == name) for r in results]
            if statistics.median(ws) >= 1 or statistics.median(cpu) >= 0.002 or name.startswith("charllm"):
                print(
                    f"    {name:<32} {statistics.median(ws):8.1f} wakeups/s  "
                    f"{100 * statistics.median(cpu):6.2f} % of a core"
                )
        print(f"    {'all threads':<32} {statistics.median(total):8.1f} wakeups/s")
        child = [r["child_cpu"] for r in results if r.get("child_cpu") is not None]
        if child:
            print(f"    telemetry process: {100 * statistics.median(child):.2f} % of a core")


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


def bootstrap_diff(on: list[float], off: list[float], n: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval of median(on) - median(off)."""
    rng = random.Random(0)
    diffs = sorted(
        statistics.median([on[rng.randrange(len(on))] for _ in on])
        - statistics.median([off[rng.randrange(len(off))] for _ in off])
        for _ in range(n)
    )
    return diffs[int(0.025 * n)], diffs[int(0.975 * n)]


def geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def report_a(args: argparse.Namespace, a: dict[str, Any]) -> None:
    on, off, pairs = a["on"], a["off"], a["pairs"]
    print(
        f"a. llama3_8b recipe shrunk (CPU, global batch {args.global_batch}, seq {args.seq}), log_to="
        f"{args.log_to!r} with the recipe's TensorBoard logger; {len(on)} ON / {len(off)} OFF steps after "
        f"{args.warmup} warm-up, ABBA in one process"
        + ("; the telemetry process stopped in the OFF steps" if args.stop_child else "")
        + ("; without the synthetic device's mark listener" if args.without_model else "")
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
    for suffix, what in (("", "wall"), ("cpu_", "training-thread CPU")):
        t_on, t_off = a[f"timers_{suffix}on"], a[f"timers_{suffix}off"]
        hooks = a["hooks" if not suffix else "hooks_cpu"]
        adapter = statistics.median(t_on) - statistics.median(t_off)
        lo, hi = bootstrap_diff(t_on, t_off)
        print(
            f"in config.timers calls, {what}: adapter ON {statistics.median(t_on) * 1e3:.3f} ms, NeMo's "
            f"Timers OFF {statistics.median(t_off) * 1e3:.3f} ms a step: the adapter adds "
            f"{adapter * 1e3:.3f} ms [{lo * 1e3:.3f}, {hi * 1e3:.3f}]; hooks + adapter "
            f"{(statistics.median(hooks) + adapter) * 1e3:.3f} ms a step"
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
    ap.add_argument(
        "--profile",
        action="store_true",
        help="part a: cProfile the step hooks and the adapter's calls (ON steps)",
    )
    ap.add_argument(
        "--stop-child",
        action="store_true",
        help="part a: SIGSTOP the telemetry process in the OFF steps (its CPU in the ON arm only)",
    )
    ap.add_argument("--skip-a", action="store_true", help="part b only")
    ap.add_argument(
        "--without-model",
        action="store_true",
        help="part a: the synthetic device's model, which follows every mark on the training thread, "
        "taken off (a real device, NVML or AMD SMI, has none): the hooks and adapter as they cost there",
    )
    ap.add_argument(
        "--compare-threads",
        action="store_true",
        help="part b: also the callback with its threads as before #40 (woken every report, two)",
    )
    ap.add_argument("--arm", choices=["on", "on-before", "off"], help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        part_b_child(args)
        return
    if not args.skip_a:
        report_a(args, part_a(args))
    if args.pairs:
        print(
            f"b. whole step across processes, {args.pairs} rounds of "
            + ("3 processes (off / on-before / on)" if args.compare_threads else "2 processes (off / on)")
            + f", {args.steps} steps each, {args.warmup} warm-up; load average {os.getloadavg()[0]:.1f} "
            f"on {os.cpu_count()} CPUs at start"
        )
        report_b(args, part_b(args))
        print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
