"""A Megatron-LM-shaped pretraining loop on CPU, with MegatronLMTelemetry: ``python
_megatron_lm_loop.py <out_dir> <steps> <result.json> [explicit]``.

megatron-core's wheel does not ship Megatron-LM's ``megatron/training`` (0.16.1: only
``megatron/core``), so this drives the real megatron-core schedules the way Megatron-LM's
``train()`` / ``train_step()`` drive them: Megatron-LM's global ``Timers`` (megatron.core.timers,
the class Megatron-LM uses) in ``config.timers``; per iteration ``timers('forward-backward',
log_level=1)`` around ``get_forward_backward_func()(...)`` and ``timers('optimizer',
log_level=1)`` around ``optimizer.step()``; ``timers.log(...)`` at the end, as
``training_log`` does. With ``explicit``, the loop uses ``telemetry.step()`` instead of relying
on the two timers.
"""

from __future__ import annotations

import json
import sys
from typing import Any, ClassVar

import torch


def main(out_dir: str, steps: int, result_path: str, explicit: bool) -> None:
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.timers import Timers

    from charllm_nemo.integrations.megatron_lm import MegatronLMTelemetry
    from charllm_nemo.train.config import TrainConfig
    from charllm_nemo.train.dist import init_distributed
    from charllm_nemo.train.model import build_model

    cfg = TrainConfig()
    mbs, gbs, seq = 1, 4, cfg.model.seq_length
    init_distributed(cfg, device="cpu")
    init_num_microbatches_calculator(0, None, gbs, mbs, 1)

    class RecordingTimers(Timers):  # type: ignore[misc]
        """Megatron-LM's Timers, noting the names it is asked for (to see the forwarding)."""

        asked: ClassVar[list[str]] = []

        def __call__(self, name: str, log_level: int | None = None) -> Any:
            self.asked.append(name)
            return super().__call__(name, log_level)

    # Megatron-LM's default --timing-log-level 0: level-1/2 timers are dummies (the real ones
    # synchronize CUDA), but every call still reaches the Timers object.
    timers = RecordingTimers(0, "minmax")
    bundle = build_model(cfg, on_cpu=True, timers=timers)
    config, model, optimizer = bundle.config, bundle.chunks, bundle.optimizer

    telemetry = MegatronLMTelemetry(hz=200, backend="synthetic", out_dir=out_dir, sampler="thread")
    timers = telemetry.install(
        timers=timers,
        model_config=config,
        global_batch_size=gbs,
        seq_length=seq,
        vocab_size=cfg.model.vocab_size,
    )

    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)

    def batches() -> Any:
        g = torch.Generator().manual_seed(0)
        while True:
            tokens = torch.randint(0, cfg.model.vocab_size, (mbs, seq + 1), generator=g)
            yield {
                "tokens": tokens[:, :-1],
                "labels": tokens[:, 1:],
                "position_ids": torch.arange(seq).view(1, seq),
                "attention_mask": mask,
            }

    def forward_step(data_iterator: Any, model: Any) -> Any:  # pretrain_gpt.py's shape
        b = next(data_iterator)
        output = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

        def loss_func(output_tensor: torch.Tensor) -> Any:
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    data = batches()
    forward_backward = get_forward_backward_func()
    losses = []

    def train_step() -> float:  # Megatron-LM training.train_step, minus what CPU lacks
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        timers("forward-backward", log_level=1).start(barrier=False)
        out = forward_backward(
            forward_step_func=forward_step,
            data_iterator=data,
            model=model,
            num_microbatches=gbs // mbs,
            seq_length=seq,
            micro_batch_size=mbs,
            decoder_seq_length=seq,
            forward_only=False,
        )
        timers("forward-backward").stop()
        timers("optimizer", log_level=1).start(barrier=False)
        optimizer.step()
        timers("optimizer").stop()
        return float(sum(float(o["lm loss"]) for o in out) / len(out))

    for i in range(steps):
        if explicit:
            with telemetry.step(i) as s:
                s.loss = train_step()
                losses.append(s.loss)
        else:
            losses.append(train_step())
    # what Megatron-LM reads off the Timers object passes through the wrapper to its own
    wrapped_names = timers._timers is RecordingTimers.asked or hasattr(timers, "_timers")
    telemetry.finish()
    result = {
        "losses": losses,
        "run_dir": telemetry.run_dir,
        "asked": sorted(set(RecordingTimers.asked)),
        "forwards_attributes": bool(wrapped_names),
        "config_timers_restored": isinstance(config.timers, RecordingTimers),
    }
    with open(result_path, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], len(sys.argv) > 4 and sys.argv[4] == "explicit")
