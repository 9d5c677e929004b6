"""One rank of a pipeline-parallel step on CPU, measuring the peak of what the step's forwards
keep for their backwards: ``python _saved_tensors_schedule.py '<case json>'``; prints
``RESULT <json>`` (this rank's pipeline stage and peak bytes).

The case is ``_saved_tensors.py``'s (model fields over tiny_gpt's, precision, micro batch size)
plus ``pp``, ``vpp``, ``tp``, ``ep`` and ``global_batch_size``. The model, data and schedule are the trainer's
(train/model.py ``build_model``, train/data.py, megatron-core's ``get_forward_backward_func``).
Every tensor saved for the backward is wrapped when autograd packs it; the wrapper's release
(autograd drops it once the backward used it) ends its storage's share, so the running sum of
live saved storages, and its peak, follow the schedule's microbatches in flight. The test sets
RANK, WORLD_SIZE, MASTER_ADDR/PORT.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from typing import Any

import torch
from _saved_tensors import config_of  # this folder: the script's own, first on sys.path

from charllm_nemo.train import model as train_model
from charllm_nemo.train.data import DataLayout, MicrobatchIterator, build_train_dataset
from charllm_nemo.train.dist import init_distributed
from charllm_nemo.train.loop import _loss_func


class LiveSaved:
    """The bytes of distinct storages that saved tensors hold right now, and the peak."""

    def __init__(self, skip: set[int]) -> None:
        self.skip = skip  # parameters' storages
        self.refs: dict[int, list[int]] = {}  # storage -> [saved tensors holding it, its bytes]
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.skip:
            return t
        entry = self.refs.get(ptr)
        if entry is None:
            entry = self.refs[ptr] = [0, storage.nbytes()]
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        return _Saved(t, ptr, self)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def release(self, ptr: int) -> None:
        entry = self.refs[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.refs[ptr]


class _Saved:
    __slots__ = ("live", "ptr", "tensor")

    def __init__(self, tensor: torch.Tensor, ptr: int, live: LiveSaved) -> None:
        self.tensor, self.ptr, self.live = tensor, ptr, live

    def __del__(self) -> None:
        self.live.release(self.ptr)


def _forward_step(data_iterator: Any, model: Any) -> tuple[Any, Any]:
    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return out, partial(_loss_func, batch["loss_mask"])


def main(case: dict[str, Any]) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cfg = config_of(case)
    p = cfg.parallel
    p.pp, p.vpp, p.tp, p.ep = case.get("pp", 1), case.get("vpp"), case.get("tp", 1), case.get("ep", 1)
    cfg.batch.global_batch_size = case["global_batch_size"]
    cfg.batch.train_steps = 1
    init_distributed(cfg, device="cpu")
    bundle = train_model.build_model(cfg, on_cpu=True)
    b = cfg.batch
    layout = DataLayout(b.micro_batch_size, b.global_batch_size, ps.get_data_parallel_world_size(), 0)
    dataset = build_train_dataset(cfg, b.global_batch_size)
    iters = [MicrobatchIterator(dataset, layout, 1, "cpu") for _ in bundle.chunks]
    params = {p.untyped_storage().data_ptr() for c in bundle.chunks for p in c.parameters()}
    live = LiveSaved(params)
    with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
        get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=iters if len(iters) > 1 else iters[0],
            model=bundle.chunks if len(bundle.chunks) > 1 else bundle.chunks[0],
            num_microbatches=layout.num_microbatches,
            seq_length=cfg.model.seq_length,
            micro_batch_size=b.micro_batch_size,
            forward_only=False,
        )
    return {
        "stage": ps.get_pipeline_model_parallel_rank(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "peak": live.peak,
        "left": live.now,
    }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
    torch.distributed.destroy_process_group()
