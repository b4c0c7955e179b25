"""Run megatron-core on CPU over gloo: the compatibility layer for machines without CUDA.

megatron-core assumes CUDA in a handful of places that have nothing to do with the maths:
`torch.cuda.current_device()` used as a device argument, literal `device="cuda"` in the pipeline
schedules, CUDA RNG state in the model-parallel RNG tracker, CUDA streams/events in the MoE
dispatcher, CUDA tensor type names in optimizer asserts, NCCL-only collectives. This module
redirects exactly those, so the same Megatron code paths (GPTModel, DDP, the optimizer, the
pipeline schedules, MoE dispatch) run on CPU with real gloo collectives. It is applied only when
CUDA is absent; on GPU nodes nothing here is touched.

Pieces (each needed by a code path the tests exercise):
- torch.cuda.* shims: current_device -> "cpu", synchronize/empty_cache no-ops, Stream/Event
  classes, rng get/set/seed mapped onto the CPU generator (on CPU the "CUDA" RNG that Megatron
  forks for tensor-parallel dropout and recompute *is* the CPU generator);
- a TorchFunctionMode that rewrites device="cuda" literals in factory calls, `.to`, `.cuda`;
- `Tensor.type()` reporting torch.cuda.* names, for the optimizer's dtype asserts;
- `moe_utils` fused TE names defined as None (megatron-core 0.16.1 reads them unguarded);
- all-to-all split sizes as plain ints, and unequal all-gather / reduce-scatter emulated on gloo;
- sequence parallelism for the torch norm: the parameters are marked `sequence_parallel` so
  `finalize_model_grads` all-reduces their gradients across the TP group, as TE's norm would.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from patches._guard import pinned, require_version

SUPPORTED = pinned("megatron-core")
_applied = False
_mode = None  # the installed CudaToCpuMode


# --------------------------------------------------------------------------------------------
# torch.cuda shims
# --------------------------------------------------------------------------------------------
class _Stream:
    """Stands in for torch.cuda.Stream: work on CPU is synchronous, so every wait is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self):
        pass

    def query(self):
        return True


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _cuda_to_cpu(device):
    """Map a CUDA device spec (str, int, torch.device) to "cpu"; leave anything else alone."""
    if isinstance(device, torch.device):
        # The string, not torch.device("cpu"): patches/device_check.py reads a cpu torch.device
        # as a deliberate host placement and the "cpu" string as a rewritten CUDA one.
        return "cpu" if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Rewrite CUDA device arguments to CPU in every torch call made while the mode is active.

    Autograd runs backward functions (e.g. activation recompute) without the Python mode stack,
    so the common factories and `Tensor.cuda` / `Tensor.to` are also wrapped directly
    (`_wrap_factories`); the mode covers everything else that takes a `device=` argument.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _cuda_to_cpu(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _cuda_to_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


_FACTORIES = ("ones", "zeros", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn",
              "randint", "randperm", "eye", "linspace", "ones_like", "zeros_like", "empty_like",
              "full_like", "rand_like", "randn_like")
_TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


def _device_kwarg_to_cpu(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cuda_to_cpu(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


def _wrap_factories() -> None:
    # `with torch.device(d):` (transformers builds models under the meta device) gives `device=d` to
    # the calls whose function is in torch's cached set of factories, built on its first use from
    # the attributes of `torch`. Built after the wrapping, the set would hold the wrappers, the
    # real factories called inside them would not be recognised, and a buffer meant for the meta
    # device would be made on the host and then skipped by the model's initialisation (transformers'
    # rotary inv_freq came out as uninitialised memory, every HF model in a learner process
    # computed wrong logits). Build it from the real factories first.
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in _FACTORIES:
        setattr(torch, name, _device_kwarg_to_cpu(getattr(torch, name)))
    for name in _TENSOR_FACTORIES:
        setattr(torch.Tensor, name, _device_kwarg_to_cpu(getattr(torch.Tensor, name)))
    orig_to = torch.Tensor.to

    @functools.wraps(orig_to)
    def to(self, *args, **kwargs):
        if args:
            args = (_cuda_to_cpu(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = _cuda_to_cpu(kwargs["device"])
        return orig_to(self, *args, **kwargs)

    torch.Tensor.to = to
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.device_count = lambda: 0
    cuda.set_device = lambda *a, **k: None
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.default_stream = lambda *a, **k: _Stream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # torch.manual_seed itself calls cuda.manual_seed_all, so seed the CPU generator directly.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state

    # Optimizer and grad-clip code assert on CUDA type names; report them for CPU float tensors.
    orig_type = torch.Tensor.type

    @functools.wraps(orig_type)
    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        if dtype is None:
            return orig_type(self)
        return orig_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = tensor_type


# --------------------------------------------------------------------------------------------
# megatron-core internals
# --------------------------------------------------------------------------------------------
class _DropForkedRngWarning(logging.Filter):
    # With the "CUDA" RNG mapped onto the CPU generator, the tracker's check that the CPU state is
    # untouched inside a fork always fires; the message is expected and says nothing here.
    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    logging.getLogger(mrandom.__name__).addFilter(_DropForkedRngWarning())
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _patch_moe_utils() -> None:
    # Not CPU-specific: megatron_fixes.py defines these on every device (a GPU without TE needs it).
    from patches.megatron_fixes import define_missing_te_names

    define_missing_te_names()


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def _patch_collectives() -> None:
    from megatron.core.tensor_parallel import mappings

    orig_gather = mappings._gather_along_first_dim
    orig_reduce_scatter = mappings._reduce_scatter_along_first_dim
    orig_all_to_all_single = dist.all_to_all_single

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or not _is_gloo(group):
            return orig_gather(input_, group, output_split_sizes, use_global_buffer)
        # gloo's all_gather needs equal sizes: pad every piece to the largest, gather, trim.
        sizes = [int(s) for s in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([p[:s] for p, s in zip(pieces, sizes)], dim=0)

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1 or not _is_gloo(group):
            return orig_reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        # Unequal reduce-scatter on gloo: all-reduce everything, keep this rank's slice.
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        sizes = [int(s) for s in input_split_sizes]
        start = sum(sizes[: group.rank()])
        return total[start : start + sizes[group.rank()]].clone()

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        # The MoE dispatcher passes split sizes as tensors or numpy ints; gloo wants Python ints.
        to_list = lambda s: None if s is None else [int(x) for x in (s.tolist() if hasattr(s, "tolist") else s)]
        return orig_all_to_all_single(output, input, to_list(output_split_sizes),
                                      to_list(input_split_sizes), group=group, async_op=async_op)

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim
    dist.all_to_all_single = all_to_all_single


def _patch_torch_norm() -> None:
    """Let the torch norm run under sequence parallelism (its grads then need a TP all-reduce)."""
    from megatron.core.transformer import torch_norm

    orig_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
            zero_centered_gamma=False, normalization="LayerNorm"):
        sequence_parallel = config.sequence_parallel
        if sequence_parallel:
            # A shallow copy with SP off passes the upstream assert; dataclasses.replace would
            # re-run TransformerConfig validation for nothing.
            config = copy.copy(config)
            object.__setattr__(config, "sequence_parallel", False)
        norm = orig_new(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                        normalization)
        for p in norm.parameters():
            # finalize_model_grads sums grads of params marked sequence_parallel across TP ranks.
            p.sequence_parallel = sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)


def apply(version: str | None = None) -> None:
    """Install the CPU compatibility layer (idempotent). Refuses an unexpected megatron-core."""
    global _applied
    require_version("megatron-core", SUPPORTED, "megatron_cpu", version)
    if _applied:
        return
    _patch_torch_cuda()
    _wrap_factories()
    _patch_rng()
    _patch_moe_utils()
    _patch_collectives()
    _patch_torch_norm()
    global _mode
    _mode = CudaToCpuMode()
    _mode.__enter__()  # process-wide; never exited
    _applied = True


@contextlib.contextmanager
def device_mode_paused():
    """Run code that never names a CUDA device without `CudaToCpuMode`: under the mode every
    torch call makes a Python round trip, which dominates code made of many small ops (the
    per-micro-batch loss and diagnostics cost ~1.6x more with it). No-op when the mode is not
    the innermost one (or not installed)."""
    n = torch._C._len_torch_function_stack()
    if _mode is None or n == 0 or torch._C._get_function_stack_at(n - 1) is not _mode:
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield
