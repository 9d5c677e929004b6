"""Measure what one microbatch's forward keeps for the backward, on CPU, one process:
``python _saved_tensors.py '<json list of cases>'``; prints one ``RESULT <json>`` line.

Each case: ``{"model": {ModelConfig fields over tiny_gpt's}, "precision": ..., "micro_batch_size":
..., "recompute": [granularity, method, num_layers] or null}``. The model is built as a
one-rank run builds it (train/model.py ``transformer_config`` and ``build_gpt_chunks``, gloo, the
CPU support), then one forward with the loss runs under ``torch.autograd.graph.
saved_tensors_hooks``: the bytes of every distinct storage saved for the backward, parameters
left out, are what the activations hold. The test sets RANK, WORLD_SIZE, MASTER_ADDR/PORT.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from charllm_nemo.train import model as train_model
from charllm_nemo.train.config import ModelConfig, TrainConfig
from charllm_nemo.train.dist import init_distributed
from charllm_nemo.train.presets import model_preset


def config_of(case: dict[str, Any]) -> TrainConfig:
    base = model_preset(case.get("preset", "tiny_gpt"))
    cfg = TrainConfig(model=ModelConfig(**{**vars(base), **case["model"]}))
    cfg.batch.precision = case["precision"]
    cfg.batch.micro_batch_size = cfg.batch.global_batch_size = case["micro_batch_size"]
    cfg.launch.device = "cpu"
    if case.get("recompute"):
        o = cfg.optim
        o.recompute_granularity, o.recompute_method, o.recompute_num_layers = case["recompute"]
    return cfg


def saved_bytes(cfg: TrainConfig) -> int:
    init_distributed(cfg, device="cpu")
    config = train_model.transformer_config(cfg, on_cpu=True)
    (chunk,) = train_model.build_gpt_chunks(cfg, config, on_cpu=True)
    chunk.train()
    params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    b, s, vocab = cfg.batch.micro_batch_size, cfg.model.seq_length, cfg.model.vocab_size
    tokens = torch.randint(0, vocab, (b, s))
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).view(1, 1, s, s)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunk(tokens, positions, mask, labels=tokens)
    return sum(storages.values())


if __name__ == "__main__":
    cases = json.loads(sys.argv[1])
    print("RESULT " + json.dumps([saved_bytes(config_of(case)) for case in cases]))
