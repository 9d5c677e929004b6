"""NeMo 2 / Lightning drop-in: :class:`PowerThermalCallback`.

One line in a NeMo 2 recipe (docs/integrations.md)::

    recipe.trainer.callbacks.append(run.Config(PowerThermalCallback, hz=100, out_dir="runs/{time}"))

or ``callbacks=[PowerThermalCallback()]`` on any ``lightning.pytorch.Trainer``.

Where each window's boundaries come from (the manifest records it, ``integration.sources``):

* step: Lightning's ``on_train_batch_start`` / ``on_train_batch_end`` (the optimizer step is
  inside; the same on NeMo's MegatronStrategy and on a plain Trainer);
* forward / backward phases and microbatches: megatron-core's ``config.timers`` calls
  (``forward-compute`` / ``backward-compute``, the pipeline's send/recv, the gradient syncs),
  through the API's timers adapter, which wraps NeMo's own ``Timers`` in ``model.config.timers``
  and forwards to it (NeMo's timing logs keep working). NeMo's ``on_megatron_microbatch_*``
  hooks bracket the forward only, so they are not used for windows;
* optimizer phase: Lightning's ``on_before_optimizer_step`` to ``on_train_batch_end``.

NeMo's ``on_megatron_*`` hooks (with exactly the parameter names MegatronStrategy passes) count
the steps and microbatches NeMo ran; each step's microbatch count is megatron-core's
``get_num_microbatches()`` (NeMo's ``step.num_microbatches`` is still None at step start).
Telemetry opens on every rank at ``on_train_start`` (its local device), and closes and flushes at
``on_train_end``, on an exception (``on_exception``), at ``teardown`` and on SIGTERM (the
session's handler). All per-step logic is the step-telemetry
API's (charllm_nemo.steps); this class only says where things begin and end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from charllm_nemo.integrations._common import (
    IntegrationOptions,
    RunFacts,
    loss_of,
    open_step_telemetry,
    options_signature,
    quiet_option_errors,
)
from charllm_nemo.integrations._observer_thread import ObserverThread, ThreadedLoggersObserver

try:
    from lightning.pytorch import Callback
except ImportError as exc:  # pragma: no cover - the callback is only for Lightning users
    raise ImportError(
        "charllm_nemo.integrations.nemo needs lightning (pip install 'lightning<=2.4'; NeMo 2 brings it)"
    ) from exc

log = logging.getLogger(__name__)

SOURCES_MEGATRON = {
    "step": "lightning:on_train_batch_start..on_train_batch_end",
    "microbatch": "megatron-core config.timers (span of forward-compute..backward-compute)",
    "phase:forward": "megatron-core config.timers forward-compute",
    "phase:backward": "megatron-core config.timers backward-compute",
    "phase:pp-*": "megatron-core config.timers p2p send/recv",
    "phase:grad-sync": "megatron-core config.timers all-grads-sync",
    "phase:optimizer": "lightning:on_before_optimizer_step..on_train_batch_end",
}
SOURCES_LIGHTNING = {
    "step": "lightning:on_train_batch_start..on_train_batch_end",
    "phase:optimizer": "lightning:on_before_optimizer_step..on_train_batch_end",
}


class PowerThermalCallback(Callback):  # type: ignore[misc]
    """Per-rank power / energy / thermal / throttle telemetry for a NeMo 2 or Lightning run.

    Every argument is a plain value (Fiddle / NeMo-Run configure it): see
    :class:`~charllm_nemo.integrations._common.IntegrationOptions` for their meaning and units
    (``hz`` in samples a second). ``log_to="trainer"`` (default) gives each step's figures to
    the trainer's loggers as ``<key_prefix><field>`` (NeMo's W&B logger among them);
    ``"wandb"`` to charllm's own W&B sink instead; ``"none"`` to neither. ``steps.jsonl`` and the
    per-rank Parquet store are written in the run directory either way. ``alerts`` (default on):
    live alerts on rank 0 (docs/alerts.md), also to ``on_alert(dict)`` when given.
    """

    # rank 0's, set at on_train_start: summary.json's rows, the trainer's loggers' observer
    _summary: _SummaryRows | None = None
    _loggers: ThreadedLoggersObserver | None = None
    _grad_norm: _LoggedGradNorm | None = None

    def __init__(self, *, on_alert: Callable[[dict[str, Any]], object] | None = None, **options: Any) -> None:
        super().__init__()
        self.options = IntegrationOptions.from_keywords("PowerThermalCallback", options)
        self.on_alert = on_alert  # called on rank 0 with each alert's dict (docs/alerts.md)
        self.telemetry: Any = None
        """This rank's StepTelemetry while training (None before and after)."""
        self.run_dir: str | None = None
        self.sources: dict[str, str] = {}
        self.microbatches_seen = 0
        """Microbatches NeMo ran (its ``on_megatron_microbatch_end``), all steps together."""
        self.megatron_steps_seen = 0
        """Steps NeMo's MegatronStrategy ran (its ``on_megatron_step_start``)."""
        self._in_step = False
        self._step_microbatches: int | None = None  # this step's, asked at its start
        self._optimizer_phase: Any = None
        self._timers_patched: list[tuple[Any, Any]] = []

    # -- open ------------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.options.enabled or self.telemetry is not None:
            return
        from charllm_nemo.telemetry.config import Placement

        configs = _megatron_configs(trainer, pl_module)
        megatron = bool(configs)
        labels: dict[str, int] = {}
        if megatron:
            labels = dict(Placement.from_megatron().labels)
        placement = Placement(
            rank=int(trainer.global_rank),
            local_rank=int(trainer.local_rank),
            world_size=int(trainer.world_size),
            local_world_size=max(1, int(getattr(trainer, "num_devices", 1) or 1)),
            labels=labels,
        )
        device = "cuda" if getattr(pl_module.device, "type", "cpu") == "cuda" else "cpu"
        model, gbs, seq = _shape_of(trainer, pl_module, self.options.attention_flops)
        self.sources = dict(SOURCES_MEGATRON if megatron else SOURCES_LIGHTNING)
        observers: list[Any] = []
        self._summary = None
        if trainer.global_rank == 0:
            self._summary = _SummaryRows(trainer, pl_module, placement, device, megatron)
            observers.append(self._summary)
        self._loggers = None
        if self.options.log_to == "trainer" and trainer.global_rank == 0 and trainer.loggers:
            # run on the observer thread (integrations/_observer_thread.py)
            self._loggers = ThreadedLoggersObserver(
                list(trainer.loggers), self.options.key_prefix, every=_log_every(trainer)
            )
            observers.append(self._loggers)
        self.telemetry, self.run_dir = open_step_telemetry(
            self.options,
            placement,
            framework="nemo" if megatron else "lightning",
            sources=self.sources,
            run=RunFacts(
                model=model,
                global_batch_size=gbs,
                seq_length=seq,
                device=device,
                num_microbatches=_num_microbatches() or 1,
                total_steps=int(trainer.max_steps) if trainer.max_steps and trainer.max_steps > 0 else None,
            ),
            observers=observers,
            on_alert=self.on_alert,
        )
        _observers_off_thread(self.telemetry)
        self._grad_norm = _LoggedGradNorm()
        for config in configs:
            inner = getattr(config, "timers", None)
            config.timers = self.telemetry.timers(inner=inner)
            self._timers_patched.append((config, inner))

    # -- steps -----------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        st = self.telemetry
        if st is None:
            return
        # NeMo's step.num_microbatches is None until its step starts: mcore's calculator knows it
        self._step_microbatches = _num_microbatches()
        st.begin_step(int(trainer.global_step), num_microbatches=self._step_microbatches)
        self._in_step = True

    def on_megatron_step_start(self, step: Any) -> None:
        self.megatron_steps_seen += 1

    def on_megatron_microbatch_end(self, step: Any, batch: Any, forward_callback: Any, output: Any) -> None:
        self.microbatches_seen += 1

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.telemetry is None or not self._in_step or self._optimizer_phase is not None:
            return
        self._optimizer_phase = self.telemetry.phase("optimizer")
        self._optimizer_phase.__enter__()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        st = self.telemetry
        if st is None or not self._in_step:
            return
        if self._optimizer_phase is not None:
            self._optimizer_phase.__exit__(None, None, None)
            self._optimizer_phase = None
        self._in_step = False
        st.end_step(
            loss=loss_of(outputs),
            num_microbatches=self._step_microbatches,
            grad_norm=_norm(self._grad_norm, trainer),
        )
        loggers = self._loggers
        if loggers is not None and loggers.handed_over and trainer.global_step % _log_every(trainer) == 0:
            loggers.flush()  # where Lightning logs its own metrics

    # -- close -----------------------------------------------------------------------------
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close("complete")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close("interrupted" if isinstance(exception, KeyboardInterrupt) else "failed")

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close("complete" if not self._in_step else "failed")

    def _close(self, status: str) -> None:
        st, self.telemetry = self.telemetry, None
        for config, inner in self._timers_patched:
            config.timers = inner  # NeMo's own Timers again
        self._timers_patched = []
        self._optimizer_phase = None
        self._in_step = False
        self._loggers = None  # closed (its last reports logged) by st.finish
        if st is not None:
            try:
                # the manifest's word (``terminated`` after a SIGTERM, whatever Lightning's
                # exception made of it): summary.json says the same
                status = st.finish(status) or status
            finally:
                summary, self._summary = self._summary, None
                if summary is not None and self.run_dir is not None:
                    summary.write(self.run_dir, status)


