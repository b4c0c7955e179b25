"""Run SGLang 0.5.23 on CPU: the fixes its CPU mode needs on a machine without CUDA.

Applied only when SGLang runs on CPU, and inside every SGLang process (the HTTP server and the
scheduler / detokenizer children it spawns): `megatron_rl.rollout.launch_server` applies it at
import time, and multiprocessing's spawn re-imports that module in each child before anything
SGLang is unpickled there.

Pieces (each needed to serve a tiny Qwen3 / Qwen3-MoE with `--device cpu`):
- the extras folder (`<venv>/sglang-cpu-extras`, requirements/sglang-cpu-extras.txt) on
  sys.path: triton (imported unconditionally, never run on CPU) and torchvision live there, not
  in site-packages, so the learner's transformers / megatron-core never see them;
- `SGLANG_USE_CPU_ENGINE=1`: without it SGLang's rotary embedding imports vllm on CPU;
- the torchvision guard: `import sglang` imports torchvision, and PyPI's torchvision 0.28.0 is
  built against CUDA torch, so its `_C` extension does not load beside the CPU build of torch
  2.13.0 and `_meta_registrations` fails on `register_fake("torchvision::nms" / "qnms")` (the
  other ops there are guarded upstream by `extension._has_ops()`; those two are not). The guard
  imports torchvision once with those two registrations skipped when the op does not exist;
  torchvision's image ops stay unavailable (SGLang never calls them for text models);
- the `sgl_kernel` import shim (patches/sgl_kernel_shim): SGLang imports `sgl_kernel` names at
  module level, no CPU wheel exists, and without AMX none is ever called; any call raises;
- the routed-experts host buffer (`--enable-return-routed-experts`): `BaseHostCache` allocates
  through `ALLOC_MEMORY_FUNCS[device]`, whose default registers the buffer with
  `cudaHostRegister`, which fails without CUDA. On CPU the buffer already lives in host memory,
  so it is allocated plainly;
- seeded sampling (`--enable-deterministic-inference`, which is what makes SGLang honour each
  request's `sampling_seed`): upstream allows it only with GPU attention backends and switches
  on "batch-invariant mode", which swaps aten matmuls for Triton kernels. On CPU the attention
  backend (`intel_amx` / `torch_native`) is added to the allowed list (SGLang then turns the
  radix cache off itself), and batch-invariant mode is the CPU one below: aten::mm / aten::addmm
  in fixed tiles of 64 rows, because MKL's GEMM rounds a row differently with the number of rows
  in the call (so a sample's log-probs depended on its batch-mates, ~1e-7). Chunked prefill is
  off (`deterministic_server_argv`, which the launcher applies): torch_native attention takes a
  sequence's whole context in one SDPA call, and the CPU kernel rounds a row by the call's length,
  so a prompt split where a crowded prefill batch fills its chunk got prefix rows rounded otherwise
  than unsplit (one sample in ~15,000 of the synchronous-loop golden, an ulp). Sampling uses the
  seeded path (`multinomial_with_seed`), whose hash has a Triton kernel and a `sgl_kernel` CPU
  op only: `murmur_hash32_cpu` is registered here as torch code (the Triton kernel's arithmetic,
  bit for bit), and the sampler's `torch.compile` wrapper is taken off on CPU (Inductor would
  build C++ at the first request of every server). Tested, not assumed: the same seeded requests
  alone and amid others give bit-identical records (tests/e2e/test_sglang_rollout.py), and a
  killed-and-resumed training run matches an uninterrupted one bit for bit
  (tests/e2e/test_trainer.py);
- the children's start method: SGLang starts its scheduler and detokenizer with multiprocessing's
  *spawn* (CUDA cannot be forked), so each child imports SGLang and torch again: 22 of a CPU
  server's 34 CPU seconds to start, and ~11 s of its 26 s wall. On CPU there is no CUDA context, so
  the children are *forked* from the server process, which has imported and patched everything:
  14 CPU seconds and 15 s wall. The server process has run no model op and holds no lock a child
  needs when it forks (the only other thread is the lifeline's sleeping watcher). Set
  `SGLANG_CPU_START_METHOD=spawn` to start them as on a GPU: tests/e2e/test_sglang_rollout.py
  serves the same greedy requests from a spawn-started and a fork-started server and gets identical
  tokens, log-probs and routes, which also proves that the patches reach spawned children the way
  they do on GPUs (launch_server's import-time apply).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from patches._guard import pinned, require_version

SUPPORTED = pinned("sglang")
TORCHVISION_SUPPORTED = ("0.28.0",)
SHIM_DIR = Path(__file__).resolve().parent / "sgl_kernel_shim"
EXTRAS_DIR = Path(sys.prefix) / "sglang-cpu-extras"
_TORCHVISION_UNGUARDED_FAKES = ("torchvision::nms", "torchvision::qnms")
_applied = False


def add_extras_dir() -> None:
    """Put the CPU extras folder (triton, torchvision) on sys.path, after site-packages."""
    if EXTRAS_DIR.is_dir() and str(EXTRAS_DIR) not in sys.path:
        sys.path.append(str(EXTRAS_DIR))
        importlib.invalidate_caches()


def _op_exists(qualname: str) -> bool:
    import torch

    ns, name = qualname.split("::")
    try:
        getattr(getattr(torch.ops, ns), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def guard_torchvision(version: str | None = None) -> bool:
    """Import torchvision with its unguarded fake registrations skipped for missing ops.

    Returns True when torchvision's compiled ops are unavailable (the guard had to act).
    Refuses a torchvision other than the one this guard was written for.
    """
    import torch.library

    require_version("torchvision", TORCHVISION_SUPPORTED, "sglang_cpu.torchvision", version)
    if "torchvision" in sys.modules:
        return not _op_exists("torchvision::nms")
    original = torch.library.register_fake
    skipped = []

    def register_fake(op, *args, **kwargs):
        if isinstance(op, str) and op in _TORCHVISION_UNGUARDED_FAKES and not _op_exists(op):
            skipped.append(op)
            return lambda fn: fn
        return original(op, *args, **kwargs)

    torch.library.register_fake = register_fake
    try:
        import torchvision  # noqa: F401
    finally:
        torch.library.register_fake = original
    return bool(skipped)


def install_sgl_kernel_shim() -> bool:
    """Make `import sgl_kernel` resolve to the shim unless a real build is importable."""
    if "sgl_kernel" in sys.modules:
        return getattr(sys.modules["sgl_kernel"], "IS_SHIM", False)
    if importlib.util.find_spec("sgl_kernel") is not None:
        return False
    sys.path.append(str(SHIM_DIR))
    import sgl_kernel  # noqa: F401

    return True


def plain_host_alloc(dims, dtype, device, pin_memory, allocator=None,
                     registration_granularity_bytes=None):
    """Host buffer for CPU serving: ordinary (unpinned) memory, no cudaHostRegister."""
    import torch

    return torch.empty(dims, dtype=dtype, device="cpu")


def _patch_host_alloc() -> None:
    from sglang.srt.mem_cache.pool_host import common

    common.ALLOC_MEMORY_FUNCS["cpu"] = plain_host_alloc


CPU_ATTENTION_BACKENDS = ("intel_amx", "torch_native")


_M32 = 0xFFFFFFFF


def _rotl32(x, r: int):
    return ((x << r) | (x >> (32 - r))) & _M32


def _murmur3_mix(h, k):
    k = (k * 0xCC9E2D51) & _M32  # int64 products wrap mod 2^64; the low 32 bits are exact
    k = (_rotl32(k, 15) * 0x1B873593) & _M32
    h = _rotl32(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & _M32


def murmur_hash32_cpu(seed, positions, col_indices):
    """[n, m] uint32 MurmurHash3 of (seed_lo, seed_hi, position, column): the arithmetic of
    SGLang's Triton `murmur_hash32_kernel`, in int64 torch ops masked to 32 bits."""
    import torch

    seed = seed.to(torch.int64)[:, None]
    h = _murmur3_mix(torch.zeros_like(seed), seed & _M32)
    h = _murmur3_mix(h, (seed >> 32) & _M32)
    h = _murmur3_mix(h, positions.to(torch.int64)[:, None] & _M32)
    h = _murmur3_mix(h, col_indices.to(torch.int64)[None, :] & _M32)
    h = h ^ 16
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    h = h ^ (h >> 16)
    return h.to(torch.uint32)


