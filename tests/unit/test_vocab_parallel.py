"""megatron_rl.vocab_parallel against plain float64 full-vocabulary math.

Tensor parallelism is simulated in-process: the full logits [T, V] are split into TP contiguous
vocabulary shards and each shard runs in its own thread with a real `ProcessGroupGloo` built on a
shared HashStore, so the very same collectives as in a multi-process run do the reductions.
References below never use the module under test: they are log_softmax / softmax over the whole
(unpadded) vocabulary in float64, with per-token Python loops for the top-K sets.
"""

from __future__ import annotations

import itertools
import math
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megatron_rl.vocab_parallel as vp
import megatron_rl.vocab_parallel.logprobs as logprobs_mod

_STORE = dist.HashStore()
_GROUP_IDS = itertools.count()


def run_tp(tp: int, fn, *full_logits: torch.Tensor):
    """Run fn(shards..., group, rank) on `tp` thread-ranks, each holding one vocab shard."""
    if tp == 1:
        return [fn(*full_logits, None, 0)]
    V = full_logits[0].shape[-1]
    assert V % tp == 0
    shards = [x.split(V // tp, dim=-1) for x in full_logits]
    prefix = f"tp{next(_GROUP_IDS)}"
    results: list = [None] * tp
    errors: list = []

    def worker(rank):
        try:
            pg = dist.ProcessGroupGloo(
                dist.PrefixStore(prefix, _STORE), rank, tp, timedelta(seconds=60)
            )
            results[rank] = fn(*[s[rank].contiguous() for s in shards], pg, rank)
        except BaseException as e:  # noqa: BLE001 - reraised in the caller
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return results


# ---------------------------------------------------------------- float64 references


def ref_logp_full(logits, vocab_size, temperature=1.0):
    return torch.log_softmax(logits.double()[..., :vocab_size] / temperature, dim=-1)


def ref_logp(logits, ids, vocab_size, temperature=1.0):
    lsm = ref_logp_full(logits, vocab_size, temperature)
    ok = (ids >= 0) & (ids < vocab_size)
    out = lsm.gather(-1, ids.clamp(0, vocab_size - 1).long())
    return torch.where(ok, out, torch.tensor(float("-inf"), dtype=torch.float64))


def ref_entropy(logits, vocab_size, temperature=1.0):
    lsm = ref_logp_full(logits, vocab_size, temperature)
    return -(lsm.exp() * lsm).sum(-1)


def ref_binary(mu_lp, pi_lp):
    mu, p = mu_lp.double().exp(), pi_lp.double().exp()
    tv = (mu - p).abs()
    kl = mu * (mu.log() - p.log()) + (1 - mu) * ((1 - mu).log() - (1 - p).log())
    return tv, kl


def ref_topk(mu_lp_t, mu_topk_lp, sampled, topk_ids, pi_lsm):
    """Per-token sets in Python: S = {a_t} ∪ topk (each id once, negatives dropped)."""
    T = sampled.shape[0]
    tv, kl = torch.zeros(T, dtype=torch.float64), torch.zeros(T, dtype=torch.float64)
    for t in range(T):
        mu = {int(sampled[t]): math.exp(float(mu_lp_t[t]))}
        for k, i in enumerate(topk_ids[t].tolist()):
            if i >= 0 and i not in mu:
                mu[i] = math.exp(float(mu_topk_lp[t, k]))
        pi = {i: math.exp(float(pi_lsm[t, i])) for i in mu}
        rest_mu = max(1 - sum(mu.values()), 1e-12)
        rest_pi = max(1 - sum(pi.values()), 1e-12)
        tv[t] = 0.5 * (sum(abs(mu[i] - pi[i]) for i in mu) + abs(rest_mu - rest_pi))
        kl[t] = sum(mu[i] * (math.log(mu[i]) - math.log(pi[i])) for i in mu if mu[i] > 0)
        kl[t] += rest_mu * (math.log(rest_mu) - math.log(rest_pi))
    return tv, kl


def ref_full(a, b, vocab_size, temperature=1.0):
    lp, lq = ref_logp_full(a, vocab_size, temperature), ref_logp_full(b, vocab_size, temperature)
    return 0.5 * (lp.exp() - lq.exp()).abs().sum(-1), (lp.exp() * (lp - lq)).sum(-1)


# ---------------------------------------------------------------- inputs

V_PAD, VOCAB = 64, 61  # padded to a multiple of 4 shards; the last 3 columns are padding


def make_logits(seed, T=23, V=V_PAD, scale=6.0, offset=40.0, dtype=torch.float64, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, V, generator=g, dtype=torch.float64) * scale + offset  # large logits
    # Huge junk in the padded columns: any leak of padding into a result shows up at once.
    x[:, vocab:] = torch.randn(T, V - vocab, generator=g, dtype=torch.float64) * 100 + 500
    return x.to(dtype)


def rollout_from(mu_logits, K, seed):
    """Sampled ids, log mu(a_t), mu's true top-K ids/log-probs, with duplicates and padding."""
    g = torch.Generator().manual_seed(seed)
    mu_lsm = ref_logp_full(mu_logits, VOCAB)
    sampled = torch.multinomial(mu_lsm.exp(), 1, generator=g)[:, 0]
    topk_lp, topk_ids = mu_lsm.topk(K, dim=-1)
    return sampled, mu_lsm.gather(-1, sampled[:, None])[:, 0], topk_ids, topk_lp, mu_lsm


TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def close(a, b, tol):
    a, b = a.double(), b.double()
    both_inf = torch.isinf(a) & torch.isinf(b) & (a.sign() == b.sign())
    err = torch.where(both_inf, torch.zeros_like(a), (a - b).abs())
    assert err.max().item() <= tol, f"max error {err.max().item():.3e} > {tol:.0e}"


# ---------------------------------------------------------------- log-probs and entropy


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 5, 1024])
@pytest.mark.parametrize("subblocks", ["min_size", "rows_16"])
def test_log_probs_entropy_values_and_grads(tp, dtype, chunk, subblocks, monkeypatch):
    if subblocks == "rows_16":  # tiny test vocabularies would otherwise always take one block
        monkeypatch.setattr(logprobs_mod, "_MIN_SUBBLOCK_ELEMS", 1)
    tau = 0.7
    x = make_logits(tp * 10 + chunk, dtype=dtype)
    T = x.shape[0]
    ids = torch.randint(0, VOCAB, (T, 3), generator=torch.Generator().manual_seed(1))
    ids[0, 1] = ids[0, 0]  # duplicate id: its gradient contributions must add up
    ids[1, 2] = VOCAB + 1  # a padding id: log-prob -inf, no gradient
    ids[2, 2] = -1
    g_lp = torch.randn(T, 3, dtype=torch.float64)
    g_h = torch.randn(T, dtype=torch.float64)

    def fn(shard, group, rank):
        shard = shard.clone().requires_grad_()
        lp, h = vp.vocab_parallel_log_probs_and_entropy(
            shard, ids, group, temperature=tau, vocab_size=VOCAB, chunk_size=chunk
        )
        finite = torch.isfinite(lp)
        loss = (torch.where(finite, lp, 0).double() * g_lp).sum() + (h.double() * g_h).sum()
        loss.backward()
        return lp.detach(), h.detach(), shard.grad

    out = run_tp(tp, fn, x)
    xr = x.double().requires_grad_()
    ref_lp = ref_logp(xr, ids, VOCAB, tau)
    ref_h = ref_entropy(xr, VOCAB, tau)
    finite = torch.isfinite(ref_lp)
    ((torch.where(finite, ref_lp, 0) * g_lp).sum() + (ref_h * g_h).sum()).backward()
    tol = TOL[dtype]
    for lp, h, _ in out:
        assert lp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        close(lp, ref_lp.detach(), tol)
        close(h, ref_h.detach(), tol)
    grad = torch.cat([g for _, _, g in out], dim=-1)
    assert grad.dtype == dtype
    # fp32: log p carries ~|lse| * 6e-8 ≈ 5e-6 absolute error (logits ≈ 60 after 1/tau), which the
    # N(0, 1) upstream gradients, summed over 3 ids and times 1/tau, amplify ~5x.
    close(grad, xr.grad, tol if dtype == torch.float64 else 5e-5)
    assert (grad[:, VOCAB:] == 0).all()


