"""Training loops shaped like Megatron-LM's and Megatron-Bridge's, over megatron-core's real
schedules on CPU, with our integrations attached: ``python _mcore_loops.py MODE <out_dir> <steps>
<result.json> [callbacks.py]``, MODE one of megatron-lm, megatron-lm-explicit, bridge;
``CHARLLM_TEST_LOG_TO`` (default ``trainer``): the integration's ``log_to``.

megatron-core's wheel does not ship Megatron-LM's ``megatron/training`` (0.16.1: only
``megatron/core``), and Megatron-Bridge needs Python >= 3.12, megatron-core >= 0.18 and CUDA. So
these drive the real megatron-core schedules the way those frameworks' ``train_step`` drive them:
their global ``Timers`` (megatron.core.timers, the class both use) in ``config.timers``;
per iteration zeroed grad buffers, ``get_forward_backward_func()(...)`` (Megatron-LM also times
it as ``forward-backward``), then ``optimizer.step()`` inside ``timers('optimizer',
log_level=1)``. Bridge's events are fired through Bridge's own ``CallbackManager`` (its
``callbacks.py`` loaded from the wheel; it imports only the standard library at run time) with
``CallbackContext`` objects as Bridge's ``train()`` builds them, around a GlobalState-shaped
object (``cfg.model`` / ``cfg.train``, ``train_state.step``, the ``timers`` property over
``_timers``, ``wandb_logger``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from types import SimpleNamespace
from typing import Any, ClassVar

import torch

MBS, GBS = 1, 4
LOG_TO = os.environ.get("CHARLLM_TEST_LOG_TO", "trainer")


def _setup() -> dict[str, Any]:
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.timers import Timers

    from charllm_nemo.train.config import TrainConfig
    from charllm_nemo.train.dist import init_distributed
    from charllm_nemo.train.model import build_model

    cfg = TrainConfig()
    seq = cfg.model.seq_length
    init_distributed(cfg, device="cpu")
    init_num_microbatches_calculator(0, None, GBS, MBS, 1)

    class RecordingTimers(Timers):  # type: ignore[misc]
        """The frameworks' Timers, noting the names it is asked for (to see the forwarding)."""

        asked: ClassVar[list[str]] = []

        def __call__(self, name: str, log_level: int | None = None) -> Any:
            self.asked.append(name)
            return super().__call__(name, log_level)

    # timing log level 0 (both frameworks' default): level-1/2 timers are dummies (the real ones
    # synchronize CUDA), but every call still reaches the Timers object.
    timers = RecordingTimers(0, "minmax")
    bundle = build_model(cfg, on_cpu=True, timers=timers)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)

    def batches() -> Any:
        g = torch.Generator().manual_seed(0)
        while True:
            tokens = torch.randint(0, cfg.model.vocab_size, (MBS, seq + 1), generator=g)
            yield {
                "tokens": tokens[:, :-1],
                "labels": tokens[:, 1:],
                "position_ids": torch.arange(seq).view(1, seq),
                "attention_mask": mask,
            }

    return {
        "cfg": cfg,
        "seq": seq,
        "timers": timers,
        "recording": RecordingTimers,
        "config": bundle.config,
        "model": bundle.chunks,
        "optimizer": bundle.optimizer,
        "data": batches(),
    }


def _forward_step(data_iterator: Any, model: Any) -> Any:  # pretrain_gpt.py's shape
    b = next(data_iterator)
    output = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

    def loss_func(output_tensor: torch.Tensor) -> Any:
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _train_step(s: dict[str, Any], timers: Any, time_forward_backward: bool) -> float:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in s["model"]:
        chunk.zero_grad_buffer()
    s["optimizer"].zero_grad()
    if time_forward_backward:  # Megatron-LM times it; Bridge does not
        timers("forward-backward", log_level=1).start(barrier=False)
    out = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=s["data"],
        model=s["model"],
        num_microbatches=GBS // MBS,
        seq_length=s["seq"],
        micro_batch_size=MBS,
        decoder_seq_length=s["seq"],
        forward_only=False,
    )
    if time_forward_backward:
        timers("forward-backward").stop()
    timers("optimizer", log_level=1).start(barrier=False)
    s["optimizer"].step()
    timers("optimizer").stop()
    return float(sum(float(o["lm loss"]) for o in out) / len(out))


