"""One-shot GPU validation: the real NVML path and CUDA training, in about 5 minutes.

    python bench/gpu_check.py --out /tmp/gpucheck            # on a GPU machine
    python bench/gpu_check.py --mode stub --quick --out DIR  # no GPU: stand-in NVML + CPU training

Parts (each prints its figures; all of them go into DIR/gpu_check.json):

1. inventory: every GPU opened through our NVML backend; each metric's support and a sample
   (throttle reasons decoded); the backend's read time per sample set.
2. load: sample idle (~10 s), under a bf16 matmul loop sized to saturate the GPU (~30 s),
   idle again (~10 s); average/peak power, temperature rise, clocks, throttle reasons seen,
   energy from the counter versus the integrated instant power, the achieved sampling rate and
   the energy counter's observed update period. Then (bench/gpu_buffers.py) the driver's own
   sample buffers: the cost of a drain, their rate and gaps in the load run, and their
   agreement with the polled instant power. Then (bench/gpu_counters.py) the driver's own
   per-reason throttle time counters against the time the sampled reason bits show, per reason,
   and each bit's transitions per minute.
3. training: ``charllm train`` for tiny_gpt and a ~1B-parameter GPT with telemetry (CUDA-event
   windows on GPU) and without, ~20 steps each: tokens/s, TFLOP/s, MFU, energy per step, and
   the step-time ratio telemetry on / off.

``--mode stub`` runs the same code paths against the stand-in libnvidia-ml.so.1 of the test
suite (tests/fakes/fake_nvml.c, built with gcc) with a CPU load and CPU training, so CI keeps
this script from rotting. Figures from that mode describe the stand-in, not hardware.

Runs from a source checkout with ``PYTHONPATH=src`` on a machine that has torch (with CUDA)
but not our other dependencies, given the wheels listed in docs/gpu-check.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

STUB_SCRIPT = [
    "* call_delay_us 10",
    "* energy_mode dynamic",
    "* energy_update_ms 50",
    "* power_instant_mw 300000",
    "* power_square_mw 650000",
    "* power_period_ms 200",
    "* name NVIDIA H200 (stand-in)",
]


def log(msg: str) -> None:
    print(msg, flush=True)


# -- part 1 --------------------------------------------------------------------------------
def inventory(reads: int) -> dict[str, Any]:
    from charllm_nemo.devices.nvml import open_backend
    from charllm_nemo.telemetry.schema import METRIC_NAMES, decode_throttle

    backend = open_backend(None)
    out: dict[str, Any] = {"devices": []}
    try:
        for dev in backend.devices:
            ident = dev.identity
            reading = dev.read()
            t0 = time.perf_counter()
            for _ in range(reads):
                dev.read()
            per_read_us = (time.perf_counter() - t0) / reads * 1e6
            sample = dict(zip(METRIC_NAMES, reading, strict=True))
            supported = dev.supported_metrics()
            log(f"GPU {ident.index}: {ident.name}  uuid={ident.uuid}  driver={ident.driver_version}")
            for name in METRIC_NAMES:
                flag = "yes" if supported.get(name) else "no "
                log(f"    {name:<22} {flag}  {sample[name]}")
            log(f"    throttle reasons now: {', '.join(decode_throttle(sample['throttle_reasons'])) or '-'}")
            log(f"    read(): {per_read_us:.1f} us per sample set ({reads} reads)")
            out["devices"].append(
                {
                    "identity": ident.to_dict(),
                    "supported": supported,
                    "sample": sample,
                    "throttle_reasons": list(decode_throttle(sample["throttle_reasons"])),
                    "read_us": per_read_us,
                }
            )
    finally:
        backend.close()
    return out


# -- part 2 --------------------------------------------------------------------------------
def _load_fn(mode: str) -> tuple[Any, str]:
    """A function that keeps the device busy for ~n seconds, and what it is."""
    if mode == "gpu":
        import torch

        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)

        def load(seconds: float) -> float:
            flops = 0.0
            torch.cuda.synchronize()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                for _ in range(20):
                    torch.matmul(a, b)
                torch.cuda.synchronize()
                flops += 20 * 2 * n**3
            return flops

        return load, f"bf16 matmul {n}x{n} on cuda"
    import numpy as np

    m = np.random.default_rng(0).standard_normal((256, 256))

    def cpu_load(seconds: float) -> float:
        flops = 0.0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            m @ m
            flops += 2 * 256**3
        return flops

    return cpu_load, "fp64 matmul 256x256 on the CPU (stub mode)"


def wait_for_samples(tel: Any, n: int, timeout_s: float) -> float:
    """Seconds until ``tel`` (a started TelemetrySession) has taken ``n`` samples; RuntimeError
    naming its start-up error after ``timeout_s`` without them."""
    t0 = time.monotonic()
    while tel.health.samples < n:
        if time.monotonic() - t0 > timeout_s:
            why = tel.health.stop_reason
            raise RuntimeError(f"the sampler took no {n} samples in {timeout_s:g} s ({why})")
        time.sleep(0.02)
    return time.monotonic() - t0


def load_test(mode: str, out_dir: Path, idle_s: float, load_s: float, hz: float) -> dict[str, Any]:
    import numpy as np

    from charllm_nemo.telemetry.attribution import attribute_windows, energy_from_counter, integrate_power
    from charllm_nemo.telemetry.reader import load_rank, to_arrays
    from charllm_nemo.telemetry.schema import decode_throttle
    from charllm_nemo.telemetry.session import TelemetrySession
    from charllm_nemo.telemetry.session_options import SessionOptions, StoreOptions
    from charllm_nemo.telemetry.timelines import GAP_PERIODS, _Series, sample_period_ns

    load, what = _load_fn(mode)
    run_dir = out_dir / "load_run"
    # Every counter with every sample: this part measures the energy counter's own update
    # period (training runs read the counters at telemetry.counter_hz, 10 Hz by default).
    # overwrite: a rerun with the same --out replaces its runs.
    options = SessionOptions(
        backend="nvml", hz=hz, devices=[0], counter_hz=hz, store=StoreOptions(overwrite=True)
    )
    tel = TelemetrySession(run_dir, options, config={"gpu_check": "load", "load": what})
    tel.start()
    rec = tel.windows
    # The windows begin once the sampler samples: its process can take seconds to start on a busy
    # host (a CI VM at load 30 had not sampled within the 3 s load window of --quick: no figures).
    waited = wait_for_samples(tel, 2, timeout_s=120.0)
    log(f"load test: sampler sampling after {waited:.1f} s")
    time.sleep(0.3)  # a counter tick before the first window, so its energy can come from the counter
    log(f"load test: idle {idle_s:g} s, {what} {load_s:g} s, idle {idle_s:g} s, sampling at {hz:g} Hz")
    with rec.window("phase", "idle_before"):
        time.sleep(idle_s)
    with rec.window("phase", "load"):
        flops = load(load_s)
    with rec.window("phase", "idle_after"):
        time.sleep(idle_s)
    time.sleep(0.3)  # a counter tick after the last window, so its energy can come from the counter
    tel.close()
    rank = load_rank(run_dir, 0)
    s = to_arrays(rank.samples)
    w = to_arrays(rank.windows)
    figs = attribute_windows(s, w)
    t = s["t_mono_ns"]
    result: dict[str, Any] = {"load": what, "achieved_tflops": flops / load_s / 1e12, "windows": {}}
    for i, name in enumerate(w["name"]):
        t0, t1 = int(w["t_begin_mono_ns"][i]), int(w["t_end_mono_ns"][i])
        inside = (t >= t0) & (t < t1)
        p = s["power_instant_w"]
        temps = s["temp_gpu_c"][inside]
        masks = s["throttle_reasons"][inside]
        union = int(np.bitwise_or.reduce(masks[masks >= 0])) if (masks >= 0).any() else 0
        e_counter = float(energy_from_counter(t, s["energy_mj"], [t0], [t1])[0])
        e_power = float(integrate_power(t, p, [t0], [t1])[0])
        entry = {
            "duration_s": (t1 - t0) / 1e9,
            "samples": int(inside.sum()),
            "achieved_hz": float(inside.sum() / ((t1 - t0) / 1e9)),
            "power_avg_w": float(figs["power_avg_w"][i]),
            "power_peak_w": float(figs["power_peak_w"][i]),
            "temp_start_c": float(temps[0]) if temps.size else None,
            "temp_end_c": float(temps[-1]) if temps.size else None,
            "temp_peak_c": float(figs["temp_gpu_peak_c"][i]),
            "temp_hbm_peak_c": float(figs["temp_hbm_peak_c"][i]),
            "clock_sm_avg_mhz": float(figs["clock_sm_avg_mhz"][i]),
            "clock_sm_min_mhz": float(figs["clock_sm_min_mhz"][i]),
            "throttle_reasons_seen": list(decode_throttle(union)),
            "energy_counter_j": e_counter,
            "energy_power_integral_j": e_power,
            # the tool's figure (the counter, its edges from the power) and its stated bound; the
            # integral's trapezoid bound (inf across a sampling gap, as a busy host leaves)
            "energy_j": float(figs["energy_j"][i]),
            "energy_bound_j": float(figs["energy_bound_j"][i]),
            "energy_power_integral_bound_j": float(
                _Series(t, p.astype(np.float64)).trapezoid_bound(
                    np.array([t0]), np.array([t1]), GAP_PERIODS * sample_period_ns(t)
                )[0]
            ),
            "energy_ratio_counter_over_integral": e_counter / e_power if e_power else None,
            "energy_method": str(figs["energy_method"][i]),
        }
        result["windows"][str(name)] = entry
        log(
            f"  {name:<12} {entry['duration_s']:6.1f} s  {entry['samples']:5d} samples "
            f"({entry['achieved_hz']:.1f} Hz)  avg {entry['power_avg_w']:.1f} W  "
            f"peak {entry['power_peak_w']:.1f} W  "
            f"T {entry['temp_start_c']}->{entry['temp_end_c']} C (HBM peak {entry['temp_hbm_peak_c']:.1f})  "
            f"SM {entry['clock_sm_avg_mhz']:.0f} MHz (min {entry['clock_sm_min_mhz']:.0f})  "
            f"throttle: {', '.join(entry['throttle_reasons_seen']) or 'none'}  "
            f"E counter {e_counter:.1f} J vs integral {e_power:.1f} J"
        )
    e = s["energy_mj"]
    ok = e >= 0
    changed = np.flatnonzero(np.diff(e[ok]) != 0) + 1
    tick_times = t[ok][changed]
    period_ms = float(np.median(np.diff(tick_times)) / 1e6) if tick_times.size > 2 else None
    result["energy_counter_update_ms_median"] = period_ms
    result["sampler"] = rank.manifest.get("sampler", {})
    result["run_dir"] = str(run_dir)
    log(
        f"  energy counter update period (median of observed ticks): {period_ms} ms; "
        f"sampler: {result['sampler'].get('samples')} samples, "
        f"{100 * result['sampler'].get('deadline_ratio', 0):.2f} % deadlines met, "
        f"read {result['sampler'].get('read_ns_mean', 0) / 1e3:.1f} us/sample"
    )
    return result


# -- part 3 --------------------------------------------------------------------------------
def _train(overrides: list[str], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "charllm_nemo.cli", "train", *overrides]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        # A hung run (an NCCL init, say) must not take the rest of the check with it.
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        log(f"  killed after {timeout_s:g} s\n{out[-2000:]}\n{err[-2000:]}")
        return {"overrides": overrides, "rc": -9, "wall_s": timeout_s, "error": f"timeout\n{err[-2000:]}"}
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        log(proc.stdout[-3000:])
        log(proc.stderr[-3000:])
        return {"overrides": overrides, "rc": proc.returncode, "wall_s": wall, "error": proc.stderr[-2000:]}
    log(f"  console (last lines):\n{proc.stdout[-1200:]}")
    return {"overrides": overrides, "rc": 0, "wall_s": wall}


def _summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    if path.exists():
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    return {}


def training(mode: str, out_dir: Path, steps: int, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    models: list[tuple[str, list[str]]] = [("tiny_gpt", ["model=tiny_gpt"])]
    if mode == "gpu":
        # ~1.2B parameters: 24 layers, hidden 2048, 16 heads, FFN 8192, seq 2048, vocab 50304.
        models.append(
            (
                "gpt_1b",
                [
                    "model=tiny_gpt",
                    "model.name=custom",
                    "model.max_position_embeddings=2048",
                    "model.num_layers=24",
                    "model.hidden_size=2048",
                    "model.num_attention_heads=16",
                    "model.ffn_hidden_size=8192",
                    "model.seq_length=2048",
                    "model.vocab_size=50304",
                    "batch.precision=bf16",
                    "batch.micro_batch_size=4",
                    "batch.global_batch_size=16",
                ],
            )
        )
    results: dict[str, Any] = {}
    for name, base in models:
        entry: dict[str, Any] = {}
        for telemetry in ("on", "off"):
            run_dir = out_dir / f"train_{name}_{telemetry}"
            overrides = [
                *base,
                f"batch.train_steps={steps}",
                f"telemetry.out_dir={run_dir}",
                "telemetry.overwrite=true",
                f"telemetry.enabled={'true' if telemetry == 'on' else 'false'}",
                "telemetry.backend=nvml",
                f"launch.device={'cuda' if mode == 'gpu' else 'cpu'}",
            ]
            log(f"training {name} with telemetry {telemetry}: {steps} steps")
            res = _train(overrides, env, timeout_s)
            res["summary"] = _summary(run_dir)
            entry[telemetry] = res
            summ = res["summary"]
            if summ:
                log(
                    "  "
                    + "  ".join(
                        f"{k}={summ[k]:.4g}" if isinstance(summ.get(k), float) else f"{k}={summ.get(k)}"
                        for k in (
                            "step_time_s_median",
                            "tokens_per_s_median",
                            "model_tflops_per_gpu_median",
                            "mfu_median",
                            "energy_j_median",
                            "power_avg_w_median",
                        )
                        if k in summ
                    )
                )
                mem = summ.get("memory") or {}
                if mem.get("peak_bytes"):
                    log(
                        f"  peak memory {max(p or 0 for p in mem['peak_bytes']) / 2**30:.2f} GiB "
                        f"({mem.get('measure')}), planned weights+grads+optimizer "
                        f"{max(p or 0 for p in mem['plan_bytes']) / 2**30:.2f} GiB, estimated activations "
                        f"{max(a or 0 for a in mem.get('activation_bytes') or [0]) / 2**30:.2f} GiB; "
                        f"setup {summ.get('setup_s')}"
                    )
        on = entry["on"]["summary"].get("step_time_s_median")
        off = entry["off"]["summary"].get("step_time_s_median")
        if on and off:
            entry["step_time_ratio_on_over_off"] = on / off
            log(f"  step time with telemetry / without: {on / off:.4f}")
        results[name] = entry
    if mode == "gpu":
        results["memory_check"] = memory_check(out_dir, env, timeout_s)
    return results


def memory_check(out_dir: Path, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Llama-3 70B on one GPU: its weights, gradients and Adam state (~1.2 TB in bf16) cannot fit,
    so every rank's check before building the model (train/loop.py ``check_gpu_memory``, through
    the real ``torch.cuda.mem_get_info`` and NCCL's ``all_gather_object``) must refuse it in
    seconds: exit 2 and one line, no allocation."""
    log("memory check: model=llama3_70b on one GPU must be refused before it is built")
    run_dir = out_dir / "train_memory_check"
    overrides = [
        "model=llama3_70b",
        "batch.global_batch_size=1",
        "batch.train_steps=1",
        "launch.device=cuda",
        "telemetry.enabled=false",
        f"telemetry.out_dir={run_dir}",
        "telemetry.overwrite=true",
    ]
    res = _train(overrides, env, timeout_s)
    error = res.get("error", "")
    res["refused"] = res["rc"] == 2 and "needs at least" in error
    log(f"  rc={res['rc']} in {res['wall_s']:.1f} s, refused as expected: {res['refused']}")
    return res