@pytest.mark.parametrize("tp", [1, 2])
def test_inplace_logits_match(tp):
    x = make_logits(21)
    ids = torch.randint(0, VOCAB, (x.shape[0], 4), generator=torch.Generator().manual_seed(3))
    ids[0, 1] = ids[0, 0]
    g = torch.randn(ids.shape, dtype=torch.float64)

    def fn(shard, group, rank):
        shard = shard.clone().requires_grad_()
        lp, h = vp.vocab_parallel_log_probs_and_entropy(
            shard, ids, group, temperature=1.2, vocab_size=VOCAB, chunk_size=5,
            entropy_grad=False, inplace_logits=True,
        )
        (lp * g).sum().backward()
        return lp.detach(), h, shard.grad

    xr = x.clone().requires_grad_()
    ref = ref_logp(xr, ids, VOCAB, 1.2)
    (ref * g).sum().backward()
    out = run_tp(tp, fn, x)
    for lp, h, _ in out:
        close(lp, ref.detach(), 1e-10)
        close(h, ref_entropy(x, VOCAB, 1.2), 1e-10)
    close(torch.cat([gr for _, _, gr in out], -1), xr.grad, 1e-10)


def test_bf16_accumulates_in_fp32():
    x = make_logits(3, dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (x.shape[0],), generator=torch.Generator().manual_seed(2))
    out = run_tp(2, lambda s, g, r: vp.vocab_parallel_log_probs(s, ids, g, vocab_size=VOCAB), x)
    assert out[0].dtype == torch.float32
    # Reference from the same bf16 values in fp64: only fp32 accumulation error remains.
    close(out[0], ref_logp(x.double(), ids[:, None], VOCAB)[:, 0], 1e-5)


