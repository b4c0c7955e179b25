"""megatron_rl.vocab_parallel with real gloo processes, TP=4 and TP=2 (two TP groups of a DP=2
layout made by dist.new_group, as Megatron builds them), against float64 full-vocabulary math.

One spawn of 4 processes runs every check and returns the per-rank results; the parent asserts.
The fused Triton kernels (`kernel="triton"`) run here too, under Triton's interpreter: each rank puts
the folder the Makefile installs triton into on its own sys.path (never the parent's; see
requirements/sglang-cpu-extras.txt) with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import megatron_rl.vocab_parallel as vp
from megatron_rl.distributed.spawn import run_distributed

T, V_PAD, VOCAB, K, TAU = 37, 96, 90, 5, 0.8
TRITON_DIR = Path(sys.prefix) / "sglang-cpu-extras"


def inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(1234)
    mu_x = torch.randn(T, V_PAD, generator=g, dtype=torch.float64) * 4 + 30
    pi_x = mu_x + torch.randn(T, V_PAD, generator=g, dtype=torch.float64)
    pi_x[:, VOCAB:] = 1e4  # padding: must never leak into a result
    mu_lsm = torch.log_softmax(mu_x[:, :VOCAB] / TAU, -1)
    sampled = torch.multinomial(mu_lsm.exp(), 1, generator=g)[:, 0]
    topk_lp, topk_ids = mu_lsm.topk(K, -1)
    topk_ids[0, 1] = topk_ids[0, 0]  # duplicate
    topk_ids[1, -1] = -1  # short list
    g_out = torch.randn(T, generator=g, dtype=torch.float64)
    mu_t = mu_lsm.gather(-1, sampled[:, None])[:, 0]
    return pi_x.to(dtype), mu_x.to(dtype), sampled, mu_t, topk_ids, topk_lp, g_out


def _checks(group, tp_rank, tp):
    """Everything one TP rank computes on its shard of the common inputs."""
    pi_x, mu_x, sampled, mu_t, topk_ids, topk_lp, g_out = inputs()
    width = V_PAD // tp
    cols = slice(tp_rank * width, (tp_rank + 1) * width)
    shard = pi_x[:, cols].clone().requires_grad_()
    stats = vp.vocab_parallel_policy_stats(
        shard, sampled, group, rollout_logp=mu_t, topk_ids=topk_ids, topk_logp=topk_lp,
        divergences=vp.DIVERGENCES, with_entropy=True, entropy_grad=True, temperature=TAU,
        vocab_size=VOCAB, chunk_size=8,
    )
    ((stats.logp + 0.1 * stats.entropy) * g_out).sum().backward()
    full = vp.vocab_parallel_full_divergence(
        mu_x[:, cols], pi_x[:, cols], group, temperature=TAU, vocab_size=VOCAB, chunk_size=6
    )
    top = vp.vocab_parallel_topk(pi_x[:, cols], K, group, temperature=TAU, vocab_size=VOCAB)
    f32 = vp.vocab_parallel_policy_stats(
        pi_x[:, cols].float(), sampled, group, rollout_logp=mu_t.float(), topk_ids=topk_ids,
        topk_logp=topk_lp.float(), divergences=vp.DIVERGENCES, with_entropy=True,
        temperature=TAU, vocab_size=VOCAB,
    )
    tri_shard = pi_x[:, cols].clone().requires_grad_()
    tri = vp.vocab_parallel_policy_stats(
        tri_shard, sampled, group, rollout_logp=mu_t, topk_ids=topk_ids, topk_logp=topk_lp,
        divergences=vp.DIVERGENCES, with_entropy=True, entropy_grad=True, temperature=TAU,
        vocab_size=VOCAB, kernel="triton",
    )
    ((tri.logp + 0.1 * tri.entropy) * g_out).sum().backward()
    return {
        "stats": {k: getattr(stats, k).detach() for k in ("logp", "entropy", *vp.DIVERGENCES)},
        "triton": {k: getattr(tri, k).detach() for k in ("logp", "entropy", *vp.DIVERGENCES)},
        "triton_grad": tri_shard.grad,
        "f32": {k: getattr(f32, k) for k in ("logp", "entropy", *vp.DIVERGENCES)},
        "grad": shard.grad,
        "full": full,
        "topk": top,
        "range": vp.vocab_range(width, group),
    }


def all_checks(rank, world_size):
    torch.set_num_threads(1)
    os.environ["TRITON_INTERPRET"] = "1"  # this rank only; set before triton is first imported
    sys.path.insert(0, str(TRITON_DIR))  # for triton only (its torchvision is SGLang's): removed
    try:  # again once triton is imported
        import triton  # noqa: F401
    finally:
        sys.path.remove(str(TRITON_DIR))
    out = {"tp4": _checks(dist.group.WORLD, rank, world_size)}
    # Megatron-style TP=2 groups: ranks {0, 1} and {2, 3}; every rank creates every group.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out["tp2"] = _checks(groups[rank // 2], rank % 2, 2)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(all_checks, 4, timeout=300)


def reference():
    pi_x, mu_x, sampled, mu_t, topk_ids, topk_lp, g_out = inputs()
    x = pi_x.clone().requires_grad_()
    lsm = torch.log_softmax(x[:, :VOCAB] / TAU, -1)
    logp = lsm.gather(-1, sampled[:, None])[:, 0]
    ent = -(lsm.exp() * lsm).sum(-1)
    ((logp + 0.1 * ent) * g_out).sum().backward()
    lsm = lsm.detach()
    p_t, m_t = logp.detach().exp(), mu_t.exp()
    ref = {
        "logp": logp.detach(),
        "entropy": ent.detach(),
        "binary_tv": (m_t - p_t).abs(),
        "binary_kl": m_t * (m_t.log() - p_t.log())
        + (1 - m_t) * ((1 - m_t).log() - (1 - p_t).log()),
    }
    tv, kl = torch.zeros(T, dtype=torch.float64), torch.zeros(T, dtype=torch.float64)
    for t in range(T):
        mu = {int(sampled[t]): math.exp(mu_t[t])}
        for k, i in enumerate(topk_ids[t].tolist()):
            if i >= 0 and i not in mu:
                mu[i] = math.exp(topk_lp[t, k])
        pi = {i: math.exp(lsm[t, i]) for i in mu}
        rm, rp = max(1 - sum(mu.values()), 1e-12), max(1 - sum(pi.values()), 1e-12)
        tv[t] = 0.5 * (sum(abs(mu[i] - pi[i]) for i in mu) + abs(rm - rp))
        kl[t] = sum(mu[i] * math.log(mu[i] / pi[i]) for i in mu) + rm * math.log(rm / rp)
    ref["topk_tv"], ref["topk_kl"] = tv, kl
    mlsm = torch.log_softmax(mu_x[:, :VOCAB] / TAU, -1)
    full = (0.5 * (mlsm.exp() - lsm.exp()).abs().sum(-1), (mlsm.exp() * (mlsm - lsm)).sum(-1))
    return ref, x.grad, full, lsm.topk(K, -1)


def _close(a, b, tol, what):
    err = (a.double() - b.double()).abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3e} > {tol:.0e}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp4", "tp2"])
def test_gloo_matches_float64_reference(results, layout):
    ref, grad, full, (top_lp, top_ids) = reference()
    tp = 4 if layout == "tp4" else 2
    for rank, res in enumerate(results):
        r = res[layout]
        tp_rank = rank % tp
        width = V_PAD // tp
        assert r["range"] == (tp_rank * width, (tp_rank + 1) * width)
        for name, value in ref.items():
            _close(r["stats"][name], value, 1e-10, f"{layout} rank {rank} {name}")
            _close(r["f32"][name], value, 1e-5, f"{layout} rank {rank} fp32 {name}")
            _close(r["triton"][name], value, 1e-10, f"{layout} rank {rank} triton {name}")
        _close(r["grad"], grad[:, tp_rank * width:(tp_rank + 1) * width], 1e-10, "grad")
        _close(r["triton_grad"], grad[:, tp_rank * width:(tp_rank + 1) * width], 1e-10,
               "triton grad")
        _close(r["full"][0], full[0], 1e-10, "full tv")
        _close(r["full"][1], full[1], 1e-10, "full kl")
        _close(r["topk"][0], top_lp, 1e-10, "top-k log-probs")
        assert torch.equal(r["topk"][1], top_ids)


@pytest.mark.slow
def test_gloo_ranks_agree_and_tp_layouts_agree(results):
    for name in ("logp", "entropy", *vp.DIVERGENCES):
        base = results[0]["tp4"]["stats"][name]
        for res in results:
            assert torch.equal(res["tp4"]["stats"][name], base), name  # bitwise across ranks
            _close(res["tp2"]["stats"][name], base, 1e-12, f"tp2 vs tp4 {name}")
