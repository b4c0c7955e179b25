"""Advantage estimators, whitening and the DAPO pieces against float64 references written from
ALGORITHMS.md §5 and §7."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megatron_rl.algorithms import get
from megatron_rl.algorithms.advantages import whiten
from megatron_rl.algorithms.dapo import (
    dynamic_sampling_keep,
    overlong_filter_mask,
    overlong_soft_punishment,
)

F64 = torch.float64


def outcome_batch():
    """7 samples: group 10 (3 samples), group 4 (2, equal rewards), group 7 (1: singleton),
    group 2 (1 sample with an empty response). Outcome reward on the last valid token."""
    R = [1.0, 0.0, 0.5, 1.0, 1.0, 0.3, 0.0]
    groups = [10, 10, 10, 4, 4, 7, 2]
    lengths = [4, 2, 3, 1, 4, 2, 0]
    B, T = len(R), 4
    rewards = torch.zeros(B, T, dtype=F64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
        if n:
            rewards[i, n - 1] = R[i]
    return R, groups, lengths, rewards, mask, torch.tensor(groups)


def _by_group(R, groups):
    out = {}
    for r, g in zip(R, groups):
        out.setdefault(g, []).append(r)
    return out


def _ref_whiten(vals):
    m = sum(vals) / len(vals)
    var = sum((v - m) ** 2 for v in vals) / (len(vals) - 1)
    return [(v - m) / math.sqrt(var + 1e-8) for v in vals]


def _expect_broadcast(adv_per_sample, lengths, T):
    out = torch.zeros(len(lengths), T, dtype=F64)
    for i, n in enumerate(lengths):
        out[i, :n] = adv_per_sample[i]
    return out


@pytest.mark.parametrize("name", ["grpo", "grpo_nostd", "dr_grpo", "rloo"])
def test_group_estimators(name):
    R, groups, lengths, rewards, mask, gid = outcome_batch()
    # the empty response's reward sits nowhere: R = 0 for it
    R = [r if n else 0.0 for r, n in zip(R, lengths)]
    grp = _by_group(R, groups)
    ref = []
    for r, g in zip(R, groups):
        vals = grp[g]
        if len(vals) == 1:
            ref.append(0.0)
            continue
        mean = sum(vals) / len(vals)
        if name == "grpo":
            ref.append((r - mean) / (statistics.stdev(vals) + 1e-6))
        elif name in ("grpo_nostd", "dr_grpo"):
            ref.append(r - mean)
        else:
            others = list(vals)
            others.remove(r)
            ref.append(r - sum(others) / len(others))
    kw = {"norm_by_std": False} if name == "grpo_nostd" else {}
    fn = get("advantage", "grpo" if name == "grpo_nostd" else name)
    adv, ret = fn(rewards, mask, group_ids_B=gid, **kw)
    expect = _expect_broadcast(ref, lengths, 4)
    torch.testing.assert_close(adv, expect, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, adv)
    assert torch.all(adv[~mask] == 0)
    with pytest.raises(ValueError, match="group_ids_B"):
        fn(rewards, mask)


def test_grpo_batch_whitening_option():
    R, groups, lengths, rewards, mask, gid = outcome_batch()
    adv, _ = get("advantage", "dr_grpo")(rewards, mask, group_ids_B=gid)
    adv_w, _ = get("advantage", "dr_grpo")(rewards, mask, group_ids_B=gid, whiten=True)
    vals = [float(v) for v in adv[mask]]
    torch.testing.assert_close(adv_w[mask], torch.tensor(_ref_whiten(vals), dtype=F64))


def test_reinforce_pp_discounted_return_whitened():
    gamma = 0.9
    rewards = torch.tensor([[0.0, 0.1, 0.0, 1.0], [0.2, -0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    adv, ret = get("advantage", "reinforce_pp")(rewards, mask, gamma=gamma)
    G = torch.zeros_like(rewards)
    for i in range(3):
        for t in range(4):
            if mask[i, t]:
                G[i, t] = sum(gamma ** (k - t) * float(rewards[i, k]) for k in range(t, 4) if mask[i, k])
    torch.testing.assert_close(ret, G)
    torch.testing.assert_close(adv[mask], torch.tensor(_ref_whiten([float(g) for g in G[mask]]), dtype=F64))
    assert torch.all(adv[~mask] == 0)


def test_reinforce_pp_baseline():
    R, groups, lengths, rewards, mask, gid = outcome_batch()
    R = [r if n else 0.0 for r, n in zip(R, lengths)]
    grp = _by_group(R, groups)
    centred = [r - sum(grp[g]) / len(grp[g]) for r, g in zip(R, groups)]
    tok = [centred[i] for i, n in enumerate(lengths) for _ in range(n)]
    w = _ref_whiten(tok)
    adv, _ = get("advantage", "reinforce_pp_baseline")(rewards, mask, group_ids_B=gid)
    torch.testing.assert_close(adv[mask], torch.tensor(w, dtype=F64))


def _ref_gae(r, v, valid, gamma, lam):
    """Textbook GAE on the valid positions only (holes skipped)."""
    idx = [t for t in range(len(r)) if valid[t]]
    adv = [0.0] * len(r)
    last, next_v = 0.0, 0.0
    for t in reversed(idx):
        delta = r[t] + gamma * next_v - v[t]
        last = delta + gamma * lam * last
        adv[t] = last
        next_v = v[t]
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae(gamma, lam):
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(3, 6, generator=g, dtype=F64)
    values = torch.randn(3, 6, generator=g, dtype=F64)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[0, 4:] = False                         # right padding
    mask[1, 2] = False                          # hole (multi-turn: an observation token)
    adv, ret = get("advantage", "gae")(rewards, mask, values_BT=values, gamma=gamma, lam=lam, whiten=False)
    ref = torch.zeros_like(rewards)
    for i in range(3):
        ref[i] = torch.tensor(_ref_gae(rewards[i].tolist(), values[i].tolist(), mask[i].tolist(), gamma, lam))
    ref = torch.where(mask, ref, torch.zeros_like(ref))
    torch.testing.assert_close(adv, ref)
    torch.testing.assert_close(ret, torch.where(mask, ref + values, torch.zeros_like(ref)))
    adv_w, ret_w = get("advantage", "gae")(rewards, mask, values_BT=values, gamma=gamma, lam=lam)
    torch.testing.assert_close(adv_w[mask], torch.tensor(_ref_whiten(ref[mask].tolist()), dtype=F64))
    torch.testing.assert_close(ret_w, ret)
    with pytest.raises(ValueError, match="values_BT"):
        get("advantage", "gae")(rewards, mask)


def test_whiten_edges():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=F64)
    mask = torch.tensor([[True, True, True, False]])
    w = whiten(x, mask)
    torch.testing.assert_close(w[mask], torch.tensor([-1.0, 0.0, 1.0], dtype=F64), rtol=1e-6, atol=1e-6)
    assert w[0, 3] == 0
    w2 = whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(w2[mask], torch.tensor([1.0, 2.0, 3.0], dtype=F64), rtol=1e-6, atol=1e-6)
    assert torch.all(whiten(x, torch.zeros_like(mask)) == 0)       # nothing valid: zeros, no NaN
    one = whiten(x, torch.tensor([[True, False, False, False]]))   # one token: centred to 0
    assert torch.isfinite(one).all() and float(one[0, 0]) == 0.0


def test_all_equal_rewards_give_zero_group_advantages():
    rewards = torch.zeros(4, 3, dtype=F64)
    rewards[:, -1] = 1.0
    mask = torch.ones(4, 3, dtype=torch.bool)
    for name in ("grpo", "dr_grpo", "rloo"):
        adv, _ = get("advantage", name)(rewards, mask, group_ids_B=torch.tensor([0, 0, 1, 1]))
        assert torch.all(adv == 0), name


def test_dynamic_sampling_keep():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.7])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 2, 3])
    keep = dynamic_sampling_keep(rewards, groups)
    assert keep.tolist() == [False, False, True, True, False, False, False, False]
    assert dynamic_sampling_keep(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0


def test_overlong_soft_punishment():
    L_max, L_buf = 20, 4
    lengths = torch.tensor([0, 10, 16, 17, 18, 20, 21])
    pen = overlong_soft_punishment(lengths, max_length=L_max, buffer_length=L_buf, factor=1.0)
    ref = []
    for y in lengths.tolist():
        if y <= L_max - L_buf:
            ref.append(0.0)
        elif y <= L_max:
            ref.append(min(-(y - (L_max - L_buf)) / L_buf * 1.0, 0.0))
        else:
            ref.append(-1.0)
    torch.testing.assert_close(pen, torch.tensor(ref, dtype=F64))
    assert overlong_soft_punishment(lengths, max_length=L_max, buffer_length=L_buf, factor=0.5)[5] == -0.5
    with pytest.raises(ValueError):
        overlong_soft_punishment(lengths, max_length=4, buffer_length=8)


def test_overlong_filter_mask():
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 3] = False
    out = overlong_filter_mask(mask, torch.tensor([False, True, False]))
    assert out.tolist() == [[True] * 4, [False] * 4, [True, True, True, False]]
