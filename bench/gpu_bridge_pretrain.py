"""Megatron-Bridge's real ``pretrain`` with PowerThermalBridgeCallback, on a tiny GPT (the
``vanilla_gpt`` recipe shrunk: 2 layers, hidden 256, sequence 256, mock data, 8 steps, no
checkpoints, no evaluation). Run by bench/gpu_check.py on a GPU whose image can import
``megatron.bridge`` (Python 3.12, megatron-core >= 0.18, its dependencies); prints one JSON line
``BRIDGE_RESULT {...}`` with the windows counted from the run directory.

    torchrun --nproc-per-node 1 bench/gpu_bridge_pretrain.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from collections import Counter


def main(out_dir: str) -> None:
    from megatron.bridge.recipes.gpt.h100.vanilla_gpt import vanilla_gpt_pretrain_1gpu_h100_bf16_config
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from charllm_nemo.integrations.bridge import PowerThermalBridgeCallback
    from charllm_nemo.telemetry.reader import load_run

    cfg = vanilla_gpt_pretrain_1gpu_h100_bf16_config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads = 2, 256, 1024, 4
    m.seq_length = cfg.dataset.seq_length = 256
    cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size = 8, 8, 2
    cfg.validation.eval_interval, cfg.validation.eval_iters = 10**6, 0
    cfg.checkpoint.save, cfg.checkpoint.save_interval = None, None
    cfg.logger.tensorboard_dir, cfg.logger.log_interval = None, 1
    cfg.scheduler.lr_warmup_iters = 1
    cb = PowerThermalBridgeCallback(hz=100, out_dir=out_dir, overwrite=True)
    pretrain(cfg, forward_step, callbacks=[cb])
    run = load_run(out_dir)
    kinds = Counter(f"{w['kind']}:{w['name']}" for w in run.windows.to_pylist())
    with open(f"{out_dir}/steps.jsonl") as fh:
        steps = [json.loads(line) for line in fh]
    print(
        "BRIDGE_RESULT "
        + json.dumps({"windows": dict(kinds), "steps": steps[-3:], "samples": run.samples.num_rows})
    )


if __name__ == "__main__":
    main(sys.argv[1])
