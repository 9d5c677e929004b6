"""Sampler benchmarks: cost per sample, deadlines under load, and Zeus's PowerMonitor side by side.

Run:  .venv/bin/python bench/bench_sampler.py [--quick] [--only a|b|c] [--wait-quiet S]

Every figure comes from child processes that load the stand-in libnvidia-ml.so.1
(tests/fakes/fake_nvml.c) through LD_LIBRARY_PATH + FAKE_NVML_SCRIPT, so the real nvidia-ml-py
bindings and the real NVML backend run; each stand-in call busy-waits ``call_delay_us`` like a
real NVML call (20 us, as DESIGN.md's stand-in; 0 us shows the worst case of our own overhead).

This machine has 2 cores and is noisy: what is compared is measured side by side in one run
(interleaved phases in one process, or concurrent processes over the same window) and printed as
a ratio; absolute times mean little. See docs/benchmarks.md for how to read the output.

  a. sampler cost: CPU per sample of the sampler thread / CPU per raw ``device.read()`` (<= 1.2),
     plus the flusher's per-row Arrow + Parquet cost, separately and included.
  b. deadlines met at 100 Hz and 1 kHz with a busy main thread, one core free and both cores
     busy (>= 99 % with one core free).
  c. Zeus 0.16 ``PowerMonitor`` vs our sampler on the same stand-in, same call delay, same
     requested rate: CPU per delivered sample (>= 3x cheaper), samples per second, start-up.

The last line printed is ``BENCH_JSON {...}`` with every figure.

This module is also the entry point of its own child processes (``--worker NAME``; the workers
live in sampler_workers.py and zeus_workers.py). Its top level imports only the standard library
and those two: Zeus's ``spawn`` helpers re-import the main module and must not pay for ours.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sampler_workers import (
    CALL_DELAY_US,
    POWER_ONLY_LINES,
    QUIET_CORES,
    ROOT,
    ZEUS_STATS_ENV,
    descendants,
    machine_busy_ns,
    schedstat_ns,
    worker_cost,
    worker_deadlines,
)
from zeus_workers import install_zeus_hook, worker_ours, worker_zeus

WORKERS = {
    "cost": worker_cost,
    "deadlines": worker_deadlines,
    "zeus": worker_zeus,
    "ours": worker_ours,
}


# ============================================================================================
# the parent: build the stand-in, run the workers, print the table and the JSON line
# ============================================================================================


class Bench:
    def __init__(self, quick: bool) -> None:
        sys.path.insert(0, str(ROOT))
        from tests.fakes import nvml_stub

        self.stub = nvml_stub
        self.lib_dir = nvml_stub.library_dir()
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-sampler-"))
        self.quick = quick
        self.results: dict[str, Any] = {
            "quick": quick,
            "call_delay_us": CALL_DELAY_US,
            "date": time.strftime("%Y-%m-%d"),
            "cpus": os.cpu_count(),
        }

    def env(self, script: list[str], extra: dict[str, str] | None = None) -> dict[str, str]:
        env: dict[str, str] = self.stub.subprocess_env(script, tmp_dir=self.tmp, lib_dir=self.lib_dir)
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = "1"
        env.setdefault("PYTHONPATH", str(ROOT / "src"))
        env.update(extra or {})
        return env

    def run_worker(
        self, name: str, opts: dict[str, Any], script: list[str], timeout: float
    ) -> dict[str, Any]:
        cmd = [sys.executable, __file__, "--worker", name, "--opts", json.dumps(opts)]
        proc = subprocess.run(cmd, env=self.env(script), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or "RESULT " not in proc.stdout:
            raise RuntimeError(f"worker {name} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
        result: dict[str, Any] = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
        return result

    # -- a -----------------------------------------------------------------------------------
    def cost(self) -> None:
        opts = {
            "rounds": 4 if self.quick else 8,
            "phase_s": 0.25 if self.quick else 0.4,
            "flush_rows": 2000 if self.quick else 5000,
        }
        r = self.run_worker("cost", opts, [f"* call_delay_us {CALL_DELAY_US}"], timeout=120)
        c20 = r["configs"][f"{CALL_DELAY_US}us@1000Hz"]
        c0 = r["configs"]["0us@1000Hz"]
        c100 = r["configs"][f"{CALL_DELAY_US}us@100Hz"]
        f50, f500 = r["flush"]["50"]["total_us_per_row"], r["flush"]["500"]["total_us_per_row"]
        r["ratio_incl_flush"] = {
            f"{CALL_DELAY_US}us@1000Hz (500-row flushes)": (c20["sampler_cpu_us_per_sample"] + f500)
            / c20["raw_cpu_us_per_read"],
            f"{CALL_DELAY_US}us@100Hz (50-row flushes)": (c100["sampler_cpu_us_per_sample"] + f50)
            / c100["raw_cpu_us_per_read"],
            "0us@1000Hz (500-row flushes)": (c0["sampler_cpu_us_per_sample"] + f500)
            / c0["raw_cpu_us_per_read"],
        }
        self.results["a_cost"] = r
        print("\n(a) Sampler cost per sample over the raw backend read (CPU time; target <= 1.2)")
        print(
            f"    {'stand-in delay @ rate':<22}{'samples':>8}{'sampler us/sample':>19}"
            f"{'raw read us':>13}{'ratio':>8}   {'read wall in sampler / raw':>27}"
        )
        for key, c in r["configs"].items():
            print(
                f"    {key:<22}{c['samples']:>8}{c['sampler_cpu_us_per_sample']:>19.1f}"
                f"{c['raw_cpu_us_per_read']:>13.1f}{c['ratio']:>8.3f}   "
                f"{c['read_wall_us_in_sampler']:>12.1f} / {c['raw_wall_us_per_read']:.1f} us"
            )
        print(
            "    where the overhead goes (CPU us per sample; 'minimal loop' = read + sleep to the next "
            "deadline, nothing else;\n     'wake-up' = the same loop without the read: this VM's floor "
            "for one timer wake-up):"
        )
        print(
            f"    {'':<22}{'sampler':>9}{'minimal loop':>14}{'wake-up':>9}{'raw read':>10}"
            f"{'sampler/minimal':>17}{'minimal/raw':>13}"
        )
        for key, c in r["configs"].items():
            print(
                f"    {key:<22}{c['sampler_cpu_us_per_sample']:>9.1f}"
                f"{c['minimal_loop_cpu_us_per_sample']:>14.1f}"
                f"{c['bare_wakeup_cpu_us']:>9.1f}{c['raw_cpu_us_per_read']:>10.1f}"
                f"{c['sampler_over_minimal_loop']:>17.3f}{c['minimal_loop_over_raw']:>13.3f}"
            )
        print("    flusher (rows_to_table + Parquet segment, atomic write), CPU per row:")
        for batch, f in r["flush"].items():
            print(
                f"      {batch:>4}-row batches: convert {f['convert_us_per_row']:.1f} + write "
                f"{f['write_us_per_row']:.1f} = {f['total_us_per_row']:.1f} us/row"
            )
        print("    ratio including the flusher's per-row cost:")
        for key, v in r["ratio_incl_flush"].items():
            print(f"      {key:<36}{v:>7.3f}")
        ok = c20["ratio"] <= 1.2 and c100["ratio"] <= 1.2

        def verdict(c: dict[str, Any]) -> str:
            return f"{'MET' if c['ratio'] <= 1.2 else 'MISSED'} ({c['ratio']:.2f})"

        print(
            f"    target (<= 1.2 at the realistic {CALL_DELAY_US} us/call, sampler alone): "
            f"1 kHz {verdict(c20)}, 100 Hz {verdict(c100)} -> {'MET' if ok else 'MISSED'};\n"
            f"      worst case 0 us/call (no realistic NVML): {c0['ratio']:.2f}; the sampler's own code adds "
            f"{c20['sampler_over_minimal_loop']:.3f}x / {c100['sampler_over_minimal_loop']:.3f}x / "
            f"{c0['sampler_over_minimal_loop']:.3f}x over the minimal loop"
        )
        self.results["a_target_met"] = ok

    # -- b -----------------------------------------------------------------------------------
    def deadlines(self) -> None:
        seg = 0.5
        per_cond = 2.0 if self.quick else 5.0
        rounds = max(1, round(per_cond / seg))
        # Next to the thread: a session's telemetry process (telemetry.sampler=auto: sampling loop
        # and collector storing the segments).
        process = [[hz, cores, "process"] for hz in (100, 1000) for cores in ("free", "busy")]
        runs: list[tuple[str, list[list[Any]]]] = [("mix", process)]
        if not self.quick:
            # A diagnostic next to the plain thread at 1 kHz: a shorter GIL switch interval.
            runs[0] = ("mix", [*process, [1000, "free", "thread-switch200us"]])
            try:
                subprocess.run(
                    [sys.executable, "-c", "import torch"], check=True, capture_output=True, timeout=60
                )
                runs.append(("torch", process))
            except (subprocess.SubprocessError, OSError):
                print("    (torch not importable: the torch workload is skipped)")
        self.results["b_deadlines"] = {}
        print(
            f"\n(b) Deadlines met with a busy main thread (target >= 99 % with one core free); "
            f"{per_cond:g} s per condition in {seg:g} s segments, conditions interleaved"
        )
        verdicts: list[bool | None] = []
        for workload, extra in runs:
            opts = {"workload": workload, "segment_s": seg, "rounds": rounds, "extra": extra}
            r = self.run_worker("deadlines", opts, [f"* call_delay_us {CALL_DELAY_US}"], timeout=300)
            self.results["b_deadlines"][workload] = r
            print(f"    workload: {r['workload']}")
            print(
                f"    {'sampler @ rate / cores':<38}{'met':>8}{'missed':>7}{'slots':>6}{'late max':>10}"
                f"{'read us':>8}{'work/s':>7}{'other load':>11}   {'met in quiet segments':>22}"
            )
            for key, c in r["conditions"].items():
                q = c["quiet"]
                quiet = (
                    f"{100 * q['deadline_ratio']:6.2f}% ({q['segments']}/{c['segments']} segs, "
                    f"late max {q['late_max_ms']:.1f} ms)"
                    if q
                    else f"  none of {c['segments']} segs quiet"
                )
                print(
                    f"    {key:<38}{100 * c['deadline_ratio']:>7.2f}%{c['deadlines_missed']:>7}"
                    f"{c['slots']:>6}{c['late_max_ms']:>8.2f}ms{c['read_us_mean']:>8.0f}"
                    f"{c['work_units_per_s']:>7.0f}{c['background_cores']:>6.2f} cores   {quiet}"
                )
                if key in ("thread@100Hz/core-free", "process@1000Hz/core-free"):
                    if q is None or q["segments"] < max(2, c["segments"] // 3):
                        verdicts.append(None)
                    else:
                        verdicts.append(q["deadline_ratio"] >= 0.99)
            if r.get("process_startup_s"):
                st = r["process_startup_s"]
                print(
                    f"    telemetry process start-up (spawn + imports + collector warm-up + NVML open, "
                    f"until it samples): "
                    f"median {1e3 * st[len(st) // 2]:.0f} ms, max {1e3 * st[-1]:.0f} ms over {len(st)} starts"
                )
        print(
            f"    ('other load' = CPU used by processes outside the benchmark, in cores; a segment is quiet "
            f"below {QUIET_CORES} cores:\n     with more, 'one core free' did not have its core. "
            f"'work/s' = workload units done per second by the main thread)"
        )
        met: bool | None = False if False in verdicts else (None if None in verdicts else True)
        print(
            f"    target (the default sampler: thread at 100 Hz, process at 1 kHz; one core free, every "
            f"workload, quiet segments): "
            f"{ {True: 'MET', False: 'MISSED', None: 'INCONCLUSIVE (machine too busy)'}[met] }"
        )
        self.results["b_target_met"] = met

    # -- c -----------------------------------------------------------------------------------
    def zeus(self) -> None:
        try:
            subprocess.run(
                [sys.executable, "-c", "import zeus.monitor.power"],
                check=True,
                capture_output=True,
                timeout=120,
            )
        except (subprocess.SubprocessError, OSError):
            print("\n(c) Zeus is not installed (pip install zeus==0.16.0): comparison skipped")
            self.results["c_zeus"] = None
            return
        window = 2.0 if self.quick else 5.0
        specs: list[tuple[str, str, dict[str, Any], list[str]]] = []
        rates = (100, 20)
        for hz in rates:
            square = ["0 power_square_mw 300000", f"0 power_period_ms {2 * 1000 // hz}"]
            base = [f"* call_delay_us {CALL_DELAY_US}", *square]
            specs.append(
                (
                    f"zeus instant @{hz}Hz",
                    "zeus",
                    {"update_period": 1.0 / hz, "domains": "device_instant"},
                    base,
                )
            )
            if not self.quick:
                specs.append(
                    (f"zeus all domains @{hz}Hz", "zeus", {"update_period": 1.0 / hz, "domains": "all"}, base)
                )
            specs.append((f"ours full row @{hz}Hz", "ours", {"hz": hz}, base))
            specs.append((f"ours power only @{hz}Hz", "ours", {"hz": hz}, base + POWER_ONLY_LINES))
        # Start them one at a time (start-up measured on a quiet machine, Zeus first), then run
        # every steady-state window at once: all of them see the same machine noise.
        procs: dict[str, tuple[subprocess.Popen[str], str, dict[str, Any]]] = {}
        try:
            for label, kind, opts, script in specs:
                stats = self.tmp / f"zeus-stats-{len(procs)}"
                stats.mkdir()
                p = subprocess.Popen(
                    [sys.executable, __file__, "--worker", kind, "--opts", json.dumps(opts)],
                    env=self.env(script, {ZEUS_STATS_ENV: str(stats)}),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                assert p.stdout is not None
                line = p.stdout.readline()
                if not line.startswith("READY"):
                    p.kill()
                    raise RuntimeError(f"{label} did not start:\n{p.communicate()[1][-3000:]}")
                procs[label] = (p, kind, json.loads(line.split(" ", 1)[1]))
            tree = [q for p, _, _ in procs.values() for q in (p.pid, *descendants(p.pid))]
            busy0, ours0 = machine_busy_ns()[0], sum(schedstat_ns(q) for q in tree)
            for p, _, _ in procs.values():
                assert p.stdin is not None
                p.stdin.write("GO\n")
                p.stdin.flush()
            time.sleep(window)
            for p, _, _ in procs.values():
                assert p.stdin is not None
                p.stdin.write("STOP\n")
                p.stdin.flush()
            busy1, ours1 = machine_busy_ns()[0], sum(schedstat_ns(q) for q in tree)
            self.results["c_background_cores"] = max(0, (busy1 - busy0) - (ours1 - ours0)) / 1e9 / window
            out: dict[str, Any] = {}
            for label, (p, kind, _) in procs.items():
                stdout, stderr = p.communicate(timeout=60)
                if "RESULT " not in stdout:
                    raise RuntimeError(f"{label} failed:\n{stderr[-3000:]}")
                out[label] = {"kind": kind, **json.loads(stdout.split("RESULT ", 1)[1].splitlines()[0])}
        finally:
            for p, _, _ in procs.values():
                if p.poll() is None:
                    p.kill()
        self.results["c_zeus"] = out
        self._print_zeus(out, rates)
        if not self.quick:
            self.zeus_spin()

    def _print_zeus(self, out: dict[str, Any], rates: tuple[int, ...]) -> None:
        print(
            f"\n(c) Zeus 0.16 PowerMonitor vs our sampler, same stand-in ({CALL_DELAY_US} us/call), "
            f"same requested rate, concurrent {next(iter(out.values()))['window_s']:.1f} s window"
        )
        print(
            f"    {'config':<26}{'procs':>6}{'polls/s':>9}{'delivered/s':>12}{'CPU us/sample':>15}"
            f"{'sampling part':>15}{'% of a core':>13}{'start wall':>12}{'start CPU':>11}"
        )
        for label, r in out.items():
            s = r["startup"]
            if r["kind"] == "zeus":
                n = sum(r["delivered"].values())
                cpu = r["helpers_cpu_ns"] + r["own_cpu_ns"]
                polls = r["polls_in_window"] / r["window_s"]
                r["cpu_us_per_delivered"] = cpu / max(n, 1) / 1e3
                r["cpu_us_per_poll"] = cpu / max(r["polls_in_window"], 1) / 1e3
                r["delivered_per_s"] = n / r["window_s"]
                r["cpu_pct_of_core"] = 100 * cpu / 1e9 / r["window_s"]
                r["helpers_us_per_delivered"] = r["helpers_cpu_ns"] / max(n, 1) / 1e3
                detail = f"{r['helpers_us_per_delivered']:.0f}"
                procs = s["processes"]
            else:
                n = r["samples"]
                r["cpu_us_per_delivered"] = r["process_cpu_ns"] / max(n, 1) / 1e3
                r["sampler_us_per_sample"] = r["sampler_cpu_ns"] / max(n, 1) / 1e3
                r["delivered_per_s"] = n / r["window_s"]
                r["cpu_pct_of_core"] = 100 * r["process_cpu_ns"] / 1e9 / r["window_s"]
                polls = r["delivered_per_s"]
                r["flusher_us_per_flush"] = r["flusher_cpu_ns"] / max(r["window_s"] / 0.5, 1) / 1e3
                detail = f"{r['sampler_us_per_sample']:.0f}"
                procs = 1
            print(
                f"    {label:<26}{procs:>6}{polls:>9.1f}{r['delivered_per_s']:>12.1f}"
                f"{r['cpu_us_per_delivered']:>15.0f}{detail:>15}{r['cpu_pct_of_core']:>12.2f}%"
                f"{s['first_sample_wall_s']:>11.2f}s"
                f"{s['first_sample_cpu_s']:>10.2f}s"
            )
        print(
            "    (CPU us/sample: Zeus = its helper processes + its own process, whose main thread drains "
            "the queue every 0.25 s;\n     ours = the whole process: sampler thread + flusher writing a "
            "Parquet segment every 0.5 s. 'sampling part' = Zeus's\n     helper processes alone / our "
            "sampler thread alone. 'procs' counts Zeus's resource tracker. Start-up = from before the\n"
            "     import to the first sample, CPU of every process involved)"
        )
        for label, r in out.items():
            if r["kind"] == "ours":
                print(
                    f"    {label}: flusher {r['flusher_us_per_flush']:.0f} us CPU per flush "
                    f"({r['delivered_per_s'] * 0.5:.0f} rows)"
                )
        ratios: dict[str, Any] = {}
        met = True
        for hz in rates:
            z = out.get(f"zeus instant @{hz}Hz")
            full = out.get(f"ours full row @{hz}Hz")
            power = out.get(f"ours power only @{hz}Hz")
            if not (z and full and power):
                continue
            zc = z["cpu_us_per_delivered"]
            rr = {
                "power_only_whole_process": zc / power["cpu_us_per_delivered"],
                "power_only_sampler_thread": zc / power["sampler_us_per_sample"],
                "full_row_whole_process": zc / full["cpu_us_per_delivered"],
                "full_row_sampler_thread": zc / full["sampler_us_per_sample"],
                "startup_cpu_zeus_over_ours": z["startup"]["first_sample_cpu_s"]
                / full["startup"]["first_sample_cpu_s"],
                "startup_wall_zeus_over_ours": z["startup"]["first_sample_wall_s"]
                / full["startup"]["first_sample_wall_s"],
                "delivered_per_s_zeus_over_ours": z["delivered_per_s"] / full["delivered_per_s"],
            }
            ratios[f"{hz}Hz"] = rr
            print(
                f"    @{hz:>3} Hz, Zeus CPU per sample / ours:  like-for-like (one power read each) "
                f"{rr['power_only_whole_process']:.1f}x whole process, "
                f"{rr['power_only_sampler_thread']:.1f}x sampler thread;\n"
                f"              against our full {full['startup']['metrics_supported']}-metric row "
                f"{rr['full_row_whole_process']:.1f}x whole process, "
                f"{rr['full_row_sampler_thread']:.1f}x sampler thread;  start-up CPU "
                f"{rr['startup_cpu_zeus_over_ours']:.1f}x, wall {rr['startup_wall_zeus_over_ours']:.1f}x; "
                f"samples/s {rr['delivered_per_s_zeus_over_ours']:.2f}x"
            )
            if rr["power_only_whole_process"] < 3:
                met = False
        print(f"    other load during the window: {self.results.get('c_background_cores', 0):.2f} cores")
        a = self.results.get("a_cost")
        z, power = out.get("zeus instant @100Hz"), out.get("ours power only @100Hz")
        if a and z and power:
            # What no periodic sampler on this machine can avoid per sample: one timer wake-up (measured in
            # part a, at 100 Hz) and the one stand-in call. What each costs beyond that is its own overhead.
            floor = a["configs"][f"{CALL_DELAY_US}us@100Hz"]["bare_wakeup_cpu_us"] + CALL_DELAY_US
            zo = z["cpu_us_per_delivered"] - floor
            ow, os_ = power["cpu_us_per_delivered"] - floor, power["sampler_us_per_sample"] - floor
            ratios["100Hz"]["floor_us"] = floor
            ratios["100Hz"]["above_floor_zeus_over_ours_whole"] = zo / ow if ow > 0 else None
            ratios["100Hz"]["above_floor_zeus_over_ours_sampler"] = zo / os_ if os_ > 0 else None
            print(
                f"    above the floor every sampler pays here (one wake-up + one {CALL_DELAY_US} us call = "
                f"{floor:.0f} us, part a), @100 Hz like-for-like:\n      Zeus {zo:.0f} us, ours {ow:.0f} us "
                f"whole process / {os_:.0f} us sampler thread"
                + (f" -> {zo / ow:.1f}x / {zo / os_:.1f}x" if ow > 0 and os_ > 0 else "")
            )
        for hz in rates:
            allz, inst = out.get(f"zeus all domains @{hz}Hz"), out.get(f"zeus instant @{hz}Hz")
            full = out.get(f"ours full row @{hz}Hz")
            if not (allz and inst and full):
                continue
            n_inst = allz["delivered"].get("device_instant", 0)
            cpu = allz["helpers_cpu_ns"] + allz["own_cpu_ns"]
            per_inst = cpu / max(n_inst, 1) / 1e3
            ratios[f"{hz}Hz"]["zeus_default_per_power_sample_over_ours_full_row"] = (
                per_inst / full["cpu_us_per_delivered"]
            )
            print(
                f"    Zeus default domains @{hz} Hz ({', '.join(allz['startup']['domains'])}: one process "
                f"each): {allz['cpu_pct_of_core']:.2f} % of a core, {per_inst:.0f} us per instant-power "
                f"sample\n      = {per_inst / full['cpu_us_per_delivered']:.1f}x our whole process per "
                f"full {full['startup']['metrics_supported']}-metric row "
                f"(device_instant only: {inst['cpu_pct_of_core']:.2f} %; "
                f"ours: {full['cpu_pct_of_core']:.2f} %)"
            )
        print(
            f"    target (>= 3x cheaper per sample, like-for-like, whole process, every rate): "
            f"{'MET' if met else 'MISSED'}"
        )
        self.results["c_ratios"] = ratios
        self.results["c_target_met"] = met

    def zeus_spin(self) -> None:
        """Zeus's default update_period=None infers a period of 0 and spins: show it briefly."""
        stats = self.tmp / "zeus-stats-spin"
        stats.mkdir()
        p = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                "zeus",
                "--opts",
                json.dumps({"update_period": None, "domains": "all"}),
            ],
            env=self.env(
                [f"* call_delay_us {CALL_DELAY_US}", "0 power_square_mw 300000", "0 power_period_ms 20"],
                {ZEUS_STATS_ENV: str(stats)},
            ),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert p.stdout is not None and p.stdin is not None
            line = p.stdout.readline()
            if not line.startswith("READY"):
                raise RuntimeError(f"zeus spin did not start:\n{p.communicate()[1][-3000:]}")
            p.stdin.write("GO\n")
            p.stdin.flush()
            time.sleep(1.5)
            p.stdin.write("STOP\n")
            p.stdin.flush()
            stdout, _ = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
        r = json.loads(stdout.split("RESULT ", 1)[1].splitlines()[0])
        cores = (r["helpers_cpu_ns"] + r["own_cpu_ns"]) / 1e9 / r["window_s"]
        polls = sum(h["polls_per_s"] or 0 for h in r["helpers"])
        r["cores_used"] = cores
        r["polls_per_s"] = polls
        self.results["c_zeus_default_period"] = r
        print(
            f"    Zeus default update_period=None: inferred {r['startup']['update_period']:g} s -> "
            f"{r['startup']['processes']} processes spin, {cores:.2f} cores busy of {os.cpu_count()}, "
            f"{polls:.0f} polls/s, {sum(r['delivered'].values()) / r['window_s']:.0f} samples/s delivered "
            f"(start-up {r['startup']['first_sample_wall_s']:.1f} s)"
        )


