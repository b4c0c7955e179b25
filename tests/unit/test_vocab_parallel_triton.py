"""The fused Triton kernels (megatron_rl/vocab_parallel/triton_kernels.py) against float64
full-vocabulary math, run on CPU by Triton's interpreter.

triton lives outside site-packages on purpose (requirements/sglang-cpu-extras.txt): this process
must not see it. So the kernels run in one child process that puts `<venv>/sglang-cpu-extras` on
sys.path and sets TRITON_INTERPRET=1 (this file, run as a script); it computes every case and
saves the results, and the tests here compare them with references computed in this process from
log_softmax over the whole unpadded vocabulary in float64 (autograd for the gradients, Python
loops for the top-K sets; nothing from the module under test).
TP 2 and 4 run as thread-ranks with a real ProcessGroupGloo on a HashStore (as in
test_vocab_parallel.py), so the cross-shard all-reduces are the real ones; the kernels' tile is
set to 16 columns so that every shard spans several tiles (the online max rescaling is exercised),
and at TP 4 the last shard holds only padding. tests/distributed/test_vocab_parallel_gloo.py runs
the kernel once more in real gloo processes (TP 2 and 4).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

T, V_PAD, VOCAB, K, TAU = 12, 96, 70, 4, 0.8  # VOCAB 70 of 96: at TP 4 the last shard is padding
EXTRAS = Path(sys.prefix) / "sglang-cpu-extras"  # where the Makefile installs triton
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------- inputs (child and parent)

def inputs(dtype):
    g = torch.Generator().manual_seed(31)
    x = torch.randn(T, V_PAD, generator=g, dtype=torch.float64) * 4 + 30  # large logits
    x[:, VOCAB:] = 1e4  # padding: must never leak into a result
    x = x.to(dtype)
    mu_x = x.double() + torch.randn(T, V_PAD, generator=g, dtype=torch.float64)
    mu_lsm = torch.log_softmax(mu_x[:, :VOCAB] / TAU, -1)
    sampled = torch.multinomial(mu_lsm.exp(), 1, generator=g)[:, 0]
    topk_lp, topk_ids = mu_lsm.topk(K, -1)
    topk_ids[0, 1] = topk_ids[0, 0]  # a duplicate inside the list
    topk_ids[1, 2] = sampled[1]  # a_t inside the list (it may already be)
    topk_ids[2, -1] = -1  # a short list
    mu_t = mu_lsm.gather(-1, sampled[:, None])[:, 0]
    up = torch.randn(4, T, generator=g, dtype=torch.float64)  # upstream gradients
    return x, sampled, mu_t, topk_ids, topk_lp, up


def odd_ids():
    """[T, 3] ids with padding (>= VOCAB), out-of-range and negative ids, and duplicates."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (T, 3), generator=g)
    ids[0, 0], ids[1, 1], ids[2, 2], ids[3, 0] = VOCAB + 3, -1, V_PAD + 5, 0
    ids[4, 1] = ids[4, 0]
    return ids


# ---------------------------------------------------------------- the child (interpreter)

def _run_tp(tp, fn, x):
    """fn(shard, group) on tp thread-ranks with a real gloo group (test_vocab_parallel.run_tp); each
    rank gets its own copy, since the in-place cases overwrite it."""
    from test_vocab_parallel import run_tp

    return run_tp(tp, lambda shard, group, _rank: fn(shard.clone(), group), x)


def _gather(results):
    """Rank 0's per-token outputs (checked equal on every rank); per-shard tensors joined."""
    sharded = ("grad", "logits_after")
    out = {k: v for k, v in results[0].items() if k not in sharded}
    for r in results[1:]:
        for k, v in out.items():
            assert torch.equal(r[k], v), f"ranks disagree on {k}"
    out.update({k: torch.cat([r[k] for r in results], dim=-1) for k in sharded if k in results[0]})
    return out


