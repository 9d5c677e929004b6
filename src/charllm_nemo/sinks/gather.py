"""Bring every rank's per-step figures to rank 0: one small fixed-size float64 tensor per rank.

No pickled objects (``gather_object`` would pickle, and cost a second collective for sizes):
each rank sends ``width`` float64 values, NaN for what it does not know, with
``torch.distributed.gather`` to rank 0 of the group (``all_gather`` where the backend has no
gather). torch is imported lazily, so importing this module needs no torch, and a job of one
process without a process group needs none either.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from charllm_nemo.sinks.keys import finite

# Backends found lacking gather (a RuntimeError / NotImplementedError on first use): use
# all_gather for them from then on.
_NO_GATHER: set[str] = set()


def _vector(values: Sequence[float | None], width: int) -> list[float]:
    if len(values) > width:
        raise ValueError(f"{len(values)} values do not fit width={width}")
    out = [math.nan] * width
    for i, v in enumerate(values):
        f = finite(v)
        out[i] = math.nan if f is None else f
    return out


def _comm_device(torch: Any, dist: Any, group: Any) -> Any:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_to_rank0(
    values: Sequence[float | None],
    group: Any = None,
    *,
    width: int | None = None,
    device: Any = None,
) -> list[list[float]] | None:
    """Gather one vector per rank to rank 0 of ``group`` (None = the default group).

    ``values``: this rank's figures (None / NaN / inf = not known; sent as NaN), padded with
    NaN to ``width`` (default ``len(values)``; every rank must use the same width: it is a
    collective, every rank of the group must call it, in the same order as the others).
    ``device``: where the tensors live; None = the current CUDA device for NCCL, else CPU.

    Returns, on the group's rank 0, a list indexed by group rank of lists of floats (NaN =
    not known); None on every other rank. Without an initialized process group (a single
    process) it returns ``[values]``.
    """
    n = len(values) if width is None else int(width)
    vec = _vector(values, n)
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return [vec]
    if not dist.is_available() or not dist.is_initialized():
        return [vec]
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    if world == 1:
        return [vec]
    dev = _comm_device(torch, dist, group) if device is None else torch.device(device)
    mine = torch.tensor(vec, dtype=torch.float64, device=dev)
    backend = str(dist.get_backend(group)).lower()
    if backend not in _NO_GATHER:
        dst = dist.get_global_rank(group, 0) if group is not None else 0
        bufs = [torch.empty_like(mine) for _ in range(world)] if me == 0 else None
        try:
            dist.gather(mine, gather_list=bufs, dst=dst, group=group)
        except (RuntimeError, NotImplementedError):
            # Every rank of a group fails the same way on an unsupported backend, so every
            # rank falls back together.
            _NO_GATHER.add(backend)
        else:
            if me != 0 or bufs is None:
                return None
            return _to_lists(torch, bufs)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    if me != 0:
        return None
    return _to_lists(torch, out)


def _to_lists(torch: Any, rows: list[Any]) -> list[list[float]]:
    """The gathered rows as lists: one device-to-host copy for all of them (one per rank would
    be a thousand synchronizing copies a step on the training thread at 1024 ranks)."""
    return [[float(x) for x in row] for row in torch.stack(rows).cpu().tolist()]
