"""This rank's place in the job: its environment, the process groups, the device.

:func:`rank_env` reads RANK / WORLD_SIZE / LOCAL_RANK (or SLURM_PROCID / SLURM_NTASKS /
SLURM_LOCALID); :func:`init_distributed` joins the process group (gloo + the CPU patches of
train/cpu.py on CPU, NCCL on GPU), builds Megatron-Core's model-parallel groups and seeds; it
returns a :class:`DistInfo`. torch and megatron-core are imported inside the functions.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.placement import local_ranks_from_env
from charllm_nemo.train.config import TrainConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits, from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def rank_env(cfg: TrainConfig, env: dict[str, str] | None = None) -> RankEnv:
    """RANK / WORLD_SIZE / LOCAL_RANK (torchrun, ``launcher=local``), else SLURM_PROCID /
    SLURM_NTASKS / SLURM_LOCALID (srun), else a single process. MASTER_ADDR defaults to
    127.0.0.1 and MASTER_PORT to ``launch.master_port`` (auto: under srun the job's port,
    ``launch.slurm_master_port``; else 29500, torch's)."""
    e = dict(os.environ) if env is None else env
    if "RANK" in e:
        rank, world = int(e["RANK"]), int(e.get("WORLD_SIZE", "1"))
        local = int(e.get("LOCAL_RANK", e["RANK"]))
    elif "SLURM_PROCID" in e:
        rank, world = int(e["SLURM_PROCID"]), int(e.get("SLURM_NTASKS", "1"))
        local = int(e.get("SLURM_LOCALID", "0"))
    else:
        rank, world, local = 0, 1, 0
    return RankEnv(
        rank=rank,
        world_size=world,
        local_rank=local,
        local_world_size=local_ranks_from_env(e, world),
        master_addr=e.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(e.get("MASTER_PORT") or _default_port(cfg, e)),
    )


def _default_port(cfg: TrainConfig, e: dict[str, str]) -> int:
    if cfg.launch.master_port is not None:
        return cfg.launch.master_port
    from charllm_nemo.train.launch import slurm_master_port

    return slurm_master_port(e) if "SLURM_PROCID" in e else 29500


@dataclass
class DistInfo:
    """This rank's place in the process groups (valid after :func:`init_distributed`)."""

    rank: int
    world_size: int
    local_rank: int
    device: str  # "cpu" | "cuda"
    backend: str  # "gloo" | "nccl"
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    ep_rank: int = 0
    dp_size: int = 1
    pp_size: int = 1
    is_last_stage: bool = True

    def labels(self) -> dict[str, int | None]:
        """Window labels (``WindowRecorder.set_labels``)."""
        return {
            "pp_stage": self.pp_rank,
            "tp_rank": self.tp_rank,
            "dp_rank": self.dp_rank,
            "ep_rank": self.ep_rank,
            "cp_rank": self.cp_rank,
        }


def resolve_device(cfg: TrainConfig) -> str:
    """``launch.device``: ``auto`` = cuda when torch sees a GPU, else cpu."""
    import torch

    dev = cfg.launch.device
    if dev == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda" and not torch.cuda.is_available():
        raise ConfigError("launch.device=cuda but torch sees no GPU; set launch.device=cpu (or auto)")
    if dev not in ("cpu", "cuda"):
        raise ConfigError(f"launch.device={dev!r} is not one of auto, cpu, cuda")
    return dev


def _quiet_known_noise(device: str) -> None:
    """Silence megatron-core's import-time notices about optional GPU libraries and torch's
    deprecation notices for the collectives mcore calls; they say nothing actionable here. On
    CPU also mcore's advice to set CUDA_DEVICE_MAX_CONNECTIONS (TP > 1): there is no CUDA."""
    patterns = [
        ".*Apex is not installed.*",
        ".*Transformer Engine and Apex are not installed.*",
        ".*torch.distributed.all_gather_into_tensor.*is deprecated.*",
        ".*torch.distributed.reduce_scatter_tensor.*is deprecated.*",
        ".*full scope is deprecated.*",
    ]
    if device == "cpu":
        patterns.append(".*CUDA_DEVICE_MAX_CONNECTIONS.*")
    for pattern in patterns:
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)