def test_gradcheck_log_probs_and_entropy():
    x = make_logits(5, T=6, V=12, scale=3.0, offset=0.0, vocab=10)
    ids = torch.tensor([[0, 3], [9, 9], [4, 10], [1, 2], [7, 8], [11, 5]])
    xr = x.clone().requires_grad_()

    def f(a):
        return vp.vocab_parallel_log_probs_and_entropy(
            a, ids, None, temperature=1.3, vocab_size=10, chunk_size=4
        )

    def finite_f(a):
        lp, h = f(a)
        return torch.where(torch.isfinite(lp), lp, 0), h

    assert torch.autograd.gradcheck(finite_f, (xr,))
    assert torch.autograd.gradcheck(
        lambda a: vp.vocab_parallel_entropy(a, None, chunk_size=2), (xr,)
    )


def test_leading_dims_and_single_ids():
    x = make_logits(6, T=12).reshape(3, 4, V_PAD)
    ids = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(0))
    lp = vp.vocab_parallel_log_probs(x, ids, None, vocab_size=VOCAB)
    assert lp.shape == (3, 4)
    close(lp, ref_logp(x, ids[..., None], VOCAB)[..., 0], 1e-10)
    with pytest.raises(ValueError):
        vp.vocab_parallel_log_probs(x, ids[:2], None)
    with pytest.raises(ValueError):
        vp.vocab_parallel_log_probs(x, ids, None, temperature=0.0)
    with pytest.raises(ValueError):
        vp.vocab_parallel_log_probs(x, ids, None, vocab_size=V_PAD + 1)


