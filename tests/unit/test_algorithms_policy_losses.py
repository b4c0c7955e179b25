"""Policy losses against float64 references written from ALGORITHMS.md, gradients, properties."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_rl.algorithms import get, names
from megatron_rl.algorithms.policy_losses import (
    aspo_entropy_eps,
    atr_bounds,
    lambert_w,
)
from megatron_rl.algorithms.registry import UnknownNameError, register

F64 = torch.float64
CLAMP = 20.0  # documented value-clamp of the log-ratio


# ----------------------------------------------------------------------------- inputs

def make_batch(seed: int, B: int = 5, T: int = 9):
    """Random [B, T] log-probs with edge cases planted: A = 0, ratios far outside any bound,
    μ ≈ 1, μ ≈ 0, a log-ratio beyond the ±20 clamp, an empty sequence, a hole in a mask."""
    g = torch.Generator().manual_seed(seed)
    log_mu = -torch.rand(B, T, generator=g, dtype=F64) * 8.0          # μ ∈ (3e-4, 1]
    log_pi = (log_mu + torch.randn(B, T, generator=g, dtype=F64) * 0.4).clamp(max=0.0)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    adv[0, 0] = 0.0                                   # A = 0
    log_mu[0, 1], log_pi[0, 1] = math.log(1e-6), math.log(0.5)       # r = 5e5, A set below
    adv[0, 1] = 1.3
    log_mu[0, 2], log_pi[0, 2] = math.log(0.5), math.log(1e-6)       # r = 2e-6
    adv[0, 2] = -0.7
    log_mu[1, 0], log_pi[1, 0] = -1e-9, -1e-3                        # μ ≈ 1
    log_mu[1, 1], log_pi[1, 1] = -1e-9, -2e-9                        # μ ≈ 1, π ≈ 1
    log_mu[1, 2], log_pi[1, 2] = math.log(1e-30), math.log(1e-29)    # μ ≈ 0
    log_mu[1, 3], log_pi[1, 3] = math.log(1e-12), 0.0                # log r = 27.6 > clamp
    adv[1, 3] = -2.0
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 5:] = False
    mask[3, 4] = False                                               # hole
    mask[4, :] = False                                               # empty sequence
    log_old = (log_mu + torch.randn(B, T, generator=g, dtype=F64) * 0.1).clamp(max=0.0)
    return log_pi, log_mu, log_old, adv, mask


def run(name, log_pi, log_mu, adv, mask=None, **kw):
    logp = log_pi.clone().requires_grad_(True)
    loss, metrics = get("policy_loss", name)(logp, log_mu, adv, response_mask=mask, **kw)
    grad, = torch.autograd.grad(loss.sum(), logp)
    return loss.detach(), grad, metrics


def ratio(lp, lm):
    return math.exp(min(max(lp - lm, -CLAMP), CLAMP))


def elementwise(ref, log_pi, log_mu, adv, mask):
    """Apply a scalar reference ref(lp, lm, a) -> (value, dloss/dlogp) to every token."""
    val = torch.zeros_like(log_pi)
    grad = torch.zeros_like(log_pi)
    for idx in itertools.product(*(range(n) for n in log_pi.shape)):
        if mask is not None and not mask[idx]:
            continue
        v, g = ref(float(log_pi[idx]), float(log_mu[idx]), float(adv[idx]))
        val[idx], grad[idx] = v, g
    return val, grad


def check(name, ref, seed, kw, mask=True):
    log_pi, log_mu, _, adv, m = make_batch(seed)
    m = m if mask else None
    loss, grad, metrics = run(name, log_pi, log_mu, adv, m, **kw)
    v_ref, g_ref = elementwise(ref, log_pi, log_mu, adv, m)
    torch.testing.assert_close(loss, v_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, g_ref, rtol=1e-10, atol=1e-12)
    if m is not None:
        assert torch.all(grad[~m] == 0) and torch.all(loss[~m] == 0)
        for v in metrics.values():
            assert not v[~m].any()
    return loss, grad, metrics


# ----------------------------------------------------------------------------- references

def ref_pg_is(lp, lm, a):
    r = ratio(lp, lm)
    return -a * r, -a * r


def make_ref_ppo(el, eh, c=None):
    def ref(lp, lm, a):
        r = ratio(lp, lm)
        l1 = -a * r
        l2 = -a * min(max(r, 1 - el), 1 + eh)
        val = max(l1, l2)
        grad = -a * r if l1 >= l2 else 0.0
        if c is not None and a < 0 and -a * c < val:
            val, grad = -a * c, 0.0
        return val, grad
    return ref


def make_ref_dppo_tv(delta, C=math.inf):
    def ref(lp, lm, a):
        pi, mu = math.exp(lp), math.exp(lm)
        D = abs(mu - pi)
        M = 0.0 if (a > 0 and pi > mu and D > delta) or (a < 0 and pi < mu and D > delta) else 1.0
        w = min(ratio(lp, lm), C)
        return -M * a * w, -M * a * w
    return ref


def ref_binary_kl(pi, mu):
    return mu * math.log(mu / pi) + (1 - mu) * math.log((1 - mu) / (1 - pi))


def make_ref_dppo_kl(delta):
    def ref(lp, lm, a):
        pi, mu = math.exp(lp), math.exp(lm)
        if not (0 < pi < 1 and 0 < mu < 1) or abs(pi - mu) < 1e-7:
            D = None          # KL of (near-)degenerate pairs: decided by the implementation's guard
        else:
            D = ref_binary_kl(pi, mu)
        r = ratio(lp, lm)
        if D is None:
            return -a * r, -a * r
        M = 0.0 if (a > 0 and pi > mu and D > delta) or (a < 0 and pi < mu and D > delta) else 1.0
        return -M * a * r, -M * a * r
    return ref


def make_ref_aspo(el, eh, c):
    def ref(lp, lm, a):
        r = ratio(lp, lm)
        if a > 0:
            if r > 1 + eh:
                return 0.0, 0.0
            w = 1.0 / r
        elif a < 0:
            if r < 1 - el:
                return 0.0, 0.0
            w = r
        else:
            return 0.0, 0.0
        if w > c:
            w = c
        return -a * w, -a * w     # gradient of the loss: −A·w·∇log π (weight 1/r for A>0, not −1/r)
    return ref


def make_ref_cispo(el, eh):
    def ref(lp, lm, a):
        r = ratio(lp, lm)
        w = r
        if el is not None:
            w = max(w, 1 - el)
        if eh is not None:
            w = min(w, 1 + eh)
        return -a * w, -a * w
    return ref


# ----------------------------------------------------------------------------- value + grad tests

@pytest.mark.parametrize("seed", [0, 1])
def test_pg_is(seed):
    check("pg_is", ref_pg_is, seed, {})


@pytest.mark.parametrize("kw", [dict(eps_low=0.2, eps_high=0.2), dict(eps_low=0.2, eps_high=0.28),
                                dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0)])
def test_ppo(kw):
    ref = make_ref_ppo(kw["eps_low"], kw["eps_high"], kw.get("dual_clip"))
    _, _, m = check("ppo", ref, 3, kw)
    assert m["masked"].any() and not m["clipped"].any()


def test_ppo_unmasked_inputs_and_bad_dual_clip():
    check("ppo", make_ref_ppo(0.2, 0.2), 4, dict(eps_low=0.2, eps_high=0.2), mask=False)
    log_pi, log_mu, _, adv, _ = make_batch(0)
    with pytest.raises(ValueError, match="dual_clip"):
        get("policy_loss", "ppo")(log_pi, log_mu, adv, dual_clip=0.9)


@pytest.mark.parametrize("kw", [dict(delta=0.15), dict(delta=0.05, truncation=5.0),
                                dict(delta_low=0.02, delta_high=0.3)])
def test_dppo_binary_tv(kw):
    if "delta" in kw:
        ref = make_ref_dppo_tv(kw["delta"], kw.get("truncation", math.inf))
        _, _, m = check("dppo", ref, 5, kw)
        assert m["masked"].any()
        torch.testing.assert_close(m["divergence"][0, 1], torch.tensor(0.5 - 1e-6, dtype=F64))
    else:
        # asymmetric δ: A>0 tokens use δ_high, A<0 tokens δ_low
        log_pi, log_mu, _, adv, mask = make_batch(6)
        _, _, m = run("dppo", log_pi, log_mu, adv, mask, **kw)
        D = (log_pi.exp() - log_mu.exp()).abs()
        up, down = log_pi > log_mu, log_pi < log_mu
        expect = mask & (((adv > 0) & up & (D > 0.3)) | ((adv < 0) & down & (D > 0.02)))
        assert torch.equal(m["masked"], expect)


def test_dppo_binary_kl():
    _, _, m = check("dppo", make_ref_dppo_kl(0.05), 7, dict(divergence_type="binary_kl"))
    assert m["masked"].any()


def test_dppo_given_divergence_anchor_and_errors():
    log_pi, log_mu, log_old, adv, mask = make_batch(8)
    D = torch.rand(log_pi.shape, generator=torch.Generator().manual_seed(1), dtype=F64) * 0.3
    loss, grad, m = run("dppo", log_pi, log_mu, adv, mask, divergence=D, divergence_type="topk_tv")
    up, down = log_pi > log_mu, log_pi < log_mu
    keep = ~(((adv > 0) & up & (D > 0.15)) | ((adv < 0) & down & (D > 0.15)))
    r = (log_pi - log_mu).clamp(-CLAMP, CLAMP).exp()
    torch.testing.assert_close(grad, torch.where(mask & keep, -adv * r, torch.zeros_like(r)))
    # KL divergence types default to δ = 0.05
    _, _, mk = run("dppo", log_pi, log_mu, adv, mask, divergence=D, divergence_type="topk_kl")
    assert torch.equal(mk["masked"], mask & (((adv > 0) & up & (D > 0.05)) | ((adv < 0) & down & (D > 0.05))))
    # anchor = recomputed π_old: ratio and mask move to π_old
    _, grad_old, _ = run("dppo", log_pi, log_mu, adv, mask, old_logp=log_old, anchor="old")
    _, grad_ref = elementwise(make_ref_dppo_tv(0.15), log_pi, log_old, adv, mask)
    torch.testing.assert_close(grad_old, grad_ref)
    with pytest.raises(ValueError, match="vocab_parallel"):
        get("policy_loss", "dppo")(log_pi, log_mu, adv, divergence_type="full_kl")
    with pytest.raises(ValueError, match="binary_tv, binary_kl"):
        get("policy_loss", "dppo")(log_pi, log_mu, adv, divergence_type="tv")
    with pytest.raises(ValueError, match="old_logp"):
        get("policy_loss", "dppo")(log_pi, log_mu, adv, anchor="old")
    with pytest.raises(ValueError, match="'rollout', 'old'"):
        get("policy_loss", "dppo")(log_pi, log_mu, adv, anchor="ref")


@pytest.mark.parametrize("kw", [dict(eps_low=0.2, eps_high=0.2, dual_clip=3.0),
                                dict(eps_low=0.1, eps_high=0.4, dual_clip=1.5)])
def test_aspo(kw):
    _, _, m = check("aspo", make_ref_aspo(kw["eps_low"], kw["eps_high"], kw["dual_clip"]), 9, kw)
    assert m["masked"].any() and m["clipped"].any()


def test_cispo():
    _, _, m = check("cispo", make_ref_cispo(None, 0.2), 10, {})
    assert m["clipped"].any() and not m["masked"].any()
    check("cispo", make_ref_cispo(0.5, 1.0), 11, dict(eps_low=0.5, eps_high=1.0))


def test_atr_equals_ppo_with_bounds_from_bisection():
    def k3_root(delta, lo, hi):
        f = lambda w: w - 1 - math.log(w) - delta
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if (f(lo) > 0) == (f(mid) > 0):
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)
    delta = 0.0231
    l, u = k3_root(delta, 1e-9, 1.0), k3_root(delta, 1.0, 50.0)
    check("atr", make_ref_ppo(1 - l, u - 1), 12, dict(delta=delta))


def test_gspo():
    log_pi, log_mu, _, adv, mask = make_batch(13)
    log_pi = (log_mu + (log_pi - log_mu) * 1e-3)            # GSPO's ε is tiny: keep s near 1
    log_pi[0, :3] = log_mu[0, :3] + 0.5                     # sequence 0: s far outside
    adv = adv[:, :1].expand_as(adv).clone()                 # sequence-level advantages
    adv[0] = 1.0                                           # A > 0 and s > 1+ε_high: clip binds
    adv[2] = -adv[2].abs()
    adv[3] = 0.0                                           # A = 0
    loss, grad, m = run("gspo", log_pi, log_mu, adv, mask)
    v_ref, g_ref = torch.zeros_like(loss), torch.zeros_like(loss)
    for i in range(log_pi.shape[0]):
        idx = [t for t in range(log_pi.shape[1]) if mask[i, t]]
        if not idx:
            continue
        s = math.exp(sum(float(log_pi[i, t] - log_mu[i, t]) for t in idx) / len(idx))
        for t in idx:
            a = float(adv[i, t])
            l1, l2 = -a * s, -a * min(max(s, 1 - 3e-4), 1 + 4e-4)
            v_ref[i, t] = max(l1, l2)
            g_ref[i, t] = -a * s if l1 >= l2 else 0.0
    torch.testing.assert_close(loss, v_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, g_ref, rtol=1e-10, atol=1e-12)
    assert m["masked"][0].all() and not m["masked"][3].any()
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        get("policy_loss", "gspo")(log_pi[0], log_mu[0], adv[0])


def test_all_tokens_masked_gives_zero_loss_and_grad():
    log_pi, log_mu, log_old, adv, _ = make_batch(14)
    none = torch.zeros_like(log_pi, dtype=torch.bool)
    for name in names("policy_loss"):
        loss, grad, metrics = run(name, log_pi, log_mu, adv, none)
        assert torch.all(loss == 0) and torch.all(grad == 0), name
        assert not metrics["masked"].any() and not metrics["clipped"].any(), name


def test_invalid_padding_with_inf_logp_does_not_poison_gradients():
    log_pi, log_mu, _, adv, mask = make_batch(15)
    log_pi = log_pi.masked_fill(~mask, -math.inf)
    for name in names("policy_loss"):
        loss, grad, _ = run(name, log_pi, log_mu, adv, mask)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all(), name
        assert torch.all(grad[~mask] == 0), name


def test_low_precision_inputs_are_upcast():
    log_pi, log_mu, _, adv, mask = make_batch(16)
    lossb, _, _ = run("dppo", log_pi.bfloat16(), log_mu.bfloat16(), adv.bfloat16(), mask)
    assert lossb.dtype == torch.float32


# ----------------------------------------------------------------------------- gradient tests through a model

def _tiny_policy(seed=0, T=6, V=7):
    g = torch.Generator().manual_seed(seed)
    W = (torch.randn(V, 4, generator=g, dtype=F64) * 0.5).requires_grad_(True)
    x = torch.randn(T, 4, generator=g, dtype=F64)
    tokens = torch.randint(0, V, (T,), generator=g)
    return W, x, tokens


def _logp(W, x, tokens):
    return torch.log_softmax(x @ W.T, dim=-1).gather(-1, tokens[:, None])[:, 0]


def _per_token_grad_logp(W, x, tokens):
    """∇_W log π(a_t) for every t, shape [T, *W.shape]."""
    lp = _logp(W, x, tokens)
    return torch.stack([torch.autograd.grad(lp[t], W, retain_graph=True)[0] for t in range(len(tokens))])


def test_gradient_aspo_positive_advantage_is_inverse_ratio_times_grad_logp():
    W, x, tokens = _tiny_policy(1)
    with torch.no_grad():
        lp0 = _logp(W, x, tokens)
    log_mu = lp0 - torch.tensor([0.1, -0.1, 0.05, 0.15, -0.05, 0.0], dtype=F64)  # r ∈ [0.9, 1.16]
    adv = torch.tensor([1.0, 0.5, 2.0, 1.5, 0.3, 0.7], dtype=F64)             # all A > 0
    loss, m = get("policy_loss", "aspo")(_logp(W, x, tokens), log_mu, adv)
    assert not m["masked"].any() and not m["clipped"].any()
    gW, = torch.autograd.grad(loss.sum(), W)
    r = (lp0 - log_mu).exp()
    glp = _per_token_grad_logp(W, x, tokens)
    objective_grad = ((1.0 / r) * adv)[:, None, None] * glp     # ∇ objective = (1/r)·A·∇log π
    torch.testing.assert_close(gW, -objective_grad.sum(0))
    # the sign matters: a differentiable 1/r would give exactly the opposite gradient
    wrong, = torch.autograd.grad((-adv / (_logp(W, x, tokens) - log_mu).exp()).sum(), W)
    torch.testing.assert_close(wrong, objective_grad.sum(0))
    # moving along −gradient (a descent step) raises π(a_t) for A > 0 tokens on average
    assert float((gW * (-objective_grad.sum(0))).sum()) > 0


def test_gradient_ppo_dual_clip_is_zero_where_it_binds():
    W, x, tokens = _tiny_policy(2)
    with torch.no_grad():
        lp0 = _logp(W, x, tokens)
    log_mu = lp0 - torch.tensor([math.log(5.0), math.log(4.0), 0.0, 0.1, math.log(10.0), -0.1], dtype=F64)
    adv = torch.tensor([-1.0, -2.0, -1.0, -0.5, 1.0, 1.0], dtype=F64)
    loss, m = get("policy_loss", "ppo")(_logp(W, x, tokens), log_mu, adv, dual_clip=3.0)
    assert m["masked"].tolist() == [True, True, False, False, True, False]  # dual, dual, -, -, clip, -
    gW, = torch.autograd.grad(loss.sum(), W)
    glp = _per_token_grad_logp(W, x, tokens)
    r = (lp0 - log_mu).exp()
    keep = ~m["masked"]
    expect = -((keep * r * adv)[:, None, None] * glp).sum(0)
    torch.testing.assert_close(gW, expect)
    torch.testing.assert_close(loss[:2], -adv[:2] * 3.0)


@pytest.mark.parametrize("name,kw", [("cispo", dict(eps_high=0.2)), ("dppo", dict(truncation=1.5)),
                                     ("dppo", dict(divergence_type="binary_kl", truncation=2.0))])
def test_gradient_is_truncated_ratio_times_grad_logp_on_kept_tokens(name, kw):
    W, x, tokens = _tiny_policy(3)
    with torch.no_grad():
        lp0 = _logp(W, x, tokens)
    log_mu = lp0 - torch.tensor([0.5, -0.3, 1.2, 0.05, -2.0, 0.3], dtype=F64)
    adv = torch.tensor([1.0, -1.0, -0.5, 2.0, 1.0, 0.0], dtype=F64)
    mask = torch.tensor([True, True, True, True, True, False])
    loss, m = get("policy_loss", name)(_logp(W, x, tokens), log_mu, adv, response_mask=mask, **kw)
    gW, = torch.autograd.grad(loss.sum(), W)
    r = (lp0 - log_mu).exp()
    C = 1.0 + kw["eps_high"] if name == "cispo" else kw["truncation"]
    kept = mask & ~m["masked"]
    expect = -((kept * r.clamp(max=C) * adv)[:, None, None] * _per_token_grad_logp(W, x, tokens)).sum(0)
    torch.testing.assert_close(gW, expect)
    assert m["clipped"].any()


def test_masked_tokens_get_exactly_zero_gradient():
    log_pi, log_mu, _, adv, mask = make_batch(17)
    for name in names("policy_loss"):
        _, grad, m = run(name, log_pi, log_mu, adv, mask)
        assert torch.all(grad[~mask] == 0), name
        assert torch.all(grad[m["masked"]] == 0), name


# ----------------------------------------------------------------------------- properties

finite_logp = st.floats(min_value=-25.0, max_value=0.0, allow_nan=False)


@settings(max_examples=150, deadline=None)
@given(lp=finite_logp, lm=finite_logp, a=st.floats(-3, 3), D=st.floats(0, 2),
       dlo=st.floats(0, 0.5), dhi=st.floats(0, 0.5), div=st.sampled_from(["binary_tv", "binary_kl", "topk_tv"]))
def test_dppo_never_masks_a_move_back_toward_mu(lp, lm, a, D, dlo, dhi, div):
    t = lambda v: torch.tensor([v], dtype=F64)
    divergence = t(D) if div == "topk_tv" else None
    _, m = get("policy_loss", "dppo")(t(lp), t(lm), t(a), divergence=divergence,
                                      divergence_type=div, delta_low=dlo, delta_high=dhi)
    pushes_away = (a > 0 and lp > lm) or (a < 0 and lp < lm)
    if not pushes_away:
        assert not m["masked"].item()


@settings(max_examples=150, deadline=None)
@given(lp=st.floats(-12.0, 0.0), lm=st.floats(-12.0, 0.0), a=st.floats(-3, 3),
       el=st.floats(0.01, 0.9), eh=st.floats(0.01, 2.0))
def test_dppo_mask_with_ratio_divergence_equals_ppo_mask(lp, lm, a, el, eh):
    r = math.exp(lp - lm)
    assume(abs(r - (1 + eh)) > 1e-9 and abs(r - (1 - el)) > 1e-9)   # fp ties on the boundary
    t = lambda v: torch.tensor([v], dtype=F64)
    _, m_ppo = get("policy_loss", "ppo")(t(lp), t(lm), t(a), eps_low=el, eps_high=eh)
    _, m_dppo = get("policy_loss", "dppo")(t(lp), t(lm), t(a), divergence=t(abs(r - 1)),
                                           divergence_type="full_tv", delta_low=el, delta_high=eh)
    assert m_ppo["masked"].item() == m_dppo["masked"].item()


@settings(max_examples=100, deadline=None)
@given(delta=st.floats(1e-4, 3.0))
def test_atr_bounds_satisfy_k3_equals_delta(delta):
    l, u = atr_bounds(delta)
    k3 = lambda w: w - 1 - math.log(w)
    assert 0 < l < 1 < u
    assert u - 1 > 1 - l                       # upper side always looser
    assert k3(l) == pytest.approx(delta, rel=1e-9, abs=1e-13)
    assert k3(u) == pytest.approx(delta, rel=1e-9, abs=1e-13)


def test_atr_bounds_published_values():
    l, u = atr_bounds(0.0231)
    assert (round(l, 3), round(u, 3)) == (0.800, 1.231)
    l, u = atr_bounds(0.01)
    assert (round(l, 3), round(u, 3)) == (0.865, 1.148)
    with pytest.raises(ValueError):
        atr_bounds(0.0)


def test_lambert_w_known_values_and_branches():
    assert lambert_w(1.0) == pytest.approx(0.5671432904097838, abs=1e-15)      # omega constant
    assert lambert_w(math.e) == pytest.approx(1.0, abs=1e-15)
    assert lambert_w(0.0) == 0.0
    assert lambert_w(-0.1, -1) == pytest.approx(-3.577152063957297, abs=1e-13)
    assert lambert_w(-0.1, 0) == pytest.approx(-0.11183255915896297, abs=1e-15)
    assert lambert_w(100.0) == pytest.approx(3.385630140290050, abs=1e-13)
    assert lambert_w(-math.exp(-1), 0) == pytest.approx(-1.0, abs=1e-7)
    for z in (-0.367, -0.3, -0.2, -1e-3, -1e-8):
        for b, side in ((0, 1), (-1, -1)):
            w = lambert_w(z, b)
            assert w * math.exp(w) == pytest.approx(z, rel=1e-12, abs=1e-15)
            assert (w + 1) * side >= 0
    with pytest.raises(ValueError):
        lambert_w(-0.5)
    with pytest.raises(ValueError):
        lambert_w(0.5, -1)


def test_aspo_entropy_eps_top_fraction_per_sequence():
    ent = torch.tensor([[0.1, 0.9, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 5.0],
                        [3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.ones_like(ent, dtype=torch.bool)
    mask[1, 3:] = False
    eps = aspo_entropy_eps(ent, mask)
    # sequence 0: 10 valid tokens, the two highest-entropy ones (0.9 and 5.0) get 0.4
    assert set(torch.nonzero(eps[0] == 0.4).flatten().tolist()) == {1, 9}
    # sequence 1: 3 valid tokens, the 0.8-quantile is 2.6 → only the 3.0 token is high
    assert eps[1].tolist() == [0.4] + [0.2] * 9


# ----------------------------------------------------------------------------- registry

def test_registry_names_and_unknown_name_error():
    assert set(names("policy_loss")) == {"pg_is", "ppo", "dppo", "drpo", "aspo", "atr", "cispo", "cppo", "gspo"}
    with pytest.raises(UnknownNameError, match="valid names: aspo, atr, cispo, cppo, dppo, drpo, gspo, pg_is, ppo"):
        get("policy_loss", "grpo")
    with pytest.raises(UnknownNameError, match="valid kinds"):
        get("loss", "ppo")
    with pytest.raises(ValueError, match="already registered"):
        register("policy_loss", "ppo")(lambda *a, **k: None)