def _megatron_configs(trainer: Any, pl_module: Any) -> list[Any]:
    """The megatron-core ``TransformerConfig`` objects whose ``timers`` megatron-core's schedules
    call (NeMo sets ``model.config.timers``); empty for a plain LightningModule."""
    configs: list[Any] = []
    seen: set[int] = set()

    def add(config: Any) -> None:
        if config is not None and hasattr(config, "timers") and id(config) not in seen:
            seen.add(id(config))
            configs.append(config)

    add(getattr(pl_module, "config", None))
    parallel = getattr(trainer.strategy, "megatron_parallel", None)
    if parallel is not None:
        for chunk in parallel:
            module = getattr(chunk, "module", chunk)
            add(getattr(module, "config", None))
    if not configs or not any(_is_transformer_config(c) for c in configs):
        return []
    return configs


def _is_transformer_config(config: Any) -> bool:
    try:
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        return False
    return isinstance(config, TransformerConfig)


def _num_microbatches() -> int | None:
    getter = _NUM_MICROBATCHES[0]
    if getter is None:
        try:
            from megatron.core.num_microbatches_calculator import get_num_microbatches
        except ImportError:
            return None  # not a Megatron run
        getter = _NUM_MICROBATCHES[0] = get_num_microbatches
    try:
        return int(getter())
    except (AssertionError, AttributeError, TypeError):
        return None  # the calculator is not set up