def test_shard_of_only_padding():
    # TP=4 over 16 columns with 5 real tokens: ranks 2 and 3 hold only padding.
    x = make_logits(8, T=7, V=16, vocab=5)
    ids = torch.randint(0, 5, (7,), generator=torch.Generator().manual_seed(0))
    out = run_tp(4, lambda s, g, r: (
        vp.vocab_parallel_log_probs(s, ids, g, vocab_size=5),
        vp.vocab_parallel_entropy(s, g, vocab_size=5),
        vp.vocab_parallel_topk(s, 5, g, vocab_size=5),
    ), x)
    ref = ref_logp_full(x, 5)
    for lp, h, (tlp, tid) in out:
        close(lp, ref.gather(-1, ids[:, None])[:, 0], 1e-10)
        close(h, ref_entropy(x, 5), 1e-10)
        close(tlp, ref.sort(-1, descending=True).values, 1e-10)
        assert sorted(tid[0].tolist()) == list(range(5))


# ---------------------------------------------------------------- divergences


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_entry_point_matches_references(tp, dtype):
    K, tau = 6, 1.0
    mu_x = make_logits(100 + tp, scale=2.0)
    pi_x = (mu_x + 0.7 * make_logits(200 + tp, scale=1.0, offset=0.0)).to(dtype)
    sampled, mu_lp, topk_ids, topk_lp, _ = rollout_from(mu_x, K, seed=tp)
    topk_ids[0, 2] = topk_ids[0, 1]  # duplicated id in the rollout list
    topk_lp[0, 2] = topk_lp[0, 1]
    topk_ids[1, -1] = -1  # short list, padded
    topk_ids[2, :] = torch.arange(K)  # sampled token not necessarily in the list
    topk_lp[2, :] = ref_logp_full(mu_x, VOCAB)[2, :K]
    sampled[2] = K + 3

    def fn(shard, group, rank):
        s = vp.vocab_parallel_policy_stats(
            shard.clone().requires_grad_(), sampled, group, rollout_logp=mu_lp,
            topk_ids=topk_ids, topk_logp=topk_lp, divergences=vp.DIVERGENCES,
            with_entropy=True, temperature=tau, vocab_size=VOCAB, chunk_size=4,
        )
        assert s.logp.requires_grad and not s.entropy.requires_grad
        assert not any(getattr(s, d).requires_grad for d in vp.DIVERGENCES)
        return s

    pi_lsm = ref_logp_full(pi_x, VOCAB, tau)
    pi_lp = pi_lsm.gather(-1, sampled[:, None])[:, 0]
    btv, bkl = ref_binary(mu_lp, pi_lp)
    ttv, tkl = ref_topk(mu_lp, topk_lp, sampled, topk_ids, pi_lsm)
    tol = TOL[dtype]
    for s in run_tp(tp, fn, pi_x):
        close(s.logp, pi_lp, tol)
        close(s.entropy, ref_entropy(pi_x, VOCAB, tau), tol)
        close(s.binary_tv, btv, tol)
        close(s.binary_kl, bkl, tol)
        close(s.topk_tv, ttv, tol)
        close(s.topk_kl, tkl, tol)
        close(s.divergence("topk_kl"), tkl, tol)