def background_cores(seconds: float = 1.0) -> float:
    """Cores' worth of CPU used on this machine over ``seconds`` by everyone but this process."""
    busy0, me0 = machine_busy_ns()[0], schedstat_ns(os.getpid())
    time.sleep(seconds)
    busy1, me1 = machine_busy_ns()[0], schedstat_ns(os.getpid())
    return max(0, (busy1 - busy0) - (me1 - me0)) / 1e9 / seconds


def wait_quiet(limit_s: float) -> float:
    """Wait up to ``limit_s`` for a quiet second; return the last background load seen (cores)."""
    if limit_s <= 0:
        return background_cores(0.2)
    deadline = time.monotonic() + limit_s
    while True:
        load = background_cores(1.0)
        if load < QUIET_CORES or time.monotonic() >= deadline:
            if load >= QUIET_CORES:
                print(f"    (machine still busy after {limit_s:g} s: {load:.2f} cores used by others)")
            return load
        time.sleep(1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs (< 40 s), fewer diagnostics")
    ap.add_argument("--only", choices=("a", "b", "c"), action="append", help="run only these parts")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help=f"before each part, wait up to S seconds for a second in which other processes use "
        f"less than {QUIET_CORES} cores (this machine is shared)",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--opts", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        WORKERS[args.worker](json.loads(args.opts))
        return
    t0 = time.perf_counter()
    bench = Bench(args.quick)
    print(
        f"charllm-nemo sampler benchmark ({'quick' if args.quick else 'full'}), {os.cpu_count()} CPUs, "
        f"stand-in NVML at {bench.lib_dir}"
    )
    parts = args.only or ["a", "b", "c"]
    try:
        for part, run in (("a", bench.cost), ("b", bench.deadlines), ("c", bench.zeus)):
            if part in parts:
                bench.results.setdefault("background_before_cores", {})[part] = wait_quiet(args.wait_quiet)
                run()
    finally:
        shutil.rmtree(bench.tmp, ignore_errors=True)
    bench.results["wall_s"] = time.perf_counter() - t0
    print(f"\ntotal {bench.results['wall_s']:.0f} s")
    print("BENCH_JSON " + json.dumps(bench.results))


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__" and os.environ.get(ZEUS_STATS_ENV):
    install_zeus_hook()
