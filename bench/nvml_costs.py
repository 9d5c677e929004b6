"""What each NVML source costs on this machine's driver, and whether polling NVML slows CUDA work.

    python bench/nvml_costs.py                      # on a GPU machine
    python bench/nvml_costs.py --skip-interference  # anywhere NVML answers (e.g. the stand-in)

1. **Sources**: every candidate source of every metric (devices/nvml_sources.py) that answers on
   GPU 0, each timed alone (``--reads`` calls; median and max in µs): a field of the batched
   ``nvmlDeviceGetFieldValues`` call in a batch of its own, a dedicated call as it is. The
   chosen source of each metric is starred; then the backend's plans: its two field batches
   (gauges, cumulative counters),
   ``read()`` (both) and ``read_gauges()`` (what the sampler calls between counter slots).
2. **Interference** (needs torch with CUDA): a launch-bound CUDA loop (small matmuls, one
   synchronize per block) timed in alternating blocks while a child process does nothing,
   calls ``read()`` at 100 Hz, or calls it back to back: the ratio of block times against the
   idle blocks says whether NVML calls from another process delay CUDA work in this one.

Prints a table per part and writes ``--json`` if given.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))


def _time_us(fn: Any, reads: int) -> tuple[float, float]:
    times = []
    for _ in range(reads):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times), max(times)


def source_costs(reads: int) -> dict[str, Any]:
    from charllm_nemo.devices.nvml import open_backend
    from charllm_nemo.devices.nvml_sources import (
        FIELD_RC,
        FIELD_STRIDE,
        NVML_SUCCESS,
        CallSource,
        FieldBatch,
        FieldSource,
        candidate_sources,
        resolve,
    )

    backend = open_backend([0])
    try:
        dev = backend.devices[0]
        p, handle = backend._nvml, dev._handle
        chosen = dev.identity.extra["metric_sources"]
        field_fn = resolve(p, "nvmlDeviceGetFieldValues")
        rows: list[dict[str, Any]] = []
        seen: set[str] = set()
        for metric, sources in candidate_sources(p, handle).items():
            for src in sources:
                if src.label in seen:  # one call serving two metrics (utilization) is timed once
                    continue
                seen.add(src.label)
                if isinstance(src, FieldSource):
                    batch = FieldBatch(src.entries)
                    rc, raw = batch.fetch(field_fn, handle)
                    rcs = raw[FIELD_RC::FIELD_STRIDE]
                    rc = rc or next((r for r in rcs if r), 0)

                    def call(batch: FieldBatch = batch) -> None:
                        batch.fetch(field_fn, handle)

                else:
                    assert isinstance(src, CallSource)
                    fn = resolve(p, src.fn_name)
                    if fn is None:
                        continue
                    rc = int(fn(*src.args))

                    def call(fn: Any = fn, args: tuple[Any, ...] = src.args) -> None:
                        fn(*args)

                if rc != NVML_SUCCESS:
                    continue
                med, mx = _time_us(call, reads)
                star = src.label == chosen.get(metric)
                rows.append(
                    {"metric": metric, "source": src.label, "chosen": star, "median_us": med, "max_us": mx}
                )
        plan: dict[str, Any] = {}
        for part, (fields, _, _) in (("gauges", dev._gauges), ("counters", dev._counters)):
            if fields is not None:
                plan[f"{part}_field_batch_entries"] = fields.count
                plan[f"{part}_field_batch_median_us"], plan[f"{part}_field_batch_max_us"] = _time_us(
                    lambda fields=fields: fields.fetch(field_fn, handle), reads
                )
        plan["read_median_us"], plan["read_max_us"] = _time_us(dev.read, reads)
        plan["read_gauges_median_us"], plan["read_gauges_max_us"] = _time_us(dev.read_gauges, reads)
    finally:
        backend.close()
    print(f"NVML sources on GPU 0 ({reads} calls each; * = the backend's choice)", flush=True)
    print(f"  {'metric':<22} {'source':<56} {'median us':>10} {'max us':>10}")
    for r in sorted(rows, key=lambda r: -r["median_us"]):
        mark = "*" if r["chosen"] else " "
        print(f"{mark} {r['metric']:<22} {r['source']:<56} {r['median_us']:10.1f} {r['max_us']:10.1f}")
    for part in ("gauges", "counters"):
        if f"{part}_field_batch_entries" in plan:
            n, med, mx = (plan[f"{part}_field_batch_{k}"] for k in ("entries", "median_us", "max_us"))
            print(f"  the {part}' field batch ({n} entries): {med:.1f} us median, {mx:.1f} max")
    for call in ("read", "read_gauges"):
        med, mx = plan[f"{call}_median_us"], plan[f"{call}_max_us"]
        print(f"  {call}(): {med:.1f} us median, {mx:.1f} max", flush=True)
    return {"sources": rows, "plan": plan}


def _poller(mode: str, go: Any, stop: Any) -> None:
    from charllm_nemo.devices.nvml import open_backend

    backend = open_backend([0])
    dev = backend.devices[0]
    period = 0.01
    while not stop.is_set():
        if not go.wait(0.05):
            continue
        if mode == "busy":
            dev.read()
        else:
            t0 = time.monotonic()
            dev.read()
            time.sleep(max(0.0, period - (time.monotonic() - t0)))
    backend.close()


def interference(rounds: int, block_s: float) -> dict[str, Any]:
    import torch

    x = torch.randn(256, 256, device="cuda")
    w = torch.randn(256, 256, device="cuda") / 16

    def block() -> float:
        """Seconds per small matmul over ~block_s of launch-bound work."""
        nonlocal x
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < block_s:
            for _ in range(200):
                x = torch.tanh(x @ w)
            torch.cuda.synchronize()
            n += 200
        return (time.perf_counter() - t0) / n

    block()  # warm-up
    ctx = mp.get_context("spawn")
    result: dict[str, Any] = {}
    for mode in ("100hz", "busy"):
        go, stop = ctx.Event(), ctx.Event()
        child = ctx.Process(target=_poller, args=(mode, go, stop), daemon=True)
        child.start()
        time.sleep(1.0)  # the child's NVML init
        idle, polled = [], []
        for i in range(rounds):
            for on in (False, True) if i % 2 == 0 else (True, False):
                (go.set if on else go.clear)()
                time.sleep(0.05)
                (polled if on else idle).append(block())
        stop.set()
        go.set()
        child.join(10)
        ratios = [b / a for a, b in zip(idle, polled, strict=True)]
        result[mode] = {
            "idle_us_per_op": statistics.median(idle) * 1e6,
            "polled_us_per_op": statistics.median(polled) * 1e6,
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
        r = result[mode]
        print(
            f"  NVML read() {mode:>5} in another process: {r['polled_us_per_op']:.2f} us per matmul vs "
            f"{r['idle_us_per_op']:.2f} idle; ratio median {r['ratio_median']:.4f} "
            f"[{r['ratio_min']:.4f}, {r['ratio_max']:.4f}] over {rounds} pairs",
            flush=True,
        )
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reads", type=int, default=50, help="timed calls per source")
    ap.add_argument("--skip-interference", action="store_true")
    ap.add_argument("--rounds", type=int, default=8, help="interference: idle/polled pairs per mode")
    ap.add_argument("--block-s", type=float, default=0.5, help="interference: seconds per block")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args(argv)
    report: dict[str, Any] = {"sources": source_costs(args.reads)}
    if not args.skip_interference:
        print("interference: launch-bound CUDA loop (256x256 fp32 matmul + tanh) in this process", flush=True)
        report["interference"] = interference(args.rounds, args.block_s)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
