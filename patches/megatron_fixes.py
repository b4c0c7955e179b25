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
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Iterator

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


def apply(version: str | None = None) -> None:
    require_version("megatron-core", SUPPORTED, "megatron_fixes", version)
    define_missing_te_names()
    from megatron.core.dist_checkpointing.strategies import base, filesystem_async

    if not getattr(base.AsyncSaveShardedStrategy.save, "_megatron_rl_fixed", False):
        base.AsyncSaveShardedStrategy.save = _sync_save(base.AsyncSaveShardedStrategy.save)
    if not getattr(filesystem_async._get_write_results_queue, "_megatron_rl_fixed", False):
        filesystem_async._get_write_results_queue = _write_results_queue(filesystem_async._get_write_results_queue)
