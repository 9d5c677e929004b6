"""train/cpu.py: what CPU cannot do (pure), and the patches applying once and only where meant."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from charllm_nemo.train.config import TrainConfig
from charllm_nemo.train.cpu import cpu_unsupported
from tests.deadline import deadline


def test_default_config_is_fine_on_cpu() -> None:
    assert cpu_unsupported(TrainConfig()) == []


@pytest.mark.parametrize(
    ("section", "field", "value", "named"),
    [
        ("parallel", "sequence_parallel", True, "parallel.sequence_parallel"),
        ("optim", "tp_comm_overlap", True, "optim.tp_comm_overlap"),
        ("parallel", "cp", 2, "parallel.cp"),
        ("parallel", "fsdp", True, "parallel.fsdp"),
        ("optim", "use_distributed_optimizer", True, "optim.use_distributed_optimizer"),
        ("optim", "overlap_param_gather", True, "optim.overlap_param_gather"),
        ("batch", "precision", "bf16", "batch.precision"),
        ("batch", "precision", "fp16", "batch.precision"),
    ],
)
def test_each_unsupported_option_names_its_field_and_a_fix(
    section: str, field: str, value: object, named: str
) -> None:
    cfg = TrainConfig()
    setattr(getattr(cfg, section), field, value)
    (msg,) = cpu_unsupported(cfg)
    assert named in msg
    assert "set " in msg  # the way out


def test_moe_dispatcher_other_than_allgather() -> None:
    cfg = TrainConfig()
    cfg.model.num_experts = 4
    assert cpu_unsupported(cfg) == []
    cfg.model.moe_token_dispatcher = "alltoall"
    (msg,) = cpu_unsupported(cfg)
    assert "model.moe_token_dispatcher=allgather" in msg


def test_overlap_grad_reduce_is_fine_on_cpu() -> None:
    cfg = TrainConfig()
    cfg.optim.overlap_grad_reduce = True
    assert cpu_unsupported(cfg) == []


def test_enable_cpu_support_is_idempotent_and_scoped() -> None:
    pytest.importorskip("megatron.core")
    # In a fresh interpreter: the patches must not leak into torch itself or unlisted modules.
    code = textwrap.dedent(
        """
        import torch
        from charllm_nemo.train import cpu
        cpu.enable_cpu_support()
        cpu.enable_cpu_support()
        import megatron.core.pipeline_parallel.schedules as sched
        import megatron.core.utils as mutils
        import megatron.core.transformer.transformer_block as block
        from megatron.core.tensor_parallel import random as mrandom
        from megatron.core.models.common.language_module.language_module import LanguageModule
        assert isinstance(sched.torch, cpu._TorchOnCpu)
        assert sched.torch.zeros(2, device="cuda").device.type == "cpu"
        assert sched.torch.cuda.current_device() == "cpu"
        assert sched.torch.cuda.is_available() is torch.cuda.is_available()
        assert mutils.torch is sched.torch  # one shim, installed once
        assert block.torch is torch  # a module not listed keeps the real torch
        assert torch.cuda.current_device is not sched.torch.cuda.current_device
        mutils.GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "t")
        assert mrandom.CudaRNGStatesTracker._charllm_cpu
        assert getattr(LanguageModule.setup_embeddings_and_output_layer, "_charllm_cpu", False)
        assert torch.distributed.all_reduce._charllm_cpu  # one-rank collectives skipped
        assert not hasattr(torch.distributed.all_reduce.__wrapped__, "_charllm_cpu")  # once
        tracker = mrandom.get_cuda_rng_tracker()
        mrandom.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
        before = torch.get_rng_state()
        with tracker.fork():
            torch.rand(3)
        assert torch.equal(before, torch.get_rng_state())  # the default stream is untouched
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=deadline(120))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def _collectives_on_rank(rank: int, init_file: str, out_dir: str) -> None:
    """One of two gloo ranks: each collective over a one-rank group and over both ranks, with
    torch's own functions counted underneath the CPU patch."""
    import collections
    import json

    import torch
    import torch.distributed as dist

    calls: collections.Counter[str] = collections.Counter()
    names = ("all_reduce", "broadcast", "barrier")

    def counting(name: str):
        orig = getattr(dist, name)

        def call(*a, **k):
            calls[name] += 1
            return orig(*a, **k)

        call.__name__ = name
        return call

    for name in names:  # installed first, so the patch wraps these: they count what reaches torch
        setattr(dist, name, counting(name))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        from charllm_nemo.train.cpu import _skip_one_rank_collectives

        _skip_one_rank_collectives()
        _skip_one_rank_collectives()  # idempotent: one layer
        alone = [dist.new_group([0]), dist.new_group([1])][rank]
        out: dict[str, object] = {}
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=alone)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=alone)
        dist.broadcast(t, src=rank, group=alone)
        dist.barrier(group=alone)
        out["alone"] = [t.item(), dict(calls)]
        dist.all_reduce(t, group=alone, async_op=True).wait()  # asynchronous: torch's work handle
        dist.all_reduce(t, op=dist.ReduceOp.PRODUCT, group=alone)  # not skipped (only sum/avg/max/min)
        out["async_and_product"] = dict(calls)
        dist.all_reduce(t)  # both ranks: summed by torch
        dist.broadcast(t, src=0)
        dist.barrier()
        out["both"] = [t.item(), dict(calls)]
        with open(f"{out_dir}/{rank}.json", "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def test_collectives_over_one_rank_are_skipped_and_the_rest_reach_torch(tmp_path) -> None:
    import json

    torch = pytest.importorskip("torch")
    torch.multiprocessing.spawn(
        _collectives_on_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True
    )
    for rank in (0, 1):
        r = json.loads((tmp_path / f"{rank}.json").read_text())
        # over one rank: the identity, and nothing reached torch
        assert r["alone"] == [rank + 1.0, {}]
        assert r["async_and_product"] == {"all_reduce": 2}
        assert r["both"] == [3.0, {"all_reduce": 3, "broadcast": 1, "barrier": 1}]