# -- driver --------------------------------------------------------------------------------
def _gpu_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _stub_env(out_dir: Path) -> dict[str, str]:
    sys.path.insert(0, str(REPO))
    from tests.fakes import nvml_stub

    env = nvml_stub.subprocess_env(STUB_SCRIPT, tmp_dir=out_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH", "")) if p)
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for gpu_check.json and the run directories")
    ap.add_argument("--mode", choices=["auto", "gpu", "stub"], default="auto")
    ap.add_argument("--quick", action="store_true", help="short phases (CI)")
    ap.add_argument("--skip-training", action="store_true")
    ap.add_argument("--hz", type=float, default=100.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--train-timeout", type=float, default=600.0, help="seconds before a training run is killed"
    )
    ap.add_argument("--skip-integrations", action="store_true", help="skip NeMo / mcore 0.19 / Bridge")
    ap.add_argument("--mcore019", default=None, help="folder holding megatron-core 0.19 (pip --target)")
    ap.add_argument("--integration-timeout", type=float, default=150.0, help="seconds per integration part")
    args = ap.parse_args(argv)
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    mode = args.mode
    if mode == "auto":
        mode = "gpu" if _gpu_available() else "stub"
    if mode == "stub" and os.environ.get("_CHARLLM_GPU_CHECK_CHILD") != "1":
        # pynvml must find the stand-in at its first init: re-run this script in a child whose
        # LD_LIBRARY_PATH and FAKE_NVML_SCRIPT point at it.
        env = _stub_env(out_dir)
        env["_CHARLLM_GPU_CHECK_CHILD"] = "1"
        return subprocess.call([sys.executable, __file__, *(argv or sys.argv[1:]), "--mode", "stub"], env=env)
    idle_s, load_s = (1.0, 3.0) if args.quick else (10.0, 30.0)
    steps = min(args.steps, 5) if args.quick else args.steps
    report: dict[str, Any] = {
        "mode": mode,
        "note": "stand-in NVML library and CPU work: figures describe the stand-in, not hardware"
        if mode == "stub"
        else "real GPU",
        "host": platform.node(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
    }
    log(f"gpu_check: mode {mode} ({report['note']}), output in {out_dir}")
    t_start = time.monotonic()
    report["inventory"] = inventory(reads=200 if args.quick else 1000)
    report["load"] = load_test(mode, out_dir, idle_s, load_s, args.hz)
    from gpu_buffers import agreement, drain_cost, summary_lines  # bench/gpu_buffers.py

    report["driver_buffers"] = {
        "drain": drain_cost(drains=5 if args.quick else 20),
        "agreement": agreement(out_dir / "load_run"),
    }
    for line in summary_lines(report["driver_buffers"]["drain"], report["driver_buffers"]["agreement"]):
        log(line)
    import gpu_counters  # bench/gpu_counters.py: the driver's throttle counters vs the sampled bits

    report["throttle_counters"] = gpu_counters.counter_check(out_dir / "load_run")
    for line in gpu_counters.summary_lines(report["throttle_counters"]):
        log(line)
    if not args.skip_training:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH", "")) if p)
        report["training"] = training(mode, out_dir, steps, env, timeout_s=args.train_timeout)
        from gpu_energy_estimate import energy_estimate  # bench/gpu_energy_estimate.py

        report["energy_estimate"] = energy_estimate(mode, out_dir, env, _train, log, args.train_timeout)
    if not args.skip_integrations:
        from gpu_integrations import integrations  # bench/gpu_integrations.py

        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH", "")) if p)
        report["integrations"] = integrations(
            mode, out_dir, env, args.mcore019, 60.0 if args.quick else args.integration_timeout
        )
    report["wall_s"] = time.monotonic() - t_start
    path = out_dir / "gpu_check.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    log(f"gpu_check: done in {report['wall_s']:.0f} s; report {path}")
    failures = [
        f"training {m} telemetry {k}"
        for m, e in report.get("training", {}).items()
        for k in ("on", "off")
        if e.get(k, {}).get("rc")
    ]
    if failures:
        log(f"gpu_check: FAILED: {', '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
