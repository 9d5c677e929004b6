"""Megatron-LM (``pretrain_gpt.py``-style loops): telemetry without patching Megatron-LM.

Megatron-LM's ``train()`` puts its global ``Timers`` (``get_timers()``) into the model config
(``config.timers = timers``), and every iteration of ``train_step`` calls::

    timers('forward-backward', log_level=1).start(barrier=...)   # forward_backward_func(...)
    timers('forward-backward').stop()
    timers('optimizer', log_level=1).start(barrier=...)          # optimizer.step()
    timers('optimizer').stop()

while megatron-core's schedules call ``forward-compute`` / ``backward-compute`` (and the pipeline's
send/recv timers) per microbatch. :class:`MegatronLMTelemetry` puts one object in place of those
timers: the step-telemetry API's timers adapter (forward / backward / pipeline / grad-sync
windows, every call forwarded to Megatron-LM's own Timers, so ``--timing-log-level`` logs keep
working), plus step boundaries: a step begins when ``forward-backward`` starts and ends when
``optimizer`` stops; the optimizer timer is also the ``optimizer`` phase. Whatever
``--timing-log-level`` says, these calls arrive (a level above it gives Megatron-LM a dummy
timer, but the call still reaches the adapter).

In ``pretrain_gpt.py`` (docs/integrations.md, "Megatron-LM")::

    telemetry = MegatronLMTelemetry(hz=100, out_dir="runs/{time}")
    pretrain(train_valid_test_datasets_provider,
             telemetry.wrap_model_provider(model_provider),   # installs after initialize_megatron
             ModelType.encoder_or_decoder, forward_step, ...)
    telemetry.finish()

``wrap_model_provider`` runs once per rank after ``initialize_megatron`` (which made the global
timers) and before ``train()`` reads them: it opens the rank's telemetry and puts the adapter in
``megatron.training.global_vars._GLOBAL_TIMERS``. A loop of one's own uses :meth:`install` with
its Timers and model config, or :meth:`step` around each iteration. All per-step logic is the API's.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from charllm_nemo.integrations._common import (
    IntegrationOptions,
    RunFacts,
    open_step_telemetry,
    options_signature,
    quiet_option_errors,
)

log = logging.getLogger(__name__)

STEP_BEGIN_TIMER = "forward-backward"
STEP_END_TIMER = "optimizer"

SOURCES = {
    "step": "Megatron-LM train_step timers: forward-backward start .. optimizer stop",
    "microbatch": "megatron-core config.timers (span of forward-compute..backward-compute)",
    "phase:forward": "megatron-core config.timers forward-compute",
    "phase:backward": "megatron-core config.timers backward-compute",
    "phase:pp-*": "megatron-core config.timers p2p send/recv",
    "phase:grad-sync": "megatron-core config.timers all-grads-sync",
    "phase:optimizer": "Megatron-LM train_step timer optimizer",
}


class _Boundary:
    """The timer Megatron-LM gets for ``forward-backward`` / ``optimizer``: its own timer's call
    plus our step (and optimizer phase) boundary."""

    __slots__ = ("_on_start", "_on_stop", "_theirs")

    def __init__(self, theirs: Any, on_start: Callable[[], None] | None, on_stop: Callable[[], None] | None):
        self._theirs = theirs
        self._on_start = on_start
        self._on_stop = on_stop

    def start(self, barrier: bool = False) -> None:
        if self._theirs is not None:
            self._theirs.start(barrier=barrier)
        if self._on_start is not None:
            self._on_start()

    def stop(self, barrier: bool = False) -> None:
        if self._on_stop is not None:
            self._on_stop()
        if self._theirs is not None:
            self._theirs.stop(barrier=barrier)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._theirs, name)


class StepBoundaryTimers:
    """Megatron-LM's ``get_timers()`` / ``config.timers`` replacement: the API's timers adapter
    (``adapter``) for every name, except ``forward-backward`` (``on_step_begin`` at its start)
    and ``optimizer`` (``on_optimizer_begin`` at its start, ``on_optimizer_end`` at its stop);
    None = no boundary there. Other attributes (``log``, ``write``, ...) are the inner Timers'.
    Megatron-Bridge's train_step calls the same two timers (integrations/bridge.py)."""

    def __init__(
        self,
        adapter: Any,
        inner: Any,
        *,
        on_step_begin: Callable[[], None] | None = None,
        on_optimizer_begin: Callable[[], None] | None = None,
        on_optimizer_end: Callable[[], None] | None = None,
    ) -> None:
        self._adapter = adapter
        self.inner = inner
        self._on_step_begin = on_step_begin
        self._on_optimizer_begin = on_optimizer_begin
        self._on_optimizer_end = on_optimizer_end

    def __call__(self, name: str, log_level: int | None = None) -> Any:
        if name in (STEP_BEGIN_TIMER, STEP_END_TIMER):
            theirs = None
            if self.inner is not None:
                theirs = self.inner(name, log_level) if log_level is not None else self.inner(name)
            if name == STEP_BEGIN_TIMER:
                return _Boundary(theirs, self._on_step_begin, None)
            return _Boundary(theirs, self._on_optimizer_begin, self._on_optimizer_end)
        if self._adapter is None:
            return self.inner(name, log_level) if log_level is not None else self.inner(name)
        return self._adapter(name, log_level)

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(f"StepBoundaryTimers has no {name!r} (and no inner Timers)")
        return getattr(inner, name)


