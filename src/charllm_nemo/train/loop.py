"""The training loop of one rank: Megatron-Core GPT/MoE with step, microbatch and phase marks.

A launcher (``launcher=local nproc=N``, torchrun, or srun) starts one process per rank with the
torch.distributed variables set; each calls :func:`run_rank`:

1. ``init_distributed`` (train/dist.py): ranks from RANK / WORLD_SIZE / LOCAL_RANK (or
   SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID), rendezvous at MASTER_ADDR:MASTER_PORT; gloo +
   the CPU patches (train/cpu.py) on CPU, NCCL on GPU; ``parallel_state.initialize_model_parallel``;
   seeds.
2. on GPU, the memory check (train/plan.py ``check_gpu_memory``); the model, DDP and optimizer
   (train/model.py), the data (train/data.py);
3. ``train_steps`` steps of ``get_forward_backward_func()`` over
   ``global_batch / (micro_batch * dp)`` microbatches, then ``optimizer.step()``;
4. everything per step goes through the framework-free step API
   (:class:`~charllm_nemo.steps.StepTelemetry`, as every other integration uses it): its timers
   adapter is ``config.timers`` (forward / backward marks), the loop says where steps and the
   optimizer begin and end, and hands it the loss terms; it gathers one vector per rank a step
   and gives rank 0's observers (console line, steps.jsonl, W&B, summary.json's rows) each
   step's report with throughput, MFU and the telemetry figures over all ranks.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any

from charllm_nemo.steps.summary import RunSummary, write_summary
from charllm_nemo.telemetry.windows import WindowRecorder
from charllm_nemo.train.config import TrainConfig, for_device
from charllm_nemo.train.disk_full import DISK_FULL, DiskWatch, TelemetryDiskFull
from charllm_nemo.train.dist import DistInfo, init_distributed, rank_env, resolve_device, shutdown_distributed
from charllm_nemo.train.profile import StepProfiler
from charllm_nemo.train.report import STEPS_FILE, SUMMARY_FILE

log = logging.getLogger("charllm_nemo.train")


RESULT_STEPS_KEPT = 1000
"""Steps whose loss, step times and gradient norm a :class:`RankResult` keeps (the last ones):
a run of weeks holds the same memory as one of minutes (steps.jsonl has every step)."""


def _ring() -> deque[Any]:
    return deque(maxlen=RESULT_STEPS_KEPT)


@dataclass
class RankResult:
    """What one rank ran. ``losses[i]`` is the loss over the global batch of the i-th of the
    last :data:`RESULT_STEPS_KEPT` steps (None only if the loss could not be reduced);
    ``step_times_s`` are max over ranks (the same steps); ``steps`` counts them all.
    ``summary`` (rank 0 only; None elsewhere) gathers summary.json's medians and its last
    per-step reports (:class:`~charllm_nemo.steps.summary.RunSummary`, bounded);
    :meth:`to_dict` gives its ``per_step`` rows as ``summaries`` (empty elsewhere)."""

    rank: int
    world_size: int
    device: str
    steps: int = 0
    losses: deque[float | None] = field(default_factory=_ring)
    step_times_s: deque[float] = field(default_factory=_ring)
    local_step_times_s: deque[float] = field(default_factory=_ring)
    grad_norms: deque[float | None] = field(default_factory=_ring)
    summary: RunSummary | None = None
    num_parameters: int = 0
    num_matrix_parameters: int = 0  # GEMM weights and embeddings (train/model.py ModelBundle)
    num_microbatches: int = 0
    labels: dict[str, int | None] = field(default_factory=dict)
    unmatched_marks: int = 0
    wall_s: float = 0.0
    memory: dict[str, Any] | None = None  # every rank's peak and plan (train/plan.py memory_report)
    setup_s: dict[str, float] = field(default_factory=dict)  # init, telemetry, model (seconds)

    def record(self, out: Any) -> None:
        """A step ended on this rank (its StepOutcome: ``StepTelemetry.last``)."""
        self.steps += 1
        self.losses.append(out.loss)
        self.grad_norms.append(out.grad_norm)
        self.step_times_s.append(out.step_time_s)
        self.local_step_times_s.append(out.local_step_time_s)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "summary"}
        for name, value in out.items():
            if isinstance(value, deque):
                out[name] = list(value)
        out["summaries"] = [] if self.summary is None else self.summary.per_step
        return out


def _loss_func(loss_mask: Any, output_tensor: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Megatron-LM's 3-tuple loss: summed token loss, token count, and [sum, count] for the log
    (the schedule divides the first by the count and the number of microbatches)."""
    import torch

    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum()
    report = torch.cat([loss.detach().view(1), tokens.detach().view(1)])
    return loss, tokens.to(torch.int), {"lm loss": report}


