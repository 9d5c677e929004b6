"""Training-step cost of telemetry: tiny_gpt on CPU, telemetry at 100 Hz (all windows) vs off.

Run:  .venv/bin/python bench/bench_train_telemetry.py [--quick] [--interleave step|block]
      [--order abba|random] [--decompose] [--profile] [--json-only]
Pool: .venv/bin/python bench/bench_train_telemetry.py --pool DUMP [DUMP ...]   (--dump-steps files)

What is compared, in ONE process with ONE model (built once, the way ``train/loop.py::_train``
builds it, and stepped through the step API as ``_train`` steps it: ``StepTelemetry``'s
``begin_step`` / timers / ``phase("optimizer")`` / ``end_step``), in one of two ways.

``--interleave step`` (the default; the headline ON/OFF comparison): ONE ``TelemetrySession`` for
the whole measurement (synthetic backend, ``activity="marks"``, 100 Hz, all window kinds,
``sampler="process"`` unless --session-option says otherwise; a session that does not sample in
a separate process is refused: a thread cannot be paused), opened once before the timed steps and
closed after them. Steps alternate between the arms, every step timed: ABBA quads (on, off, off,
on, on, off, off, on, ...; ``--order abba``, the default) or adjacent pairs in a random order
(``--order random``). The switch happens between steps, outside the timed region:

* ``on``:  SIGCONT to the telemetry process, ``config.timers`` = the timers of a
  ``StepTelemetry`` over the session (step, microbatch, phase); its ``end_step`` sends the step's
  window to ``session.request_figures`` and reads an earlier ON step's figures
  (``session.step_figures``), as the loop does: the previous step's, or for short steps those of
  the step ``lag`` ON steps back (charllm_nemo.steps.pending.PendingSteps).
* ``off``: SIGSTOP to the telemetry process (frozen: it uses no CPU), ``config.timers = None``,
  a ``StepTelemetry`` with no session and no windows: ``run_rank`` with ``telemetry.enabled=false``.

Statistics over units (ABBA quads, or pairs): ratio of the medians and of the 10 % trimmed means
of ON over OFF step times, 95 % bootstrap intervals resampling whole units, and the geometric
mean of the per-unit ratios with a t interval; steps right after a switch against the others
(what a switch costs); the load of other processes per segment of ~32 steps. No bare-thread
reference in this mode.

``--interleave block`` (the original design; ``--decompose`` needs it): rounds of blocks of
``--block-steps`` timed steps, one block per arm, the order of the arms inside each round drawn
at random:

* ``on``:  a fresh ``TelemetrySession`` (synthetic backend, ``activity="marks"``, 100 Hz, the
  default 0.5 s flusher) started before the block and closed after it; its WindowRecorder gets
  the run's labels, and a ``StepTelemetry`` over it (all window kinds) gives ``config.timers``,
  as ``run_rank`` wires them; every step also asks the session for an earlier step's figures
  (``session.step_figures``), as the loop does.
* ``off``: no session, no sampler or flusher thread, ``config.timers = None``, a
  ``StepTelemetry`` with no windows (what ``run_rank`` does with ``telemetry.enabled=false``).
* ``bare``: a bare sampling thread (``Sampler`` at 100 Hz over a synthetic device at a fixed
  level; no marks, no store): DESIGN.md's reference, measured again in the same run.
* with ``--decompose`` also ``proc`` (the bare sampler in its own process, SIGSTOPped outside
  its blocks: no GIL shared with training), ``marks`` (StepTelemetry + WindowRecorder + the
  synthetic device's MarkActivity listener, no thread), ``sampler`` (marks + the sampler thread)
  and ``session`` (the whole session without the loop's per-step figures): where the overhead
  comes from.

Session start/stop is outside the timed steps (their times are printed). Each block begins with
a pause drawn from U[0, flush interval) (every arm, so the flusher's phase relative to the timed
steps is uniform, as in a long run) and one untimed lead-in step.

Three timings per step, in both modes: ``iteration`` = ``time.perf_counter()`` around the whole
loop body (marks, forward/backward of every microbatch, optimizer, an earlier step's figures,
the step's reduction over the ranks): the headline; ``loop_step`` = the loop's own step window
(``StepTiming.seconds``: no figures, no reduction); ``main_cpu`` = the training thread's CPU
time (``time.thread_time``): its own extra work, which other threads and processes lengthen only
through caches, so the least noisy of the three.

Two configurations, each in its own child process, one after the other:

* ``free``: ``OMP_NUM_THREADS=1`` + ``torch.set_num_threads(1)``, nothing else started: one core
  is left for the telemetry threads or process, as on a GPU node (target ratio <= 1.005).
* ``busy``: the same, plus a process spinning pure Python on the last core, started before the
  child and stopped after it; the child is pinned to the other core(s) (``--busy-pin split``;
  ``none`` pins neither, and then the scheduler sometimes puts the training thread next to the
  spinner: bimodal step times). A telemetry or sampling process inherits the child's pinning.

Block-mode figures: ON/OFF (arm/OFF) ratio of the medians and of the 10 % trimmed means of step
times, each with a 95 % bootstrap interval over rounds (rounds resampled whole, so slow drifts
stay paired), and the mean of the per-round ratios of block medians with a t interval; the
sampler's deadline ratio (SamplerHealth) over the timed steps of ON blocks and over whole ON
sessions; the load of other processes during each round (/proc/stat minus this child and the
spinner) and the ratios over the quiet rounds only; garbage-collector work per arm; with
``--profile``, a cProfile of the training thread per arm (both modes). The last line printed is
``BENCH_JSON {...}``. docs/bench-train.md says how to read it.

This machine has 2 cores and is shared and noisy: only side-by-side ratios mean something, and a
verdict is given only when other processes stayed under 0.3 cores on average.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its parts beside it, however it is loaded

# what tests/bench/test_bench_train_stats.py reads from this script: re-exported
from train_telemetry_consts import BUSY_MACHINE_CORES as BUSY_MACHINE_CORES
from train_telemetry_consts import (
    CONTRASTS,
    DECOMPOSE_ARMS,
    FLUSH_INTERVAL_S,
    HZ,
    MIN_QUIET_ROUNDS,
    ORDERS,
    PROFILE_FUNCS,
    QUIET_CORES,
    REFERENCE_BARE_THREAD,
    ROOT,
    SEGMENT_STEPS,
    STEP_PAIRS,
    STEP_WARM_QUADS,
    TARGET_FREE,
    TIMINGS,
)
from train_telemetry_report import print_pool as print_pool
from train_telemetry_report import print_table, step_summary_line
from train_telemetry_report import verdict as verdict
from train_telemetry_stats import (
    BenchRefused,
    calls_report,
    machine_busy_ns,
    process_cpu_ns,
    sched_report,
    sched_snapshot,
    sched_step,
    schedstat_ns,
    step_stats,
    summarize,
    time_telemetry_calls,
)
from train_telemetry_stats import pool_dumps as pool_dumps
from train_telemetry_stats import summarize_units as summarize_units


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ============================================================================================
# the worker: one configuration, in its own child process
# ============================================================================================

HEALTH_KEYS = ("slots", "on_time", "deadlines_missed", "samples")
"""The sampler's health counters summed over ON blocks (block mode)."""


