"""What PowerThermalCallback costs a NeMo 2 training step, on the training thread.

One ``nl.Trainer`` + ``MegatronStrategy`` run of a tiny ``llm.GPTModel`` (CPU by default, the
test support of tests/integrations/nemo_cpu.py; ``--device cuda`` on a GPU). The callback is on
for some steps and off for others, finely interleaved (ABBA blocks of one step), in one process:
ON = its hooks, the timers adapter in ``model.config.timers`` (NeMo's Timers inside it) and the
API's begin/end step; OFF = NeMo's own Timers and no hook work. The telemetry session (its
sampler in the background) is open in both arms, so the difference is the training-thread
cost. A step is timed from the first callback's ``on_train_batch_start`` to the last one's
``on_train_batch_end``.

    .venv-nemo/bin/python bench/bench_nemo_callback.py --steps 400

Prints the median step time of each arm, their ratio with a bootstrap 95 % interval, and the
median of the paired differences (ms a step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def is_on(step: int) -> bool:
    """ABBA: steps 0,3 | 4,7 | ... on; 1,2 | 5,6 | ... off (drift cancels within each block)."""
    return step % 4 in (0, 3)


def build_callbacks(out_dir: str, warmup: int) -> tuple[list[Any], dict[str, list[float]]]:
    import lightning.pytorch as pl

    from charllm_nemo.integrations.nemo import PowerThermalCallback

    times: dict[str, list[float]] = {"on": [], "off": [], "hooks": []}
    clock = time.perf_counter

    class Interleaved(PowerThermalCallback):  # type: ignore[misc]
        """The callback, doing its per-step work only on the ON steps; the time spent inside its
        step hooks (begin_step, the optimizer phase, end_step) is summed per step."""

        hook_s = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            on = is_on(trainer.global_step)
            for config, inner in self._timers_patched:
                config.timers = self._adapters[id(config)] if on else inner
            if on:
                t = clock()
                super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
                self.hook_s = clock() - t

        def on_before_optimizer_step(self, *a: Any) -> None:
            t = clock()
            super().on_before_optimizer_step(*a)
            self.hook_s += clock() - t

        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            t = clock()
            on = self._in_step
            super().on_train_batch_end(trainer, *a)
            if on and trainer.global_step - 1 >= warmup:
                times["hooks"].append(self.hook_s + clock() - t)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            super().on_train_start(trainer, pl_module)
            self._adapters = {id(c): c.timers for c, _inner in self._timers_patched}
            self._adapters_kept = dict(self._adapters)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._telemetry_kept = self.telemetry  # measured after fit, then finished
            self.telemetry = None
            for config, inner in self._timers_patched:
                config.timers = inner

    class StartClock(pl.Callback):  # type: ignore[misc]
        def on_train_batch_start(self, trainer: Any, *a: Any) -> None:
            self.t0 = time.perf_counter()

    class EndClock(pl.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            dt = time.perf_counter() - start.t0
            step = trainer.global_step - 1  # global_step counts the step just done
            if step >= warmup:
                times["on" if is_on(step) else "off"].append(dt)

    start = StartClock()
    cb = Interleaved(
        backend="synthetic" if os.environ.get("CHARLLM_BENCH_SYNTHETIC", "1") == "1" else "auto",
        out_dir=out_dir,
        hz=100,
        steps_file=True,
    )
    return [start, cb, EndClock()], times


def timer_call_cost(cb: Any, n: int = 20000) -> float:
    """Seconds per ``timers("forward-compute").start(); .stop()`` through the adapter wrapping
    NeMo's Timers, inside an open step (the calls megatron-core makes per microbatch)."""
    adapter = next(iter(cb._adapters_kept.values()))
    st = cb._telemetry_kept
    st.begin_step(10**6)
    t = time.perf_counter()
    for _ in range(n):
        adapter("forward-compute", log_level=2).start()
        adapter("forward-compute").stop()
    dt = (time.perf_counter() - t) / n
    st.end_step()
    return dt