def test_fused_validates_and_divergence_grad():
    x = make_logits(9)
    sampled, mu_lp, topk_ids, topk_lp, _ = rollout_from(x, 4, seed=0)
    with pytest.raises(ValueError, match="valid: binary_tv"):
        vp.vocab_parallel_policy_stats(x, sampled, divergences=["tv"], rollout_logp=mu_lp)
    with pytest.raises(ValueError, match="rollout_logp"):
        vp.vocab_parallel_policy_stats(x, sampled, divergences=["binary_tv"])
    with pytest.raises(ValueError, match="topk_ids"):
        vp.vocab_parallel_policy_stats(x, sampled, divergences=["topk_tv"], rollout_logp=mu_lp)
    s = vp.vocab_parallel_policy_stats(x, sampled, rollout_logp=mu_lp, divergences=["binary_tv"])
    with pytest.raises(KeyError, match="not requested"):
        s.divergence("topk_kl")
    # With divergence_grad the top-K KL is differentiable and matches autograd of the reference.
    pi = (x + make_logits(10, scale=1.0, offset=0.0)).requires_grad_()
    s = vp.vocab_parallel_policy_stats(
        pi, sampled, rollout_logp=mu_lp, topk_ids=topk_ids, topk_logp=topk_lp,
        divergences=["topk_kl", "binary_kl"], divergence_grad=True, with_entropy=True,
        entropy_grad=True, vocab_size=VOCAB,
    )
    (s.topk_kl.sum() + s.binary_kl.sum() + s.entropy.sum()).backward()
    pr = pi.detach().clone().requires_grad_()
    lsm = ref_logp_full(pr, VOCAB)
    ids_S = torch.cat([sampled[:, None], topk_ids], -1)
    mu_S = torch.cat([mu_lp[:, None], topk_lp], -1)
    keep = torch.tensor([[i not in row[:j] for j, i in enumerate(row)] for row in ids_S.tolist()])
    mu_p = torch.where(keep, mu_S.exp(), 0)
    pi_p = torch.where(keep, lsm.gather(-1, ids_S).exp(), 0)
    rest_mu, rest_pi = (1 - mu_p.sum(-1)).clamp(min=1e-12), (1 - pi_p.sum(-1)).clamp(min=1e-12)
    kl = (torch.where(keep, mu_p * (mu_S - lsm.gather(-1, ids_S)), 0)).sum(-1)
    kl = kl + rest_mu * (rest_mu.log() - rest_pi.log())
    p_t = lsm.gather(-1, sampled[:, None])[:, 0].exp()
    m_t = mu_lp.exp()
    bkl = m_t * (m_t.log() - p_t.log()) + (1 - m_t) * ((1 - m_t).log() - (1 - p_t).log())
    (kl.sum() + bkl.sum() + ref_entropy(pr, VOCAB).sum()).backward()
    close(pi.grad, pr.grad, 1e-10)
    tk = vp.vocab_parallel_topk_divergence(
        pi, sampled, mu_lp, topk_ids, topk_lp, kind="kl", vocab_size=VOCAB, requires_grad=True
    )
    assert tk.requires_grad
    close(tk, kl, 1e-10)


def test_binary_kl_near_one_is_stable():
    # mu(a_t) = 1 - 1e-9 and pi(a_t) = 1 - 2e-9: forming 1 - p from p would lose every digit.
    mu_lp = torch.tensor([math.log1p(-1e-9), 0.0, math.log1p(-1e-9), -1e-30], dtype=torch.float32)
    pi_lp = torch.tensor([math.log1p(-2e-9), math.log1p(-1e-6), 0.0, -50.0], dtype=torch.float32)
    kl = vp.binary_kl(mu_lp, pi_lp)
    assert torch.isfinite(kl).all() and (kl >= 0).all()
    # float64 closed form with exact complements: mu=1-a, pi=1-b
    a, b = 1e-9, 2e-9
    expect0 = (1 - a) * (math.log1p(-a) - math.log1p(-b)) + a * (math.log(a) - math.log(b))
    assert abs(kl[0].item() - expect0) <= 1e-4 * abs(expect0)
    close(kl[1:2], torch.tensor([-math.log1p(-1e-6)]), 1e-9)  # mu = 1: KL = -log pi
    expect2 = (1 - a) * math.log1p(-a) + a * (math.log(a) - math.log(1e-12))  # 1 - pi floored at eps
    assert kl[2].item() == pytest.approx(expect2, rel=1e-4)