@dataclass
class StepHandle:
    """What :meth:`MegatronLMTelemetry.step` yields: set ``loss`` (this rank's, averaged) and
    ``grad_norm`` before the block ends to have them in the step's report."""

    step: int
    loss: float | None = None
    grad_norm: float | None = None


class MegatronLMTelemetry:
    """Per-rank telemetry for a Megatron-LM-style loop (module doc). The keywords are
    :class:`~charllm_nemo.integrations._common.IntegrationOptions`' (``hz`` in samples a second,
    ...); ``log_metrics``: a function ``(metrics: dict, step: int)`` that receives each step's
    figures on rank 0 (e.g. Megatron-LM's W&B writer), with ``log_to="trainer"``; ``on_alert``:
    a function called on rank 0 with each alert's dict (``alerts=True``, the default:
    docs/alerts.md)."""

    def __init__(
        self,
        log_metrics: Callable[[dict[str, float], int], Any] | None = None,
        on_alert: Callable[[dict[str, Any]], object] | None = None,
        **options: Any,
    ) -> None:
        self.on_alert = on_alert
        self.options = IntegrationOptions.from_keywords("MegatronLMTelemetry", options)
        self.log_metrics = log_metrics
        self.telemetry: Any = None
        self.run_dir: str | None = None
        self.timers: StepBoundaryTimers | None = None
        self._step = 0
        self._in_step = False
        self._optimizer: Any = None
        self._configs: list[tuple[Any, Any]] = []
        self._global_installed = False
        self._explicit = False  # inside step(): the timers mark no step boundary

    # -- open --------------------------------------------------------------------------------
    def install(
        self,
        *,
        timers: Any = None,
        model_config: Any = None,
        args: Any = None,
        model_configs: Sequence[Any] = (),
        global_batch_size: int | None = None,
        seq_length: int | None = None,
        vocab_size: int | None = None,
        first_step: int = 0,
        device: str | None = None,
    ) -> StepBoundaryTimers:
        """Open this rank's telemetry (after ``torch.distributed`` and megatron-core's parallel
        state are initialised) and return the timers object to use as ``config.timers`` /
        ``get_timers()``; ``timers``: Megatron-LM's own (forwarded to). ``model_config`` (and
        ``model_configs``): TransformerConfigs whose ``timers`` are set to it now. ``args``:
        Megatron-LM's parsed arguments (shape, batch size, sequence length, first iteration);
        without them, the shape comes from ``model_config`` with ``vocab_size`` and
        ``seq_length`` (tokens). No shape: no throughput or MFU, the rest as usual."""
        from charllm_nemo.integrations._common import LoggersObserver
        from charllm_nemo.metrics.flops import ModelShape
        from charllm_nemo.telemetry.config import Placement

        if self.telemetry is not None:
            raise RuntimeError("MegatronLMTelemetry.install() called twice; call finish() first")
        placement = Placement.from_megatron()
        causal = self.options.attention_flops == "causal"
        shape = None
        try:
            if args is not None:
                shape = ModelShape.from_megatron_args(args, causal_attention_flops=causal)
                global_batch_size = global_batch_size or getattr(args, "global_batch_size", None)
                seq_length = seq_length or getattr(args, "seq_length", None)
                first_step = first_step or int(getattr(args, "iteration", 0) or 0)
            elif model_config is not None and seq_length is not None and vocab_size is not None:
                shape = ModelShape.from_transformer_config(
                    model_config, vocab_size=vocab_size, seq_length=seq_length, causal_attention_flops=causal
                )
        except Exception as exc:  # figures go on without FLOPs / MFU; say why once
            log.warning("charllm: no FLOPs / MFU for this model: %s", exc)
        if device is None:
            device = _default_device()
        observers = []
        if self.log_metrics is not None and self.options.log_to == "trainer" and placement.rank == 0:
            observers.append(LoggersObserver(self.log_metrics, self.options.key_prefix))
        self.telemetry, self.run_dir = open_step_telemetry(
            self.options,
            placement,
            framework="megatron-lm",
            sources=SOURCES,
            run=RunFacts(
                model=shape,
                global_batch_size=global_batch_size,
                seq_length=seq_length,
                device=device,
                num_microbatches=_num_microbatches() or 1,
            ),
            observers=observers,
            on_alert=self.on_alert,
        )
        self._step = first_step
        adapter = self.telemetry.timers(inner=timers)
        self.timers = StepBoundaryTimers(
            adapter,
            timers,
            on_step_begin=self._timer_begin,
            on_optimizer_begin=self._optimizer_begin,
            on_optimizer_end=self._timer_end,
        )
        for config in (model_config, *model_configs):
            if config is not None:
                self._configs.append((config, getattr(config, "timers", None)))
                config.timers = self.timers
        atexit.register(self._at_exit)
        return self.timers

    def wrap_model_provider(self, model_provider: Callable[..., Any]) -> Callable[..., Any]:
        """``model_provider`` for Megatron-LM's ``pretrain``: on its first call (after
        ``initialize_megatron``, before ``train()``), :meth:`install` with Megatron-LM's global
        timers and arguments, and put the result in ``global_vars._GLOBAL_TIMERS`` so that
        ``train()``'s ``get_timers()`` (and hence ``config.timers``) is it."""

        def provider(*a: Any, **kw: Any) -> Any:
            if self.telemetry is None:
                from megatron.training import global_vars  # Megatron-LM (not in the mcore wheel)

                timers = self.install(timers=global_vars.get_timers(), args=global_vars.get_args())
                global_vars._GLOBAL_TIMERS = timers
                self._global_installed = True
            return model_provider(*a, **kw)

        provider.__wrapped__ = model_provider  # type: ignore[attr-defined]
        return provider

    # -- steps ---------------------------------------------------------------------------------
    def _timer_begin(self) -> None:
        if not self._explicit:
            self._auto_begin()

    def _timer_end(self) -> None:
        if not self._explicit:
            self._auto_end()

    def _auto_begin(self) -> None:
        if self.telemetry is None or self._in_step:
            return
        self.telemetry.begin_step(self._step, num_microbatches=_num_microbatches())
        self._in_step = True

    def _optimizer_begin(self) -> None:
        if self.telemetry is None or not self._in_step or self._optimizer is not None:
            return
        self._optimizer = self.telemetry.phase("optimizer")
        self._optimizer.__enter__()

    def _auto_end(self, loss: float | None = None, grad_norm: float | None = None) -> None:
        if self.telemetry is None or not self._in_step:
            return
        if self._optimizer is not None:
            self._optimizer.__exit__(None, None, None)
            self._optimizer = None
        self._in_step = False
        self.telemetry.end_step(loss=loss, num_microbatches=_num_microbatches(), grad_norm=grad_norm)
        self._step += 1

    @contextmanager
    def step(self, step: int | None = None) -> Iterator[StepHandle]:
        """``with telemetry.step() as s: ...; s.loss = loss``: one step of a loop of one's own
        (instead of the ``forward-backward`` / ``optimizer`` timers); ``step`` defaults to the
        count so far."""
        if step is not None:
            self._step = step
        handle = StepHandle(self._step)
        self._auto_begin()
        self._explicit = True
        try:
            yield handle
        finally:
            self._explicit = False
        self._auto_end(loss=handle.loss, grad_norm=handle.grad_norm)

    # -- close --------------------------------------------------------------------------------
    def finish(self, status: str = "complete") -> None:
        """Wait (bounded) for the last steps' figures, close the session and the observers, and
        give the configs their own Timers back. Idempotent."""
        st, self.telemetry = self.telemetry, None
        for config, inner in self._configs:
            config.timers = inner
        self._configs = []
        if self._global_installed and self.timers is not None:
            from megatron.training import global_vars

            global_vars._GLOBAL_TIMERS = self.timers.inner
            self._global_installed = False
        if self._optimizer is not None:
            self._optimizer = None
        status = "failed" if self._in_step and status == "complete" else status
        self._in_step = False
        if st is not None:
            st.finish(status)

    def _at_exit(self) -> None:
        # the process exits without finish(): close what was recorded, gather nothing
        if self.telemetry is not None:
            self.finish("interrupted")


def _num_microbatches() -> int | None:
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        return int(get_num_microbatches())
    except (ImportError, AssertionError, AttributeError, TypeError):
        return None


def _default_device() -> str:
    try:
        import torch
    except ImportError:  # pragma: no cover - Megatron needs torch
        return "cpu"
    initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return "cuda" if torch.cuda.is_available() and initialized else "cpu"


MegatronLMTelemetry.__signature__ = options_signature(MegatronLMTelemetry.__init__)  # type: ignore[attr-defined]
quiet_option_errors()  # a refused option, left uncaught, prints its message alone