def train_step(
    st: Any,
    step: int,
    bundle: Any,
    forward_backward: Any,
    data_iter: Any,
    model: Any,
    n_micro: int,
    cfg: TrainConfig,
    reports_loss: bool,
) -> None:
    """One training step through the step API ``st`` (a StepTelemetry): zero the gradients,
    megatron-core's ``forward_backward`` over ``n_micro`` microbatches, the optimizer in its
    phase, and the step's summed token loss (where this rank has it: ``reports_loss``) to
    ``end_step``. The loop's own step, and what bench/bench_train_telemetry.py times."""
    import torch

    st.begin_step(step)
    for chunk in bundle.chunks:
        chunk.zero_grad_buffer()
    bundle.optimizer.zero_grad()
    outputs = forward_backward(
        forward_step_func=_forward_step,
        data_iterator=data_iter,
        model=model,
        num_microbatches=n_micro,
        seq_length=cfg.model.seq_length,
        micro_batch_size=cfg.batch.micro_batch_size,
        forward_only=False,
    )
    with st.phase("optimizer"):
        ok, grad_norm, _zeros = bundle.optimizer.step()
        if ok:
            bundle.scheduler.step(1)
    loss_sum = loss_tokens = 0.0
    if reports_loss and outputs:
        tot = torch.stack([o["lm loss"] for o in outputs]).sum(dim=0)
        loss_sum, loss_tokens = float(tot[0]), float(tot[1])
    st.end_step(num_microbatches=n_micro, grad_norm=grad_norm, loss_sum=loss_sum, loss_tokens=loss_tokens)


def _forward_step(data_iterator: Any, model: Any) -> tuple[Any, Any]:
    """mcore's ``forward_step_func``: called once per microbatch (per model chunk). With context
    parallelism each rank keeps its two of the sequence's 2 * cp chunks (mcore's
    ``get_batch_on_this_cp_rank``, as Megatron-LM's ``get_batch``; a no-op at cp=1): the model
    and the schedules' pipeline buffers expect ``seq_length / cp`` tokens per rank."""
    from charllm_nemo.train.mcore_compat import batch_on_this_cp_rank

    batch = batch_on_this_cp_rank(next(data_iterator))
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _open_session(cfg: TrainConfig, dist: DistInfo, local_ranks: int, rank_threads: int) -> Any:
    """This rank's telemetry session; ``local_ranks`` on this node, each keeping ``rank_threads``
    CPU threads busy (``telemetry.collector_sched=auto``)."""
    from charllm_nemo.telemetry.config import Placement, open_session

    # No overwrite here: telemetry.overwrite's removing was done before any rank could write
    # (train/app.py check_run_dir), so a rank folder holding files now is another job's.
    # The parallel ranks from the start: the live exporter's series carry them from the first scrape.
    labels = {k: v for k, v in dist.labels().items() if v is not None}
    placement = Placement(dist.rank, dist.local_rank, dist.world_size, max(local_ranks, 1), labels)
    return open_session(
        replace(cfg.telemetry, overwrite=False),
        placement,
        run_config=cfg,
        rank_threads=rank_threads,
        validate=False,  # validated with the whole config, before any process group
    )


def _open_sink(cfg: TrainConfig, dist: DistInfo, session: Any) -> Any:
    """Rank 0's metrics sink (W&B) for ``logger=wandb``, started off the training thread;
    None elsewhere. ``logger=console`` is the loop's own per-step line, ``none`` silences it."""
    if cfg.logger.name != "wandb":
        return None
    from charllm_nemo.sinks.config import build_sink

    # The node's number: srun's, or torchrun's (GROUP_RANK; launcher=slurm sets it too).
    node = int(os.environ.get("SLURM_NODEID") or os.environ.get("GROUP_RANK") or 0)
    sink = build_sink(
        cfg.logger, dist.rank, run_dir=cfg.telemetry.out_dir, local_rank=dist.local_rank, node_rank=node
    )
    if sink is not None:
        manifest = dict(session.manifest) if session is not None else {"world_size": dist.world_size}
        sink.start(asdict(cfg), manifest)
    return sink