def test_full_divergence_and_topk_policy():
    a = make_logits(11)
    b = (a + make_logits(12, scale=2.0, offset=0.0)).float()
    for tp, chunk in [(1, 3), (2, 1), (4, 1000)]:
        for tv, kl in run_tp(tp, lambda s, q, g, r: vp.vocab_parallel_full_divergence(
            s, q, g, temperature=0.9, vocab_size=VOCAB, chunk_size=chunk
        ), a, b):
            rtv, rkl = ref_full(a, b.double(), VOCAB, 0.9)
            close(tv, rtv, 1e-10)
            close(kl, rkl, 1e-10)
        for lp, ids in run_tp(tp, lambda s, g, r: vp.vocab_parallel_topk(
            s, 7, g, temperature=0.9, vocab_size=VOCAB, chunk_size=chunk
        ), a):
            rlp, rids = ref_logp_full(a, VOCAB, 0.9).topk(7, dim=-1)
            close(lp, rlp, 1e-10)
            assert torch.equal(ids, rids)


def test_memory_stays_within_one_chunk_buffer():
    """Allocation tracking with the PyTorch profiler: extra memory ≈ one fp32 [chunk, V_l] buffer."""
    T, V, chunk = 256, 16384, 64
    x = torch.randn(T, V)
    ids = torch.randint(0, V, (T, 21))
    buffer = chunk * V * 4
    from torch.profiler import ProfilerActivity, profile

    def peak(fn):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        live = top = 0
        for e in sorted(
            (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
            key=lambda e: e.start_ns(),
        ):
            live += e.nbytes()
            top = max(top, live)
        return top

    assert peak(lambda: torch.empty(chunk, V)) >= buffer  # the tracker sees allocations
    fwd = peak(lambda: vp.vocab_parallel_log_probs(x, ids, None, chunk_size=chunk))
    assert fwd <= 1.1 * buffer, (fwd, buffer)
    xr = x.clone().requires_grad_()
    bwd = peak(lambda: vp.vocab_parallel_log_probs(xr, ids, None, chunk_size=chunk).sum().backward())
    small = T * 21 * 8 * 4  # a few [T, J] id/gradient tensors
    assert bwd <= T * V * 4 + small, (bwd, buffer)  # the gradient itself and no scratch (fp32)
    # In place (Megatron's trick) the logits' storage is the buffer and then the gradient.
    xi = x.clone().requires_grad_()
    inpl = peak(lambda: vp.vocab_parallel_log_probs(
        xi, ids, None, chunk_size=chunk, inplace_logits=True).sum().backward())
    assert inpl <= small, (inpl, buffer)
    with pytest.raises(ValueError, match="entropy gradient"):
        vp.vocab_parallel_policy_stats(x, ids[:, 0], with_entropy=True, entropy_grad=True,
                                       inplace_logits=True)
    with pytest.raises(ValueError, match="contiguous fp32"):
        vp.vocab_parallel_log_probs(x.bfloat16(), ids, None, inplace_logits=True)


# ---------------------------------------------------------------- properties


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    shift=st.floats(0.0, 3.0),
    temperature=st.sampled_from([0.6, 1.0, 1.5]),
    tp=st.sampled_from([1, 2, 4]),
    chunk=st.sampled_from([1, 3, 64]),
)
def test_divergence_properties(seed, shift, temperature, tp, chunk):
    T, K = 9, 5
    mu_x = make_logits(seed, T=T, scale=3.0, offset=0.0)
    pi_x = mu_x + shift * make_logits(seed + 1, T=T, scale=1.0, offset=0.0)
    # mu at the same temperature as pi, so binary <= top-K <= full compares one pair of laws.
    sampled, mu_lp, topk_ids, topk_lp, _ = rollout_from(mu_x / temperature, K, seed)

    def fn(p, m, group, rank):
        s = vp.vocab_parallel_policy_stats(
            p, sampled, group, rollout_logp=mu_lp, topk_ids=topk_ids, topk_logp=topk_lp,
            divergences=vp.DIVERGENCES, temperature=temperature, vocab_size=VOCAB,
            chunk_size=chunk,
        )
        full = vp.vocab_parallel_full_divergence(
            m, p, group, temperature=temperature, vocab_size=VOCAB, chunk_size=chunk
        )
        same = vp.vocab_parallel_full_divergence(
            p, p, group, temperature=temperature, vocab_size=VOCAB, chunk_size=chunk
        )
        return s, full, same

    results = run_tp(tp, fn, pi_x, mu_x)
    s, (ftv, fkl), (stv, skl) = results[0]
    for name in vp.DIVERGENCES:
        for r in results[1:]:  # every rank holds the same values
            assert torch.equal(getattr(r[0], name), getattr(s, name))
    for tv in (s.binary_tv, s.topk_tv, ftv):
        assert ((tv >= 0) & (tv <= 1)).all()
    for kl in (s.binary_kl, s.topk_kl, fkl):
        assert (kl >= 0).all()
    eps = 1e-12
    assert (s.binary_tv <= s.topk_tv + eps).all() and (s.topk_tv <= ftv + eps).all()
    assert (s.binary_kl <= s.topk_kl + eps).all() and (s.topk_kl <= fkl + eps).all()
    # D(p, p) = 0 up to rounding: gloo's ring all-reduce may sum the p and q halves of one
    # packed buffer in different rank orders, so their log-partitions can differ by an ulp.
    assert (stv <= 1e-14).all() and (skl <= 1e-14).all()
    # Same values at TP=1 (group None): only the summation order differs, so the log-partition
    # moves by ~eps·|z|. The rest bucket 1 - sum_S turns that into a relative error of
    # eps·|z|/rest_pi where pi puts almost all its mass on S, and the KL's rest term
    # rest_mu·log(rest_mu/rest_pi) carries it as eps·|z|·rest_mu/rest_pi (seed 434, shift 2.66,
    # T 0.6: rest_pi 3.8e-7 against rest_mu 2.8e-3 moved topk_kl by 4.6e-10). TV takes it unscaled.
    s1, (ftv1, fkl1), _ = run_tp(1, fn, pi_x, mu_x)[0]
    zmax = (pi_x[:, :VOCAB] / temperature).abs().amax(-1)
    mu_p, pi_p = (ref_logp_full(x, VOCAB, temperature).exp() for x in (mu_x, pi_x))
    for name in vp.DIVERGENCES:
        tol = torch.full((T,), 1e-10, dtype=torch.float64)
        if name.endswith("_kl"):
            S = torch.zeros(T, VOCAB, dtype=torch.bool)
            S[torch.arange(T), sampled] = True
            if name == "topk_kl":
                S.scatter_(1, topk_ids, True)
            rest_mu, rest_pi = ((p * ~S).sum(-1) for p in (mu_p, pi_p))
            tol += 64 * torch.finfo(torch.float64).eps * zmax * rest_mu / rest_pi
        err = (getattr(s, name).double() - getattr(s1, name).double()).abs()
        assert (err <= tol).all(), (name, err, tol)
    close(s.logp, s1.logp, 1e-12)
    close(ftv, ftv1, 1e-12)
    close(fkl, fkl1, 1e-12)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), tp=st.sampled_from([2, 4]), K=st.integers(1, 8))