class GcWatch:
    """The garbage collector's work during timed steps, per arm (its pauses hold the GIL: the
    sampler thread waits them out, and window dicts kept until a flush make them longer).
    ``arm``: the arm whose timed step runs now; None: not counted. A ``gc.callbacks`` entry."""

    def __init__(self) -> None:
        self.arm: str | None = None
        self.stats: dict[str, dict[str, float]] = {}
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if self.arm is None:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        d = self.stats.setdefault(self.arm, {"gen0": 0, "gen1": 0, "gen2": 0, "ms": 0.0, "gen2_ms_max": 0.0})
        dt = (time.perf_counter() - self._t0) * 1e3
        d[f"gen{info['generation']}"] += 1
        d["ms"] += dt
        if info["generation"] == 2:
            d["gen2_ms_max"] = max(d["gen2_ms_max"], dt)

    def per_100_steps(self, steps: int) -> dict[str, dict[str, float]]:
        """Collections and their ms per 100 timed steps of each arm (the longest pause as it is)."""
        return {
            arm: {key: v * 100 / steps if key != "gen2_ms_max" else v for key, v in d.items()}
            for arm, d in self.stats.items()
        }


@dataclass
class Rig:
    """One configuration's model, built once the way train/loop.py's ``_train`` builds it, and
    what every arm shares: the step API's factory, the step counter, the figure-call counts."""

    opts: dict[str, Any]
    rng: random.Random
    cfg: Any  # TrainConfig
    dist: Any  # the process group's ranks (train/dist.py)
    bundle: Any
    data_iter: Any
    forward_backward: Any
    n_micro: int
    group_size: Any
    placement: Any
    train_step: Any  # train/loop.py's own train_step
    step_telemetry: Any  # the StepTelemetry class
    gc: GcWatch = field(default_factory=GcWatch)
    steps_done: int = 0
    fig_counts: dict[str, int] = field(default_factory=lambda: {"asked": 0, "not_ready": 0, "requested": 0})
    st_off: Any = None  # as run_rank with telemetry off: nothing is recorded

    @property
    def config(self) -> Any:
        """The model's config: its ``timers`` are the arm's (None when telemetry is off)."""
        return self.bundle.config

    @property
    def out_root(self) -> Path:
        return Path(self.opts["out_dir"])

    def step_api(self, session: Any = None, recorder: Any = None) -> Any:
        """A StepTelemetry as ``charllm train`` builds one (train/loop.py ``_step_telemetry``, no
        observers): over ``session`` (figures asked for and read), or only marking into
        ``recorder``, or neither (telemetry off: nothing marked, ``config.timers`` None)."""
        from charllm_nemo.steps import StepOptions

        windows = list(self.cfg.telemetry.windows) if session is not None or recorder is not None else []
        options = StepOptions(num_microbatches=self.n_micro, group_size=self.group_size, windows=windows)
        return self.step_telemetry(session, self.placement, options=options, recorder=recorder)

    def count_figures(self, session: Any) -> None:
        """Count the figure calls the step API makes on ``session`` (asked, not ready, requested)."""
        step_figures, request_figures = session.step_figures, session.request_figures
        counts = self.fig_counts

        def counted_figures(*a: Any, **k: Any) -> Any:
            rows = step_figures(*a, **k)
            counts["asked"] += 1
            counts["not_ready"] += rows is None
            return rows

        def counted_request(*a: Any, **k: Any) -> Any:
            counts["requested"] += 1
            return request_figures(*a, **k)

        session.step_figures, session.request_figures = counted_figures, counted_request

    def one_step(self, st: Any) -> tuple[float, float, float]:
        """One training step through the step API: train/loop.py's own ``train_step`` (its
        observers aside): (wall s, the step's own window s, main-thread CPU s). ``st``: the arm's
        StepTelemetry (its timers are ``config.timers``, set by the caller)."""
        step = self.steps_done
        self.steps_done += 1
        train_step, model = self.train_step, self.bundle.chunks[0]
        args = (self.bundle, self.forward_backward, self.data_iter, model, self.n_micro, self.cfg, True)
        c0 = time.thread_time_ns()
        t0 = time.perf_counter()
        train_step(st, step, *args)
        t1 = time.perf_counter()
        c1 = time.thread_time_ns()
        return t1 - t0, st.last.local_step_time_s, (c1 - c0) / 1e9

    def session(self, out_dir: Path, **defaults: Any) -> Any:
        """The ON arm's TelemetrySession (not started): its options, ``defaults`` and then
        --session-option on top (a field of SessionOptions, StoreOptions or ProcessOptions, or
        handle_signals); this rank's placement; the run's config in its manifest."""
        from dataclasses import asdict, fields

        from charllm_nemo.telemetry.placement import local_ranks_from_env
        from charllm_nemo.telemetry.session import TelemetrySession
        from charllm_nemo.telemetry.session_options import (
            Placement,
            ProcessOptions,
            SessionOptions,
            StoreOptions,
        )

        flat: dict[str, Any] = {
            "backend": "synthetic",
            "hz": HZ,
            "flush_interval_s": FLUSH_INTERVAL_S,
            "backend_options": {"activity": "marks"},
            **defaults,
            **self.opts.get("session_options", {}),
        }
        handle_signals = flat.pop("handle_signals", True)
        parts = {}
        for name, kind in (("store", StoreOptions), ("process", ProcessOptions)):
            own = {f.name for f in fields(kind)}
            parts[name] = kind(**{k: flat.pop(k) for k in list(flat) if k in own})
        options = SessionOptions(**flat, **parts)
        dist = self.dist
        local_world = local_ranks_from_env(os.environ, dist.world_size)  # as the session read it
        placement = Placement(dist.rank, dist.local_rank, dist.world_size, local_world)
        config = asdict(self.cfg)
        return TelemetrySession(
            out_dir, options, placement=placement, config=config, handle_signals=handle_signals
        )


def total_steps(opts: dict[str, Any]) -> int:
    """The steps the data iterator must hold for one configuration's run."""
    if opts.get("interleave", "block") == "step":
        return int(opts["warmup"] + 4 * STEP_WARM_QUADS + 2 * opts["pairs"] + 8)
    per_block = opts["block_steps"] + 1  # + the untimed lead-in step
    n_arms = len(opts["arms"])
    return int(
        opts["warmup"] + (n_arms * opts["pairs"] + n_arms) * per_block + 2
    )  # + a warm-up block per arm