def child_cases() -> dict:
    import megatron_rl.vocab_parallel as vp
    from megatron_rl.vocab_parallel import triton_kernels as tk

    tk.DEFAULT_BLOCK_V = 16  # tiles of 16 columns: every shard (24-96 wide) spans several tiles
    torch.set_num_threads(1)
    res = {}

    def stats_case(dtype, divergence_grad=False, inplace=False):
        x, sampled, mu_t, topk_ids, topk_lp, up = inputs(dtype)

        def fn(shard, group):
            shard.requires_grad_()
            s = vp.vocab_parallel_policy_stats(
                shard, sampled, group, rollout_logp=mu_t, topk_ids=topk_ids, topk_logp=topk_lp,
                divergences=vp.DIVERGENCES, with_entropy=True, entropy_grad=True,
                temperature=TAU, vocab_size=VOCAB, divergence_grad=divergence_grad,
                inplace_logits=inplace, kernel="triton")
            loss = (s.logp * up[0]).sum() + 0.1 * (s.entropy * up[1]).sum()
            if divergence_grad:
                loss = loss + (s.topk_tv * up[2]).sum() + (s.topk_kl * up[3]).sum()
            loss.backward()
            out = {k: getattr(s, k).detach() for k in ("logp", "entropy", *vp.DIVERGENCES)}
            out["grad"] = shard.grad
            out["logits_after"] = shard.detach()  # in place: the gradient, else the logits
            return out

        return fn, x

    for (name, dtype), tp in itertools.product(DTYPES.items(), (1, 2, 4)):
        fn, x = stats_case(dtype)
        res[f"{name}_tp{tp}"] = _gather(_run_tp(tp, fn, x))
    fn, x = stats_case(torch.float32, divergence_grad=True)
    res["divgrad_tp2"] = _gather(_run_tp(2, fn, x))
    fn, x = stats_case(torch.bfloat16, inplace=True)
    res["inplace_bf16_tp2"] = _gather(_run_tp(2, fn, x))

    def odd(shard, group):  # invalid ids, no entropy
        shard.requires_grad_()
        lp, _ = tk.triton_log_probs_and_entropy(shard, odd_ids(), group, temperature=TAU,
                                                vocab_size=VOCAB, with_entropy=False)
        (torch.where(torch.isfinite(lp), lp, 0.0) * inputs(torch.float32)[-1][0][:, None]).sum().backward()
        return {"logp": lp.detach(), "grad": shard.grad}

    res["odd_ids_tp4"] = _gather(_run_tp(4, odd, inputs(torch.float32)[0]))

    def entropy_only(shard, group):  # J = 0 ids
        shard.requires_grad_()
        _, h = tk.triton_log_probs_and_entropy(shard, torch.empty(T, 0, dtype=torch.long), group,
                                               temperature=TAU, vocab_size=VOCAB)
        (h * inputs(torch.float32)[-1][1]).sum().backward()
        return {"entropy": h.detach(), "grad": shard.grad}

    res["entropy_only_tp2"] = _gather(_run_tp(2, entropy_only, inputs(torch.float32)[0]))

    os.environ["TRITON_INTERPRET"] = "0"  # CPU tensors without the interpreter: a clear error
    try:
        vp.vocab_parallel_policy_stats(inputs(torch.float32)[0], inputs(torch.float32)[1],
                                       kernel="triton")
    except ValueError as e:
        res["cpu_error"] = str(e)
    return res


# ---------------------------------------------------------------- the parent (references, tests)

@pytest.fixture(scope="module")
def results(tmp_path_factory):
    assert (EXTRAS / "triton").is_dir(), f"no triton in {EXTRAS} (make setup installs it)"
    out = tmp_path_factory.mktemp("triton") / "results.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(EXTRAS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out)


def reference(dtype, divergence_grad=False):
    """float64 values and the gradient of the child's loss w.r.t. the full padded logits."""
    x, sampled, mu_t, topk_ids, topk_lp, up = inputs(dtype)
    x = x.double().requires_grad_()
    lsm = torch.log_softmax(x[:, :VOCAB] / TAU, -1)
    logp = lsm.gather(-1, sampled[:, None])[:, 0]
    ent = -(lsm.exp() * lsm).sum(-1)
    tv, kl = [], []
    for t in range(T):  # S = {a_t} ∪ top-K, each id once, negatives dropped
        ids, mus = [int(sampled[t])], [mu_t[t]]
        for k, i in enumerate(topk_ids[t].tolist()):
            if i >= 0 and i not in ids:
                ids.append(i)
                mus.append(topk_lp[t, k])
        mu, pi = torch.stack(mus).exp(), lsm[t, ids].exp()
        rm, rp = (1 - mu.sum()).clamp(min=1e-12), (1 - pi.sum()).clamp(min=1e-12)
        tv.append(0.5 * ((mu - pi).abs().sum() + (rm - rp).abs()))
        kl.append((mu * (mu.log() - pi.log())).sum() + rm * (rm.log() - rp.log()))
    tv, kl = torch.stack(tv), torch.stack(kl)
    loss = (logp * up[0]).sum() + 0.1 * (ent * up[1]).sum()
    if divergence_grad:
        loss = loss + (tv * up[2]).sum() + (kl * up[3]).sum()
    loss.backward()
    p, m = logp.exp(), mu_t.exp()
    ref = {"logp": logp, "entropy": ent, "topk_tv": tv, "topk_kl": kl, "binary_tv": (m - p).abs(),
           "binary_kl": m * (m.log() - p.log()) + (1 - m) * ((1 - m).log() - (1 - p).log())}
    return {k: v.detach() for k, v in ref.items()}, x.grad


