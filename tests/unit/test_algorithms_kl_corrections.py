"""KL-to-reference estimators, entropy bonus, TIS / IcePop and the binary divergences, against
float64 references written from ALGORITHMS.md §1, §3, §4."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algorithms import get
from megatron_rl.algorithms.divergence import binary_kl, binary_tv
from megatron_rl.algorithms.kl import entropy_bonus, kl_penalty_rewards

F64 = torch.float64


def _inputs(seed=0, n=40):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, generator=g, dtype=F64) * 6
    ref = logp + torch.randn(n, generator=g, dtype=F64) * 0.7
    ref[0] = logp[0]                     # identical policies
    ref[1] = logp[1] - 30.0              # log-ratio beyond the ±20 clamp
    ref[2] = logp[2] + 25.0
    return logp, ref


def test_kl_estimators_values_and_gradients():
    logp, ref = _inputs()
    for name in ("k1", "k2", "k3", "low_var_kl", "k1+", "k3+"):
        x = logp.clone().requires_grad_(True)
        val = get("kl", name)(x, ref)
        grad, = torch.autograd.grad(val.sum(), x)
        val = val.detach()
        for i in range(len(logp)):
            d = float(logp[i] - ref[i])                 # log π − log π_ref
            k1, k2 = d, 0.5 * d * d
            log_rho = min(max(-d, -20.0), 20.0)
            k3_raw = math.exp(log_rho) - log_rho - 1
            k3 = min(k3_raw, 10.0)
            # dk3/dlogπ = −ρ + 1 where neither clamp binds, else 0
            g3 = (1 - math.exp(log_rho)) if (abs(d) < 20 and k3_raw < 10) else 0.0
            expect = {"k1": (k1, 1.0), "k2": (k2, d), "k3": (k3, g3), "low_var_kl": (k3, g3),
                      "k1+": (k1, d), "k3+": (k3, d)}[name]
            assert float(val[i]) == pytest.approx(expect[0], rel=1e-12, abs=1e-12), (name, i)
            assert float(grad[i]) == pytest.approx(expect[1], rel=1e-12, abs=1e-12), (name, i)
    assert float(get("kl", "k3")(logp, ref)[0]) == 0.0


def test_kl_penalty_rewards_and_entropy_bonus():
    logp, ref = _inputs(1, 12)
    logp, ref = logp.reshape(3, 4), ref.reshape(3, 4)
    rewards = torch.zeros(3, 4, dtype=F64)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0], dtype=F64)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 2:] = False
    out = kl_penalty_rewards(rewards, logp.requires_grad_(True), ref, coef=0.1, estimator="k1", response_mask=mask)
    assert not out.requires_grad
    expect = torch.where(mask, rewards - 0.1 * (logp.detach() - ref), torch.zeros_like(rewards))
    torch.testing.assert_close(out, expect)
    ent = torch.rand(3, 4, dtype=F64)
    torch.testing.assert_close(entropy_bonus(ent, 0.01), -0.01 * ent)


def test_tis_token_and_sequence():
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(3, 5, generator=g, dtype=F64) * 3
    mu = old + torch.randn(3, 5, generator=g, dtype=F64) * 0.8
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2, :] = False
    w, m = get("correction", "tis")(old, mu, cap=2.0, response_mask=mask)
    for i in range(3):
        for t in range(5):
            rho = math.exp(float(old[i, t] - mu[i, t]))
            assert float(w[i, t]) == pytest.approx(min(rho, 2.0) if mask[i, t] else 0.0, rel=1e-12)
            assert bool(m["clipped"][i, t]) == (bool(mask[i, t]) and rho > 2.0)
    ws, _ = get("correction", "tis")(old, mu, cap=2.0, level="sequence", response_mask=mask)
    for i in range(2):
        rho = math.exp(sum(float(old[i, t] - mu[i, t]) for t in range(5) if mask[i, t]))
        for t in range(5):
            assert float(ws[i, t]) == pytest.approx(min(rho, 2.0) if mask[i, t] else 0.0, rel=1e-12)
    assert torch.all(ws[2] == 0)
    with pytest.raises(ValueError, match="token, sequence"):
        get("correction", "tis")(old, mu, level="batch")


def test_icepop_band():
    old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5, 0.9], dtype=F64))
    rho = torch.tensor([0.49, 0.5, 1.0, 5.0, 5.01, 1.3], dtype=F64)
    mu = old - torch.log(rho)
    w, m = get("correction", "icepop")(old, mu, low=0.5, high=5.0)
    torch.testing.assert_close(w, torch.tensor([0.0, 0.5, 1.0, 5.0, 0.0, 1.3], dtype=F64))
    assert m["masked"].tolist() == [True, False, False, False, True, False]
    ws, ms = get("correction", "icepop")(old[None], mu[None], level="sequence")
    # sequence ρ = Π ρ_t = 0.49·0.5·5·5.01·1.3 ≈ 7.98 > 5: the whole sequence is dropped
    assert torch.all(ws == 0) and ms["masked"].all()


def test_binary_divergences_reference_and_edges():
    pairs = [(1e-4, 1e-2), (0.99, 0.8), (0.5, 0.5), (0.3, 0.6), (1e-30, 1e-29), (1 - 1e-9, 0.2),
             (0.2, 1 - 1e-12)]
    mu = torch.tensor([p[0] for p in pairs], dtype=F64)
    pi = torch.tensor([p[1] for p in pairs], dtype=F64)
    tv = binary_tv(mu.log(), pi.log())
    kl = binary_kl(mu.log(), pi.log())
    for i, (m_, p_) in enumerate(pairs):
        assert float(tv[i]) == pytest.approx(abs(m_ - p_), rel=1e-9, abs=1e-15)
        ref = m_ * math.log(m_ / p_) + (1 - m_) * math.log((1 - m_) / (1 - p_))
        assert float(kl[i]) == pytest.approx(max(ref, 0.0), rel=1e-5, abs=1e-12), pairs[i]
    assert float(kl[2]) == 0.0
    # π → 1 exactly: 1 − π is guarded, the KL stays finite
    assert torch.isfinite(binary_kl(torch.log(torch.tensor([0.5], dtype=F64)), torch.zeros(1, dtype=F64))).all()
    # float32 input stays float32 and agrees
    kl32 = binary_kl(mu.log().float(), pi.log().float())
    assert kl32.dtype == torch.float32
    torch.testing.assert_close(kl32[:4].double(), kl[:4], rtol=1e-4, atol=1e-6)


@settings(max_examples=100, deadline=None)
@given(mu=st.floats(1e-6, 1 - 1e-6), pi=st.floats(1e-6, 1 - 1e-6))
def test_binary_kl_is_nonnegative_and_above_pinsker(mu, pi):
    kl = float(binary_kl(torch.tensor([math.log(mu)], dtype=F64), torch.tensor([math.log(pi)], dtype=F64)))
    assert kl >= 0
    # Pinsker: KL ≥ 2·TV² for the binary partition
    assert kl >= 2 * (mu - pi) ** 2 - 1e-12


def test_binary_divergences_agree_with_the_vocab_parallel_module():
    """The loss library's convenience binary TV/KL and the learner's vocab-parallel ones must give
    the same DPPO mask: same formula, same argument order (μ first)."""
    from megatron_rl.vocab_parallel import divergences as vp

    g = torch.Generator().manual_seed(4)
    mu = -torch.rand(200, generator=g, dtype=F64) * 12
    pi = (mu + torch.randn(200, generator=g, dtype=F64)).clamp(max=0.0)
    mu[:3] = torch.tensor([-1e-12, 0.0, math.log(0.99)], dtype=F64)
    pi[:3] = torch.tensor([-5.0, -1e-3, math.log(0.8)], dtype=F64)
    torch.testing.assert_close(binary_tv(mu, pi), vp.binary_tv(mu, pi), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(binary_kl(mu, pi), vp.binary_kl(mu, pi), rtol=1e-9, atol=1e-12)
    adv = torch.randn(200, generator=g, dtype=F64)
    for kind, fn in (("binary_tv", vp.binary_tv), ("binary_kl", vp.binary_kl)):
        _, own = get("policy_loss", "dppo")(pi, mu, adv, divergence_type=kind)
        _, given_ = get("policy_loss", "dppo")(pi, mu, adv, divergence_type=kind, divergence=fn(mu, pi))
        assert torch.equal(own["masked"], given_["masked"]) and own["masked"].any()