def build_rig(opts: dict[str, Any]) -> Rig:
    """Pin the child (before torch starts its threads), build tiny_gpt and its data once, the way
    ``_train`` does, and open the process group."""
    import gc
    from dataclasses import replace

    rng = random.Random(opts["seed"])
    if opts["cpus"]:
        os.sched_setaffinity(0, set(opts["cpus"]))
    import torch

    torch.set_num_threads(1)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from charllm_nemo.steps import StepTelemetry
    from charllm_nemo.telemetry.config import Placement
    from charllm_nemo.train.config import BatchConfig, LaunchConfig, TelemetryConfig, TrainConfig
    from charllm_nemo.train.data import DataLayout, MicrobatchIterator, build_train_dataset
    from charllm_nemo.train.dist import init_distributed, rank_env
    from charllm_nemo.train.loop import train_step
    from charllm_nemo.train.model import build_model
    from charllm_nemo.train.presets import model_preset
    from charllm_nemo.train.validate import validate

    cfg = TrainConfig(
        model=replace(model_preset("tiny_gpt"), **opts.get("model_overrides", {})),
        batch=BatchConfig(micro_batch_size=1, global_batch_size=4, train_steps=total_steps(opts)),
        telemetry=TelemetryConfig(
            enabled=True, backend="synthetic", hz=HZ, out_dir=str(Path(opts["out_dir"]))
        ),
        launch=LaunchConfig(device="cpu"),
    )
    env = rank_env(cfg)
    layout = validate(cfg, world_size=env.world_size, device="cpu")
    dist = init_distributed(cfg, env, "cpu")
    assert torch.get_num_threads() == 1, torch.get_num_threads()

    b = cfg.batch
    bundle = build_model(cfg, on_cpu=True, pipeline_layout=layout.mcore_pipeline_layout())
    data_layout = DataLayout(b.micro_batch_size, b.global_batch_size, dist.dp_size, dist.dp_rank)
    dataset = build_train_dataset(cfg, b.train_steps * b.global_batch_size)
    rig = Rig(
        opts=opts,
        rng=rng,
        cfg=cfg,
        dist=dist,
        bundle=bundle,
        data_iter=MicrobatchIterator(dataset, data_layout, b.train_steps, "cpu"),
        forward_backward=get_forward_backward_func(),
        n_micro=data_layout.num_microbatches,
        group_size=getattr(bundle.config, "microbatch_group_size_per_vp_stage", None),
        placement=Placement(dist.rank, dist.local_rank, dist.world_size),
        train_step=train_step,
        step_telemetry=StepTelemetry,
    )
    rig.st_off = rig.step_api()
    gc.callbacks.append(rig.gc)
    return rig


def worker(opts: dict[str, Any]) -> dict[str, Any]:
    """One configuration, in this (child) process: its figures, as ``WORKER_JSON`` reports them."""
    rig = build_rig(opts)
    if opts.get("interleave", "block") == "step":
        return step_interleave(rig)
    return block_interleave(rig)


# -- --interleave block ------------------------------------------------------------------------


def new_block_acc() -> dict[str, Any]:
    """Block mode's sums over the ON blocks' sessions."""
    return {
        "timed": dict.fromkeys(HEALTH_KEYS, 0),
        "session": dict.fromkeys(HEALTH_KEYS, 0),
        "late_max_ns": 0,
        "flushes": 0,
        "flush_ms_max": 0.0,
        "windows_recorded": 0,
        "session_start_ms": [],
        "session_close_ms": [],
        "unmatched_marks": 0,
    }


