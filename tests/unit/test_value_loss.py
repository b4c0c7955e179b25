"""Value losses (clipped and unclipped) against a plain float64 reference for values and gradients,
their aggregation, and their use with GAE returns (ALGORITHMS.md §5)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms import get, names
from megatron_rl.algorithms.aggregation import aggregate, local_count
from megatron_rl.algorithms.registry import UnknownNameError

F64 = torch.float64
EPS = 0.2


def random_inputs(seed=0, B=4, T=7):
    g = torch.Generator().manual_seed(seed)
    returns = torch.randn(B, T, generator=g, dtype=F64)
    old_values = returns + 0.5 * torch.randn(B, T, generator=g, dtype=F64)
    # Moves of up to ±1 around V_old: both inside and outside the ±0.2 clip range.
    values = old_values + (torch.rand(B, T, generator=g, dtype=F64) * 2 - 1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 5:] = False
    mask[2, 1] = False
    mask[3] = False
    return values, returns, old_values, mask


def reference(v, r, v_old, eps, clipped: bool):
    """(loss, dloss/dv, clip chosen) for one token, in plain Python floats."""
    unclipped = (v - r) ** 2
    if not clipped:
        return 0.5 * unclipped, v - r, False
    delta = min(max(v - v_old, -eps), eps)
    v_clip = v_old + delta
    clipped_term = (v_clip - r) ** 2
    if clipped_term > unclipped:
        inside = -eps < v - v_old < eps
        return 0.5 * clipped_term, (v_clip - r) if inside else 0.0, True
    return 0.5 * unclipped, v - r, False


@pytest.mark.parametrize("name", ["clipped", "mse"])
def test_values_and_gradients_match_float64_reference(name):
    values, returns, old_values, mask = random_inputs()
    values.requires_grad_(True)
    loss, metrics = get("value_loss", name)(values, returns, old_values=old_values, clip_eps=EPS,
                                            response_mask=mask)
    # A random weight per token makes the summed gradient check every token's own gradient.
    w = torch.rand(values.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    (grad,) = torch.autograd.grad((loss * w).sum(), values)
    ref_loss, ref_grad = torch.zeros_like(returns), torch.zeros_like(returns)
    ref_chosen = torch.zeros_like(mask)
    for i in range(values.shape[0]):
        for t in range(values.shape[1]):
            if not mask[i, t]:
                continue
            l, d, c = reference(float(values.detach()[i, t]), float(returns[i, t]), float(old_values[i, t]),
                                EPS, clipped=name == "clipped")
            ref_loss[i, t], ref_grad[i, t], ref_chosen[i, t] = l, d * float(w[i, t]), c
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    assert torch.equal(metrics["clipped"], ref_chosen)
    if name == "clipped":
        # The random inputs exercise both branches and the zero-gradient case.
        assert ref_chosen.any() and (~ref_chosen & mask).any()
        assert ((ref_grad == 0) & mask).any()


def test_clipped_equals_mse_inside_the_clip_range():
    values, returns, old_values, mask = random_inputs(seed=1)
    values = old_values + 0.1 * torch.tanh(values - old_values)   # |V − V_old| < ε everywhere
    a, _ = get("value_loss", "clipped")(values, returns, old_values=old_values, clip_eps=EPS,
                                        response_mask=mask)
    b, _ = get("value_loss", "mse")(values, returns, response_mask=mask)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_padding_never_reaches_loss_or_gradient():
    values, returns, old_values, mask = random_inputs(seed=2)
    values = torch.where(mask, values, torch.full_like(values, float("nan"))).requires_grad_(True)
    returns = torch.where(mask, returns, torch.full_like(returns, float("inf")))
    for name in ("clipped", "mse"):
        loss, metrics = get("value_loss", name)(values, returns, old_values=old_values, clip_eps=EPS,
                                                response_mask=mask)
        (grad,) = torch.autograd.grad(loss.sum(), values)
        assert torch.isfinite(loss).all() and torch.all(loss[~mask] == 0), name
        assert torch.isfinite(grad).all() and torch.all(grad[~mask] == 0), name
        assert not metrics["clipped"][~mask].any()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_aggregated_value_loss(mode):
    """Aggregated with the global normaliser, micro-batch pieces add up to the full-batch loss."""
    values, returns, old_values, mask = random_inputs(seed=3)
    loss, _ = get("value_loss", "clipped")(values, returns, old_values=old_values, clip_eps=EPS,
                                           response_mask=mask)
    n = local_count(mask, mode)
    full = aggregate(loss, mask, mode, normalizer=n)
    pieces = sum(aggregate(loss[i:i + 2], mask[i:i + 2], mode, normalizer=n) for i in (0, 2))
    torch.testing.assert_close(pieces, full)
    if mode == "token-mean":
        torch.testing.assert_close(full, loss[mask].mean())
    else:
        per_seq = [loss[i][mask[i]].mean() for i in range(4) if mask[i].any()]
        torch.testing.assert_close(full, torch.stack(per_seq).mean())


def test_value_loss_on_gae_returns_is_half_squared_advantage():
    """R = A + V_old, so at V = V_old the loss is ½·A² per token (unwhitened GAE advantages)."""
    g = torch.Generator().manual_seed(4)
    rewards = torch.zeros(3, 5, dtype=F64)
    rewards[:, -1] = torch.randn(3, generator=g, dtype=F64)
    v_old = torch.randn(3, 5, generator=g, dtype=F64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    adv, ret = get("advantage", "gae")(rewards, mask, values_BT=v_old, gamma=0.99, lam=0.95, whiten=False)
    loss, metrics = get("value_loss", "clipped")(v_old, ret, old_values=v_old, clip_eps=EPS,
                                                 response_mask=mask)
    torch.testing.assert_close(loss, 0.5 * adv.square(), rtol=1e-12, atol=1e-12)
    assert not metrics["clipped"].any()


def test_registry_and_errors():
    assert set(names("value_loss")) == {"clipped", "mse"}
    with pytest.raises(UnknownNameError, match="clipped, mse"):
        get("value_loss", "huber")
    values, returns, _, mask = random_inputs()
    with pytest.raises(ValueError, match="old_values"):
        get("value_loss", "clipped")(values, returns, response_mask=mask)
    with pytest.raises(ValueError, match="clip_eps"):
        get("value_loss", "clipped")(values, returns, old_values=values, clip_eps=0.0)
    with pytest.raises(ValueError, match="response_mask"):
        get("value_loss", "mse")(values, returns, response_mask=mask[:, :3])