def megatron_lm(out_dir: str, steps: int, explicit: bool) -> dict[str, Any]:
    from charllm_nemo.integrations.megatron_lm import MegatronLMTelemetry

    s = _setup()
    telemetry = MegatronLMTelemetry(
        hz=200, backend="synthetic", out_dir=out_dir, sampler="thread", log_to=LOG_TO
    )
    timers = telemetry.install(
        timers=s["timers"],
        model_config=s["config"],
        global_batch_size=GBS,
        seq_length=s["seq"],
        vocab_size=s["cfg"].model.vocab_size,
    )
    losses = []
    for i in range(steps):
        if explicit:
            with telemetry.step(i) as handle:
                handle.loss = _train_step(s, timers, True)
                losses.append(handle.loss)
        else:
            losses.append(_train_step(s, timers, True))
    forwards = timers._timers is s["timers"]._timers  # an attribute of the inner Timers
    telemetry.finish()
    return {
        "losses": losses,
        "asked": sorted(set(s["recording"].asked)),
        "forwards_attributes": forwards,
        "timers_restored": s["config"].timers is s["timers"],
    }


def bridge(out_dir: str, steps: int, callbacks_py: str) -> dict[str, Any]:
    from charllm_nemo.integrations.bridge import PowerThermalBridgeCallback

    spec = importlib.util.spec_from_file_location("bridge_callbacks", callbacks_py)
    assert spec is not None and spec.loader is not None
    callbacks = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = callbacks  # (its dataclasses resolve annotations through it)
    spec.loader.exec_module(callbacks)

    s = _setup()
    config = s["config"]
    # Bridge's model provider is a TransformerConfig that also carries these
    config.seq_length = s["seq"]
    config.vocab_size = s["cfg"].model.vocab_size

    class GlobalState:  # the attributes of megatron.bridge.training.state.GlobalState used here
        def __init__(self) -> None:
            self.cfg = SimpleNamespace(
                model=config,
                train=SimpleNamespace(global_batch_size=GBS, micro_batch_size=MBS, train_iters=steps),
            )
            self.train_state = SimpleNamespace(step=0)
            self._timers = s["timers"]
            self.wandb_logger = None

        @property
        def timers(self) -> Any:
            return self._timers

    state = GlobalState()
    cb = PowerThermalBridgeCallback(
        hz=200, backend="synthetic", out_dir=out_dir, sampler="thread", log_to=LOG_TO
    )
    manager = callbacks.normalize_callbacks([cb])  # what pretrain(callbacks=[...]) does

    def context(**kw: Any) -> Any:
        return callbacks.CallbackContext(
            state=state, model=s["model"], user_state=manager.user_state, optimizer=s["optimizer"], **kw
        )

    registered = sorted(e for e in callbacks.VALID_EVENTS if manager.has_callbacks(e))
    losses = []
    manager.fire("on_train_start", context())
    for _ in range(steps):  # Bridge's train(): events around train_step, then step += 1
        if callbacks.should_fire(manager, "on_train_step_start"):
            manager.fire("on_train_step_start", context())
        loss = _train_step(s, state.timers, False)
        losses.append(loss)
        manager.fire(
            "on_train_step_end",
            context(loss_dict={"lm loss": torch.tensor(loss)}, grad_norm=1.5, skipped_iter=False),
        )
        state.train_state.step += 1
    manager.fire("on_train_end", context())
    return {
        "losses": losses,
        "registered": registered,
        "asked": sorted(set(s["recording"].asked)),
        "timers_restored": state.timers is s["timers"] and config.timers is s["timers"],
    }


if __name__ == "__main__":
    mode, out_dir, steps, result_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if mode == "bridge":
        result = bridge(out_dir, steps, sys.argv[5])
    else:
        result = megatron_lm(out_dir, steps, mode == "megatron-lm-explicit")
    with open(result_path, "w") as fh:
        json.dump(result, fh)
