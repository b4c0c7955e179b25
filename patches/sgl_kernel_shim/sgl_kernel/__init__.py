"""Import shim for `sgl_kernel` when SGLang runs on a CPU without a CPU `sgl_kernel` build.

SGLang 0.5.23 imports a handful of `sgl_kernel` names at module level (activation, norm and
sampling modules), but on a CPU without AMX every layer takes its native torch path and none of
them is ever called; no CPU `sgl_kernel` wheel exists on PyPI. This package makes those imports
succeed: each of those names (`OPS`) is a stand-in that raises `SglKernelUnavailable`, naming the op,
the moment it is called, so a code path that really needs a kernel fails loudly instead of
computing something else. Other names and submodules are absent (ImportError), exactly as
without `sgl_kernel`, so SGLang's own import fallbacks still apply.

`torch.ops.sgl_kernel` stays empty, so SGLang's AMX check
(`hasattr(torch.ops.sgl_kernel, "convert_weight_packed")`) is False even on AMX hosts and the
native torch path is chosen there too.

Put on `sys.path` by `patches.sglang_cpu` only when no real `sgl_kernel` is importable.
"""

from __future__ import annotations

IS_SHIM = True


class SglKernelUnavailable(RuntimeError):
    pass


class _MissingOp:
    """Stands in for one `sgl_kernel` name; calling it raises with the op's full name."""

    def __init__(self, qualname: str):
        self.__qualname__ = self.__name__ = qualname

    def __call__(self, *args, **kwargs):
        raise SglKernelUnavailable(
            f"{self.__qualname__} was called, but this process runs SGLang on CPU with the import "
            f"shim from patches/sgl_kernel_shim (no sgl_kernel build for this machine). A code path "
            f"that needs a compiled kernel was taken: use a model/flag combination whose layers "
            f"have a native torch path on CPU, or install a real sgl_kernel."
        )

    def __repr__(self):
        return f"<sgl_kernel shim op {self.__qualname__}>"


# The names SGLang 0.5.23 imports from `sgl_kernel` at module level on the CPU serving path
# (found by serving tiny Qwen3 and Qwen3-MoE with this shim). Anything else stays missing, so
# SGLang's own `try: from sgl_kernel... except ImportError:` fallbacks keep working.
OPS = ("copy_all_layer_kv_cache_cpu", "assign_req_to_token_pool_cpu", "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu", "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu", "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu", )

globals().update({name: _MissingOp(f"sgl_kernel.{name}") for name in OPS})