def close(a, b, tol, what, rel=0.0):
    a, b = a.double(), b.double()
    both_inf = torch.isinf(a) & torch.isinf(b) & (a.sign() == b.sign())
    err = torch.where(both_inf, torch.zeros_like(a), (a - b).abs() - rel * b.abs())
    assert err.max().item() <= tol, f"{what}: max error {err.max().item():.3e} > {tol:.0e}"


# fp32 accumulation on logits of ~40 / tau: ~1e-6 absolute. bf16 gradients are rounded once, at
# the store: compiled Triton rounds to nearest (2^-8 relative; tests/gpu checks that), but the
# interpreter's fp32 -> bf16 cast truncates (triton 3.9 `cast_impl`), so here one ulp, 2^-7.
VALUE_TOL = 2e-5
GRAD_TOL = {"fp32": (1e-5, 0.0), "bf16": (1e-7, 2.0**-7)}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_triton_policy_stats_match_float64(results, dtype, tp):
    r = results[f"{dtype}_tp{tp}"]
    ref, grad = reference(DTYPES[dtype])
    for name, value in ref.items():
        close(r[name], value, VALUE_TOL, f"{dtype} tp{tp} {name}")
    assert r["grad"].dtype == DTYPES[dtype]
    atol, rel = GRAD_TOL[dtype]
    close(r["grad"], grad, atol, f"{dtype} tp{tp} grad", rel)
    assert torch.equal(r["logits_after"], inputs(DTYPES[dtype])[0])  # not in place: intact


@pytest.mark.slow
def test_triton_divergence_gradients_match_float64(results):
    r = results["divgrad_tp2"]
    ref, grad = reference(torch.float32, divergence_grad=True)
    for name, value in ref.items():
        close(r[name], value, VALUE_TOL, name)
    # The top-K rest buckets 1 - sum pi are formed in fp32 (divergences.py, either kernel): the
    # torch path is 7.7e-6 off here too, on gradients up to 2.2.
    close(r["grad"], grad, 2e-5, "grad through log pi, entropy, top-K TV and KL")


@pytest.mark.slow
def test_triton_inplace_writes_the_same_gradient_over_the_logits(results):
    r = results["inplace_bf16_tp2"]
    assert torch.equal(r["logits_after"], r["grad"])  # the backward wrote over the logits
    assert torch.equal(r["grad"], results["bf16_tp2"]["grad"])  # and bitwise the usual gradient


@pytest.mark.slow
def test_triton_invalid_ids_and_entropy_only(results):
    x = inputs(torch.float32)[0].double().requires_grad_()
    up = inputs(torch.float32)[-1]
    ids = odd_ids()
    lsm = torch.log_softmax(x[:, :VOCAB] / TAU, -1)
    ok = (ids >= 0) & (ids < VOCAB)
    lp = torch.where(ok, lsm.gather(-1, ids.clamp(0, VOCAB - 1)), float("-inf"))
    (torch.where(ok, lp, 0.0) * up[0][:, None]).sum().backward()
    r = results["odd_ids_tp4"]
    assert torch.isinf(r["logp"][~ok]).all() and (r["logp"][~ok] < 0).all()
    close(r["logp"], lp.detach(), VALUE_TOL, "odd ids logp")
    close(r["grad"], x.grad, GRAD_TOL["fp32"][0], "odd ids grad")

    x.grad = None
    lsm = torch.log_softmax(x[:, :VOCAB] / TAU, -1)
    ent = -(lsm.exp() * lsm).sum(-1)
    (ent * up[1]).sum().backward()
    close(results["entropy_only_tp2"]["entropy"], ent.detach(), VALUE_TOL, "entropy")
    close(results["entropy_only_tp2"]["grad"], x.grad, GRAD_TOL["fp32"][0], "entropy grad")
    assert "CUDA" in results["cpu_error"] and "TRITON_INTERPRET" in results["cpu_error"]


# ---------------------------------------------------------------- unit tier (no triton needed)

def test_unknown_kernel_names_the_valid_ones():
    import megatron_rl.vocab_parallel as vp

    x, sampled = inputs(torch.float32)[:2]
    with pytest.raises(ValueError, match="unknown kernel 'cuda'; valid: torch, triton"):
        vp.vocab_parallel_policy_stats(x, sampled, kernel="cuda")


def test_triton_kernel_without_triton_is_a_clear_error():
    import megatron_rl.vocab_parallel as vp
    from megatron_rl.vocab_parallel import triton_kernels as tk

    if tk.triton_available():
        pytest.skip("triton is importable in this process (this checks the install without it)")
    x, sampled = inputs(torch.float32)[:2]
    with pytest.raises(ImportError, match="needs the triton package.*kernel='torch'"):
        vp.vocab_parallel_policy_stats(x, sampled, kernel="triton")
    assert "triton" not in sys.modules


if __name__ == "__main__":  # the child: TRITON_INTERPRET=1, triton on PYTHONPATH (see `results`)
    torch.save(child_cases(), sys.argv[1])