def _finish_sink(sink: Any, cfg: TrainConfig, rank: int, status: str, torch: Any) -> None:
    """Once this rank closed its telemetry: every rank says so and how it ended; rank 0, when
    its own run is complete, waits for every other rank's word (so the run directory is final)
    at most logger.finish_timeout_s, names the ranks that failed or stayed silent, then finishes
    W&B (windows table, artifact) within logger.finish_timeout_s. No barrier: a rank that failed
    after training does not hold rank 0 for the process group's timeout, and the other ranks
    leave at once."""
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1:
        from charllm_nemo.train.dist import announce_closed, closing_problems, wait_for_ranks_closed

        if rank != 0:
            announce_closed(torch, rank, status)
        elif sink is not None and status == "complete":
            timeout_s = cfg.logger.finish_timeout_s
            statuses = wait_for_ranks_closed(torch, range(1, world), timeout_s)
            problems = closing_problems(statuses, timeout_s)
            if problems:
                print(f"charllm: {problems}; W&B gets the run directory as is", file=sys.stderr, flush=True)
    if sink is None:
        return
    sink.finish(Path(cfg.telemetry.out_dir))
    # Always said on rank 0's console: a run whose W&B lost steps must say how many.
    print(f"charllm: {sink.report.line()}", file=sys.stderr, flush=True)


def _resolved_layout(cfg: TrainConfig, world_size: int, device: str) -> Any:
    from charllm_nemo.train.validate import validate

    return validate(cfg, world_size=world_size, device=device)


def run_rank(
    cfg: TrainConfig,
    session: Any = None,
    *,
    recorder: WindowRecorder | None = None,
    shutdown: bool = True,
) -> RankResult:
    """Train ``cfg`` on this rank; returns what it ran.

    ``session``: a telemetry session (``.windows``: WindowRecorder, ``.request_figures(t_begin_ns,
    t_end_ns, figures, batch=)``, ``.step_figures(t_begin_ns, t_end_ns, wait_s, figures)``,
    ``.close()``) owned by the caller. None: with ``telemetry.enabled`` one is opened here
    (charllm_nemo.telemetry.session.TelemetrySession, writing under ``telemetry.out_dir``) and
    closed at the end; ``recorder`` (tests) instead gives a bare
    WindowRecorder and no session. ``shutdown``: destroy the process groups at the end.
    """
    import torch

    env = rank_env(cfg)
    device = resolve_device(cfg)
    cfg = for_device(cfg, device)
    layout = _resolved_layout(cfg, env.world_size, device)  # raises ConfigProblems, before any group
    t_start = time.monotonic()
    dist = init_distributed(cfg, env, device)
    setup_s = {"init": time.monotonic() - t_start}  # megatron-core's import, the process groups
    own_session = False
    status = "failed"
    sink = None
    disk = DiskWatch(cfg.telemetry.out_dir, required=cfg.telemetry.required, rank=dist.rank)
    started: list[RankResult] = []  # _train's result once it exists: a partial one if training stops
    try:
        t0 = time.monotonic()
        if session is None and recorder is None and cfg.telemetry.enabled:
            # A rank keeps a CPU busy; on CPU, one per intra-op thread.
            threads = torch.get_num_threads() if device == "cpu" else 1
            session = _open_session(cfg, dist, env.local_world_size, threads)
            own_session = True
        sink = _open_sink(cfg, dist, session)
        setup_s["telemetry"] = time.monotonic() - t0
        # Windows are recorded into a session or a caller's recorder; with telemetry off and
        # neither, nothing is marked at all (config.timers stays None: the bench's "off" case).
        marking = session is not None or recorder is not None
        rec = session.windows if session is not None else recorder
        if rec is not None:
            rec.set_labels(**dist.labels())
        kinds = list(cfg.telemetry.windows) if marking else []
        result = _train(cfg, dist, layout, rec, session, kinds, torch, sink, started, setup_s, disk)
        status = "complete"
        return result
    except TelemetryDiskFull:  # telemetry.required and the disk is full: said by the worker, once
        status = DISK_FULL
        raise
    except KeyboardInterrupt:  # Ctrl-C (the local launcher forwards it to every rank)
        status = "interrupted"
        raise
    except SystemExit:  # SIGTERM (train/worker.py unwinds the rank with SystemExit)
        status = "terminated"
        raise
    finally:
        if status == "complete" and (disk.full or getattr(session, "disk_full", False)):
            status = DISK_FULL  # trained to the end; telemetry stopped when the disk filled
        if started:
            started[0].wall_s = time.monotonic() - t_start
        disk.release()  # the room kept for summary.json
        if started and dist.rank == 0:
            try:
                _write_summary(cfg, layout, started[0], status)
            except OSError as exc:  # a full disk: one line, not a traceback
                log.error(
                    "could not write summary.json in %s: %s", cfg.telemetry.out_dir, exc.strerror or exc
                )
            except Exception:  # never hide why training stopped
                log.exception("could not write summary.json")
        closed = status
        try:
            if own_session and session is not None:
                session.close(status)
        except Exception:
            closed = "failed"  # its telemetry did not close (a full disk, say): rank 0 hears so
            raise
        finally:
            if sink is not None or cfg.logger.name == "wandb":
                _finish_sink(sink, cfg, dist.rank, closed, torch)
            if shutdown:
                shutdown_distributed()


