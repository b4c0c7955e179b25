"""DRPO (ALGORITHMS.md §10) against float64 references: value, gradient weight w, its three regimes
on both advantage signs, the detached form, DPPO's mask as w < 0, and the per-split diagnostics."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms import get
from megatron_rl.algorithms.adapter import compute_policy_loss, global_normalizer, reduce_diagnostics
from megatron_rl.algorithms.diagnostics import SPLITS

from test_algorithms_policy_losses import check, make_batch, ratio

F64 = torch.float64


def make_ref_drpo(delta):
    """J = r·A − |A|/(2δ)·μ·(r−1)², loss −J; d(loss)/d log π = −A·r·(1 − sign(A)·μ(r−1)/δ)."""
    def ref(lp, lm, a):
        r, mu = ratio(lp, lm), math.exp(lm)
        value = -(a * r - abs(a) / (2 * delta) * mu * (r - 1) ** 2)
        w = 1 - math.copysign(1.0, a) * mu * (r - 1) / delta if a != 0 else 1.0
        return value, -a * r * w
    return ref


@pytest.mark.parametrize("delta,seed", [(12.5, 0), (0.15, 1), (0.5, 2)])
def test_drpo_value_and_gradient(delta, seed):
    _, _, m = check("drpo", make_ref_drpo(delta), seed, dict(delta=delta))
    assert not m["masked"].any() and not m["clipped"].any()
    if delta == 0.15:
        assert m["reversed"].any()  # the batch reaches the corrective regime at DPPO's scale


def one(lp, lm, a, delta):
    logp = torch.tensor([math.log(lp)], dtype=F64, requires_grad=True)
    loss, m = get("policy_loss", "drpo")(logp, torch.tensor([math.log(lm)], dtype=F64),
                                         torch.tensor([a], dtype=F64), delta=delta)
    grad, = torch.autograd.grad(loss.sum(), logp)
    return float(m["drpo_w"][0]), bool(m["reversed"][0]), float(grad[0])


@pytest.mark.parametrize("a", [1.5, -0.5])
def test_w_inside_on_and_beyond_dppo_boundary(a):
    """w = 1 − sign(A)(π − μ)/δ: 1 at μ; falls moving with A, 0 exactly at |π − μ| = δ, < 0 beyond;
    > 1 moving against A. The gradient is −A·r·w·∇log π, so it vanishes on the boundary."""
    mu, d, s = 0.4, 0.125, math.copysign(1.0, a)  # δ and μ ± δ exact in binary
    w, rev, g = one(mu, mu, a, d)
    assert w == 1.0 and not rev and g == pytest.approx(-a)
    w, rev, _ = one(mu + s * d / 2, mu, a, d)          # halfway to the boundary
    assert w == pytest.approx(0.5, abs=1e-12) and not rev
    w, rev, g = one(mu + s * d, mu, a, d)              # on it
    assert w == pytest.approx(0.0, abs=1e-12) and abs(g) < 1e-12 and not rev
    w, rev, g = one(mu + s * 2 * d, mu, a, d)          # beyond: corrective, the gradient turns round
    assert w == pytest.approx(-1.0, abs=1e-12) and rev
    r = (mu + s * 2 * d) / mu
    assert g == pytest.approx(a * r, rel=1e-12)        # −A·r·w with w = −1
    w, rev, _ = one(mu - s * d, mu, a, d)              # against the advantage: w > 1
    assert w == pytest.approx(2.0, abs=1e-12) and not rev


def test_quadratic_form_and_detached_form_have_the_same_gradient():
    log_pi, log_mu, _, adv, mask = make_batch(5)
    logp = log_pi.clone().requires_grad_(True)
    loss, m = get("policy_loss", "drpo")(logp, log_mu, adv, response_mask=mask, delta=0.2)
    g_quad, = torch.autograd.grad(loss.sum(), logp)
    logp2 = log_pi.clone().requires_grad_(True)
    r = m["ratio"]
    detached = -(adv * r * m["drpo_w"]).detach() * torch.where(mask, logp2, 0.0)
    g_det, = torch.autograd.grad(detached.sum(), logp2)
    torch.testing.assert_close(g_quad, g_det, rtol=1e-12, atol=1e-14)


def test_dppo_mask_is_w_below_zero():
    """At the same δ, DPPO binary-TV masks exactly the tokens where DRPO's w < 0 (a move away from μ
    in the advantage's direction by more than δ); moves back toward μ are never masked, w > 1."""
    g = torch.Generator().manual_seed(3)
    log_mu = -torch.rand(4000, generator=g, dtype=F64) * 3
    log_pi = (log_mu + torch.randn(4000, generator=g, dtype=F64) * 0.5).clamp(max=0)
    adv = torch.randn(4000, generator=g, dtype=F64)
    _, d = get("policy_loss", "dppo")(log_pi, log_mu, adv, divergence_type="binary_tv", delta=0.15)
    _, r = get("policy_loss", "drpo")(log_pi, log_mu, adv, delta=0.15)
    assert d["masked"].any() and torch.equal(d["masked"], r["reversed"])


def test_diagnostics_report_reversed_fraction_and_mean_w_per_split():
    log_pi, log_mu, _, adv, mask = make_batch(7, B=6, T=40)
    N = global_normalizer(mask, "token-mean")
    _, stats = compute_policy_loss("drpo", logp=log_pi, rollout_logp=log_mu, advantages=adv,
                                   response_mask=mask, normalizer=N, loss_kwargs={"delta": 0.15})
    out = reduce_diagnostics(stats)
    _, m = get("policy_loss", "drpo")(log_pi, log_mu, adv, response_mask=mask, delta=0.15)
    mu = log_mu.exp()
    sel = {"all": mask, "adv_pos": mask & (adv > 0), "adv_neg": mask & (adv < 0),
           "mu_gt_0.9": mask & (mu > 0.9), "adv_neg/mu_lt_0.1": mask & (adv < 0) & (mu < 0.1)}
    for split, s in sel.items():
        suffix = "" if split == "all" else f"/{split}"
        n = max(int(s.sum()), 1)
        assert out[f"reversed_frac{suffix}"] == pytest.approx(float(m["reversed"][s].sum()) / n, abs=1e-12)
        assert out[f"drpo_w/mean{suffix}"] == pytest.approx(float(m["drpo_w"][s].sum()) / n, abs=1e-12)
    assert out["reversed_frac"] > 0 and out["masked_frac"] == 0
    assert all(f"reversed_frac/{s}" in out for s in SPLITS if s != "all")
    # Losses without their own statistics report none.
    _, stats = compute_policy_loss("dppo", logp=log_pi, rollout_logp=log_mu, advantages=adv,
                                   response_mask=mask, normalizer=N)
    assert not any(k.startswith(("reversed", "drpo_w")) for k in reduce_diagnostics(stats))


def test_delta_must_be_positive():
    x = torch.zeros(3, dtype=F64)
    with pytest.raises(ValueError, match="delta > 0"):
        get("policy_loss", "drpo")(x, x, x, delta=0.0)
