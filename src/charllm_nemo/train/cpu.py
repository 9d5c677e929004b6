"""CPU / gloo support for Megatron-Core, isolated in one module.

Megatron-Core is written for CUDA. On a CPU (a laptop, CI, this project's 2-core machines) it runs
dense GPT, MoE, TP=2, PP=2, EP=2 and DP=2 over gloo once a handful of CUDA assumptions are
handled. :func:`enable_cpu_support` handles them; the trainer calls it only when it runs on CPU,
so nothing here touches a GPU run. Every patch is narrow (one module or one function), has a
comment saying why, and was checked against megatron-core 0.16.1 (``MCORE_CHECKED``).

The patches, in short (docs/training-internals.md has the long form):

1. A module-scoped ``torch`` shim (:class:`_TorchOnCpu`) replaces the global name ``torch`` in
   the mcore modules of :data:`SHIMMED_MODULES`, which allocate on ``device="cuda"`` /
   ``torch.cuda.current_device()`` or call ``torch.cuda.synchronize()``: there, ``"cuda"`` means
   the CPU and synchronize is a no-op. Everything else resolves to the real ``torch``; other
   modules, and torch itself, are untouched.
2. The model-parallel "CUDA" RNG tracker tracks CPU generator states instead (the fork/restore
   logic is mcore's; only the state getters/setters and the fork's warning differ).
3. MoE without TransformerEngine: ``moe_utils.te_general_gemm`` is an undefined name when the TE
   import fails; it is defined as ``None`` so the router takes its plain ``torch.mm`` path.
4. ``clip_grad_by_total_norm_fp32`` asserts CUDA grads: replaced by the same scaling.
5. The tied-embedding setup of PP > 1 calls ``Tensor.cuda()``: it runs with that as identity.
6. :func:`cpu_transformer_overrides`: ``use_cpu_initialization``, and no batched p2p (gloo swaps
   same-shaped sends to one peer under PP=2 with VPP).
7. Blocking ``all_reduce`` / ``broadcast`` / ``barrier`` over a one-rank group return at once
   (the identity; gloo would hand each to a worker thread and wait for it).

What CPU cannot do is listed by :func:`cpu_unsupported` for config validation (it lives in
train/cpu_rules.py, which imports no torch: a dry run validates without paying for torch).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from charllm_nemo.train.cpu_rules import cpu_unsupported as cpu_unsupported  # re-exported: its old home

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

MCORE_CHECKED = "0.16.1"
"""The megatron-core version these patches were written and tested against (CI's)."""

MCORE_ALSO_CHECKED = ("0.19.2",)
"""Later releases a tiny CPU run was checked on (docs/integrations.md, megatron-core 0.16 to 0.19)."""

# Modules whose global ``torch`` is replaced by the CPU shim, with the reason for each
# (megatron-core 0.16.1 line references in the comments of docs/training-internals.md).
SHIMMED_MODULES: tuple[tuple[str, str], ...] = (
    (
        "megatron.core.pipeline_parallel.schedules",
        "total_num_tokens = torch.zeros(..., device='cuda') in every forward_backward_* schedule",
    ),
    (
        "megatron.core.pipeline_parallel.p2p_communication",
        "recv buffers on torch.cuda.current_device(); torch.cuda.synchronize() after batched p2p",
    ),
    (
        "megatron.core.utils",
        "GlobalMemoryBuffer.get_tensor allocates on torch.cuda.current_device() (used by "
        "DotProductAttention every forward); local_multi_tensor_l2_norm returns a 'cuda' tensor",
    ),
    (
        "megatron.core.models.common.embeddings.rotary_pos_embedding",
        "RotaryEmbedding moves inv_freq to torch.cuda.current_device() at the first forward",
    ),
    (
        "megatron.core.transformer.utils",
        "get_default_causal_mask / get_sliding_window_causal_mask build masks on device='cuda' "
        "(the trainer passes an explicit mask anyway; this covers any other caller)",
    ),
    (
        "megatron.core.optimizer.clip_grads",
        "get_grad_norm_fp32 / count_zeros_fp32 allocate norm and overflow buffers on 'cuda'",
    ),
    (
        "megatron.core.optimizer.optimizer",
        "FP32Optimizer._scale and MixedPrecisionOptimizer.found_inf are created on 'cuda'",
    ),
    (
        "megatron.core.distributed.param_and_grad_buffer",
        "DDP's contiguous param/grad buffers are allocated on torch.cuda.current_device()",
    ),
    (
        "megatron.core.distributed.distributed_data_parallel",
        "DDP calls torch.cuda.synchronize() around buffer (re)allocation",
    ),
    (
        "megatron.core.transformer.moe.moe_utils",
        "the MoE aux-loss logging tracker is created with torch.zeros(..., device='cuda')",
    ),
    (
        "megatron.core.transformer.moe.router",
        "the router moves its weight/bias and aux-loss scalars to torch.cuda.current_device()",
    ),
    (
        "megatron.core.tensor_parallel.mappings",
        "gather/reduce-scatter outputs along the first dim on torch.cuda.current_device() (the "
        "MoE allgather token dispatcher uses them)",
    ),
    (
        "megatron.core.tensor_parallel.random",
        "the RNG tracker's add() seeds through torch.cuda.get_rng_state/manual_seed",
    ),
)

_FACTORIES = (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "eye",
    "rand",
    "randn",
    "randint",
)

_enabled = False


def _is_cuda_device(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):  # torch.cuda.current_device() returns an index on a GPU
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _cpu_factory(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    factory.__name__ = getattr(fn, "__name__", "factory")
    factory.__doc__ = f"torch.{factory.__name__} with device='cuda' mapped to the CPU (charllm CPU shim)"
    return factory


class _CpuStream:
    """The one "stream" of a CPU run. CPU ops run in program order, so waiting on a stream or an
    event has nothing to wait for. megatron-core 0.19's ``start_grad_sync`` asks
    ``torch.cuda.current_stream()`` for a stream to ``wait_event`` on (events of CUDA-graph
    replays, which a CPU run never records)."""

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


_CPU_STREAM = _CpuStream()


class _CudaOnCpu(types.ModuleType):
    """``torch.cuda`` as the shimmed modules see it: the current device is the CPU, synchronize is
    a no-op (CPU ops are synchronous), the RNG calls act on the CPU generator, the current and the
    default stream are one :class:`_CpuStream`. Anything else is the
    real ``torch.cuda`` (so ``is_available()`` stays False)."""

    def __init__(self) -> None:
        super().__init__("torch.cuda", "torch.cuda seen from a CPU run (charllm_nemo.train.cpu)")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def current_stream(device: Any = None) -> _CpuStream:
        return _CPU_STREAM

    @staticmethod
    def default_stream(device: Any = None) -> _CpuStream:
        return _CPU_STREAM


class _TorchOnCpu(types.ModuleType):
    """``torch`` as the shimmed modules see it: tensor factories map ``device='cuda'`` (or a CUDA
    index) to the CPU and ``torch.cuda`` is :class:`_CudaOnCpu`. Every other attribute is the real
    torch's, looked up on each access."""

    def __init__(self) -> None:
        super().__init__("torch", "torch seen from a CPU run (charllm_nemo.train.cpu)")
        self.cuda = _CudaOnCpu()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _install_torch_shim(shim: _TorchOnCpu) -> list[str]:
    patched = []
    for modname, _why in SHIMMED_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:  # a module this mcore version lacks: nothing to patch
            continue
        if isinstance(getattr(mod, "torch", None), _TorchOnCpu):
            continue
        if getattr(mod, "torch", None) is not torch:
            log.warning("cpu support: %s has no global 'torch'; not shimmed", modname)
            continue
        mod.torch = shim  # type: ignore[attr-defined]
        patched.append(modname)
    return patched


def _install_cpu_rng_tracker() -> None:
    """Make mcore's model-parallel RNG tracker track CPU generator states.

    On a GPU the tracker keeps separate CUDA generator states for the data-parallel, the
    tensor-parallel and the expert-parallel regions and forks between them (dropout inside TP
    regions must differ across TP ranks). On CPU there is only the CPU generator, so the states it
    keeps are CPU generator states; the fork/restore bookkeeping is mcore's own. mcore 0.16.1
    reads/writes the states through ``random._get_cuda_rng_state`` / ``_set_cuda_rng_state``
    (``torch.cuda.default_generators`` underneath: fails on CPU), used by the tracker and by
    activation recomputation (``CheckpointFunction``); both are replaced.
    """
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state

    base = mrandom.CudaRNGStatesTracker
    if getattr(base, "_charllm_cpu", False):
        return

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """mcore's tracker over CPU generator states. ``fork`` is mcore 0.16.1's without its
        "CPU RNG state changed within GPU RNG context" warning, which on CPU fires on every
        dropout (the CPU generator *is* the forked one here)."""

        _charllm_cpu = True

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            orig_state = torch.get_rng_state()
            orig_name: str = self._current_state_name  # type: ignore[has-type]
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    # initialize_rng_tracker() instantiates the module-global class name: every tracker made from
    # now on (including after force_reset) is the CPU one. A tracker made before is replaced.
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    if tracker is not None and not isinstance(tracker, CpuRNGStatesTracker):
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def _define_te_general_gemm() -> None:
    """mcore 0.16.1 ``moe_utils`` imports ``te_general_gemm`` inside ``try: ... except
    ImportError`` without a fallback, then tests ``if te_general_gemm is not None`` in the router's
    gating GEMM: a NameError without TransformerEngine. Defining it as None selects the
    ``torch.mm`` path that is already there."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _cpu_clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """mcore 0.16.1 ``clip_grad_by_total_norm_fp32`` minus its
    ``assert param.grad.type() == 'torch.cuda.FloatTensor'``: the same in-place scaling of the
    fp32 grads by ``max_norm / (total_norm + 1e-6)`` when that is < 1, with the dtype checked
    instead of the device."""
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is None:
            continue
        assert grad.dtype in (torch.float32, torch.bfloat16), f"grad dtype {grad.dtype}"
        grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


@contextlib.contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    """While active, ``Tensor.cuda()`` returns the tensor itself (CPU runs only, one call)."""
    orig = torch.Tensor.cuda

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    torch.Tensor.cuda = cuda  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.Tensor.cuda = orig  # type: ignore[method-assign]


def _patch_tied_embedding_setup() -> None:
    """mcore 0.16.1 ``LanguageModule.setup_embeddings_and_output_layer`` does
    ``weight.data = weight.data.cuda()`` before all-reducing the tied embedding between the first
    and the last pipeline stage (PP > 1 with tied embeddings). A Tensor method cannot be shimmed
    per module, so the method runs with ``Tensor.cuda`` as the identity for its duration."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    orig = LanguageModule.setup_embeddings_and_output_layer
    if getattr(orig, "_charllm_cpu", False):
        return

    def setup_embeddings_and_output_layer(self: Any) -> None:
        with _tensor_cuda_is_identity():
            orig(self)

    setup_embeddings_and_output_layer._charllm_cpu = True  # type: ignore[attr-defined]
    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def _patch_clip_grad() -> None:
    """optimizer.py imported the function by name: patch that name (and clip_grads' own)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer

    moptimizer.clip_grad_by_total_norm_fp32 = _cpu_clip_grad_by_total_norm_fp32
    clip_grads.clip_grad_by_total_norm_fp32 = _cpu_clip_grad_by_total_norm_fp32


def _one_rank(group: Any, async_op: bool) -> bool:
    """Whether a blocking collective over ``group`` involves only this rank (and so is the
    identity). Asynchronous calls and calls outside an initialized process group are never
    skipped: they go to torch, which returns its work handle or raises its own error."""
    if async_op or not torch.distributed.is_initialized():
        return False
    try:
        return bool(torch.distributed.get_world_size(group) == 1)
    except (RuntimeError, ValueError):  # not a member of that group: torch says so
        return False


def _skip_one_rank_collectives() -> None:
    """Blocking ``all_reduce`` (sum, average, max, min), ``broadcast`` and ``barrier`` over a
    one-rank group return at once. Over one rank they are the identity, but gloo still hands
    each to a worker thread and waits for it: 14 ``all_reduce`` calls a tiny_gpt step with one
    rank, ~78 µs each in the step here (mcore reduces over its model-parallel, data-parallel and
    embedding groups whatever their size), ~1.3 µs skipped. Groups of two or more ranks,
    asynchronous calls and other reductions go to torch unchanged."""
    dist = torch.distributed
    if getattr(dist.all_reduce, "_charllm_cpu", False):
        return
    ops = dist.ReduceOp
    sum_op = ops.SUM
    identity_ops = (ops.SUM, ops.AVG, ops.MAX, ops.MIN)  # over one rank (PREMUL_SUM scales: not these)
    orig_all_reduce, orig_broadcast, orig_barrier = dist.all_reduce, dist.broadcast, dist.barrier

    def all_reduce(tensor: Any, op: Any = sum_op, group: Any = None, async_op: bool = False) -> Any:
        if _one_rank(group, async_op) and op in identity_ops:
            return None
        return orig_all_reduce(tensor, op=op, group=group, async_op=async_op)

    def broadcast(tensor: Any, src: Any = None, group: Any = None, async_op: bool = False, **kw: Any) -> Any:
        if not kw and _one_rank(group, async_op):
            return None
        return orig_broadcast(tensor, src, group=group, async_op=async_op, **kw)

    def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, **kw: Any) -> Any:
        if _one_rank(group, async_op):
            return None
        return orig_barrier(group=group, async_op=async_op, device_ids=device_ids, **kw)

    wrappers: tuple[tuple[Any, Any], ...] = (
        (all_reduce, orig_all_reduce),
        (broadcast, orig_broadcast),
        (barrier, orig_barrier),
    )
    for fn, orig in wrappers:
        fn._charllm_cpu = True
        fn.__wrapped__ = orig
        fn.__doc__ = orig.__doc__
        setattr(dist, fn.__name__, fn)


def enable_cpu_support() -> None:
    """Apply every CPU patch (idempotent). Call it before building the model, on CPU runs only."""
    global _enabled
    if _enabled:
        return
    from charllm_nemo.train.mcore_compat import import_megatron_core

    import_megatron_core()  # megatron-core >= 0.18 on a CPU torch: "pip install triton", said plainly
    patched = _install_torch_shim(_TorchOnCpu())
    _install_cpu_rng_tracker()
    _define_te_general_gemm()
    _patch_clip_grad()
    _patch_tied_embedding_setup()
    _skip_one_rank_collectives()
    _check_version()
    _enabled = True
    log.debug("cpu support enabled; torch shim in %s", ", ".join(patched))


def cpu_support_enabled() -> bool:
    return _enabled


def _check_version() -> None:
    try:
        from megatron.core.package_info import __version__ as mcore_version
    except ImportError:  # pragma: no cover - every released mcore has package_info
        return
    checked = {v.rsplit(".", 1)[0] for v in (MCORE_CHECKED, *MCORE_ALSO_CHECKED)}
    if str(mcore_version).rsplit(".", 1)[0] not in checked:
        log.warning(
            "megatron-core %s: the CPU patches were checked against %s; if a run fails on a CUDA "
            "call, see docs/training-internals.md",
            mcore_version,
            MCORE_CHECKED,
        )


def cpu_transformer_overrides() -> dict[str, Any]:
    """``TransformerConfig`` fields a CPU run must set, over what the config asks for.

    * ``use_cpu_initialization``: mcore otherwise creates every weight on
      ``torch.cuda.current_device()`` (and initializes it through the CUDA RNG tracker).
    * ``batch_p2p_comm=False`` / ``overlap_p2p_comm=False``: batched p2p
      (``batch_isend_irecv``) gives wrong results on gloo with PP=2 and VPP. With two stages the
      previous and the next stage are the same peer; the interleaved schedule sends an activation
      (to next) and a gradient (to prev) of the same shape in one batch, and gloo matches sends
      to one peer in posting order, so the receiver gets them swapped (found with mcore 0.16.1:
      grad norms ~15x too large, NaN with overlap). mcore's unbatched ``_p2p_ops`` sends the two
      directions over two different process groups when the PP group has 2 ranks, which keeps
      them apart.
    """
    return {"use_cpu_initialization": True, "batch_p2p_comm": False, "overlap_p2p_comm": False}