def start_proc_sampler() -> subprocess.Popen[str]:
    """The bare sampler in a process of its own (the ``proc`` arm), stopped (SIGSTOP) until its
    first block."""
    proc = subprocess.Popen([sys.executable, "-c", PROC_SAMPLER, str(HZ)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("the sampler process did not start")
    os.kill(proc.pid, signal.SIGSTOP)
    return proc


@dataclass
class BlockRun:
    """Block mode over its rounds: the ON sessions' sums (``acc``), the profiles of --profile,
    the ``proc`` arm's sampler process, the CPU of the ON sessions' own processes."""

    rig: Rig
    profiles: dict[str, Any]
    proc_sampler: Any = None
    acc: dict[str, Any] = field(default_factory=new_block_acc)
    own_children_ns: int = 0  # summed when each ON session closes

    def open_arm(self, arm: str, idx: int) -> tuple[Any, Any, Any]:
        """(the block's StepTelemetry, sampler or None, closer) of one block."""
        from charllm_nemo.devices.factory import open_backend as open_synthetic
        from charllm_nemo.telemetry.sampler import Sampler
        from charllm_nemo.telemetry.windows import WindowRecorder

        rig = self.rig
        if arm == "off":
            return rig.st_off, None, None
        if arm == "bare":
            # The reference: a bare sampling thread (the synthetic device at a fixed level), no
            # marks, no store; what DESIGN.md's "bare thread" figures measure.
            backend = open_synthetic("synthetic", None, activity=1.0)
            sampler = Sampler(backend.devices, HZ, source="synthetic")
            sampler.start()
            return rig.st_off, sampler, sampler.stop
        if arm == "proc":
            # The same bare sampler in a separate process (no GIL shared with training), woken
            # for the block and stopped (SIGSTOP) outside it.
            pid = self.proc_sampler.pid
            os.kill(pid, signal.SIGCONT)
            return rig.st_off, None, lambda: os.kill(pid, signal.SIGSTOP)
        if arm in ("marks", "sampler"):
            # The session's pieces without its store and flusher: the marks (with the synthetic
            # device's MarkActivity listener, as the session wires it) and, for "sampler", the
            # bare sampler thread over the same backend.
            backend = open_synthetic("synthetic", None, activity="marks")
            rec = WindowRecorder()
            rec.add_listener(backend.activity)  # synthetic, activity=marks
            rec.set_labels(**rig.dist.labels())
            st = rig.step_api(recorder=rec)
            if arm == "marks":
                return st, None, None
            sampler = Sampler(backend.devices, HZ, source="synthetic")
            sampler.start()
            return st, sampler, sampler.stop
        t_s = time.perf_counter()
        session = rig.session(rig.out_root / f"block-{idx:04d}").start()
        session.windows.set_labels(**rig.dist.labels())
        self.acc["session_start_ms"].append((time.perf_counter() - t_s) * 1e3)
        # "session": everything but the loop's per-step figures (marks into the session only);
        # "on": all of it, as run_rank.
        if arm == "on":
            rig.count_figures(session)
            return rig.step_api(session), session.sampler, session
        return rig.step_api(recorder=session.windows), session.sampler, session

    def run_block(self, arm: str, idx: int, timed: bool) -> list[list[float]]:
        """One block of ``arm``: a pause, the untimed lead-in step, --block-steps timed steps;
        per timing, the block's step times."""
        from charllm_nemo.telemetry.session import TelemetrySession

        rig = self.rig
        st, sampler, closer = self.open_arm(arm, idx)
        rig.config.timers = st.timers()
        time.sleep(rig.rng.uniform(0.0, FLUSH_INTERVAL_S))  # every arm: uniform flusher phase
        rig.one_step(st)  # untimed lead-in
        h = sampler.health if sampler is not None else None
        h0 = {key: getattr(h, key) for key in HEALTH_KEYS} if h is not None else None
        times: list[list[float]] = [[] for _ in TIMINGS]
        rig.gc.arm = arm if timed else None
        prof = self.profiles.get(arm) if timed else None
        if prof is not None:
            prof.enable()
        for _ in range(rig.opts["block_steps"]):
            t = rig.one_step(st)
            for lst, v in zip(times, t, strict=True):
                lst.append(v)
        if prof is not None:
            prof.disable()
        rig.gc.arm = None
        rig.config.timers = None
        if h is not None and h0 is not None and timed and arm == "on":
            h = sampler.health  # a process sampler's health is a snapshot: read it again
            for key in HEALTH_KEYS:
                self.acc["timed"][key] += getattr(h, key) - h0[key]
        if isinstance(closer, TelemetrySession):
            self.close_session(closer, st, idx, counted=timed and arm == "on")
        elif closer is not None:
            closer()
        return times

    def close_session(self, session: Any, st: Any, idx: int, counted: bool) -> None:
        """Close a block's session (timed), adding its figures to ``acc`` when ``counted``."""
        acc = self.acc
        # A session's own process (a sampling / telemetry process, where the session has one)
        # is not "other processes": its CPU until now counts with this child's.
        tp_pid = getattr(session.sampler, "pid", None)
        if tp_pid:
            self.own_children_ns += process_cpu_ns(tp_pid)
        t_c = time.perf_counter()
        session.close("complete")
        acc["session_close_ms"].append((time.perf_counter() - t_c) * 1e3)
        if counted:
            for key in HEALTH_KEYS:
                acc["session"][key] += getattr(session.sampler.health, key)
            acc["late_max_ns"] = max(acc["late_max_ns"], session.sampler.health.late_max_ns)
            fl = getattr(session, "_flusher", None)  # gone where the telemetry process flushes
            if fl is not None:
                acc["flushes"] += fl.flushes
                acc["flush_ms_max"] = max(acc["flush_ms_max"], fl.flush_ns_max / 1e6)
            acc["windows_recorded"] += session.store.manifest["windows_recorded"]
            acc["unmatched_marks"] += st.unmatched_marks
        shutil.rmtree(self.rig.out_root / f"block-{idx:04d}", ignore_errors=True)

    def snapshot(self) -> tuple[int, int, int, int]:
        """(monotonic ns, the machine's busy ns, this process's CPU ns, its helpers' CPU ns)."""
        spinner_pid = self.rig.opts.get("spinner_pid")
        ours = schedstat_ns(spinner_pid) if spinner_pid else 0
        ours += self.own_children_ns + (process_cpu_ns(self.proc_sampler.pid) if self.proc_sampler else 0)
        return time.monotonic_ns(), machine_busy_ns(), time.process_time_ns(), ours


def block_interleave(rig: Rig) -> dict[str, Any]:
    """--interleave block: rounds of one block per arm, the arms' order drawn for each round."""
    from charllm_nemo.train.dist import shutdown_distributed

    opts = rig.opts
    arms = list(opts["arms"])
    proc_sampler = start_proc_sampler() if "proc" in arms else None
    # --profile: cProfile of the training thread during the timed steps of each arm (it slows
    # Python code several-fold, so its ratios are not the benchmark's; it says where time goes).
    profiles = {arm: cProfile.Profile() for arm in arms} if opts.get("profile") else {}
    run = BlockRun(rig, profiles, proc_sampler)
    t_begin = time.monotonic()
    for _ in range(opts["warmup"]):
        rig.one_step(rig.st_off)
    for arm in arms:
        run.run_block(arm, 9000 + len(arm), timed=False)  # warm every path (imports, Parquet writer)
    by_arm: dict[str, list[list[list[float]]]] = {a: [[] for _ in TIMINGS] for a in arms}
    on_first = 0
    background: list[float] = []  # cores used by other processes during each round
    for i in range(opts["pairs"]):
        order = arms[:]
        rig.rng.shuffle(order)
        on_first += order.index("on") < order.index("off")
        s0 = run.snapshot()
        for j, arm in enumerate(order):
            for which, lst in enumerate(run.run_block(arm, len(arms) * i + j, timed=True)):
                by_arm[arm][which].append(lst)
        s1 = run.snapshot()
        other = (s1[1] - s0[1]) - (s1[2] - s0[2]) - (s1[3] - s0[3])
        background.append(max(0.0, other / (s1[0] - s0[0])))
    elapsed = time.monotonic() - t_begin
    if proc_sampler is not None:
        proc_sampler.kill()
        proc_sampler.wait()
    shutdown_distributed()
    return block_result(run, by_arm, background, on_first, elapsed)


def deadline_ratio(d: dict[str, int]) -> float:
    """Slots sampled on time over slots (1 when there were none)."""
    return d["on_time"] / d["slots"] if d["slots"] else 1.0


def block_result(
    run: BlockRun,
    by_arm: dict[str, list[list[list[float]]]],
    background: list[float],
    on_first: int,
    elapsed: float,
) -> dict[str, Any]:
    """Block mode's figures: each arm against OFF, paired by round."""
    opts, acc = run.rig.opts, run.acc
    arms, pairs_n, k = list(opts["arms"]), opts["pairs"], opts["block_steps"]
    quiet = [i for i, bg in enumerate(background) if bg < QUIET_CORES]

    def paired(
        arm: str, which: int, rounds: list[int] | None = None
    ) -> list[tuple[list[float], list[float]]]:
        both = list(zip(by_arm[arm][which], by_arm["off"][which], strict=True))
        return both if rounds is None else [both[i] for i in rounds]

    def per_timing(arm: str, rounds: list[int] | None = None) -> dict[str, Any]:
        return {t: summarize(paired(arm, w, rounds)) for w, t in enumerate(TIMINGS)}

    return {
        "config": opts["config"],
        "model_overrides": opts.get("model_overrides", {}),
        "pairs": pairs_n,
        "block_steps": k,
        "arms": arms,
        "on_first": on_first,
        **per_timing("on"),
        "background_cores_mean": statistics.fmean(background),
        "background_cores_max": max(background),
        "quiet_rounds": len(quiet),
        "quiet": (
            {arm: per_timing(arm, quiet) for arm in arms if arm != "off"}
            if len(quiet) >= MIN_QUIET_ROUNDS
            else None
        ),
        "decompose": {arm: per_timing(arm) for arm in arms if arm not in ("on", "off")},
        "sampler": {
            "deadline_ratio_timed": deadline_ratio(acc["timed"]),
            "deadline_ratio_session": deadline_ratio(acc["session"]),
            "slots_timed": acc["timed"]["slots"],
            "missed_timed": acc["timed"]["deadlines_missed"],
            "samples_timed": acc["timed"]["samples"],
            "late_max_ms": acc["late_max_ns"] / 1e6,
        },
        "flusher": {"flushes": acc["flushes"], "flush_ms_max": acc["flush_ms_max"]},
        "windows_recorded": acc["windows_recorded"],
        "unmatched_marks": acc["unmatched_marks"],
        "gc_per_100_steps": run.rig.gc.per_100_steps(pairs_n * k),
        "profile": profile_report(run.profiles, pairs_n * k) if run.profiles else None,
        "session_start_ms_median": statistics.median(acc["session_start_ms"]),
        "session_close_ms_median": statistics.median(acc["session_close_ms"]),
        "elapsed_s": elapsed,
    }


# -- --interleave step -------------------------------------------------------------------------


def open_step_session(rig: Rig) -> tuple[Any, int, float]:
    """(the one session of step mode, its telemetry process's pid, its start ms); refused
    (BenchRefused) unless it samples in a separate process, which OFF steps SIGSTOP."""
    t_s = time.perf_counter()
    session = rig.session(rig.out_root / "steps", sampler="process").start()
    session_start_ms = (time.perf_counter() - t_s) * 1e3
    pid = getattr(session.sampler, "pid", None)
    if session.sampler_mode != "process" or pid is None:
        mode = session.sampler_mode
        session.close("complete")
        raise BenchRefused(
            f"--interleave step needs the session's sampler in a separate process (it is "
            f"SIGSTOPped during OFF steps; a sampling thread inside the training process cannot be "
            f"paused), but this session samples in a {mode!r} "
            f"(session options {rig.opts.get('session_options') or {}}); drop --session-option "
            f"sampler=..., or use --interleave block"
        )
    session.windows.set_labels(**rig.dist.labels())
    rig.count_figures(session)
    return session, pid, session_start_ms


class StepSwitch:
    """Step mode's switch between the arms, made between steps (outside the timed region):
    freeze (SIGSTOP) or wake (SIGCONT) the telemetry process and swap the loop's timers.

    --contrast says what differs between the arms. "all": the telemetry process (frozen in OFF
    steps) and the training thread's calls (none in OFF steps); "thread": only the calls (the
    process runs throughout); "process": only the process (the calls in every step, OFF steps
    not waiting for figures the frozen process cannot give). "figures": OFF steps make the same
    marks (the process running) but neither ask for figures nor read an earlier step's."""

    def __init__(self, rig: Rig, session: Any, st_on: Any, pid: int) -> None:
        self.rig, self.st_on, self.pid = rig, st_on, pid
        self.contrast = rig.opts.get("contrast", "all")
        self.freeze = self.contrast in ("all", "process")
        self.st_calls_off = st_on if self.contrast == "process" else rig.st_off
        if self.contrast == "figures":
            self.st_calls_off = rig.step_api(recorder=session.windows)  # the marks, no figure calls
        self.running = True
        self.current = "on"  # the arm of the last switch

    def off_step(self) -> tuple[float, float, float]:
        """One OFF step, as --contrast has it."""
        return self.rig.one_step(self.st_calls_off)

    def switch(self, arm: str) -> None:
        """Between steps: freeze / wake the telemetry process and swap the loop's timers."""
        if arm == "off" and self.running and self.freeze:
            os.kill(self.pid, signal.SIGSTOP)
            self.running = False
        elif arm == "on" and not self.running:
            os.kill(self.pid, signal.SIGCONT)
            self.running = True
        # No waiting for figures while the telemetry process is frozen: they cannot become ready.
        self.st_on.max_figure_wait_s = None if self.running else 0.0
        self.rig.config.timers = (self.st_on if arm == "on" else self.st_calls_off).timers()
        self.current = arm

    def wait_stopped(self, timeout_s: float = 1.0) -> bool:
        """Whether the telemetry process reached state T (stopped) within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{self.pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                        return True
            except OSError:
                return False
            time.sleep(0.001)
        return False


def arm_plan(opts: dict[str, Any], rng: random.Random) -> list[list[str]]:
    """The order of the arms, in units: "abba" = quads on,off,off,on repeated (on,off,off,on,
    on,off,off,on,...): each arm has exactly half of its steps right after a switch, and a
    linear drift within a quad cancels; "random" = pairs, each on,off or off,on at random."""
    if opts["order"] == "abba":
        return [["on", "off", "off", "on"] for _ in range((opts["pairs"] + 1) // 2)]
    return [rng.sample(["on", "off"], 2) for _ in range(opts["pairs"])]


@dataclass
class StepTimes:
    """What step mode's timed steps gave: every step ``(unit, arm, right after a switch,
    (iteration, loop_step, main_cpu) s)``, other processes' cores per segment, the samples
    the ON steps got, the schedstat of --sched-stats, the telemetry process's CPU."""

    plan: list[list[str]]
    profiles: dict[str, Any]
    sched: dict[str, list[tuple[float, ...]]] | None
    records: list[tuple[int, str, bool, tuple[float, float, float]]] = field(default_factory=list)
    background: list[float] = field(default_factory=list)
    cover: dict[str, int] = field(default_factory=lambda: {"samples": 0, "ns": 0})
    stopped_ok: bool = True
    tp_cpu_ns: int = 0
    elapsed_s: float = 0.0

    @property
    def units_per_segment(self) -> int:
        return max(1, int(SEGMENT_STEPS) // len(self.plan[0]))


def timed_step(sw: StepSwitch, session: Any, arm: str, times: StepTimes) -> tuple[float, float, float]:
    """One timed step of ``arm`` (the switch made), profiled under --profile; an ON step adds the
    samples its session got to ``times.cover``."""
    rig, prof = sw.rig, times.profiles.get(arm)
    if arm == "on":
        h0 = session.sampler.health.samples
        c0 = time.monotonic_ns()
    rig.gc.arm = arm
    if prof is not None:
        prof.enable()
    t = rig.one_step(sw.st_on) if arm == "on" else sw.off_step()
    if prof is not None:
        prof.disable()
    rig.gc.arm = None
    if arm == "on":
        times.cover["ns"] += time.monotonic_ns() - c0
        times.cover["samples"] += session.sampler.health.samples - h0
    return t


def run_steps(sw: StepSwitch, session: Any, times: StepTimes) -> None:
    """Warm-up, untimed: OFF steps, then ABBA quads (imports and first calls on the ON path); then
    the plan's steps, each timed, the load of other processes per segment. The telemetry
    process is never left frozen."""
    rig, pid = sw.rig, sw.pid
    spinner_pid = rig.opts.get("spinner_pid")

    def snapshot() -> tuple[int, int, int, int]:
        others = (schedstat_ns(spinner_pid) if spinner_pid else 0) + process_cpu_ns(pid)
        return time.monotonic_ns(), machine_busy_ns(), time.process_time_ns(), others

    t_begin = time.monotonic()
    try:
        sw.switch("off")
        times.stopped_ok = sw.wait_stopped() if sw.freeze else True
        for _ in range(rig.opts["warmup"]):
            sw.off_step()
        for arm in ["on", "off", "off", "on"] * STEP_WARM_QUADS:
            sw.switch(arm)
            if arm == "on":
                rig.one_step(sw.st_on)
            else:
                sw.off_step()
        rig.fig_counts.update(asked=0, not_ready=0, requested=0)
        s_prev = snapshot()
        tp_cpu0 = process_cpu_ns(pid)  # the telemetry process's CPU: it runs only while ON
        n_units, per_segment = len(times.plan), times.units_per_segment
        for u, order in enumerate(times.plan):
            for arm in order:
                after_switch = arm != sw.current
                sw.switch(arm)
                s0 = sched_snapshot(main_last=True) if times.sched is not None else None
                t = timed_step(sw, session, arm, times)
                times.records.append((u, arm, after_switch, t))
                if times.sched is not None and s0 is not None:
                    times.sched[arm].append(sched_step(s0, sched_snapshot(main_last=False), t[0]))
            if (u + 1) % per_segment == 0 or u == n_units - 1:
                s1 = snapshot()
                other = (s1[1] - s_prev[1]) - (s1[2] - s_prev[2]) - (s1[3] - s_prev[3])
                times.background.append(max(0.0, other / max(1, s1[0] - s_prev[0])))
                s_prev = s1
        times.tp_cpu_ns = process_cpu_ns(pid) - tp_cpu0
        if rig.opts.get("dump_steps"):
            dump_steps(rig.opts, times)
    finally:
        sw.switch("on")  # never leave the telemetry process frozen
        rig.config.timers = None
    times.elapsed_s = time.monotonic() - t_begin


def dump_steps(opts: dict[str, Any], times: StepTimes) -> None:
    """--dump-steps: every timed step, for --pool."""
    dump = {
        "config": opts["config"],
        "contrast": opts.get("contrast", "all"),
        "model_overrides": opts.get("model_overrides", {}),
        "order": opts["order"],
        "unit_steps": len(times.plan[0]),
        "segment_units": times.units_per_segment,
        "background": times.background,
        "steps": [[u, arm, sw, list(t)] for u, arm, sw, t in times.records],
    }
    Path(opts["dump_steps"]).write_text(json.dumps(dump))


def switch_ratio(
    records: list[tuple[int, str, bool, tuple[float, float, float]]], arm: str
) -> dict[str, Any]:
    """``arm``'s steps right after a switch against its other steps: the median ratio."""
    after = [t[0] for _u, a, sw, t in records if a == arm and sw]
    steady = [t[0] for _u, a, sw, t in records if a == arm and not sw]
    if not after or not steady:
        return {"after_switch": len(after), "steady": len(steady), "ratio_median": None}
    return {
        "after_switch": len(after),
        "steady": len(steady),
        "ratio_median": statistics.median(after) / statistics.median(steady),
    }


def steady_units(times: StepTimes, which: int) -> list[tuple[list[float], list[float]]]:
    """Per unit, its steps that do NOT follow a switch (ABBA: the first ON, the second OFF),
    units with both arms only: the ON/OFF comparison without any wake-up cost."""
    out: list[tuple[list[float], list[float]]] = [([], []) for _ in times.plan]
    for u, arm, sw, t in times.records:
        if not sw:
            out[u][0 if arm == "on" else 1].append(t[which])
    return [x for x in out if x[0] and x[1]]


def step_interleave(rig: Rig) -> dict[str, Any]:
    """--interleave step: ONE session for the whole measurement, its sampler in a separate
    process; steps alternate between ON and OFF (ABBA quads or random pairs), every step
    timed, the switch (SIGCONT / SIGSTOP of the telemetry process, config.timers) between
    steps, outside the timed region."""
    from charllm_nemo.train.dist import shutdown_distributed

    opts = rig.opts
    session, pid, session_start_ms = open_step_session(rig)
    st_on = rig.step_api(session)
    call_ns = time_telemetry_calls(st_on.marker, session) if opts.get("time_calls") else None
    # Python threads the session left in this process (a flusher, in the src of 2026-12): they
    # are not paused for OFF steps, so whatever they do lands on both arms.
    threads = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    flusher = getattr(session, "_flusher", None) if any("flush" in n for n in threads) else None
    sw = StepSwitch(rig, session, st_on, pid)
    times = StepTimes(
        plan=arm_plan(opts, rig.rng),
        profiles={arm: cProfile.Profile() for arm in ("off", "on")} if opts.get("profile") else {},
        sched={"on": [], "off": []} if opts.get("sched_stats") else None,
    )
    run_steps(sw, session, times)
    t_c = time.perf_counter()
    session.close("complete")
    closed = {
        "session_close_ms": (time.perf_counter() - t_c) * 1e3,
        "flushes": (flusher.flushes, flusher.flush_ns_max / 1e6) if flusher is not None else None,
        "health": session.sampler.health,
        "windows_recorded": session.store.manifest["windows_recorded"],  # made here or in its process
        "threads": threads,
        "session_start_ms": session_start_ms,
        "call_ns": call_ns,
    }
    shutil.rmtree(rig.out_root / "steps", ignore_errors=True)
    shutdown_distributed()
    return step_result(sw, session, times, closed)


def step_result(sw: StepSwitch, session: Any, times: StepTimes, closed: dict[str, Any]) -> dict[str, Any]:
    """Step mode's figures: ON against OFF over the units, the switch's own cost, the sampler."""
    rig, records = sw.rig, times.records
    opts, health, flushes = rig.opts, closed["health"], closed["flushes"]
    steady = steady_units(times, 0)
    steps_per_arm = sum(1 for r in records if r[1] == "on")
    on_s = sum(t[0] for _u, arm, _sw, t in records if arm == "on")
    cover, tp_cpu_ns = times.cover, times.tp_cpu_ns
    return {
        "config": opts["config"],
        "model_overrides": opts.get("model_overrides", {}),
        "interleave": "step",
        "order": opts["order"],
        "contrast": sw.contrast,
        "pairs": steps_per_arm,
        "units": len(times.plan),
        "unit_steps": len(times.plan[0]),
        "segment_units": times.units_per_segment,
        "segments": len(times.background),
        "arms": ["off", "on"],
        **step_stats(records, times.background, times.units_per_segment),
        "switch": {arm: switch_ratio(records, arm) for arm in ("on", "off")},
        "steady_iteration": summarize_units(steady) if len(steady) >= 2 else None,
        "sampler": {
            "mode": session.sampler_mode,
            "collector_sched": session.collector_sched,
            "stopped_state_seen": times.stopped_ok,
            "samples_on": cover["samples"],
            "expected_on": cover["ns"] / 1e9 * HZ,
            "coverage_on": cover["samples"] / (cover["ns"] / 1e9 * HZ) if cover["ns"] else None,
            "process_cpu_ms_per_on_step": tp_cpu_ns / 1e6 / steps_per_arm,
            "process_cores_while_on": tp_cpu_ns / 1e9 / on_s if on_s else None,
            "samples_session": health.samples,
            "rows_lost": health.rows_lost,
            "stop_reason": health.stop_reason,
        },
        "figures": {
            "request_figures": True,
            "requested": rig.fig_counts["requested"],
            "asked": rig.fig_counts["asked"],
            "not_ready": rig.fig_counts["not_ready"],
        },
        "threads": closed["threads"],
        "flusher": (
            {"thread_in_training_process": True, "flushes": flushes[0], "flush_ms_max": flushes[1]}
            if flushes is not None
            else {"thread_in_training_process": False}
        ),
        "windows_recorded": closed["windows_recorded"],
        "unmatched_marks": sw.st_on.unmatched_marks,
        "gc_per_100_steps": rig.gc.per_100_steps(steps_per_arm),
        "profile": profile_report(times.profiles, steps_per_arm) if times.profiles else None,
        "calls": calls_report(closed["call_ns"]) if closed["call_ns"] is not None else None,
        "sched": sched_report(times.sched) if times.sched else None,
        "session_start_ms_median": closed["session_start_ms"],
        "session_close_ms_median": closed["session_close_ms"],
        "elapsed_s": times.elapsed_s,
    }


PROC_SAMPLER = """
import sys, time
from charllm_nemo.devices.factory import open_backend
from charllm_nemo.telemetry.sampler import Sampler
backend = open_backend("synthetic", None, activity=1.0)
sampler = Sampler(backend.devices, float(sys.argv[1]), source="synthetic")
sampler.start()
print("ready", flush=True)
while True:
    time.sleep(0.5)
    sampler.take_rows()
"""


def profile_report(profiles: dict[str, Any], steps: int) -> dict[str, Any]:
    """Per arm: total profiled time per step and the cumulative time per step (ms) of the
    telemetry functions that run on the training thread."""
    import pstats

    out: dict[str, Any] = {}
    for arm, prof in profiles.items():
        st = pstats.Stats(prof)
        total = st.total_tt  # type: ignore[attr-defined]
        funcs: dict[str, float] = {}
        for (path, _line, fn), (_cc, _nc, _tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
            for (suffix, name), label in PROFILE_FUNCS.items():
                if fn == name and path.replace(os.sep, "/").endswith(suffix):
                    funcs[label] = funcs.get(label, 0.0) + ct * 1e3 / steps
        out[arm] = {"profiled_ms_per_step": total * 1e3 / steps, "ms_per_step": funcs}
    return out


# ============================================================================================
# the parent: one child per configuration, the spinner for "busy"
# ============================================================================================


SPIN = (
    "import os, sys\nif sys.argv[1]:\n    os.sched_setaffinity(0, {int(sys.argv[1])})\n"
    "while True:\n    pass\n"
)


def session_options(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs (VALUE read as JSON when it parses, else a string) for TelemetrySession."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--session-option {item!r}: use KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def model_overrides(items: list[str]) -> dict[str, Any]:
    """--model-set KEY=VALUE pairs: tiny_gpt's ModelConfig fields to change (VALUE read as JSON)."""
    from dataclasses import fields

    from charllm_nemo.train.config import ModelConfig

    out = session_options(items)
    known = {f.name for f in fields(ModelConfig)} - {"name"}
    unknown = sorted(set(out) - known)
    if unknown:
        fields_s = ", ".join(sorted(known))
        raise SystemExit(f"--model-set {', '.join(unknown)}: not a model field; use one of {fields_s}")
    return out


def run_config(name: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        }
    )
    opts = {
        "config": name,
        "pairs": args.pairs,
        "block_steps": args.block_steps,
        "warmup": args.warmup,
        "seed": args.seed,
        "out_dir": str(out_dir / name),
        "arms": ["off", "on"]
        if args.interleave == "step"
        else DECOMPOSE_ARMS
        if args.decompose
        else ["off", "bare", "on"],
        "interleave": args.interleave,
        "order": args.order,
        "cpus": None,
        "profile": args.profile,
        "session_options": session_options(args.session_option),
        "model_overrides": args.model_overrides,
        "contrast": args.contrast,
        "time_calls": args.time_calls,
        "sched_stats": args.sched_stats,
        "dump_steps": str(Path(args.dump_steps).with_suffix(f".{name}.json")) if args.dump_steps else None,
    }
    spinner = None
    if name == "busy":
        cpus = sorted(os.sched_getaffinity(0))
        spin_cpu = str(cpus[-1]) if args.busy_pin == "split" else ""
        spinner = subprocess.Popen([sys.executable, "-c", SPIN, spin_cpu])
        opts["spinner_pid"] = spinner.pid
        if args.busy_pin == "split":
            opts["cpus"] = cpus[:-1]
        time.sleep(0.3)
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(opts)],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        if spinner is not None:
            spinner.terminate()
            spinner.wait(5)
    for line in proc.stdout.splitlines():
        if line.startswith("WORKER_JSON "):
            return json.loads(line[len("WORKER_JSON ") :])  # type: ignore[no-any-return]
        if line.startswith("WORKER_REFUSED "):
            raise SystemExit(f"config {name}: {line[len('WORKER_REFUSED ') :]}")
    sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
    raise SystemExit(f"config {name}: the child printed no result (rc {proc.returncode})")


def build_parser() -> argparse.ArgumentParser:
    """The command line (step-mode options: :func:`add_step_options`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~30 s: fewer pairs")
    ap.add_argument(
        "--interleave",
        choices=("step", "block"),
        default=None,
        help="step (default): ON and OFF alternate step by step in one session whose telemetry process "
        "is SIGSTOPped for OFF steps; block: rounds of --block-steps blocks per arm, a fresh session "
        "per ON block, with the bare-thread reference (the default with --decompose)",
    )
    ap.add_argument(
        "--order",
        choices=ORDERS,
        default="abba",
        help="step mode: ABBA quads (on,off,off,on, ...; default) or pairs in a random order",
    )
    ap.add_argument(
        "--pairs",
        type=int,
        default=None,
        help=f"ON/OFF pairs per configuration: of steps in step mode (default {STEP_PAIRS['full']}, "
        f"--quick {STEP_PAIRS['quick']}), of blocks (rounds) in block mode (default 40, --quick 5)",
    )
    ap.add_argument("--block-steps", type=int, default=5, help="block mode: timed steps per block")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--configs", default="free,busy")
    ap.add_argument("--json-only", action="store_true")
    ap.add_argument(
        "--decompose",
        action="store_true",
        help="add arms marks / sampler / session between off and on (where the overhead comes from)",
    )
    ap.add_argument(
        "--busy-pin",
        choices=("split", "none"),
        default="split",
        help="busy: spinner on the last core and the child on the others (split), or neither pinned",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the training thread in each arm's timed steps (ms per step of the telemetry calls)",
    )
    ap.add_argument(
        "--session-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra session option for the on/session arms (repeatable; a field of SessionOptions, "
        "StoreOptions or ProcessOptions), e.g. flush_interval_s=1.0",
    )
    ap.add_argument(
        "--model-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change a field of tiny_gpt's model config (repeatable), e.g. hidden_size=256: how the "
        "ratio moves with the step's length (no verdict then)",
    )
    add_step_options(ap)
    ap.add_argument(
        "--pool",
        nargs="+",
        default=None,
        metavar="DUMP",
        help="run nothing: pool the steps of earlier runs' --dump-steps files (one configuration) and "
        "print each run's and the pooled figures, with the verdict over all of them",
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap


def add_step_options(ap: argparse.ArgumentParser) -> None:
    """--contrast, --time-calls, --sched-stats, --dump-steps: step mode only."""
    ap.add_argument(
        "--contrast",
        choices=CONTRASTS,
        default="all",
        help="step mode: what the OFF steps leave out. all (default): the telemetry process (frozen) and "
        "the training thread's telemetry calls; thread: only the calls (the process runs throughout); "
        "process: only the process (the calls in every step); figures: only the figure calls (OFF steps "
        "make the marks but neither ask for nor read figures)",
    )
    ap.add_argument(
        "--time-calls",
        action="store_true",
        help="step mode: time every telemetry call of the ON steps on the training thread, in the step "
        "(per call and per step; the wrappers add a few hundred ns a call to ON steps)",
    )
    ap.add_argument(
        "--sched-stats",
        action="store_true",
        help="step mode: around every timed step (outside its timing, in both arms) read the training "
        "thread's and the process's other threads' /proc schedstat: how long they waited for a CPU and "
        "how long the training thread slept, per arm (Linux; ~1 ms of reads between steps)",
    )
    ap.add_argument(
        "--dump-steps",
        default=None,
        metavar="FILE",
        help="step mode: write every timed step (unit, arm, right after a switch, [iteration, loop_step, "
        "main_cpu] s) to FILE with the configuration's name before the suffix",
    )


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill in the mode's defaults and refuse options that do not go together."""
    if args.interleave is None:
        args.interleave = "block" if args.decompose else "step"
    if args.decompose and args.interleave == "step":
        ap.error("--decompose needs --interleave block (its arms are whole blocks)")
    if args.pairs is None:
        if args.interleave == "step":
            args.pairs = STEP_PAIRS["quick" if args.quick else "full"]
        else:
            args.pairs = 5 if args.quick else 40
    if args.pairs < 2:
        ap.error("--pairs must be at least 2")
    if args.interleave == "step" and session_options(args.session_option).get("sampler") == "thread":
        ap.error(
            "--interleave step pauses the telemetry process (SIGSTOP) for OFF steps; a sampler thread "
            "cannot be paused: drop --session-option sampler=thread, or use --interleave block"
        )
    if args.interleave != "step" and (
        args.contrast != "all" or args.dump_steps or args.time_calls or args.sched_stats
    ):
        ap.error(
            "--contrast, --time-calls, --sched-stats and --dump-steps are step-mode options "
            "(drop --interleave block / --decompose)"
        )


def print_results(args: argparse.Namespace, results: dict[str, dict[str, Any]], elapsed_s: float) -> None:
    """The human-readable lines: the run's header, the table, one line per configuration."""
    print(
        f"tiny_gpt{f' with {args.model_overrides}' if args.model_overrides else ''} on CPU, "
        f"telemetry synthetic @ {HZ:g} Hz (step+microbatch+phase windows) vs off; "
        f"{os.cpu_count()} CPUs; busy pinning {args.busy_pin}; seed {args.seed}; "
        f"{elapsed_s:.0f} s; "
        + (
            f"interleave step ({'ABBA quads' if args.order == 'abba' else 'random pairs'})"
            if args.interleave == "step"
            else f"interleave block ({args.block_steps} steps)"
        )
        + (f"; session options {session_options(args.session_option)}" if args.session_option else "")
        + (f"; contrast {args.contrast}" if args.interleave == "step" else "")
    )
    print_table(results)
    print()
    for name in results:
        r = results[name]
        if r.get("interleave") == "step":
            print(step_summary_line(name, r))
            continue
        on = r["iteration"]["ratio_median"]
        bare = r.get("decompose", {}).get("bare", {}).get("iteration", {}).get("ratio_median")
        bare_s = f", bare thread in this run {bare:.4f}" if bare is not None else ""
        lo, hi = r["iteration"]["ratio_median_ci95"]
        line = (
            f"{name}: iteration median ratio ON/OFF {on:.4f} [{lo:.4f}, {hi:.4f}]{bare_s} "
            f"(DESIGN.md bare thread: "
            f"{REFERENCE_BARE_THREAD.get(name, float('nan'))})"
        )
        if name == "free":
            line += f"; target <= {TARGET_FREE}: {verdict(r)}"
        print(line)


def bench_payload(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What ``BENCH_JSON`` holds."""
    return {
        "bench": "train_telemetry",
        "model": "tiny_gpt",
        "model_overrides": args.model_overrides,
        "hz": HZ,
        "target_free": TARGET_FREE,
        "verdict_free": verdict(results["free"]) if "free" in results else None,
        "reference_bare_thread": REFERENCE_BARE_THREAD,
        "seed": args.seed,
        "quick": args.quick,
        "busy_pin": args.busy_pin,
        "interleave": args.interleave,
        "order": args.order if args.interleave == "step" else None,
        "contrast": args.contrast if args.interleave == "step" else None,
        "pairs": args.pairs,
        "session_options": session_options(args.session_option),
        "results": results,
    }


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    if args.pool is not None:
        raise SystemExit(print_pool(args.pool, args.json_only))
    args.model_overrides = model_overrides(args.model_set)
    if args.worker is not None:
        try:
            res = worker(json.loads(args.worker))
        except BenchRefused as exc:
            sys.stdout.write(f"WORKER_REFUSED {exc}\n")
            raise SystemExit(2) from None
        sys.stdout.write("WORKER_JSON " + json.dumps(res) + "\n")
        return
    check_args(ap, args)
    if args.seed is None:
        args.seed = int(time.time())
    out_dir = Path(tempfile.mkdtemp(prefix="bench-train-telemetry-"))
    results: dict[str, dict[str, Any]] = {}
    t0 = time.monotonic()
    try:
        for name in args.configs.split(","):
            results[name] = run_config(name, args, out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    if not args.json_only:
        print_results(args, results, time.monotonic() - t0)
    print("BENCH_JSON " + json.dumps(bench_payload(args, results)))


if __name__ == "__main__":
    main()