def bootstrap_ratio(on: list[float], off: list[float], n: int = 2000) -> tuple[float, float]:
    import random

    rng = random.Random(0)
    ratios = []
    for _ in range(n):
        a = [on[rng.randrange(len(on))] for _ in on]
        b = [off[rng.randrange(len(off))] for _ in off]
        ratios.append(statistics.median(a) / statistics.median(b))
    ratios.sort()
    return ratios[int(0.025 * n)], ratios[int(0.975 * n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--global-batch", type=int, default=2)
    args = ap.parse_args()

    sys.path.insert(0, str(REPO))
    tmp = tempfile.mkdtemp(prefix="bench-nemo-")
    from tests.integrations import nemo_cpu

    if args.device == "cpu":
        nemo_cpu.enable(os.path.join(tmp, "nemorun"))
    else:
        os.environ["NEMORUN_HOME"] = os.path.join(tmp, "nemorun")
        nemo_cpu.drop_removed_optimizer_kwargs()  # NeMo 2.7.3 + megatron-core 0.16, GPU too
    import torch
    from nemo import lightning as nl
    from nemo.collections import llm

    if args.device == "cpu":
        torch.set_num_threads(1)  # one core for the step, one left for the sampler
        config = nemo_cpu.tiny_gpt_config()
        strategy = nemo_cpu.cpu_strategy()
        optim = nemo_cpu.cpu_optimizer()
        plugins = nl.MegatronMixedPrecision(precision="32")
    else:
        config = llm.GPTConfig(
            num_layers=4,
            hidden_size=512,
            ffn_hidden_size=2048,
            num_attention_heads=8,
            seq_length=512,
            vocab_size=nemo_cpu.VOCAB,
            make_vocab_size_divisible_by=128,
            share_embeddings_and_output_weights=False,
        )
        strategy = nl.MegatronStrategy(ckpt_async_save=False)
        optim = nemo_cpu.cpu_optimizer()
        plugins = nl.MegatronMixedPrecision(precision="32")
    callbacks, times = build_callbacks(os.path.join(tmp, "run"), args.warmup)
    model = llm.GPTModel(config, optim=optim, tokenizer=nemo_cpu.ByteTokenizer())
    data = nemo_cpu.MaskedMockDataModule(
        seq_length=config.seq_length, micro_batch_size=1, global_batch_size=args.global_batch
    )
    trainer = nl.Trainer(
        accelerator="cpu" if args.device == "cpu" else "gpu",
        devices=1,
        max_steps=args.steps,
        strategy=strategy,
        plugins=plugins,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
    )
    trainer.fit(model, data)
    cb = callbacks[1]
    cost = timer_call_cost(cb)
    cb._telemetry_kept.finish("complete")

    on, off = times["on"], times["off"]
    med_on, med_off = statistics.median(on), statistics.median(off)
    lo, hi = bootstrap_ratio(on, off)
    # paired differences: each ABBA block gives (A1 + A2 - B1 - B2) / 2
    blocks = zip(on[0::2], off[0::2], off[1::2], on[1::2], strict=False)
    pairs = [(a1 + a2 - b1 - b2) / 2 for a1, b1, b2, a2 in blocks]
    print(
        f"NeMo {args.device} tiny GPT, global batch {args.global_batch}, {len(on)} ON / {len(off)} OFF steps "
        f"after {args.warmup} warm-up, ABBA-interleaved in one process"
    )
    print(f"median step: ON {med_on * 1e3:.2f} ms, OFF {med_off * 1e3:.2f} ms")
    print(f"ratio ON/OFF (medians) {med_on / med_off:.4f}  bootstrap 95% [{lo:.4f}, {hi:.4f}]")
    print(
        f"cost per step: median of ABBA block differences {statistics.median(pairs) * 1e3:+.3f} ms "
        f"(mean {statistics.fmean(pairs) * 1e3:+.3f} ms, {len(pairs)} blocks)"
    )
    hooks = sorted(times["hooks"])
    print(
        f"inside the callback's step hooks (begin_step, optimizer phase, end_step): median "
        f"{statistics.median(hooks) * 1e3:.3f} ms a step, p90 {hooks[int(0.9 * len(hooks))] * 1e3:.3f} ms"
    )
    pairs_per_step = 2 * args.global_batch + 3  # forward + backward per microbatch; the grad syncs
    print(
        f"timers adapter: {cost * 1e6:.2f} us per start+stop pair over NeMo's Timers "
        f"({pairs_per_step} pairs a step here: ~{cost * pairs_per_step * 1e3:.3f} ms)"
    )
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
