"""Packed micro-batches (batch/packing.py) against a direct construction: the packed row, the
THD boundaries and positions, the unpacking and its gradient, and the configurations refused.

The model's packed forward and the whole packed step against the padded one (TP2 with sequence
parallelism, PP2, EP2 with R3 replay) are tests/distributed/test_token_budget.py's."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.batch.packing import packed_positions, packing, per_token, unpacked


def test_pack_lays_the_sequences_end_to_end_and_unpack_puts_them_back():
    lens, S = torch.tensor([3, 5, 1]), 5
    x = torch.arange(3 * S * 2, dtype=torch.float64).view(3, S, 2)
    p = packing(lens, S, multiple=4)
    assert (p.n, p.T) == (9, 12)
    # Direct: each sequence's first len rows, in order, then copies of the first row (or a fill).
    direct = torch.cat([x[i, :n] for i, n in enumerate(lens.tolist())])
    packed = p.pack(x)
    assert packed.shape == (1, 12, 2)
    assert torch.equal(packed[0, :9], direct) and torch.equal(packed[0, 9:], x[0, :1].expand(3, 2))
    assert torch.equal(p.pack(x, fill=-1)[0, 9:], torch.full((3, 2), -1.0, dtype=torch.float64))
    assert p.params.qkv_format == "thd"
    assert p.params.cu_seqlens_q.tolist() == [0, 3, 8, 9, 12] == p.params.cu_seqlens_kv.tolist()
    assert p.params.cu_seqlens_q.dtype == torch.int32 and p.params.max_seqlen_q == 5
    # On the device q and kv share one tensor: attention checks `is` before comparing them, which on
    # CUDA would wait for the device once per layer (models/torch_spec.py SDPAttention._packed).
    moved = p.to("cpu").params
    assert moved.cu_seqlens_q is moved.cu_seqlens_kv
    assert packed_positions(p, "cpu").tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 0, 1, 2]]
    back = p.unpack(packed)
    keep = torch.arange(S)[None] < lens[:, None]
    assert torch.equal(back[keep], x[keep]) and not back[~keep].any()


def test_unpack_is_differentiable_and_sends_nothing_to_the_round_up():
    p = packing(torch.tensor([2, 4]), 4, multiple=8)
    y = torch.randn(1, p.T, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 4, dtype=torch.float64)
    (p.unpack(y) * w).sum().backward()
    expect = torch.zeros(p.T, dtype=torch.float64)
    expect[:6] = torch.cat([w[0, :2], w[1, :4]])
    assert torch.equal(y.grad[0], expect)


def test_per_token_and_unpacked_leave_an_unpacked_micro_batch_alone():
    labels = torch.tensor([[1, 2, 0], [3, 4, 5]])
    assert per_token({"labels": labels}, "labels") is labels
    x = torch.ones(2, 3)
    assert unpacked({"labels": labels}, x) is x
    mb = {"labels": labels, "packing": packing(torch.tensor([2, 3]), 3)}
    assert per_token(mb, "labels").tolist() == [[1, 2, 3, 4, 5]]


def test_lengths_outside_the_rows_are_refused():
    with pytest.raises(ValueError, match=r"sequence lengths \[0, 3\] must lie in \[1, 3\]"):
        packing(torch.tensor([0, 3]), 3)
    with pytest.raises(ValueError, match=r"must lie in \[1, 2\]"):
        packing(torch.tensor([3]), 2)


@pytest.mark.parametrize("overrides, message", [
    (["model.spec=local"], "learner.pack_sequences=true needs model.spec=torch"),
    (["model.spec=torch", "model=tiny_qwen3_moe", "algorithm.router_replay=r2"],
     "learner.pack_sequences=true with algorithm.router_replay=r2"),
])
def test_configurations_packing_cannot_serve_are_refused(overrides, message):
    from megatron_rl.config.load import load_config, to_object
    from megatron_rl.trainer.preflight import validate

    validate(to_object(load_config("tiny_cpu", ["model.spec=torch", "learner.pack_sequences=true"])))
    cfg = to_object(load_config("tiny_cpu", ["learner.pack_sequences=true", *overrides]))
    with pytest.raises(ValueError, match=message):
        validate(cfg)


def test_packed_plan_bounds_tokens_not_padded_slots():
    """With packing a micro-batch costs its tokens: the budget bounds Σ lengths (rounded up), every
    sequence once, a longer one alone, and fewer micro-batches than the padded plan needs."""
    from megatron_rl.batch import micro

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 600, (64,), generator=g)
    lens[3] = 900  # over the budget: alone
    plan = micro.plan_micro_batches(lens, max_tokens=800, multiple=8, packed=True)
    assert sorted(i for mb in plan for i in mb.tolist()) == list(range(64))
    for mb in plan:
        total = -(-int(lens[mb].sum()) // 8) * 8
        assert total <= 800 or mb.tolist() == [3], (mb.tolist(), total)
    # First-fit decreasing: at most one micro-batch is at most half full.
    assert sum(int(lens[mb].sum()) <= 400 for mb in plan) <= 1
    padded = micro.plan_micro_batches(lens, max_tokens=800, multiple=8)
    assert len(plan) < len(padded), (len(plan), len(padded))