def test_divergence_of_a_distribution_with_itself_is_zero(seed, tp, K):
    x = make_logits(seed, T=8, scale=4.0, offset=10.0)
    sampled, _, topk_ids, _, _ = rollout_from(x, K, seed)

    def fn(shard, group, rank):
        # mu := pi itself, read off the shard: log-probs of the sampled and top-K ids.
        mu_lp = vp.vocab_parallel_log_probs(shard, sampled, group, vocab_size=VOCAB)
        mu_topk = vp.vocab_parallel_log_probs(shard, topk_ids, group, vocab_size=VOCAB)
        return vp.vocab_parallel_policy_stats(
            shard, sampled, group, rollout_logp=mu_lp, topk_ids=topk_ids, topk_logp=mu_topk,
            divergences=vp.DIVERGENCES, vocab_size=VOCAB, chunk_size=3,
        )

    for s in run_tp(tp, fn, x):
        for name in vp.DIVERGENCES:  # zero up to all-reduce summation order (see above)
            assert (getattr(s, name) <= 1e-14).all(), name


def test_topk_support_keeps_each_id_once_in_column_order():
    """S = {a_t} ∪ topK: the first column holding an id keeps it (a_t first), padding (< 0) is
    dropped; against a per-row Python set walk, with many duplicates."""
    from megatron_rl.vocab_parallel import topk_support

    g = torch.Generator().manual_seed(0)
    sampled = torch.randint(0, 6, (300,), generator=g)
    topk = torch.randint(-2, 6, (300, 9), generator=g)
    ids, keep = topk_support(sampled, topk)
    assert keep.tolist() == first_occurrences(ids)
    assert torch.equal(ids[:, 0], sampled) and bool(keep[:, 0].all())


