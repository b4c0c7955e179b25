"""CPPO (ALGORITHMS.md §12) against a per-token float64 Python reference of the paper's rule, the
hand cases of the issue, its reductions to DPPO, and at TP 2 = TP 1 with top-K TV."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rl.algorithms import get
from megatron_rl.algorithms.adapter import compute_policy_loss, reduce_diagnostics
import megatron_rl.vocab_parallel as vp

from test_vocab_parallel import VOCAB, make_logits, ref_logp_full, ref_topk, rollout_from, run_tp

cppo = get("policy_loss", "cppo")
dppo = get("policy_loss", "dppo")


# ---------------------------------------------------------------- the reference: loops over tokens


def ref_keep(D, away, valid, *, delta=0.15, w_min=0.8, delta_b=0.02, horizon="response",
             calibrate=False, q=0.9, mult=2.0):
    """Keep mask per ALGORITHMS.md §12, one response per row, positions from its first valid token."""
    B, S = len(D), len(D[0])
    keep = [[True] * S for _ in range(B)]
    for b in range(B):
        idx = [s for s in range(S) if valid[b][s]]
        if not idx:
            continue
        first, last = idx[0], idx[-1]
        T = last - first + 1 if horizon == "response" else horizon
        rate = delta_b
        if calibrate:
            rate = min(max(float(np.quantile([D[b][s] for s in idx], q)), delta_b), mult * delta_b)
        S_sum = W_sum = 0.0
        for s in idx:
            t = s - first + 1
            w = max(1.0 - (1.0 - w_min) * (t - 1) / max(T - 1, 1), w_min)
            Z = w * D[b][s]
            c = min(delta, delta + (rate * W_sum if W_sum > 0 else 0.0) - S_sum)
            keep[b][s] = (not away[b][s]) or Z <= c
            S_sum += Z
            W_sum += w
    return torch.tensor(keep)


def batch(seed, B=5, S=40, scale=0.25):
    g = torch.Generator().manual_seed(seed)
    mu = torch.log(torch.rand(B, S, generator=g, dtype=torch.float64).clamp(0.02, 0.98))
    pi = (mu + scale * torch.randn(B, S, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    A = torch.randn(B, S, generator=g, dtype=torch.float64)
    A[:, ::7] = 0.0
    valid = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):  # a prompt, a response of varying length, padding; tool tokens inside
        start = 3 + b
        end = S - 2 * b
        valid[b, start:end] = True
        if b % 2:
            valid[b, start + 5:start + 9] = False
    valid[-1] = False  # a row without a response
    return pi, mu, A, valid


# ---------------------------------------------------------------- against the reference


@pytest.mark.parametrize("horizon", ["response", 48, 7])
@pytest.mark.parametrize("calibrate", [False, True])
@pytest.mark.parametrize("divergence_type", ["binary_tv", "binary_kl"])
def test_mask_matches_the_per_token_reference(horizon, calibrate, divergence_type):
    for seed in range(4):
        pi, mu, A, valid = batch(seed)
        delta = 0.1 if divergence_type == "binary_tv" else 0.03
        _, m = cppo(pi, mu, A, response_mask=valid, divergence_type=divergence_type, delta=delta,
                    horizon=horizon, calibrate=calibrate, delta_b=0.02)
        D = get("divergence", divergence_type)(mu, pi)
        away = (A * torch.expm1(pi - mu)) > 0
        keep = ref_keep(D.tolist(), away.tolist(), valid.tolist(), delta=delta, horizon=horizon,
                        calibrate=calibrate)
        assert torch.equal(m["masked"], ~keep & valid)
        assert m["masked"].any() and (m["masked"] != (away & (D > delta) & valid)).any()  # not DPPO's


def test_calibrated_rate_is_the_clamped_quantile_of_each_response():
    pi, mu, A, valid = batch(3, scale=0.6)
    _, m = cppo(pi, mu, A, response_mask=valid, calibrate=True, delta_b=0.02, calibrate_max_mult=5.0)
    D = (pi.exp() - mu.exp()).abs()
    for b in range(valid.shape[0]):
        if not valid[b].any():
            continue
        want = min(max(float(np.quantile(D[b][valid[b]].numpy(), 0.9)), 0.02), 0.1)
        got = m["cppo_delta_b"][b][valid[b]]
        assert torch.allclose(got, torch.full_like(got, want), atol=1e-12)


# ---------------------------------------------------------------- the hand cases


def one(D, A=None, up=True, **kw):
    """A single response whose π(a_t) − μ(a_t) = ±D (binary TV = D); all moves away from μ unless
    `up` says otherwise per token."""
    D = torch.tensor([D], dtype=torch.float64)
    mu = torch.full_like(D, 0.5)
    ups = torch.tensor([up if isinstance(up, list) else [up] * D.shape[1]])
    pi = torch.where(ups, mu + D, mu - D)
    A = torch.ones_like(D) if A is None else torch.tensor([A], dtype=torch.float64)
    logp = pi.log().requires_grad_()
    loss, m = cppo(logp, mu.log(), A, **kw)
    return loss, m, logp


def test_early_drift_spends_the_budget():
    # t1: c = 0.15, Z 0.14 kept; t2: c = 0.15 + 0.02 − 0.14 = 0.03 < 0.14 → masked by the budget;
    # t3 moves toward μ: kept whatever c, and still adds to S; t4: c = 0.15 + 0.06 − 0.42 < 0 → even
    # a small move away is masked; the budget refills at δ_b·w per token until t9.
    D = [0.14, 0.14, 0.14, 0.01] + [0.0] * 5 + [0.01]
    up = [True, True, False, True] + [True] * 6
    _, m, _ = one(D, up=up, w_min=1.0, delta_b=0.02, calibrate=False)
    masked = m["masked"][0].tolist()
    assert masked[:4] == [False, True, False, True]
    c = m["cppo_threshold"][0]
    assert c[3] == pytest.approx(0.15 + 0.02 * 3 - 0.42) and c[3] < 0
    assert m["cppo_budget_masked"][0].tolist() == masked and not m["cppo_token_masked"].any()
    assert m["cppo_negative"][0, 3] and m["cppo_tightened"][0, 1]
    # recovery: at t10 the budget is 0.15 + 0.02·9 − 0.43 = −0.10 ... still closed; with δ_b 0.05 open
    assert masked[9]
    _, m2, _ = one(D, up=up, w_min=1.0, delta_b=0.05, calibrate=False)
    assert not m2["masked"][0, 9] and m2["masked"][0, 1]


def test_late_token_above_delta_is_kept_by_its_position_weight():
    D = [0.0] * 10 + [0.16]  # T = 11: w_11 = 0.8, Z = 0.128 ≤ δ
    _, m, _ = one(D, w_min=0.8, calibrate=False)
    assert not m["masked"].any()
    _, m, _ = one(D, w_min=1.0, calibrate=False)  # unweighted: the token test masks it
    assert m["masked"][0, -1] and m["cppo_token_masked"][0, -1]
    # a fixed horizon longer than the response: the same token weighs more, Z = 0.16·(1 − 0.2·10/99) > δ
    _, m, _ = one(D, w_min=0.8, calibrate=False, horizon=100)
    assert m["masked"][0, -1]
    # past a fixed horizon: w_min
    _, m, _ = one(D, w_min=0.8, calibrate=False, horizon=3)
    assert m["cppo_threshold"][0, -1] == pytest.approx(0.15) and not m["masked"].any()


def test_moves_toward_mu_are_never_masked():
    D = [0.4, 0.45, 0.3, 0.49]
    _, m, _ = one(D, up=False, calibrate=False)  # A > 0, π < μ
    assert not m["masked"].any()
    _, m, _ = one(D, A=[-1.0] * 4, up=True, calibrate=False)  # A < 0, π > μ
    assert not m["masked"].any()
    _, m, _ = one(D, A=[-1.0] * 4, up=False, calibrate=False)
    assert m["masked"].all()


def test_single_token_response_is_tested_at_delta():
    _, m, _ = one([0.16], w_min=0.5, calibrate=False)
    assert m["masked"].all()
    _, m, _ = one([0.15], w_min=0.5, calibrate=False,  # a tie is kept (D given: exp∘log may round)
                  divergence=torch.tensor([[0.15]], dtype=torch.float64))
    assert not m["masked"].any()


def test_padding_and_tool_tokens_keep_positions_but_not_weight():
    # Tool tokens (invalid) at positions 2-3 of the response: excluded from S and W, but position 4
    # has weight w_4, not w_2. A prompt before and padding after change nothing.
    D = torch.tensor([[0.0, 0.0, 0.1, 9.0, 9.0, 0.1, 0.0, 0.0]], dtype=torch.float64)
    valid = torch.tensor([[False, False, True, False, False, True, False, False]])
    mu = torch.full_like(D, 0.01).log()
    pi = torch.where(valid, (mu.exp() + D).log(), torch.full_like(D, -math.inf))
    A = torch.ones_like(D)
    _, m = cppo(pi, mu, A, response_mask=valid, w_min=0.5, delta=0.2, delta_b=0.0, calibrate=False)
    # response = positions 2..5 (T = 4): w = 1, ·, ·, 0.5; S_1 = 0.1; c_4 = min(0.2, 0.2 − 0.1) = 0.1
    assert m["cppo_threshold"][0, 5] == pytest.approx(0.1)
    assert not m["masked"][0, 5]  # Z_4 = 0.05 ≤ 0.1 (w_2 = 0.833 would give 0.083, kept too)
    _, m = cppo(pi, mu, A, response_mask=valid, w_min=0.5, delta=0.2, delta_b=0.0, calibrate=False,
                horizon="response", divergence=torch.where(valid, D, 0.0) * torch.tensor([[1, 1, 1, 1, 1, 1.9, 1, 1]]))
    assert not m["masked"][0, 5]  # Z_4 = 0.095 ≤ 0.1; at w_2 it would be 0.158 > 0.1
    assert torch.isfinite(m["cppo_threshold"]).all() and not m["masked"][~valid].any()


def test_gradient_masked_exactly_zero_kept_as_dppo():
    pi, mu, A, valid = batch(7, scale=0.5)
    lp1 = pi.clone().requires_grad_()
    loss, m = cppo(lp1, mu, A, response_mask=valid, truncation=2.0, delta=0.1, calibrate=False)
    loss.sum().backward()
    lp2 = pi.clone().requires_grad_()
    dloss, _ = dppo(lp2, mu, A, response_mask=valid, truncation=2.0, delta=1e9)  # DPPO keeping all
    dloss.sum().backward()
    masked = m["masked"]
    assert masked.any() and (~masked & valid).any()
    assert (lp1.grad[masked] == 0).all() and (lp1.grad[~valid] == 0).all()
    assert torch.equal(lp1.grad[~masked], lp2.grad[~masked])
    want = -A * torch.exp(pi - mu).clamp(max=2.0)
    assert torch.allclose(lp1.grad[~masked & valid], want[~masked & valid], atol=1e-12)


# ---------------------------------------------------------------- reductions


def test_reduces_to_dppo_with_unit_weights_and_no_budget():
    for seed in range(5):
        pi, mu, A, valid = batch(seed, scale=0.5)
        loss, m = cppo(pi, mu, A, response_mask=valid, w_min=1.0, delta_b=math.inf, calibrate=False)
        dl, dm = dppo(pi, mu, A, response_mask=valid)
        assert dm["masked"].any()
        assert torch.equal(m["masked"], dm["masked"]) and torch.equal(loss, dl)


def test_larger_divergence_keeps_a_subset():
    strict = False
    for seed in range(5):
        pi, mu, A, valid = batch(seed, scale=0.4)
        D = (pi.exp() - mu.exp()).abs()
        bigger = D + torch.rand(D.shape, generator=torch.Generator().manual_seed(seed), dtype=D.dtype) * 0.05
        _, m1 = cppo(pi, mu, A, response_mask=valid, divergence=D, calibrate=False)
        _, m2 = cppo(pi, mu, A, response_mask=valid, divergence=bigger, calibrate=False)
        assert (m2["masked"] | ~m1["masked"]).all()  # kept(2) ⊆ kept(1)
        strict |= bool((m2["masked"] & ~m1["masked"]).any())
    assert strict


def test_bad_arguments_are_named():
    pi, mu, A, valid = batch(0)
    with pytest.raises(ValueError, match="horizon"):
        cppo(pi, mu, A, response_mask=valid, horizon="max")
    with pytest.raises(ValueError, match="w_min"):
        cppo(pi, mu, A, response_mask=valid, w_min=0.0)
    with pytest.raises(ValueError, match="needs the divergence"):
        cppo(pi, mu, A, response_mask=valid, divergence_type="topk_tv")


# ---------------------------------------------------------------- through the adapter


def test_adapter_diagnostics_and_the_recipes_horizon():
    pi, mu, A, valid = batch(11, scale=0.5)
    kwargs = dict(logp=pi, rollout_logp=mu, advantages=A, response_mask=valid, normalizer=valid.sum(),
                  loss_kwargs={"delta": 0.1, "calibrate": False})
    _, stats = compute_policy_loss("cppo", max_response_length=64, **kwargs)
    out = reduce_diagnostics(stats)
    _, m = cppo(pi, mu, A, response_mask=valid, delta=0.1, calibrate=False, horizon=64)
    n = valid.sum().item()
    assert out["masked_frac"] == pytest.approx(m["masked"].sum().item() / n)
    assert out["cppo_budget_masked_frac"] + out["cppo_token_masked_frac"] == pytest.approx(out["masked_frac"])
    assert out["cppo_budget_masked_frac"] > 0 and out["cppo_token_masked_frac"] > 0
    assert out["cppo_threshold/mean"] == pytest.approx(m["cppo_threshold"][valid].mean().item())
    assert out["cppo_delta_b/mean"] == pytest.approx(0.02) and "cppo_tightened_frac/adv_pos" in out
    # the horizon came from max_response_length, not from the batch's width (40)
    _, m40 = cppo(pi, mu, A, response_mask=valid, delta=0.1, calibrate=False, horizon=40)
    assert not torch.equal(m40["cppo_threshold"], m["cppo_threshold"])
    # a subset's diagnostics with the whole response scanned (the trainer's fresh/stale split)
    part = valid.clone()
    part[:, 20:] = False
    _, sub = compute_policy_loss("cppo", max_response_length=64, **{
        **kwargs, "response_mask": part, "loss_kwargs": {**kwargs["loss_kwargs"], "scan_mask": valid}})
    assert reduce_diagnostics(sub)["masked_frac"] == pytest.approx(
        m["masked"][part].sum().item() / part.sum().item())


# ---------------------------------------------------------------- top-K TV across tensor shards


@pytest.mark.parametrize("tp", [2, 4])
def test_topk_tv_at_tp_equals_tp1(tp):
    B, T, K = 3, 10, 5
    mu_x = make_logits(500, T=B * T, scale=2.0)
    pi_x = mu_x + 0.3 * make_logits(600, T=B * T, scale=1.0, offset=0.0)  # top-K TV 0.04-0.19
    sampled, mu_lp, topk_ids, topk_lp, _ = rollout_from(mu_x, K, seed=3)
    missing = ~(topk_ids == sampled[:, None]).any(-1)
    topk_ids[missing, -1], topk_lp[missing, -1] = sampled[missing], mu_lp[missing]
    g = torch.Generator().manual_seed(5)
    A = torch.randn(B, T, generator=g, dtype=torch.float64)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, :2] = False   # prompt
    valid[1, 6:] = False   # padding
    valid[2, 4] = False    # a tool token

    def fn(shard, group, rank):
        x = shard.clone().requires_grad_()
        s = vp.vocab_parallel_policy_stats(
            x, sampled, group, rollout_logp=mu_lp, topk_ids=topk_ids, topk_logp=topk_lp,
            divergences=("topk_tv",), vocab_size=VOCAB, chunk_size=7, topk_distinct=True)
        loss, m = cppo(s.logp.view(B, T), mu_lp.view(B, T), A, divergence=s.topk_tv.view(B, T),
                       divergence_type="topk_tv", delta=0.1, delta_b=0.01, calibrate=True,
                       response_mask=valid)
        loss.sum().backward()
        return loss.detach(), m, x.grad

    one_rank = run_tp(1, fn, pi_x)[0]
    results = run_tp(tp, fn, pi_x)
    for loss, m, _ in results:
        assert torch.equal(m["masked"], one_rank[1]["masked"])
        assert torch.allclose(loss, one_rank[0], atol=1e-12, rtol=1e-10)
    assert one_rank[1]["cppo_budget_masked"].any() and one_rank[1]["cppo_token_masked"].any()
    grads = torch.cat([gr for _, _, gr in results], dim=-1)
    assert torch.allclose(grads, one_rank[2], atol=1e-12, rtol=1e-10)
    # and the TP-exact top-K TV is what the mask was computed from (float64 reference)
    ttv, _ = ref_topk(mu_lp, topk_lp, sampled, topk_ids, ref_logp_full(pi_x, VOCAB))
    pi_lp = ref_logp_full(pi_x, VOCAB).gather(-1, sampled[:, None])[:, 0]
    away = (A * torch.expm1(pi_lp.view(B, T) - mu_lp.view(B, T))) > 0
    keep = ref_keep(ttv.view(B, T).tolist(), away.tolist(), valid.tolist(), delta=0.1, delta_b=0.01,
                    calibrate=True)
    assert torch.equal(one_rank[1]["masked"], ~keep & valid)