_sgl_kernel_lib = None  # keeps the op registration alive


def _register_murmur_op() -> None:
    global _sgl_kernel_lib
    import torch

    if _op_exists("sgl_kernel::murmur_hash32_cpu"):
        return
    _sgl_kernel_lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    _sgl_kernel_lib.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
    _sgl_kernel_lib.impl("murmur_hash32_cpu", murmur_hash32_cpu, "CPU")


# Batch-invariant matrix products on CPU. MKL's GEMM rounds a row differently depending on how many
# rows the call has (blocking and kernel choice follow M; measured: a row's result changes for
# 7+ rows), so a sequence's log-probs depended on which other requests shared its forward batch.
# Every product here is computed in fixed tiles of BATCH_INVARIANT_ROWS rows (the last one padded
# with zeros), so each row always meets the same kernel on the same shapes: its result depends
# on its own values only. Same arithmetic as the untiled call, a Python loop per tile.
BATCH_INVARIANT_ROWS = 64
_batch_invariant_lib = None


def _mm_fixed_tiles(a, b):
    import torch

    M, N = a.shape[0], b.shape[1]
    dtype = torch.promote_types(a.dtype, b.dtype)
    out = torch.empty(M, N, dtype=dtype, device=a.device)
    T = BATCH_INVARIANT_ROWS
    full = M - M % T
    for r in range(0, full, T):
        torch.mm(a[r:r + T], b, out=out[r:r + T])  # aten::mm.out: the original kernel
    if full < M:
        pad = a.new_zeros(T, a.shape[1])
        pad[:M - full] = a[full:]
        tile = torch.empty(T, N, dtype=dtype, device=a.device)
        torch.mm(pad, b, out=tile)
        out[full:] = tile[:M - full]
    return out