def first_occurrences(ids):
    """Per row, whether each column is the first to hold its id (negative ids never are)."""
    out = []
    for row in ids.tolist():
        seen, want = set(), []
        for i in row:
            want.append(i >= 0 and i not in seen)
            seen.add(i)
        out.append(want)
    return out


def test_topk_support_for_distinct_lists_matches_the_general_one():
    """distinct_topk=True (engine top-K lists, ids distinct) drops only the entry equal to a_t:
    the same support as the sort-based search, and as a per-row Python walk, whenever the lists
    are distinct."""
    from megatron_rl.vocab_parallel import topk_support

    g = torch.Generator().manual_seed(1)
    T, K, V = 400, 7, 12
    topk = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(T)])
    topk[::5, -2:] = -1  # short lists padded with -1 (repeated, but dropped either way)
    sampled = torch.randint(0, V, (T,), generator=g)  # in the list or not
    ids_a, keep_a = topk_support(sampled, topk)
    ids_b, keep_b = topk_support(sampled, topk, distinct_topk=True)
    assert torch.equal(ids_a, ids_b) and torch.equal(keep_a, keep_b)
    assert keep_b.tolist() == first_occurrences(ids_b)
    assert bool((keep_a[:, 1:].sum(-1) < (topk >= 0).sum(-1)).any())  # a_t was in some lists


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_with_distinct_topk_matches_references(tp):
    """The learner's setting: a_t forced into mu's true top-K (as RolloutRecord does), padded
    rows, topk_distinct=True; against the float64 per-token Python sets."""
    K = 5
    mu_x = make_logits(300 + tp, scale=2.0)
    pi_x = mu_x + 0.5 * make_logits(400 + tp, scale=1.0, offset=0.0)
    sampled, mu_lp, topk_ids, topk_lp, _ = rollout_from(mu_x, K, seed=tp)
    missing = ~(topk_ids == sampled[:, None]).any(-1)
    topk_ids[missing, -1], topk_lp[missing, -1] = sampled[missing], mu_lp[missing]
    topk_ids[3, -2:] = -1

    def fn(shard, group, rank):
        x = shard.clone().requires_grad_()
        s = vp.vocab_parallel_policy_stats(
            x, sampled, group, rollout_logp=mu_lp, topk_ids=topk_ids, topk_logp=topk_lp,
            divergences=vp.DIVERGENCES, vocab_size=VOCAB, chunk_size=5, topk_distinct=True,
        )
        s.logp.sum().backward()
        return s, x.grad

    pi_lsm = ref_logp_full(pi_x, VOCAB)
    ttv, tkl = ref_topk(mu_lp, topk_lp, sampled, topk_ids, pi_lsm)
    ref_x = pi_x.clone().requires_grad_()
    ref_logp(ref_x, sampled[:, None], VOCAB).sum().backward()
    results = run_tp(tp, fn, pi_x)
    for s, _ in results:
        close(s.topk_tv, ttv, 1e-10)
        close(s.topk_kl, tkl, 1e-10)
    close(torch.cat([gr for _, gr in results], dim=-1), ref_x.grad, 1e-10)
