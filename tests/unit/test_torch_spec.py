"""models/torch_spec.py's two kernels against float64 references written out here.

- `grouped_linear`: torch's grouped GEMM (`torch._grouped_mm`, which torch 2.13 also runs on CPU)
  and the per-expert loop against a float64 per-expert product, values and gradients, with an
  expert that receives no token; bf16 grouped vs loop.
- `SDPAttention`: causal grouped-query attention against softmax(QKᵀ/√d + causal) V in float64
  with K/V heads repeated (Megatron's grouping: query head h reads K/V head h // (n_q/n_kv));
  an explicit Megatron mask (True = masked out); packed THD sequences against each sequence alone.
The model-level equalities (torch spec = local spec = HF at TP2, PP2 x VPP2, EP2 with R3 replay)
are in tests/distributed/test_learner_layouts.py and test_router_replay.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.models.torch_spec import SDPAttention, grouped_linear

COUNTS = [5, 0, 9, 2]  # tokens per expert; expert 1 gets none
E, T, K, N = len(COUNTS), sum(COUNTS), 16, 24


def _reference(x, w, counts):
    rows, out = torch.split(x.double(), counts), []
    for e, x_e in enumerate(rows):
        out.append(x_e @ w[e].double().t())
    return torch.cat(out)


def _grads(fn, x, w, upstream):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w)
    (y * upstream.to(y.dtype)).sum().backward()  # a dense upstream gradient, as a layer's is
    return y.detach(), x.grad, w.grad


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
def test_grouped_linear_fp32_equals_float64_per_expert_products(grouped):
    g = torch.Generator().manual_seed(0)
    x, w, up = torch.randn(T, K, generator=g), torch.randn(E, N, K, generator=g), torch.randn(T, N, generator=g)
    y, gx, gw = _grads(lambda a, b: grouped_linear(a, b, COUNTS, grouped=grouped), x, w, up)
    y64, gx64, gw64 = _grads(lambda a, b: _reference(a, b, COUNTS), x.double(), w.double(), up.double())
    assert y.shape == (T, N)
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx.double(), gx64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw.double(), gw64, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(gw[1]) == 0  # the expert without tokens gets no gradient


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_grouped_linear_bf16_grouped_equals_loop():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(T, K, generator=g).bfloat16(), torch.randn(E, N, K, generator=g).bfloat16()
    up = torch.randn(T, N, generator=g)
    a = _grads(lambda p, q: grouped_linear(p, q, COUNTS, grouped=True), x, w, up)
    b = _grads(lambda p, q: grouped_linear(p, q, COUNTS, grouped=False), x, w, up)
    y64 = _reference(x, w, COUNTS)
    for ours, loop in zip(a, b):
        # both round to bf16 once per product (unit roundoff 2^-8, |y| ~ √K)
        torch.testing.assert_close(ours.float(), loop.float(), rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(a[0].double(), y64, rtol=2e-2, atol=5e-2)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_grouped_linear_keeps_no_stacked_copy_for_the_backward(monkeypatch):
    """The [E, N, K] stack of the expert weights is freed when the forward returns (autograd keeps
    the per-expert weights and stacks them again in the backward), and the gradients are exact."""
    import gc
    import weakref

    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, K, generator=g, requires_grad=True)
    weights = [torch.randn(N, K, generator=g, requires_grad=True) for _ in range(E)]
    up = torch.randn(T, N, generator=g)
    stacks, grouped_mm = [], torch._grouped_mm

    def spy(a, b, **kw):
        stacks.append(weakref.ref(b._base))
        return grouped_mm(a, b, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    y = grouped_linear(x, weights, COUNTS, grouped=True)
    gc.collect()
    assert len(stacks) == 1 and stacks[0]() is None, "the stacked weights outlived the forward"
    (y * up).sum().backward()
    y64 = _reference(x, torch.stack(weights), COUNTS)
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    x64, w64 = x.detach().double().requires_grad_(), torch.stack(weights).detach().double().requires_grad_()
    (_reference(x64, w64, COUNTS) * up.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    for e, w in enumerate(weights):
        torch.testing.assert_close(w.grad.double(), w64.grad[e], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
H_Q, H_KV, D = 4, 2, 16


def _attention(mask_type="causal"):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=H_Q * D, num_attention_heads=H_Q,
                               num_query_groups=H_KV, kv_channels=D, attention_dropout=0.0)
    one_rank = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))  # TP=1: all heads on this rank
    return SDPAttention(config, 1, getattr(AttnMaskType, mask_type), "self", pg_collection=one_rank)


def _reference_attention(q_SBND, k_SBND, v_SBND, masked_BSS):
    """float64 softmax(QKᵀ/√d, masked positions -inf) V with K/V repeated per query group."""
    rep = q_SBND.shape[2] // k_SBND.shape[2]
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q_SBND, k_SBND, v_SBND))
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(masked_BSS[:, None], float("-inf"))
    out = torch.softmax(scores, -1) @ v  # [b, n, s, d]
    return out.permute(2, 0, 1, 3).reshape(q_SBND.shape[0], q_SBND.shape[1], -1)


def _qkv(S, B, g):
    return (torch.randn(S, B, H_Q, D, generator=g), torch.randn(S, B, H_KV, D, generator=g),
            torch.randn(S, B, H_KV, D, generator=g))


def test_sdpa_attention_is_causal_gqa_attention_values_and_gradients():
    S, B = 7, 3
    g = torch.Generator().manual_seed(2)
    q, k, v = (t.requires_grad_() for t in _qkv(S, B, g))
    causal = torch.ones(S, S, dtype=torch.bool).triu(1).expand(B, S, S)
    up = torch.randn(S, B, H_Q * D, generator=g)
    out = _attention()(q, k, v, None)
    assert out.shape == (S, B, H_Q * D)
    (out * up).sum().backward()
    ours = [out.detach(), q.grad, k.grad, v.grad]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _reference_attention(q64, k64, v64, causal)
    (ref * up.double()).sum().backward()
    for a, b in zip(ours, [ref.detach(), q64.grad, k64.grad, v64.grad]):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_sdpa_attention_uses_an_explicit_megatron_mask_as_given():
    S, B = 6, 2
    g = torch.Generator().manual_seed(3)
    q, k, v = _qkv(S, B, g)
    masked = torch.ones(S, S, dtype=torch.bool).triu(1).repeat(B, 1, 1)
    masked[1, :, 4:] = True  # sequence 1 is 4 tokens long: no query attends to its padding
    masked[1, 4:, :] = False  # the padding queries attend to everything (their rows are ignored)
    out = _attention()(q, k, v, masked[:, None])
    torch.testing.assert_close(out.double(), _reference_attention(q, k, v, masked), rtol=1e-5, atol=1e-5)


def test_sdpa_attention_packed_sequences_equal_each_sequence_alone():
    from megatron.core.packed_seq_params import PackedSeqParams

    lens = [5, 1, 8]
    g = torch.Generator().manual_seed(4)
    q, k, v = _qkv(sum(lens), 1, g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    out = _attention()(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=params)
    assert out.shape == (sum(lens), H_Q * D)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        n = b - a
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)[None]
        ref = _reference_attention(q[a:b], k[a:b], v[a:b], causal)[:, 0]
        torch.testing.assert_close(out[a:b].double(), ref, rtol=1e-5, atol=1e-5)