_NUM_MICROBATCHES: list[Callable[[], int] | None] = [None]
"""megatron-core's ``get_num_microbatches``, looked up once (asked twice a step)."""


def _shape_of(trainer: Any, pl_module: Any, attention: str) -> tuple[Any, int | None, int | None]:
    """(ModelShape or None, global batch size in sequences, sequence length) from NeMo's model
    config and data sampler; (None, None, None) when the module is not a NeMo GPT model."""
    config = getattr(pl_module, "config", None)
    if config is None or not hasattr(config, "num_layers"):
        return None, None, None
    from charllm_nemo.metrics.flops import ModelShape

    try:
        shape = ModelShape.from_nemo_config(
            config,
            tokenizer=getattr(pl_module, "tokenizer", None),
            causal_attention_flops=attention == "causal",
        )
    except Exception as exc:  # the figures go on without MFU; say why once
        log.warning("charllm: no FLOPs / MFU for this model: %s", exc)
        return None, None, None
    sampler = getattr(trainer.strategy, "data_sampler", None)
    gbs = getattr(sampler, "global_batch_size", None) or getattr(
        trainer.datamodule, "global_batch_size", None
    )
    seq = getattr(config, "seq_length", None)
    return shape, (int(gbs) if gbs else None), (int(seq) if seq else None)


def _log_every(trainer: Any) -> int:
    """Lightning's ``log_every_n_steps`` (at least 1)."""
    try:
        return max(1, int(trainer.log_every_n_steps))
    except (AttributeError, TypeError, ValueError):
        return 1


def _norm(reader: _LoggedGradNorm | None, trainer: Any) -> float | None:
    return None if reader is None else reader(trainer)