def init_distributed(cfg: TrainConfig, env: RankEnv | None = None, device: str | None = None) -> DistInfo:
    """Join the process group and build Megatron-Core's model-parallel groups for ``cfg``.

    gloo on CPU (after :func:`charllm_nemo.train.cpu.enable_cpu_support`), NCCL on GPU
    (``torch.cuda.set_device`` to the rank's GPU first). Seeds torch and mcore's model-parallel RNG
    tracker with ``data.seed``. An existing default process group is reused."""
    import torch

    env = env or rank_env(cfg)
    device = device or resolve_device(cfg)
    _quiet_known_noise(device)
    if device == "cpu":
        from charllm_nemo.train.cpu import enable_cpu_support

        enable_cpu_support()
        if "OMP_NUM_THREADS" not in os.environ:
            # One intra-op thread per rank unless OMP_NUM_THREADS says otherwise (torchrun's
            # default too): ranks share the host's cores, and spinning OpenMP threads on a busy
            # 2-core host made tiny steps ~50x slower here. It also leaves cores to the sampler.
            torch.set_num_threads(1)
    else:
        from charllm_nemo.telemetry.placement import local_device_ordinal

        if cfg.parallel.tp > 1:
            # One hardware work queue, so that a TP collective launched before a GEMM starts
            # before it (Megatron-LM's and NeMo's launch scripts set it); read when the CUDA
            # context is made, at set_device. A value the job set wins.
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

        # Local rank N drives device N; a task that sees fewer GPUs (srun --gpus-per-task=1)
        # drives its own, device 0: the one telemetry samples too (session.py).
        torch.cuda.set_device(local_device_ordinal(env.local_rank, torch.cuda.device_count()))
    backend = "gloo" if device == "cpu" else "nccl"
    dist = torch.distributed
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        dist.init_process_group(
            backend=backend, rank=env.rank, world_size=env.world_size, timeout=timedelta(minutes=10)
        )
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    p = cfg.parallel
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp if p.vpp and p.vpp > 1 else None,
        context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
        distributed_timeout_minutes=10,
        # mcore's extra gloo copies of the data-parallel groups serve only checkpointing, which
        # this trainer does not do; each costs a rendezvous at start and, per rank, threads that
        # wake every 10 ms for the whole run (gloo's TCP loop).
        create_gloo_process_groups=False,
    )
    torch.manual_seed(cfg.data.seed)
    model_parallel_cuda_manual_seed(cfg.data.seed)
    return DistInfo(
        rank=env.rank,
        world_size=env.world_size,
        local_rank=env.local_rank,
        device=device,
        backend=backend,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        is_last_stage=ps.is_pipeline_last_stage(ignore_virtual=True),
    )


def shutdown_distributed() -> None:
    """Tear down mcore's groups and the default process group (idempotent)."""
    import torch
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


CLOSED_KEY = "charllm/closed/{rank}"
"""The key each rank sets in the process group's store when its telemetry is closed (its files
under the run directory are final); the value is how its run ended (``complete``, ``failed``, ...)."""


def announce_closed(torch: Any, rank: int, status: str) -> None:
    """Tell rank 0, through the default process group's store, that this rank's telemetry is
    closed and how its run ended. Never raises: a store that is gone (rank 0 exited) only
    means nobody waits."""
    try:
        torch.distributed.distributed_c10d._get_default_store().set(CLOSED_KEY.format(rank=rank), status)
    except Exception:  # the end of a run: nothing here may hide why it ended
        log.debug("could not announce rank %d closed", rank, exc_info=True)


def wait_for_ranks_closed(torch: Any, ranks: Sequence[int], timeout_s: float) -> dict[int, str | None]:
    """On rank 0: wait until each of ``ranks`` has :func:`announce_closed`, at most ``timeout_s``
    seconds. Returns each one's status, None for a rank not heard from by then. Unlike a
    barrier, a rank that failed still answers (it announces ``failed``), one that died costs
    ``timeout_s`` rather than the process group's timeout, and the other ranks do not wait."""
    store = torch.distributed.distributed_c10d._get_default_store()
    keys = {r: CLOSED_KEY.format(rank=r) for r in ranks}
    try:
        store.wait(list(keys.values()), timedelta(seconds=timeout_s))
        heard = list(keys)
    except Exception:  # torch raises DistStoreError (a RuntimeError) on the timeout
        heard = [r for r, key in keys.items() if store.check([key])]
    statuses: dict[int, str | None] = dict.fromkeys(keys)
    if heard:
        values = store.multi_get([keys[r] for r in heard])
        statuses.update({r: bytes(v).decode() for r, v in zip(heard, values, strict=True)})
    return statuses


def closing_problems(statuses: dict[int, str | None], timeout_s: float) -> str | None:
    """Rank 0's line about the ranks that did not close cleanly (None when every rank says
    ``complete``): which ended how, and which were not heard from within ``timeout_s``."""
    silent = [r for r, s in statuses.items() if s is None]
    ended: dict[str, list[int]] = {}
    for r, s in statuses.items():
        if s is not None and s != "complete":
            ended.setdefault(s, []).append(r)
    parts = [f"rank(s) {_ranks(rs)} ended {s}" for s, rs in sorted(ended.items())]
    if silent:
        parts.append(f"rank(s) {_ranks(silent)} had not closed their telemetry after {timeout_s:g} s")
    return "; ".join(parts) or None


def _ranks(ranks: list[int], most: int = 8) -> str:
    shown = ", ".join(map(str, ranks[:most]))
    return shown + (f" and {len(ranks) - most} more" if len(ranks) > most else "")