def _addmm_fixed_tiles(bias, a, b, *, beta=1, alpha=1):
    out = _mm_fixed_tiles(a, b)
    if alpha != 1:
        out.mul_(alpha)
    if beta == 0:
        return out
    return out.add_(bias if beta == 1 else bias * beta)


def enable_cpu_batch_invariant_mode() -> None:
    """Route aten::mm / aten::addmm on CPU (F.linear, matmul, the LM head) through fixed tiles."""
    global _batch_invariant_lib
    import torch

    if _batch_invariant_lib is not None:
        return
    _batch_invariant_lib = torch.library.Library("aten", "IMPL")
    _batch_invariant_lib.impl("aten::mm", _mm_fixed_tiles, "CPU")
    _batch_invariant_lib.impl("aten::addmm", _addmm_fixed_tiles, "CPU")


CHUNKED_PREFILL_FLAG = "--chunked-prefill-size"
MAX_PREFILL_FLAG = "--max-prefill-tokens"
SMALL_HOST_BYTES = 20 * 2**30  # below it SGLang chunks prefill by 2,048 tokens, else by 4,096 or more


def deterministic_prefill_tokens(memory_bytes: int | None = None) -> int:
    """The prefill batch budget of a deterministic CPU server: the chunk SGLang itself picks for a
    host of this memory (2,048 tokens below 20 GB, else 4,096), so its activation reserve stays
    what it was with chunking on."""
    if memory_bytes is None:
        import psutil

        memory_bytes = psutil.virtual_memory().total
    return 2048 if memory_bytes < SMALL_HOST_BYTES else 4096


_DETERMINISTIC_FLAGS = ("--enable-deterministic-inference", "--rl-on-policy-target")


