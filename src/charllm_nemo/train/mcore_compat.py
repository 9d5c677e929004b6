"""Differences between megatron-core releases (0.16 to 0.19) that this trainer has to bridge.

CI runs megatron-core 0.16.x on Python 3.11; users' containers carry newer releases (0.17+ need
Python >= 3.12). What changed under our calls, checked against the 0.19.2 wheel:

* ``megatron.core.utils.get_batch_on_this_cp_rank`` takes a required ``is_hybrid_cp`` (0.19) and
  reads ``cp_group=None`` as the whole world; 0.16 took ``(batch, cp_group=None)`` and read None
  as the initialised context-parallel group. :func:`batch_on_this_cp_rank` passes the CP group
  explicitly on both.
* From 0.18 ``import megatron.core`` imports ``triton`` unconditionally (through the pipeline
  schedules -> ``transformer.moe.paged_stash`` -> ``moe.ops.paged_stash``). CUDA builds of torch
  bring triton; the CPU build does not. :func:`import_megatron_core` turns that ImportError into a
  message naming the fix.
* ``start_grad_sync`` calls ``torch.cuda.current_stream()`` (0.19): the CPU layer's ``torch.cuda``
  stand-in answers it (:mod:`charllm_nemo.train.cpu`).
"""

from __future__ import annotations

import importlib
import inspect
from functools import cache
from types import ModuleType
from typing import Any

from charllm_nemo.errors import ConfigError


def import_megatron_core() -> ModuleType:
    """``import megatron.core``, with the triton case of megatron-core >= 0.18 explained.

    Raises :class:`ConfigError` when megatron-core is missing or when it needs ``triton`` that is
    not installed (the CPU build of torch does not depend on it)."""
    try:
        return importlib.import_module("megatron.core")
    except ModuleNotFoundError as exc:
        if exc.name == "triton" or (exc.name or "").startswith("triton."):
            raise ConfigError(
                "megatron-core >= 0.18 imports triton when megatron.core is imported "
                "(megatron/core/transformer/moe/ops/paged_stash.py), and this environment has "
                "none: CUDA builds of torch install it, the CPU build does not. Install it with "
                "`pip install triton` (the import needs no GPU), or use megatron-core 0.16.x"
            ) from exc
        if (exc.name or "").startswith("megatron"):
            raise ConfigError(
                "megatron-core is not installed: pip install 'charllm-nemo[megatron]' "
                "(megatron-core 0.16.x; 0.17+ need Python >= 3.12)"
            ) from exc
        raise


@cache
def mcore_version() -> tuple[int, int]:
    """(major, minor) of the installed megatron-core, e.g. (0, 16)."""
    from megatron.core.package_info import __version__

    major, minor = str(__version__).split(".")[:2]
    return int(major), int(minor)


@cache
def _cp_takes_is_hybrid() -> bool:
    from megatron.core.utils import get_batch_on_this_cp_rank

    return "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters


def batch_on_this_cp_rank(batch: dict[str, Any], cp_group: Any = None) -> dict[str, Any]:
    """This context-parallel rank's share of ``batch`` (mcore's ``get_batch_on_this_cp_rank``,
    as Megatron-LM's ``get_batch`` calls it): the identity at cp=1.

    ``cp_group``: the context-parallel process group; None = the one ``parallel_state`` holds
    (0.19 would otherwise read None as the whole world and cut the sequence across every rank).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    if cp_group is None and ps.model_parallel_is_initialized():
        cp_group = ps.get_context_parallel_group()
    if _cp_takes_is_hybrid():
        result: dict[str, Any] = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    else:
        result = get_batch_on_this_cp_rank(batch, cp_group=cp_group)
    return result