class _LoggedGradNorm:
    """Each step's gradient norm as NeMo logged it: MegatronStrategy.optimizer_step logs
    megatron-core's ``grad_norm`` (the optimizer's returned norm) with ``self.log('grad_norm')``,
    so it sits in Lightning's result collection by ``on_train_batch_end``. Read from the step's
    cached value directly (``trainer.callback_metrics`` would recompute every logged metric
    each step). Lightning keeps that value across steps: one not logged anew this step (NeMo
    logs none when the optimizer returns no norm) is the same object as last step's and gives
    None, as does a run where nothing logs it (a plain Lightning module)."""

    def __init__(self) -> None:
        self._last: Any = None  # the tensor read last step (held, so that its id is not reused)
        self._key: str | None = None  # the collection's key of it, once found (a scan fewer a step)

    def __call__(self, trainer: Any) -> float | None:
        results = getattr(trainer, "_results", None)
        if results is None:
            return None
        try:
            metric = results.get(self._key) if self._key is not None else None
            if metric is None:
                self._key, metric = next(
                    ((k, m) for k, m in results.items() if k.endswith(".grad_norm")), (None, None)
                )
            value = getattr(metric, "_forward_cache", None)
            if value is None or value is self._last:
                return None
            self._last = value
            return float(value)
        except (AttributeError, TypeError, ValueError, RuntimeError):
            return None  # another Lightning's internals: no norm rather than a wrong one


class _SummaryRows:
    """Rank 0's step reports, kept for ``summary.json`` (what ``charllm train`` writes when
    training ends, docs/store.md): the medians and the last reports in bounded memory
    (charllm_nemo.steps.summary :class:`RunSummary`), the atomic write by its
    :func:`write_summary`. An observer on the observer thread (its copy of each report off the
    training thread); written after that thread ended."""

    def __init__(self, trainer: Any, pl_module: Any, placement: Any, device: str, megatron: bool) -> None:
        import time

        from charllm_nemo.steps.summary import RunSummary

        self._t0 = time.monotonic()
        self.rows = RunSummary(int(placement.world_size))
        self.meta: dict[str, Any] = {
            "model": type(pl_module).__name__,
            "layout": {"world_size": int(placement.world_size), **dict(placement.labels)},
            "world_size": int(placement.world_size),
            "device": device,
            "telemetry": True,
        }
        try:
            self.meta["num_parameters"] = int(sum(p.numel() for p in pl_module.parameters()))
        except Exception:  # a figure, never a reason to fail
            log.debug("no parameter count", exc_info=True)
        if megatron and (n := _num_microbatches()) is not None:
            self.meta["num_microbatches"] = n

    def on_step(self, report: Any) -> None:
        self.rows.on_step(report)  # a copy without every rank's vectors; rows made at the end

    def close(self, status: str) -> None:
        pass  # written by the callback after the session closed (its status is final then)

    def write(self, run_dir: str, status: str) -> None:
        import time
        from pathlib import Path

        from charllm_nemo.steps.summary import SUMMARY_FILE, write_summary

        data = {
            "status": status,
            **self.meta,
            "wall_s": time.monotonic() - self._t0,
            **self.rows.summary(),
        }
        try:
            if write_summary(Path(run_dir) / SUMMARY_FILE, data) == "compact":
                log.error("charllm: the disk is full: summary.json written without its per-step rows")
        except OSError as exc:  # a full disk: one line, never hide why training stopped
            log.error("charllm: could not write summary.json in %s: %s", run_dir, exc.strerror or exc)


MERGE_ALERTS = True
"""Run the alert checks on the observer thread (not a thread of their own): one thread wakes."""


def _observers_off_thread(st: Any) -> None:
    """Rank 0's summary rows, ``steps.jsonl``, trainer's-loggers and alert observers onto one
    :class:`ObserverThread` (their work off the training thread, and one thread to wake, seldom:
    integrations/_observer_thread.py), where the first of them was (the alert observer is
    first: closed first, its last alerts reach the loggers and the W&B sink still open)."""
    from charllm_nemo.alerts import AlertObserver
    from charllm_nemo.steps import StepsFileObserver

    kinds: tuple[type, ...] = (_SummaryRows, StepsFileObserver, ThreadedLoggersObserver)
    if MERGE_ALERTS:
        kinds += (AlertObserver,)
    moved = [o for o in st.observers if isinstance(o, kinds)]
    if not moved:
        return
    for o in moved:
        if isinstance(o, AlertObserver):
            o.run_inline()
    at = next(i for i, o in enumerate(st.observers) if o is moved[0])
    rest = [o for o in st.observers if all(o is not m for m in moved)]
    st.observers = [*rest[:at], ObserverThread(moved), *rest[at:]]


PowerThermalCallback.__signature__ = options_signature(PowerThermalCallback.__init__)
quiet_option_errors()  # a refused option, left uncaught, prints its message alone
