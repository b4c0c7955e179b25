"""Aggregation modes, the adapter and the diagnostics: references from ALGORITHMS.md §6, and
invariance of the step loss (and its gradient and diagnostics) to micro-batch and data-parallel
splitting — the latter on a real 2-process gloo group (one spawn for this module)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algorithms import get
from megatron_rl.algorithms.adapter import compute_policy_loss, global_normalizer, reduce_diagnostics
from megatron_rl.algorithms.aggregation import AGG_MODES, aggregate, local_count
from megatron_rl.algorithms.diagnostics import collect
from megatron_rl.distributed.spawn import run_distributed

F64 = torch.float64
L_CONST = 7


def ref_aggregate(loss, mask, mode):
    """Full-batch formula: sums over valid tokens; B = sequences with ≥ 1 valid token."""
    rows = [[float(loss[i, t]) for t in range(loss.shape[1]) if mask[i, t]] for i in range(loss.shape[0])]
    rows = [r for r in rows if r]
    if not rows:
        return 0.0
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / len(rows) / L_CONST


def random_batch(seed, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[1] = False
    loss[~mask] = torch.nan            # padding garbage must not leak
    return loss, mask


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_matches_reference(mode):
    loss, mask = random_batch(0)
    out = aggregate(loss, mask, mode, normalizer=local_count(mask, mode), max_response_length=L_CONST)
    assert float(out) == pytest.approx(ref_aggregate(loss, mask, mode), rel=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_all_masked_is_zero_with_zero_gradient(mode):
    loss = torch.randn(3, 4, dtype=F64, requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    out = aggregate(loss, mask, mode, normalizer=local_count(mask, mode), max_response_length=L_CONST)
    out.backward()
    assert float(out.detach()) == 0.0 and torch.all(loss.grad == 0)


def test_aggregation_errors():
    loss, mask = random_batch(1)
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum"):
        aggregate(loss, mask, "mean", normalizer=1)
    with pytest.raises(ValueError, match="max_response_length"):
        aggregate(loss, mask, "seq-mean-token-sum-norm", normalizer=1)
    with pytest.raises(ValueError, match="shape"):
        aggregate(loss, mask[:, :2], "token-mean", normalizer=1)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), B=st.integers(1, 8), T=st.integers(1, 6), mode=st.sampled_from(AGG_MODES),
       seed=st.integers(0, 2**16))
def test_aggregation_invariant_to_micro_batch_and_shard_splitting(data, B, T, mode, seed):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) < data.draw(st.floats(0.0, 1.0))
    cuts = sorted(data.draw(st.lists(st.integers(0, B), max_size=4)))
    bounds = [0] + cuts + [B]
    pieces = [(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    N = global_normalizer([mask[a:b] for a, b in pieces], mode)
    split = sum(float(aggregate(loss[a:b], mask[a:b], mode, normalizer=N, max_response_length=L_CONST))
                for a, b in pieces)
    full = aggregate(loss, mask, mode, normalizer=local_count(mask, mode), max_response_length=L_CONST)
    assert split == pytest.approx(float(full), rel=1e-12, abs=1e-15)
    assert split == pytest.approx(ref_aggregate(loss, mask, mode), rel=1e-12, abs=1e-15)


# ----------------------------------------------------------------------------- diagnostics

def test_diagnostics_fractions_by_sign_and_bucket():
    mu = torch.tensor([0.01, 0.05, 0.5, 0.5, 0.95, 0.99, 0.02, 0.5], dtype=F64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 0.0, 1.0], dtype=F64)
    masked = torch.tensor([True, False, False, True, False, True, False, True])
    clipped = torch.tensor([False, True, False, False, False, False, False, False])
    valid = torch.tensor([True, True, True, True, True, True, True, False])
    ratio = torch.tensor([100.0, 0.5, 1.0, 0.9, 1.01, 0.8, 1.0, 7.0], dtype=F64)
    div = torch.tensor([0.01, 0.02, 0.1, 0.2, 0.05, 0.19, 0.0, 9.0], dtype=F64)
    logp = torch.log(mu * ratio)
    ent = torch.arange(8, dtype=F64)
    st_ = collect(response_mask=valid, advantages=adv, rollout_logp=mu.log(), logp=logp, masked=masked,
                  clipped=clipped, ratio=ratio, divergence=div, entropy=ent)
    m = st_.finalize()
    v = valid.tolist()

    def frac(ind, sel):
        idx = [i for i in range(8) if v[i] and sel(i)]
        return sum(bool(ind[i]) for i in idx) / len(idx) if idx else 0.0

    pos = lambda i: adv[i] > 0
    neg = lambda i: adv[i] < 0
    lo = lambda i: mu[i] < 0.1
    mid = lambda i: 0.1 <= mu[i] <= 0.9
    hi = lambda i: mu[i] > 0.9
    expect = {
        "masked_frac": frac(masked, lambda i: True), "clipped_frac": frac(clipped, lambda i: True),
        "masked_frac/adv_pos": frac(masked, pos), "masked_frac/adv_neg": frac(masked, neg),
        "masked_frac/mu_lt_0.1": frac(masked, lo), "masked_frac/mu_0.1_0.9": frac(masked, mid),
        "masked_frac/mu_gt_0.9": frac(masked, hi),
        "masked_frac/adv_pos/mu_lt_0.1": frac(masked, lambda i: pos(i) and lo(i)),
        "masked_frac/adv_neg/mu_gt_0.9": frac(masked, lambda i: neg(i) and hi(i)),
        "masked_frac/adv_pos/mu_gt_0.9": frac(masked, lambda i: pos(i) and hi(i)),
        "clipped_frac/adv_neg/mu_lt_0.1": frac(clipped, lambda i: neg(i) and lo(i)),
        "token_frac/mu_lt_0.1": 3 / 7, "tokens": 7.0,
        "divergence/mean": sum(div[:7].tolist()) / 7, "divergence/max": 0.2,
        "entropy/mean": sum(range(7)) / 7,
        "abs_logp_diff/mean": sum(abs(math.log(r)) for r in ratio[:7].tolist()) / 7,
        "ratio/max": 100.0, "ratio/min": 0.5, "ratio/p50": 1.0,
    }
    for k, val in expect.items():
        assert float(m[k]) == pytest.approx(val, rel=1e-12, abs=1e-12), k
    # sorted valid ratios [0.5, 0.8, 0.9, 1, 1, 1.01, 100]: p95 at position 5.7
    assert float(m["ratio/p95"]) == pytest.approx(1.01 + 0.7 * (100 - 1.01))
    assert "abs_old_logp_diff/mean" not in m
    # merging two halves equals collecting everything at once (additive statistics)
    halves = [collect(response_mask=valid[s], advantages=adv[s], rollout_logp=mu.log()[s], logp=logp[s],
                      masked=masked[s], clipped=clipped[s], ratio=ratio[s], divergence=div[s], entropy=ent[s])
              for s in (slice(0, 3), slice(3, 8))]
    merged = halves[0].merge(halves[1]).finalize()
    assert merged.keys() == m.keys()
    for k in m:
        assert float(merged[k]) == pytest.approx(float(m[k]), rel=1e-12, abs=1e-12), k


def test_diagnostics_all_masked_reports_zeros():
    z = torch.zeros(2, 3, dtype=F64)
    none = torch.zeros(2, 3, dtype=torch.bool)
    m = collect(response_mask=none, advantages=z, rollout_logp=z, logp=z, masked=none, clipped=none,
                ratio=z + 1).finalize()
    assert all(math.isfinite(float(v)) for v in m.values())
    assert float(m["tokens"]) == 0 and float(m["masked_frac"]) == 0 and float(m["ratio/p50"]) == 0


# ----------------------------------------------------------------------------- adapter

def adapter_batch(seed=0, B=7, T=5):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g, dtype=F64) * 5
    logp = (rollout + torch.randn(B, T, generator=g, dtype=F64) * 0.5).clamp(max=0.0)
    logp[0, 0], rollout[0, 0] = math.log(0.8), math.log(0.99)          # dominant token falls
    logp[2, 1], rollout[2, 1] = math.log(1e-2), math.log(1e-4)          # rare token rises
    old = (rollout + torch.randn(B, T, generator=g, dtype=F64) * 0.2).clamp(max=0.0)
    ref = (rollout + torch.randn(B, T, generator=g, dtype=F64) * 0.3).clamp(max=0.0)
    adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T).clone()
    adv[0], adv[2] = -1.0, 1.0
    ent = torch.rand(B, T, generator=g, dtype=F64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[3, 2:] = False
    mask[5] = False                                                      # empty sequence
    mask[6, 1] = False
    logp = logp.masked_fill(~mask, -math.inf)                            # garbage padding
    return dict(logp=logp, rollout_logp=rollout, old_logp=old, ref_logp=ref, advantages=adv,
                entropy=ent, response_mask=mask)


ADAPTER_KW = dict(kl_coef=0.01, kl_estimator="k3", entropy_coef=0.001, correction="tis",
                  correction_kwargs={"cap": 2.0}, loss_kwargs={"truncation": 5.0})


def run_adapter(batch, rows, mode, normalizer):
    logp = batch["logp"][rows].clone().requires_grad_(True)
    ent = batch["entropy"][rows].clone().requires_grad_(True)
    sub = {k: v[rows] for k, v in batch.items() if k not in ("logp", "entropy")}
    loss, stats = compute_policy_loss("dppo", logp=logp, entropy=ent, normalizer=normalizer, agg_mode=mode,
                                      max_response_length=L_CONST, **sub, **ADAPTER_KW)
    loss.backward()
    return loss.detach(), logp.grad, ent.grad, stats


def test_adapter_matches_manual_composition():
    b = adapter_batch()
    mask = b["response_mask"]
    mode = "token-mean"
    N = global_normalizer(mask, mode)
    assert int(N) == int(mask.sum())
    loss, glogp, gent, stats = run_adapter(b, slice(None), mode, N)
    # manual: same pieces, composed by hand from the pure functions
    clean = lambda x: torch.where(mask, x, torch.zeros_like(x))
    lp = clean(b["logp"]).requires_grad_(True)
    pg, _ = get("policy_loss", "dppo")(lp, b["rollout_logp"], b["advantages"], response_mask=mask, truncation=5.0)
    w, _ = get("correction", "tis")(b["old_logp"], b["rollout_logp"], cap=2.0, response_mask=mask)
    kl = get("kl", "k3")(lp, clean(b["ref_logp"]))
    per_tok = pg * w + 0.01 * kl - 0.001 * b["entropy"]
    manual = torch.where(mask, per_tok, torch.zeros_like(per_tok)).sum() / mask.sum()
    manual.backward()
    assert float(loss) == pytest.approx(float(manual.detach()), rel=1e-12)
    assert torch.all(glogp[~mask] == 0) and torch.isfinite(glogp).all()
    torch.testing.assert_close(glogp, torch.where(mask, lp.grad, torch.zeros_like(lp.grad)))
    torch.testing.assert_close(gent, torch.where(mask, torch.full_like(gent, -0.001 / mask.sum()), torch.zeros_like(gent)))
    m = reduce_diagnostics(stats)
    assert float(m["loss/total"]) == pytest.approx(float(manual.detach()), rel=1e-12)
    assert float(m["loss/total"]) == pytest.approx(
        float(m["loss/pg"]) + 0.01 * float(m["loss/kl"]) - 0.001 * float(m["loss/entropy"]), rel=1e-12)
    # the dominant token falling under A<0 is masked by DPPO; the rare rising token is not
    assert float(m["masked_frac/adv_neg/mu_gt_0.9"]) == 1.0
    assert float(m["masked_frac/adv_pos/mu_lt_0.1"]) == 0.0
    assert "abs_old_logp_diff/mean" in m and "correction_clipped_frac" in m
    with pytest.raises(ValueError, match="old_logp"):
        compute_policy_loss("ppo", logp=b["logp"], rollout_logp=b["rollout_logp"], advantages=b["advantages"],
                            response_mask=mask, normalizer=N, correction="icepop")
    with pytest.raises(ValueError, match="ref_logp"):
        compute_policy_loss("ppo", logp=b["logp"], rollout_logp=b["rollout_logp"], advantages=b["advantages"],
                            response_mask=mask, normalizer=N, kl_coef=0.1)


def test_adapter_passes_divergence_only_to_losses_that_take_it():
    b = adapter_batch(1)
    mask = b["response_mask"]
    D = torch.full(mask.shape, 0.5, dtype=F64)                 # "top-K TV" from elsewhere: all large
    common = dict(logp=b["logp"], rollout_logp=b["rollout_logp"], advantages=b["advantages"],
                  response_mask=mask, normalizer=global_normalizer(mask, "token-mean"))
    _, st_d = compute_policy_loss("dppo", divergence=D, loss_kwargs={"divergence_type": "topk_tv"}, **common)
    _, st_p = compute_policy_loss("ppo", divergence=D, **common)
    md, mp = reduce_diagnostics(st_d), reduce_diagnostics(st_p)
    assert float(md["divergence/mean"]) == pytest.approx(0.5) and float(mp["divergence/max"]) == 0.5
    up = (b["logp"] > b["rollout_logp"]) & mask
    pushes = ((b["advantages"] > 0) & up) | ((b["advantages"] < 0) & ~up & mask & (b["logp"] < b["rollout_logp"]))
    assert float(md["masked_frac"]) == pytest.approx(float((pushes & mask).sum() / mask.sum()))


# ----------------------------------------------------------------------------- data parallel (one spawn)

def _dp_worker(rank, world_size, batch, shards, micro_splits):
    import torch.distributed as dist

    group = dist.group.WORLD
    lo, hi = shards[rank]
    out = {}
    for mode in AGG_MODES:
        micro = [(lo + a, lo + b) for a, b in micro_splits[rank]]
        N = global_normalizer([batch["response_mask"][a:b] for a, b in micro], mode, dp_group=group)
        total, grads, stats = 0.0, [], None
        for a, b in micro:
            loss, g, _, st_ = run_adapter(batch, slice(a, b), mode, N)
            total += float(loss)
            grads.append(g)
            stats = st_ if stats is None else stats.merge(st_)
        out[mode] = (int(N), total, torch.cat(grads), reduce_diagnostics(stats, dp_group=group))
    return out


@pytest.mark.slow
def test_loss_gradient_and_diagnostics_invariant_to_dp_and_micro_batch_layout():
    batch = adapter_batch(2, B=7)
    shards = [(0, 3), (3, 7)]
    micro_splits = [[(0, 1), (1, 3)], [(0, 2), (2, 3), (3, 4)]]
    results = run_distributed(_dp_worker, 2, batch, shards, micro_splits)
    for mode in AGG_MODES:
        N_full = global_normalizer(batch["response_mask"], mode)
        full_loss, full_grad, _, full_stats = run_adapter(batch, slice(None), mode, N_full)
        full_m = reduce_diagnostics(full_stats)
        assert all(r[mode][0] == int(N_full) for r in results), mode
        split_loss = sum(r[mode][1] for r in results)
        assert split_loss == pytest.approx(float(full_loss), rel=1e-12, abs=1e-15), mode
        torch.testing.assert_close(torch.cat([r[mode][2] for r in results]), full_grad, rtol=1e-12, atol=1e-15)
        for rank_metrics in (r[mode][3] for r in results):
            assert rank_metrics.keys() == full_m.keys()
            for k, v in full_m.items():
                if k in ("ratio/p05", "ratio/p50", "ratio/p95"):
                    continue          # quantiles are per-rank by design (documented)
                assert float(rank_metrics[k]) == pytest.approx(float(v), rel=1e-12, abs=1e-15), (mode, k)