def deterministic_server_argv(argv: list[str]) -> list[str]:
    """A CPU server's arguments with chunked prefill off where they ask for deterministic inference.

    The fixed tiles make every GEMM's row independent of its batch-mates; attention is the other
    place a row meets them. torch_native computes each sequence's extend in one SDPA call over its
    whole context, and the CPU flash kernel's blocks, vector tails and GEMM row counts follow the
    call's length. A prompt prefilled whole always meets the same call; one split by chunked prefill
    (wherever a prefill batch fills `--chunked-prefill-size`, so only among other requests) has its
    first part's rows computed in a shorter call, rounded differently, and every later row and
    log-prob moves by an ulp. Off, each prompt is one call of its own length; prefill batches are
    then bounded by `--max-prefill-tokens` alone: set, unless given, to the chunk SGLang would have
    used (`deterministic_prefill_tokens`), because SGLang sizes its activation reserve by it when
    chunking is off, and its default (16,384 tokens, a 25 GB reserve) leaves a small host's memory
    negative for the KV cache. A request that does not fit a batch waits for the next instead of
    being split; a prompt above the budget runs alone, whole, beyond the reserve (a CPU server's
    prompts are short).

    A requeued or retracted request (KV exhausted mid-decode) is prefilled again with its tokens so
    far: those rows differ from their decode by the same ulps; deterministic mode promises nothing
    there. An explicit positive chunk size is refused rather than silently changed."""
    from megatron_rl.rollout.placement import flag_value  # no torch at import

    def given(flag: str) -> str | None:
        return "" if argv and argv[-1] == flag else flag_value(argv, (flag,))  # a store_true flag last

    if not any(given(f) is not None for f in _DETERMINISTIC_FLAGS):
        return list(argv)
    size = given(CHUNKED_PREFILL_FLAG)
    out = list(argv) if size is not None else [*argv, CHUNKED_PREFILL_FLAG, "-1"]
    if given(MAX_PREFILL_FLAG) is None:
        out += [MAX_PREFILL_FLAG, str(deterministic_prefill_tokens())]
    if size is not None and (not size.lstrip("-").isdigit() or int(size) > 0):
        raise ValueError(f"{CHUNKED_PREFILL_FLAG} {size} with deterministic inference on CPU: a prompt split "
                         "into chunks is rounded differently from one prefilled whole, so its log-probs would "
                         f"depend on its batch-mates; leave {CHUNKED_PREFILL_FLAG} out (it is then -1, off)")
    return out


def _maybe_enable_cpu_batch_invariant_mode(model_runner) -> None:
    # Upstream's hook swaps in Triton kernels when --enable-deterministic-inference is on.
    from sglang.srt.runtime_context import get_exec

    if get_exec().deterministic.enable_deterministic_inference and str(model_runner.device) == "cpu":
        enable_cpu_batch_invariant_mode()


def _patch_deterministic_sampling() -> None:
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers import sampler
    from sglang.srt.model_executor.model_runner import ModelRunner

    for b in CPU_ATTENTION_BACKENDS:
        if b not in choices.DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
            choices.DETERMINISTIC_ATTENTION_BACKEND_CHOICES.append(b)
    ModelRunner.maybe_enable_batch_invariant_mode = _maybe_enable_cpu_batch_invariant_mode
    _register_murmur_op()
    # The module global is looked up at call time by sampling_from_probs_torch.
    compiled = sampler.multinomial_with_seed
    sampler.multinomial_with_seed = getattr(compiled, "_torchdynamo_orig_callable", compiled)


START_METHOD_ENV = "SGLANG_CPU_START_METHOD"


def children_start_method() -> str:
    method = os.environ.get(START_METHOD_ENV, "fork")
    if method not in ("fork", "spawn"):
        raise ValueError(f"{START_METHOD_ENV}={method!r}: use fork (the CPU default) or spawn (as on GPUs)")
    return method


def _patch_start_method() -> None:
    # SGLang sets spawn in _set_envs_and_config (called by launch_subprocesses, looked up as a module
    # global at call time) and starts its children with the default context right after.
    import multiprocessing as mp

    from sglang.srt.entrypoints import engine

    upstream = engine._set_envs_and_config

    def set_envs_and_config(server_args):
        upstream(server_args)
        method = children_start_method()
        if method != "spawn":
            mp.set_start_method(method, force=True)
        print(f"megatron-rl: SGLang's scheduler and detokenizer start by {method} (CPU)", flush=True)

    engine._set_envs_and_config = set_envs_and_config


def apply(version: str | None = None, torchvision_version: str | None = None) -> None:
    """Install the CPU fixes in this process (idempotent). Refuses an unexpected sglang.

    Call before anything imports sglang (the torchvision guard and the shim must come first).
    """
    global _applied
    add_extras_dir()
    require_version("sglang", SUPPORTED, "sglang_cpu", version)
    require_version("torchvision", TORCHVISION_SUPPORTED, "sglang_cpu.torchvision",
                    torchvision_version)
    if _applied:
        return
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    guard_torchvision()
    install_sgl_kernel_shim()
    _patch_host_alloc()
    _patch_deterministic_sampling()
    _patch_start_method()
    _applied = True
