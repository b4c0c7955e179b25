"""megatron-core fixes every device needs (`patches.apply_all` applies them on CPU and on GPU).

- MoE routing without Transformer Engine. `moe_utils` imports `te_general_gemm` and the fused MoE
  kernels from Transformer Engine inside a try block and, when TE is absent, leaves the names
  undefined. The fused kernels are guarded by `HAVE_TE`, but `RouterGatingLinearFunction` reads
  `te_general_gemm` unguarded, so every MoE forward without TE raised NameError. The GPU smoke suite's
  first run (H200, no TE) failed 11 of its 20 tests on this. Until then the CPU layer
  (megatron_cpu.py) had defined the names on CPU only, which hid the bug from every CPU test. The
  missing names are now defined as None on every device, which sends megatron-core down its own
  torch paths.
- Synchronous dist_checkpointing saves spawn no Manager process. `FileSystemWriterAsync` hands its
  write results through `_get_write_results_queue()`, a spawn-context
  `multiprocessing.Manager().Queue()` made on first use, so that an asynchronous save's writer
  process can return them. The first `put` carries torch.distributed.checkpoint `WriteResult`s, and
  unpickling them imports torch in the Manager process: 1.86 s on the first put, 0.0 s after. That
  cost landed on every process's first checkpoint. A synchronous save
  (`AsyncSaveShardedStrategy.save`: `async_save`, then `execute_sync` in the calling process; the
  only kind this project makes) puts and gets in the calling process, so inside one the queue is a
  plain in-process queue (`synchronous_save()`, also used by run/checkpoint.py when it runs a
  save's write in the calling process). Asynchronous saves keep upstream's Manager queue.
- Multi-tensor ops without Transformer Engine or apex. The optimizer's grad norm, gradient clipping
  and master-to-model parameter copy go through `multi_tensor_applier` with amp_C's (or TE's) fused
  kernels; without either, megatron-core falls back to `utils.local_multi_tensor_l2_norm` and
  `local_multi_tensor_scale`. The norm takes one `torch.norm` per tensor and then builds a host
  tensor from the list of device scalars (`torch.tensor(l2)`): one host wait per parameter, 1,055 per
  step at `moe_30b_layer` (docs/gpu.md). The scale allocates `src * scale` per tensor, then copies it
  (also for the copy with scale 1.0, fp32 master weights to bf16 parameters): three passes over
  every parameter where one does. On an H200 these ran as 1,055 norm kernels, 1,128 multiplications
  and 1,677 casts per step. `foreach_l2_norm` and `foreach_scale` keep amp_C's contract on torch's
  multi-tensor (`_foreach_*`) kernels: a handful of launches per step, no host wait, one pass per
  tensor; they replace the fallbacks only where megatron-core chose them
  (`restore_local_multi_tensor_ops` puts them back, for the GPU suite's before/after).
- One copy of a non-contiguous output gradient in the linear backward, not two.
  `LinearWithGradAccumulationAndAsyncCommunication.backward` first multiplies `grad_output` by the
  weight (`matmul` reshapes a non-contiguous [s, b, n] gradient into a copy) and then makes it
  contiguous for the weight gradient (a second copy of the same values). The LM head's gradient
  arrives transposed ([b, s, V] back to [s, b, V]): at V = 151,936 and 4,096 tokens that is 1.2 GB
  copied twice per micro-batch, 6.2 ms of each H200 step's device time for the second copy (the
  2026-11-28 profile). The backward now receives `grad_output.contiguous()` (a no-op for every
  other layer, whose gradients arrive contiguous).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Iterator

import torch

from patches._guard import pinned, require_version

SUPPORTED = pinned("megatron-core")
TE_NAMES = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
            "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
            "fused_topk_with_score_function", "fused_unpermute", "te_general_gemm")
_sync = threading.local()  # depth of synchronous saves running on this thread


def define_missing_te_names() -> None:
    from megatron.core.transformer.moe import moe_utils

    for name in TE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


@contextlib.contextmanager
def synchronous_save() -> Iterator[None]:
    """Inside it, a save's write results travel through an in-process queue: for callers that run an
    AsyncRequest's write in this process themselves (run/checkpoint.py's synchronous saves)."""
    _sync.depth = getattr(_sync, "depth", 0) + 1
    try:
        yield
    finally:
        _sync.depth -= 1


def _sync_save(save):
    def wrapper(self, sharded_state_dict, checkpoint_dir):
        with synchronous_save():
            return save(self, sharded_state_dict, checkpoint_dir)

    wrapper._megatron_rl_fixed = True
    return wrapper


def _write_results_queue(upstream):
    def get():
        return queue.Queue() if getattr(_sync, "depth", 0) else upstream()

    get._megatron_rl_fixed = True
    return get


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's contract: (the L2 norm of every tensor of every list as a [1] fp32
    tensor, the per-tensor norms or None), computed on the tensors' device with no host wait."""
    tensors = [t for ts in tensor_lists for t in ts]
    if not tensors:
        device = noop_flag.device if torch.is_tensor(noop_flag) else None
        return torch.zeros(1, dtype=torch.float32, device=device), None
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    return torch.linalg.vector_norm(norms).reshape(1), (norms if per_tensor else None)


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale's contract (dst = src x scale, cast to dst's dtype) in one pass:
    a copy when scale is 1, an in-place multiply when the lists are the same tensors."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if not torch.is_tensor(scale) and scale == 1.0:
        torch._foreach_copy_(dst, src)
    elif all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _multi_tensor_sites():
    """(module, name, megatron-core's local fallback) for every module-level binding of a fallback."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    return ((clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm),
            (clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale),
            (optimizer, "multi_tensor_scale_impl", utils.local_multi_tensor_scale))


def use_foreach_multi_tensor_ops() -> int:
    """Replace megatron-core's local multi-tensor fallbacks where they are in use; returns how many
    bindings now use the foreach versions."""
    ours = {"l2_norm_impl": foreach_l2_norm, "multi_tensor_scale_impl": foreach_scale}
    n = 0
    for module, name, local in _multi_tensor_sites():
        if getattr(module, name) is local:
            setattr(module, name, ours[name])
        n += getattr(module, name) is ours[name]
    return n


def restore_local_multi_tensor_ops() -> None:
    """megatron-core's own fallbacks back (what it runs without TE, apex or this patch)."""
    ours = (foreach_l2_norm, foreach_scale)
    for module, name, local in _multi_tensor_sites():
        if getattr(module, name) in ours:
            setattr(module, name, local)


def contiguous_linear_grad_output() -> None:
    """The linear backward gets a contiguous `grad_output` (one copy where upstream makes two)."""
    from megatron.core.tensor_parallel import layers

    cls = layers.LinearWithGradAccumulationAndAsyncCommunication
    upstream = cls.backward
    if getattr(upstream, "_megatron_rl_fixed", False):
        return

    def backward(ctx, grad_output):
        return upstream(ctx, grad_output.contiguous())

    backward._megatron_rl_fixed = True
    cls.backward = staticmethod(backward)


def apply(version: str | None = None) -> None:
    require_version("megatron-core", SUPPORTED, "megatron_fixes", version)
    define_missing_te_names()
    use_foreach_multi_tensor_ops()
    contiguous_linear_grad_output()
    from megatron.core.dist_checkpointing.strategies import base, filesystem_async

    if not getattr(base.AsyncSaveShardedStrategy.save, "_megatron_rl_fixed", False):
        base.AsyncSaveShardedStrategy.save = _sync_save(base.AsyncSaveShardedStrategy.save)
    if not getattr(filesystem_async._get_write_results_queue, "_megatron_rl_fixed", False):
        filesystem_async._get_write_results_queue = _write_results_queue(filesystem_async._get_write_results_queue)