def _write_summary(cfg: TrainConfig, layout: Any, result: RankResult, status: str) -> None:
    """Rank 0 writes ``summary.json`` into the run directory when training ends, however it
    ends (``status``: complete, interrupted, terminated, failed; schema in docs/store.md)."""
    from dataclasses import asdict, is_dataclass

    out = Path(cfg.telemetry.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "status": status,
        "model": cfg.model.name,
        "layout": asdict(layout) if is_dataclass(layout) and not isinstance(layout, type) else str(layout),
        "world_size": result.world_size,
        "device": result.device,
        "telemetry": cfg.telemetry.enabled,
        "mfu_attention": cfg.telemetry.attention_flops,  # how MFU counted attention (full | causal)
        "num_parameters": result.num_parameters,
        "num_microbatches": result.num_microbatches,
        "wall_s": result.wall_s,
        "setup_s": result.setup_s,
        "memory": result.memory,
        **(result.summary or RunSummary(result.world_size)).summary(),
    }
    if write_summary(out / SUMMARY_FILE, data) == "compact":
        log.error("the disk is full: summary.json written without its per-step rows (steps.jsonl has them)")


def setup_line(setup_s: dict[str, float], num_parameters: int, steps: int) -> str:
    """Rank 0's line before the first step: how long getting ready took, by part (on a cluster
    the process groups and the model build can take minutes), and what comes next."""
    parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in setup_s.items())
    return (
        f"charllm train: rank 0 ready after {sum(setup_s.values()):.1f} s ({parts}; "
        f"{num_parameters:,} parameters on this rank); training {steps} step(s)"
    )


def _gather_memory(cfg: TrainConfig, layout: Any, dist: DistInfo, torch: Any, device: Any) -> dict[str, Any]:
    """Every rank's peak memory, its stage's planned weights, gradients and optimizer state and
    its stage's estimated activations (train/plan.py), on every rank: one all_gather at the end
    of training (none with one rank). -1 stands for "unknown" on the wire and None in the
    result."""
    from charllm_nemo.train.model import layers_built
    from charllm_nemo.train.plan import memory_report, peak_memory, plan_stage_activations, plan_stage_memory

    on_cpu = dist.device == "cpu"
    measure, peak = peak_memory(torch, on_cpu)
    plan = acts = None
    try:  # figures, never a reason to fail
        plan = plan_stage_memory(cfg, layout)[dist.pp_rank].total_bytes
        acts = plan_stage_activations(cfg, layout, layers_built(on_cpu))[dist.pp_rank].total_bytes
    except Exception:
        log.debug("no memory plan for this rank", exc_info=True)
    mine = [-1 if v is None else v for v in (peak, plan, dist.pp_rank, acts)]
    rows = [mine]
    if dist.world_size > 1:
        t = torch.tensor(mine, dtype=torch.int64, device=device)
        out = [torch.empty_like(t) for _ in range(dist.world_size)]
        torch.distributed.all_gather(out, t)
        rows = [[int(v) for v in o.tolist()] for o in out]
    return memory_report(measure, [(_known(p), _known(n), stage, _known(a)) for p, n, stage, a in rows])


def _stage_layout(cfg: TrainConfig, dist: DistInfo, layout: Any) -> Any:
    """The alerts' StageLayout (docs/alerts.md, "Pipelines"): each rank's stage in
    megatron-core's default rank order (the one init_distributed uses) and each stage's work,
    its layers plus, on the last, the logits in layers' FLOPs; None without a pipeline."""
    if dist.pp_size <= 1:
        return None
    from charllm_nemo.alerts import StageLayout
    from charllm_nemo.metrics import flops

    logits = 0.0
    try:  # the work is context for the alerts, never a reason to fail
        shape = flops.ModelShape.from_model_config(cfg.model)
        per_step = flops.model_flops_per_step(shape, 1)
        layer = (per_step.total - per_step.logits) / shape.num_layers
        logits = per_step.logits / layer if layer > 0 else 0.0
    except Exception:
        log.debug("no FLOPs for the stages' work", exc_info=True)
    return StageLayout.megatron(dist.world_size, dist.pp_size, list(layout.layers_per_stage), logits)


def _known(value: int) -> int | None:
    return None if value < 0 else value


def _train(
    cfg: TrainConfig,
    dist: DistInfo,
    layout: Any,
    rec: WindowRecorder | None,
    session: Any,
    kinds: list[str],
    torch: Any,
    sink: Any = None,
    started: list[RankResult] | None = None,
    setup_s: dict[str, float] | None = None,
    disk: DiskWatch | None = None,
) -> RankResult:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from charllm_nemo.train.data import DataLayout, MicrobatchIterator, build_train_dataset, token_check
    from charllm_nemo.train.model import build_model, layers_built

    on_cpu = dist.device == "cpu"
    b = cfg.batch
    setup_s = {} if setup_s is None else setup_s
    t0 = time.monotonic()
    if not on_cpu:
        from charllm_nemo.train.model import initialize_tp_comm_overlap
        from charllm_nemo.train.plan import check_gpu_memory

        check_gpu_memory(cfg, layout, dist, torch, layers_built(on_cpu))
        if cfg.optim.tp_comm_overlap:
            initialize_tp_comm_overlap(cfg)
    bundle = build_model(cfg, on_cpu=on_cpu, pipeline_layout=layout.mcore_pipeline_layout())
    setup_s["model"] = time.monotonic() - t0
    config = bundle.config
    data_layout = DataLayout(b.micro_batch_size, b.global_batch_size, dist.dp_size, dist.dp_rank)
    n_micro = data_layout.num_microbatches
    dataset = build_train_dataset(cfg, b.train_steps * b.global_batch_size)
    data_device = "cpu" if on_cpu else f"cuda:{torch.cuda.current_device()}"
    check = token_check(cfg)  # real data: its token ids against model.vocab_size
    iters = [
        MicrobatchIterator(dataset, data_layout, b.train_steps, data_device, **check) for _ in bundle.chunks
    ]
    forward_backward = get_forward_backward_func()
    comm_device = "cpu" if on_cpu else torch.device("cuda", torch.cuda.current_device())
    reports_loss = dist.is_last_stage and dist.tp_rank == 0
    result = RankResult(
        rank=dist.rank,
        world_size=dist.world_size,
        device=dist.device,
        num_parameters=bundle.num_parameters,
        num_matrix_parameters=bundle.num_matrix_parameters,
        num_microbatches=n_micro,
        labels=dist.labels(),
        setup_s=setup_s,
    )
    if started is not None:
        started.append(result)
    print_steps = cfg.logger.name != "none"
    if dist.rank == 0 and print_steps:
        print(setup_line(setup_s, bundle.num_parameters, b.train_steps), file=sys.stderr, flush=True)
    st = _step_telemetry(cfg, dist, layout, rec, session, kinds, bundle, n_micro, sink, result, print_steps)
    config.timers = st.timers()  # None with nothing marked: the bench's "off" case
    from charllm_nemo.steps import StepsFileObserver

    # rank 0's steps.jsonl, which DiskWatch asks whether the disk filled up
    steps_file = next((o.file for o in st.observers if isinstance(o, StepsFileObserver)), None)
    data_iter: Any = iters[0] if len(iters) == 1 else iters
    profiler = StepProfiler(cfg.telemetry.out_dir, dist.rank, cfg.telemetry.profile_steps)
    model: Any = bundle.chunks[0] if len(bundle.chunks) == 1 else bundle.chunks
    try:
        for step in range(b.train_steps):
            with profiler.step(step):  # telemetry.profile_steps: PyTorch profiler traces
                train_step(st, step, bundle, forward_backward, data_iter, model, n_micro, cfg, reports_loss)
            assert st.last is not None
            result.record(st.last)
            if disk is not None:  # every rank: telemetry's store; rank 0: steps.jsonl too
                disk.check(session, steps_file, step)
        # The last steps' figures (one more gather each, within one bounded wait); the session
        # stays open: run_rank closes it after summary.json.
        st.finish("complete", close_session=False)
        result.memory = _gather_memory(cfg, layout, dist, torch, comm_device)
        if dist.rank == 0 and print_steps:
            from charllm_nemo.train.plan import memory_line

            line = memory_line(result.memory)
            if line:
                print(line, flush=True)
    finally:
        st.finish("failed", close_session=False)  # stopped early: the observers close, no gather
    result.unmatched_marks = st.unmatched_marks
    return result


