"""Megatron-Bridge 0.6.x: :class:`PowerThermalBridgeCallback`.

Bridge (NeMo's successor for LLM training) takes callbacks in ``pretrain``, not in the recipe's
``ConfigContainer``; every hook gets one ``CallbackContext`` (``state``: Bridge's GlobalState with
``cfg``, ``train_state``, ``timers``; ``model``; ``optimizer``; at step end ``loss_dict``,
``grad_norm``, ``skipped_iter``)::

    from charllm_nemo.integrations.bridge import PowerThermalBridgeCallback
    pretrain(config, forward_step, callbacks=[PowerThermalBridgeCallback(hz=100)])

Where each window comes from (recorded in the manifest, ``integration.sources``):

* step: ``on_train_step_start`` .. ``on_train_step_end`` (Bridge's train_step: forward/backward
  of every microbatch, grad sync, optimizer);
* forward / backward / microbatch / pipeline / grad-sync: megatron-core's ``config.timers``
  calls through the API's timers adapter, which Bridge's own Timers sits inside (Bridge's timing
  logs keep working). Bridge sets ``cfg.model.timers`` at setup and puts ``state.timers`` back
  into the model config after each evaluation, so both are replaced at ``on_train_start``;
* optimizer: Bridge's ``timers("optimizer")`` around ``optimizer.step()``.

The callback does not subclass Bridge's ``Callback`` (Bridge imports only on Python >= 3.12 with
megatron-core >= 0.18): Bridge's ``CallbackManager.add`` registers any object's methods named after
its events. All per-step logic is the step-telemetry API's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from charllm_nemo.integrations._common import (
    IntegrationOptions,
    LoggersObserver,
    RunFacts,
    loss_of,
    open_step_telemetry,
    options_signature,
    quiet_option_errors,
)
from charllm_nemo.integrations.megatron_lm import StepBoundaryTimers, _default_device, _num_microbatches

log = logging.getLogger(__name__)

SOURCES = {
    "step": "bridge:on_train_step_start..on_train_step_end",
    "microbatch": "megatron-core config.timers (span of forward-compute..backward-compute)",
    "phase:forward": "megatron-core config.timers forward-compute",
    "phase:backward": "megatron-core config.timers backward-compute",
    "phase:pp-*": "megatron-core config.timers p2p send/recv",
    "phase:grad-sync": "megatron-core config.timers all-grads-sync",
    "phase:optimizer": "bridge train_step timer optimizer",
}


class PowerThermalBridgeCallback:
    """Per-rank power / energy / thermal / throttle telemetry for Megatron-Bridge's ``pretrain``.

    The keywords are :class:`~charllm_nemo.integrations._common.IntegrationOptions`' (``hz`` in
    samples a second, ...). ``log_to="trainer"`` hands each step's figures to Bridge's W&B run
    (``state.wandb_logger``) when it has one; ``"wandb"``: charllm's own W&B sink; ``"none"``.
    ``alerts`` (default on): live alerts on rank 0 (docs/alerts.md), also to ``on_alert(dict)``.
    """

    def __init__(self, *, on_alert: Callable[[dict[str, Any]], object] | None = None, **options: Any) -> None:
        self.options = IntegrationOptions.from_keywords("PowerThermalBridgeCallback", options)
        self.on_alert = on_alert  # called on rank 0 with each alert's dict (docs/alerts.md)
        self.telemetry: Any = None
        self.run_dir: str | None = None
        self._in_step = False
        self._optimizer: Any = None
        self._restore: list[tuple[Any, str, Any]] = []

    # -- Bridge's events -------------------------------------------------------------------------
    def on_train_start(self, context: Any) -> None:
        if not self.options.enabled or self.telemetry is not None:
            return
        from charllm_nemo.metrics.flops import ModelShape
        from charllm_nemo.telemetry.config import Placement

        state = context.state
        cfg = state.cfg
        model_cfg = getattr(cfg, "model", None)
        train_cfg = getattr(cfg, "train", None)
        gbs = getattr(train_cfg, "global_batch_size", None)
        seq = getattr(model_cfg, "seq_length", None)
        shape = None
        try:
            vocab = getattr(model_cfg, "vocab_size", None)
            if model_cfg is not None and seq and vocab:
                shape = ModelShape.from_transformer_config(
                    model_cfg,
                    vocab_size=int(vocab),
                    seq_length=int(seq),
                    causal_attention_flops=self.options.attention_flops == "causal",
                )
        except Exception as exc:  # figures go on without FLOPs / MFU; say why once
            log.warning("charllm: no FLOPs / MFU for this model: %s", exc)
        placement = Placement.from_megatron()
        observers: list[Any] = []
        wandb_run = getattr(state, "wandb_logger", None)
        if self.options.log_to == "trainer" and wandb_run is not None and placement.rank == 0:
            observers.append(LoggersObserver(_wandb_log(wandb_run), self.options.key_prefix))
        self.telemetry, self.run_dir = open_step_telemetry(
            self.options,
            placement,
            framework="megatron-bridge",
            sources=SOURCES,
            run=RunFacts(
                model=shape,
                global_batch_size=int(gbs) if gbs else None,
                seq_length=int(seq) if seq else None,
                device=_default_device(),
                num_microbatches=_num_microbatches() or 1,
                total_steps=getattr(train_cfg, "train_iters", None),
            ),
            observers=observers,
            on_alert=self.on_alert,
        )
        inner = state.timers
        timers = StepBoundaryTimers(
            self.telemetry.timers(inner=inner),
            inner,
            on_optimizer_begin=self._optimizer_begin,
            on_optimizer_end=self._optimizer_end,
        )
        # train_step and evaluate read state.timers; the schedules read the model config's
        self._swap(state, "_timers", timers)
        configs = [model_cfg] + [_model_config(m) for m in context.model]
        seen: set[int] = set()
        for config in configs:
            if config is not None and id(config) not in seen and hasattr(config, "timers"):
                seen.add(id(config))
                self._swap(config, "timers", timers)

    def on_train_step_start(self, context: Any) -> None:
        st = self.telemetry
        if st is None:
            return
        st.begin_step(int(context.state.train_state.step), num_microbatches=_num_microbatches())
        self._in_step = True

    def on_train_step_end(self, context: Any) -> None:
        st = self.telemetry
        if st is None or not self._in_step:
            return
        self._optimizer_end()
        self._in_step = False
        st.end_step(
            loss=loss_of(context.loss_dict),
            num_microbatches=_num_microbatches(),
            grad_norm=context.grad_norm,
        )

    def on_train_end(self, context: Any) -> None:
        self.close("complete")

    # -- inside ----------------------------------------------------------------------------------
    def _optimizer_begin(self) -> None:
        if self.telemetry is None or not self._in_step or self._optimizer is not None:
            return
        self._optimizer = self.telemetry.phase("optimizer")
        self._optimizer.__enter__()

    def _optimizer_end(self) -> None:
        if self._optimizer is not None:
            self._optimizer.__exit__(None, None, None)
            self._optimizer = None

    def _swap(self, obj: Any, attr: str, value: Any) -> None:
        self._restore.append((obj, attr, getattr(obj, attr, None)))
        setattr(obj, attr, value)

    def close(self, status: str = "complete") -> None:
        """Close the telemetry (Bridge has no exception event: call ``close("failed")`` in an
        ``except`` around ``pretrain`` if it matters; SIGTERM and exit are the session's)."""
        st, self.telemetry = self.telemetry, None
        for obj, attr, old in reversed(self._restore):
            setattr(obj, attr, old)
        self._restore = []
        self._optimizer = None
        if self._in_step and status == "complete":
            status = "failed"
        self._in_step = False
        if st is not None:
            st.finish(status)


def _model_config(chunk: Any) -> Any:
    try:
        from megatron.core.utils import get_model_config

        return get_model_config(chunk)
    except (ImportError, AttributeError, AssertionError):
        return getattr(chunk, "config", None)


def _wandb_log(run: Any) -> Any:
    # A step's figures arrive a few steps after Bridge logged that step, and W&B drops a row
    # whose step= is behind its own counter: the step goes in as a key instead (as Lightning's
    # WandbLogger does with trainer/global_step).
    def log_metrics(metrics: dict[str, float], step: int) -> None:
        run.log({**metrics, "charllm/step": step})

    return log_metrics


PowerThermalBridgeCallback.__signature__ = options_signature(PowerThermalBridgeCallback.__init__)  # type: ignore[attr-defined]
quiet_option_errors()  # a refused option, left uncaught, prints its message alone
