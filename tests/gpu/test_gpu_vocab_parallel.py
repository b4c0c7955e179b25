"""(c) megatron_rl.vocab_parallel on the device against float64 full-vocabulary math, and the
vocab-parallel benchmark (benchmarks/bench_vocab_parallel.py) at Qwen3's V = 151936.

References never use the module under test: log_softmax / softmax over the whole unpadded
vocabulary in float64, per-token Python sets for the top-K divergences, autograd for gradients.
They take the logits exactly as the module does (bf16 -> float64 is exact), so what remains is the
module's fp32 accumulation over V terms: tolerance 2e-5 up to V = 2048 and 1e-4 at V = 151936
(fp32 unit roundoff 6e-8 times the reduction depth, with margin). Gradients come back in the
logits' dtype: relative to the largest reference gradient, 2e-5 for fp32 and 2^-7 for bf16 (one
rounding of the result to bf16 is 2^-9 relative; margin for its accumulation).

Both kernels of `vocab_parallel_policy_stats` are checked: kernel="torch" and kernel="triton" (the
fused Triton kernels; the GPU image has triton). In the CPU dry run Triton's interpreter runs the
latter (TRITON_INTERPRET=1, with the triton the Makefile keeps off sys.path), at the same tiny
shapes, so the dry run passes only where the kernel ran. Compiled Triton rounds bf16 gradients to
nearest, the interpreter truncates: both within the bf16 tolerance below.

TP = 1 runs the module as the learner does on one GPU (no collective). TP = 2 and 4 split the
vocabulary into shards on the device, one thread per rank, reduced over gloo (which all-reduces
CUDA tensors; NCCL refuses two ranks on one GPU): the shard arithmetic on device memory.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import threading
from datetime import timedelta

import pytest

import gpu_common

K, TAU = 8, 0.8
CASES = {
    # (tokens, padded V, real vocab, chunk)
    "cuda": [(256, 2048, 2000, 128), (64, 151936, 151643, 1024)],
    "cpu": [(24, 64, 61, 8), (8, 2048, 2000, 1024)],
}
_GROUP_IDS = itertools.count()


def _tol(V: int) -> float:
    return 2e-5 if V <= 2048 else 1e-4


def _inputs(T, V, vocab, dtype, device, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    mu_x = torch.randn(T, V, generator=g, dtype=torch.float64) * 4 + 30  # large logits
    pi_x = mu_x + torch.randn(T, V, generator=g, dtype=torch.float64)
    pi_x[:, vocab:] = 1e4  # padding: must never leak into a result
    mu_lsm = torch.log_softmax(mu_x[:, :vocab] / TAU, -1)
    sampled = torch.multinomial(mu_lsm.exp(), 1, generator=g)[:, 0]
    topk_lp, topk_ids = mu_lsm.topk(K, -1)
    mu_t = mu_lsm.gather(-1, sampled[:, None])[:, 0]
    g_out = torch.randn(T, generator=g, dtype=torch.float64)
    pi_x = pi_x.to(dtype)  # what the module sees; the reference upcasts exactly these values
    return [t.to(device) for t in (pi_x, sampled, mu_t, topk_ids, topk_lp, g_out)]


def _reference(pi_x, sampled, mu_t, topk_ids, topk_lp, g_out, vocab):
    import torch

    x = pi_x.double().detach().requires_grad_()
    lsm = torch.log_softmax(x[:, :vocab] / TAU, -1)
    logp = lsm.gather(-1, sampled[:, None])[:, 0]
    ent = -(lsm.exp() * lsm).sum(-1)
    ((logp + 0.1 * ent) * g_out.double()).sum().backward()
    mu, pi = mu_t.double().exp(), logp.detach().exp()
    out = {"logp": logp.detach(), "entropy": ent.detach(), "grad": x.grad,
           "binary_tv": (mu - pi).abs(),
           "binary_kl": mu * (mu.log() - pi.log()) + (1 - mu) * ((1 - mu).log() - (1 - pi).log())}
    lsm_c, T = lsm.detach().cpu(), sampled.shape[0]
    tv, kl = torch.zeros(T, dtype=torch.float64), torch.zeros(T, dtype=torch.float64)
    for t in range(T):  # S = {a_t} ∪ top-K ids, each once, plus the rest bucket
        m = {int(sampled[t]): math.exp(float(mu_t[t]))}
        for k, i in enumerate(topk_ids[t].tolist()):
            m.setdefault(i, math.exp(float(topk_lp[t, k])))
        p = {i: math.exp(float(lsm_c[t, i])) for i in m}
        rm, rp = max(1 - sum(m.values()), 1e-12), max(1 - sum(p.values()), 1e-12)
        tv[t] = 0.5 * (sum(abs(m[i] - p[i]) for i in m) + abs(rm - rp))
        kl[t] = sum(m[i] * (math.log(m[i]) - math.log(p[i])) for i in m) + rm * (math.log(rm) - math.log(rp))
    out.update(topk_tv=tv, topk_kl=kl)
    return out


def _module(shard, sampled, mu_t, topk_ids, topk_lp, g_out, group, vocab, chunk, kernel):
    import megatron_rl.vocab_parallel as vp

    x = shard.detach().clone().requires_grad_()
    s = vp.vocab_parallel_policy_stats(
        x, sampled, group, rollout_logp=mu_t.float(), topk_ids=topk_ids, topk_logp=topk_lp.float(),
        divergences=vp.DIVERGENCES, with_entropy=True, entropy_grad=True, temperature=TAU,
        vocab_size=vocab, chunk_size=chunk, topk_distinct=True, kernel=kernel)
    ((s.logp + 0.1 * s.entropy) * g_out.float()).sum().backward()
    out = {k: getattr(s, k).detach() for k in ("logp", "entropy", *vp.DIVERGENCES)}
    out["grad"] = x.grad
    # The learner's own path for fp32 logits: log-probs only, logits overwritten and reused.
    inplace = shard.detach().float().clone().requires_grad_()
    if kernel == "torch":
        lp = vp.vocab_parallel_log_probs(inplace, sampled, group, temperature=TAU,
                                         vocab_size=vocab, chunk_size=chunk, inplace_logits=True)
    else:  # the gradient written over the logits by the backward kernel
        lp = vp.vocab_parallel_policy_stats(inplace, sampled, group, temperature=TAU,
                                            vocab_size=vocab, inplace_logits=True,
                                            kernel=kernel).logp
    (lp * g_out.float()).sum().backward()
    out["inplace_logp"], out["inplace_grad"] = lp.detach(), inplace.grad
    return out


def _run_tp(tp, pi_x, rest, vocab, chunk, kernel):
    """The module on `tp` vocabulary shards, one thread per rank, gloo reducing device tensors."""
    import torch
    import torch.distributed as dist

    if tp == 1:
        return [_module(pi_x, *rest, None, vocab, chunk, kernel)]
    store, prefix = dist.HashStore(), f"tp{next(_GROUP_IDS)}"
    shards = pi_x.split(pi_x.shape[-1] // tp, dim=-1)
    results, errors = [None] * tp, []

    def rank(r):
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), r, tp, timedelta(seconds=120))
            results[r] = _module(shards[r].contiguous(), *rest, pg, vocab, chunk, kernel)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return results


def _max_err(a, b) -> float:
    import torch

    a, b = a.double().cpu(), b.double().cpu()
    both_inf = torch.isinf(a) & torch.isinf(b) & (a.sign() == b.sign())
    return float(torch.where(both_inf, torch.zeros_like(a), (a - b).abs()).max())


def correctness_worker(device: str) -> dict:
    import torch

    errors = {}
    for (T, V, vocab, chunk), dtype, tp, kernel in itertools.product(
            CASES[device], (torch.float32, torch.bfloat16), (1, 2, 4), KERNELS):
        if tp > 1 and V > 2048 and dtype == torch.bfloat16:
            continue  # the sharding is the same at every V; keep the large case to TP 1 and fp32
        if kernel == "triton" and device == "cpu" and (T, V) != CASES["cpu"][0][:2]:
            continue  # the interpreter costs ~3 ms per row and pass: its first case only here
            # (tests/unit/test_vocab_parallel_triton.py checks it under the interpreter in depth)
        pi_x, *rest = _inputs(T, V, vocab, dtype, torch.device(device))
        ref = _reference(pi_x, *rest, vocab)
        outs = _run_tp(tp, pi_x, rest, vocab, chunk, kernel)
        assert all(o["logp"].device.type == device for o in outs)
        key = f"T{T}_V{V}_{str(dtype).split('.')[-1]}_tp{tp}" + ("" if kernel == "torch" else "_triton")
        e = {}
        for name in ("logp", "entropy", "binary_tv", "binary_kl", "topk_tv", "topk_kl"):
            e[name] = max(_max_err(o[name], ref[name]) for o in outs)
        grad = torch.cat([o["grad"] for o in outs], dim=-1)
        e["grad"] = _max_err(grad, ref["grad"])
        e["grad_tol"] = (2e-5 if dtype == torch.float32 else 2**-7) * float(ref["grad"].abs().max())
        # inplace path: log-probs against the reference; its gradient is that of logp alone
        x = pi_x.double().detach().requires_grad_()
        lp = torch.log_softmax(x[:, :vocab] / TAU, -1).gather(-1, rest[0][:, None])[:, 0]
        (lp * rest[4].double()).sum().backward()
        e["inplace_logp"] = max(_max_err(o["inplace_logp"], lp.detach()) for o in outs)
        e["inplace_grad"] = _max_err(torch.cat([o["inplace_grad"] for o in outs], dim=-1), x.grad)
        e["inplace_grad_tol"] = 2e-5 * float(x.grad.abs().max())  # fp32 copy of the logits
        e["tol"] = _tol(V)
        errors[key] = e
    return errors


KERNELS = ("torch", "triton")
BENCH = {
    "cuda": dict(tokens=4096, vocab=[151936], chunk=1024, k=20, reps=10, pairs=0, naive_max_vocab=10**9,
                 triton=True),
    # 16 tokens: the Triton variants run through the interpreter here, at ~3 ms per row and pass
    "cpu": dict(tokens=16, vocab=[512], chunk=8, k=8, reps=1, pairs=0, naive_max_vocab=10**9, triton=True),
}
TARGET_MS = 3.0  # issue 31: log-prob + entropy + top-K TV fwd+bwd at T = 4096, V = 151936


def worker(device: str) -> dict:
    """The float64 comparisons (no process group: gloo thread-ranks), then the benchmark."""
    sys.path.insert(0, str(gpu_common.REPO))
    from benchmarks import bench_vocab_parallel as bench

    if device == "cpu":  # the dry run: the Triton kernels through Triton's interpreter
        bench.use_triton_interpreter()
    errors = correctness_worker(device)
    gpu_common.start_group()  # Megatron's TP group (size 1) for vocab_parallel_cross_entropy
    res = bench.measure(0, 1, argparse.Namespace(device=device, **BENCH[device]))
    print(bench._fmt_table(res))
    return {"errors": errors, "benchmark": bench.summary(res)}


@pytest.fixture(scope="module")
def results():
    return gpu_common.run_isolated(worker, gpu_common.device(), timeout=480)


def test_log_probs_entropy_divergences_and_grads_match_float64(results):
    errors = results["errors"]
    gpu_common.record("c_vocab_parallel", {"max_abs_error_vs_float64": errors})
    for key, e in errors.items():
        tol = e["tol"]
        for name in ("logp", "entropy", "binary_tv", "binary_kl", "topk_tv", "topk_kl", "inplace_logp"):
            assert e[name] <= tol, (key, name, e[name], tol)
        assert e["grad"] <= e["grad_tol"] and e["inplace_grad"] <= e["inplace_grad_tol"], (key, e)


def test_benchmark_at_qwen3_vocabulary_against_megatron_cross_entropy(results):
    """Absolute ms and peak extra memory of each variant; figures go to the figures file. The
    only assertions: every variant ran, megatron-core's kernel and the Triton kernels among them,
    and the module's memory stays within its documented bound (one [chunk, V] fp32 buffer beyond
    the gradient; the Triton kernels: none). The 3 ms target is recorded, not asserted."""
    out = results["benchmark"]
    (row,) = out["rows"]
    v = row["variants"]
    if "f_triton" in v:
        out["triton_target"] = {"target_ms": TARGET_MS, "f_triton_fwd_bwd_ms": v["f_triton"]["fwd_bwd_ms"],
                                "met": v["f_triton"]["fwd_bwd_ms"] <= TARGET_MS,
                                "measured_on": gpu_common.device()}
    gpu_common.record("c_vocab_parallel", {"benchmark": out})
    assert out["megatron_error"] is None, out["megatron_error"]
    assert out["triton_skipped"] is None, out["triton_skipped"]
    assert row["tp"] == 1 and row["v_local"] == BENCH[gpu_common.device()]["vocab"][0]
    assert {"a", "b", "c", "a_inplace", "c_inplace", "d", "e", "f", "g", "f_bf16", "a_triton", "c_triton",
            "f_triton", "f_triton_inplace", "g_triton", "f_triton_bf16"} <= v.keys(), sorted(v)
    for key in ("a", "b", "c", "a_inplace", "b_inplace", "c_inplace", "e", "f", "f_triton", "f_triton_inplace",
                "g_triton", "f_triton_bf16"):
        assert v[key]["fwd_ms"] > 0 and v[key]["fwd_bwd_ms"] > 0, (key, v[key])
    # The Triton kernels keep no [chunk, V] buffer: beyond the gradient only [T, K]-sized tensors
    # (in place, the gradient is the logits' own storage).
    small = 0.1 * row["buffer_mib"] + 1
    assert v["f_triton"]["peak_extra_fwd_bwd_mib"] <= row["grad_mib"] + small, (v["f_triton"], row)
    assert v["f_triton_inplace"]["peak_extra_fwd_bwd_mib"] <= small, (v["f_triton_inplace"], row)
    assert v["f_triton"]["peak_extra_fwd_mib"] <= small, (v["f_triton"], row)
    # inplace_logits reuses the logits' storage: its extra peak is a small fraction of one buffer
    assert v["a_inplace"]["peak_extra_fwd_bwd_mib"] <= 0.1 * row["buffer_mib"] + 1, v["a_inplace"]
    assert v["c"]["peak_extra_fwd_mib"] <= 1.5 * row["buffer_mib"] + 1, (v["c"], row["buffer_mib"])