def _step_telemetry(
    cfg: TrainConfig,
    dist: DistInfo,
    layout: Any,
    rec: WindowRecorder | None,
    session: Any,
    kinds: list[str],
    bundle: Any,
    n_micro: int,
    sink: Any,
    result: RankResult,
    print_steps: bool,
) -> Any:
    """This rank's :class:`~charllm_nemo.steps.StepTelemetry`: rank 0's observers are the
    console (``logger`` not ``none``), steps.jsonl, W&B (``logger=wandb``; finished by
    run_rank once the session closed its files) and summary.json's rows."""
    import torch

    from charllm_nemo.steps import (
        ConsoleObserver,
        Observer,
        StepOptions,
        StepsFileObserver,
        WandbObserver,
    )
    from charllm_nemo.steps.open import build_step_telemetry
    from charllm_nemo.telemetry.config import Placement
    from charllm_nemo.train.model import uses_transformer_engine
    from charllm_nemo.train.report import train_rates

    on_cpu = dist.device == "cpu"
    gpu = None if on_cpu else torch.cuda.get_device_properties(torch.cuda.current_device())
    rates = train_rates(
        cfg,
        dist.world_size,
        None if gpu is None else gpu.name,
        on_cpu,
        list(layout.layers_per_virtual_stage),
        compute_units=None if gpu is None else gpu.multi_processor_count,
        tf32_gemms=uses_transformer_engine(on_cpu),
    )
    observers: list[Observer] = []
    if dist.rank == 0:
        result.summary = RunSummary(dist.world_size)  # summary.json's medians and last rows, bounded
        observers.append(result.summary)
        observers.append(StepsFileObserver(Path(cfg.telemetry.out_dir) / STEPS_FILE))
        if print_steps:
            synthetic = getattr(session, "source", None) == "synthetic"
            observers.append(ConsoleObserver(cfg.batch.train_steps, dist.world_size, synthetic=synthetic))
        if sink is not None:
            observers.append(WandbObserver(sink, finish=False))

    # Alerts (docs/alerts.md): every rank sums its phases and sends its facts once; rank 0
    # watches. Off (alerts=off, or no telemetry to judge): no observer, nothing summed or sent.
    def alerter(others: Sequence[Observer]) -> Observer | None:
        from charllm_nemo.alerts import alert_observer

        p = cfg.parallel
        # tensor / expert / context parallel collectives sit inside the forward and backward
        coupled = any((size or 1) > 1 for size in (p.tp, p.ep, p.cp))
        stages = _stage_layout(cfg, dist, layout)
        return alert_observer(
            cfg.alerts, run_dir=cfg.telemetry.out_dir, sink=sink, stages=stages, collectives_in_phases=coupled
        )

    config = bundle.config
    return build_step_telemetry(
        session,
        Placement(dist.rank, dist.local_rank, dist.world_size),
        StepOptions(
            device=dist.device,
            windows=kinds,
            total_steps=cfg.batch.train_steps,
            num_microbatches=n_micro,
            num_chunks=len(bundle.chunks),
            group_size=getattr(config, "microbatch_group_size_per_vp_stage", None),
        ),
        rates=rates,
        observers=observers,
        alerter=alerter if cfg.alerts.enabled and session is not None else None,
        recorder=rec,
    )
