"""Where a training step's time goes: a torch.profiler summary for the figures JSON (test_gpu_throughput).

One profiled `Learner.train_step` after the timed ones. Device time is the CUDA kernels' (on the
CPU dry run: the leaf CPU ops', so the same code runs). Each kernel is put in one category:

  attention  under `SDPAttention.forward` (record_function "attention"), or the backward of an op
             recorded there, or a kernel named like an attention kernel (flash / fmha / cudnn / sdpa)
  experts    under "moe_experts" (TorchMoELayer: grouped GEMMs, activation x probs), its backward
  routing    under "moe_route" / "moe_permute" / "moe_unpermute" (router, top-k, permutation), its backward
  loss       the vocab-parallel log-prob / entropy / NLL functions (`_LogProbsEntropy`,
             `_TritonLogProbsEntropy`, `vocab_parallel_*`), forward and backward
  optimizer  under "optimizer" (the learner's `optimizer.step` and `zero_grad`, wrapped while profiling)
  gemm       any other matrix product (QKV/O and dense MLP projections, the LM head, the router's
             linear): a kernel named like a GEMM (nvjet / gemm / xmma / cutlass) outside the ranges above
  other      everything else (elementwise ops, norms, copies and casts, DDP's gradient accumulation, ...)

A backward kernel has no record_function range of its own (autograd runs it on its own thread); it
takes the category of the forward op whose autograd node launched it (the profiler's sequence
numbers link the two). Each of the longest kernels also names the ops that launched it (`launched_by`:
the launching op and up to three enclosing ops or ranges, ms each, the three largest). Host-side gaps = the profiled step's wall time minus the time the device was
busy (the union of kernel intervals); the profiler's own overhead inflates them, so the unprofiled
median step minus the same busy time is recorded beside them.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

CATEGORIES = ("attention", "experts", "routing", "loss", "optimizer", "gemm", "other")
GEMM_NAMES = ("nvjet", "gemm", "xmma", "cutlass", "cublas", "addmm", "aten::mm", "aten::bmm", "aten::matmul")
RANGES = {"attention": "attention", "moe_experts": "experts", "moe_route": "routing",
          "moe_permute": "routing", "moe_unpermute": "routing", "optimizer": "optimizer", "loss": "loss"}
NAME_RULES = (
    ("loss", ("logprobsentropy", "vocab_parallel", "cross_entropy", "nll_loss")),
    ("attention", ("scaled_dot_product", "flash", "fmha", "cudnn_sdpa", "efficient_attention")),
    ("experts", ("_grouped_mm", "groupedmm", "_stackedparams", "grouped_gemm")),
    ("routing", ("_gatherrows", "_sumrows")),
    ("optimizer", ("optimizer.", "adam", "multi_tensor")),
)
TOP_KERNELS = 15


def _by_name(name: str) -> str | None:
    low = name.lower()
    if low in RANGES:
        return RANGES[low]
    for cat, keys in NAME_RULES:
        if any(k in low for k in keys):
            return cat
    return None


def summarize(prof, wall_s: float, device: str, unprofiled_step_s: float | None = None) -> dict:
    """The summary dict (see the module docstring) of one profiled step."""
    from torch.autograd import DeviceType

    events = prof.events()
    backward_prefix = "autograd::engine::evaluate_function:"

    def ranged(e) -> str | None:
        """The category of the innermost range/op (e or an ancestor) that names one."""
        while e is not None:
            if e.name.startswith(backward_prefix):
                return fwd_category.get(getattr(e, "sequence_nr", -1)) or _by_name(e.name[len(backward_prefix):])
            cat = _by_name(e.name)
            if cat is not None:
                return cat
            e = e.cpu_parent
        return None

    # Forward ops' categories by sequence number, for the backward ops they created.
    fwd_category: dict[int, str] = {}
    for e in events:
        seq = getattr(e, "sequence_nr", -1)
        if (seq is not None and seq >= 0 and e.device_type == DeviceType.CPU
                and not e.name.startswith(backward_prefix) and seq not in fwd_category):
            cat = ranged(e)
            if cat is not None:
                fwd_category[seq] = cat

    per_cat: dict[str, float] = defaultdict(float)  # µs
    # name -> [µs, calls, category, {the launching op and its ancestors: µs}]
    per_kernel: dict[str, list] = defaultdict(lambda: [0.0, 0, None, defaultdict(float)])
    intervals = []
    for e in events:
        if e.device_type != DeviceType.CPU:
            if device == "cuda":
                intervals.append((e.time_range.start, e.time_range.end))
            continue
        if device == "cuda":
            kernels = [(k.name, k.duration) for k in e.kernels]
        else:  # the dry run: leaf CPU ops stand in for kernels
            kernels = [] if e.cpu_children or e.name.startswith(backward_prefix) else [(e.name, e.self_cpu_time_total)]
        if not kernels:
            continue
        op_cat = ranged(e)
        chain = _chain(e)
        for name, us in kernels:
            cat = op_cat or ("gemm" if any(g in name.lower() or g in e.name.lower() for g in GEMM_NAMES)
                             else "other")
            per_cat[cat] += us
            k = per_kernel[name]
            k[0] += us
            k[1] += 1
            k[2] = k[2] or cat
            k[3][chain] += us
    total_us = sum(per_cat.values())
    if device == "cuda" and intervals:
        busy_us = _union(intervals)
    else:
        busy_us = total_us
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    out = {
        "device_time_s": total_us / 1e6,
        "device_busy_s": busy_us / 1e6,
        "profiled_step_wall_s": wall_s,
        "host_gap_s": max(wall_s - busy_us / 1e6, 0.0),
        "share": {c: (per_cat.get(c, 0.0) / total_us if total_us else 0.0) for c in CATEGORIES},
        "top_kernels": [dict(name=n[:160], total_ms=v[0] / 1e3, calls=v[1], category=v[2],
                             share=v[0] / total_us if total_us else 0.0,
                             launched_by={c: t / 1e3 for c, t in sorted(v[3].items(), key=lambda ct: -ct[1])[:3]})
                        for n, v in top],
        "kernel_source": "cuda kernels" if device == "cuda" else "leaf cpu ops (dry run)",
    }
    if unprofiled_step_s is not None:
        out["unprofiled_step_s"] = unprofiled_step_s
        out["host_gap_unprofiled_s"] = max(unprofiled_step_s - busy_us / 1e6, 0.0)
    return out


def _chain(e, depth: int = 4) -> str:
    """The op that launched a kernel and its enclosing ops/ranges, innermost first ("aten::copy_ <
    aten::clone < ..."): which code a kernel comes from (ms per chain in `launched_by`)."""
    names = []
    while e is not None and len(names) < depth:
        names.append(e.name[:60])
        e = e.cpu_parent
    return " < ".join(names)


def _union(intervals) -> float:
    """Total length of the union of [start, end) intervals (kernels on several streams overlap)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


@contextmanager
def optimizer_ranges(optimizer):
    """Wrap `optimizer.step` and `optimizer.zero_grad` in record_function("optimizer") for the block
    (instance attributes; the class is untouched)."""
    import torch

    saved = {}
    for name in ("step", "zero_grad"):
        orig = getattr(optimizer, name)
        saved[name] = orig

        def wrapped(*a, _orig=orig, **k):
            with torch.profiler.record_function("optimizer"):
                return _orig(*a, **k)
        setattr(optimizer, name, wrapped)
    try:
        yield
    finally:
        for name in saved:
            delattr(optimizer, name)  # back to the bound method of the class


def profile_step(step_fn, device: str, unprofiled_step_s: float | None = None) -> dict:
    """Run `step_fn()` once under torch.profiler and summarize it."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step_fn()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    out = summarize(prof, wall, device, unprofiled_step_s)
    out["summary_s"] = time.perf_counter() - t1
    return out
