"""models/torch_spec.py's expert path without host synchronisation: `SortedTokenDispatcher` (device-side
permutation with static shapes) and `GroupedExperts` reading its weights in place.

- The dispatcher against megatron-core's own unfused `permute` / `unpermute` (moe_utils, the local
  spec's all-to-all dispatcher at EP = ETP = 1): the same permuted rows in the same order, the same
  probabilities, the same counts, the same combined output; gradients of input and probabilities
  through the dispatcher against float64 autograd through megatron-core's functions.
- Zero host synchronisations in a routed layer's forward and backward (dispatch -> grouped GEMMs ->
  combine, counts kept on the device): every call that makes the host wait for a device (`.item()`,
  `.tolist()`, `.cpu()`, `.numpy()`, a tensor's truth value or int/float, `nonzero`, `masked_select`,
  `unique`, `bincount`, tensor-sized `repeat_interleave`, `torch.cuda.synchronize`, stream/event
  waits) is patched to count; megatron-core's path through the same counter makes several, which
  shows the counter sees them.
- `GroupedExperts`' weights: the per-expert parameters are views of one [E, out, in] stack, which
  the grouped GEMM reads without a copy; gradients reach each parameter.
Model-level equality (torch spec = local spec = HF at TP2, PP2, EP2 + R3) is in tests/distributed;
the MoE layer built from the torch spec at TP1 / TP2 x SP (sorted dispatch) and EP2 (megatron-core's
dispatcher) against the local spec's layer, outputs and every gradient, with the host syncs of the
whole layer counted (zero with the sorted dispatch), is the `slow` test at the end.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_rl.models import torch_spec
from megatron_rl.models.torch_spec import SortedTokenDispatcher, _stacked_view, grouped_linear

T, E, K, H = 13, 6, 3, 8  # tokens, experts, top-k, hidden


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E,
                             moe_router_topk=K, moe_token_dispatcher_type="alltoall", **kw)


def _routing(g, T=T):
    """A router's output: [T, E] probabilities (zero off the route) and the boolean map."""
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    top = logits.topk(K, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, top, True)
    probs = torch.zeros(T, E, dtype=torch.float64).scatter(1, top, torch.softmax(logits.gather(1, top), -1))
    return probs, routing_map


def test_sorted_dispatch_equals_megatron_permute_and_unpermute():
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    g = torch.Generator().manual_seed(0)
    probs, routing_map = _routing(g)
    x = torch.randn(T, 1, H, generator=g, dtype=torch.float64)
    d = SortedTokenDispatcher(_config(), E)
    x_J, p_J = d.token_dispatch(*d.dispatch_preprocess(x, routing_map, probs))
    x_J, counts, p_J = d.dispatch_postprocess(x_J, p_J)
    ref_x, ref_p, ref_idx = permute(x.view(T, H), routing_map, probs=probs, num_out_tokens=T * K)
    assert torch.equal(x_J, ref_x) and torch.equal(p_J, ref_p)
    assert torch.equal(counts, routing_map.sum(0)) and counts.device == x.device
    y_J = torch.randn(T * K, H, generator=g, dtype=torch.float64)  # the experts' output rows
    out = d.combine_postprocess(d.token_combine(d.combine_preprocess(y_J)))
    ref = unpermute(y_J, ref_idx, restore_shape=(T, H), routing_map=routing_map)
    assert out.shape == x.shape
    torch.testing.assert_close(out.view(T, H), ref, rtol=1e-12, atol=1e-12)


def test_sorted_dispatch_gradients_equal_megatron_autograd():
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    g = torch.Generator().manual_seed(1)
    probs0, routing_map = _routing(g)
    x0 = torch.randn(T, 1, H, generator=g, dtype=torch.float64)
    w = torch.randn(H, H, generator=g, dtype=torch.float64)
    up = torch.randn(T, 1, H, generator=g, dtype=torch.float64)

    def run(dispatch):
        x, probs = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
        out = dispatch(x, probs)
        (out * up).sum().backward()
        return out.detach(), x.grad, probs.grad

    def ours(x, probs):
        d = SortedTokenDispatcher(_config(), E)
        x_J, p_J = d.dispatch_preprocess(x, routing_map, probs)
        x_J, _, p_J = d.dispatch_postprocess(x_J, p_J)
        return d.combine_postprocess(torch.tanh(x_J @ w) * p_J[:, None])

    def megatron(x, probs):
        x_J, p_J, idx = permute(x.view(T, H), routing_map, probs=probs, num_out_tokens=T * K)
        return unpermute(torch.tanh(x_J @ w) * p_J[:, None], idx, restore_shape=(T, H),
                         routing_map=routing_map).view(T, 1, H)

    for a, b in zip(run(ours), run(megatron)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------
# host synchronisations
_SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero",
                 "masked_select", "unique", "bincount", "repeat_interleave")
_SYNC_FUNCTIONS = ("nonzero", "masked_select", "unique", "bincount", "repeat_interleave")


@contextlib.contextmanager
def counting_host_syncs(monkeypatch):
    """Count every call that would make the host wait for the device (see the module docstring).
    `repeat_interleave` counts only with tensor repeats and no `output_size` (its output size is
    then data-dependent)."""
    calls: list[str] = []

    def wrap(name, fn):
        def counted(*args, **kwargs):
            if name == "repeat_interleave":
                repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
                if not torch.is_tensor(repeats) or kwargs.get("output_size") is not None:
                    return fn(*args, **kwargs)
            calls.append(name)
            return fn(*args, **kwargs)
        return counted

    with monkeypatch.context() as m:
        for name in _SYNC_METHODS:
            m.setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
        for name in _SYNC_FUNCTIONS:
            m.setattr(torch, name, wrap(name, getattr(torch, name)))
        m.setattr(torch.cuda, "synchronize", wrap("cuda.synchronize", torch.cuda.synchronize))
        m.setattr(torch.cuda.Event, "synchronize", wrap("Event.synchronize", torch.cuda.Event.synchronize))
        m.setattr(torch.cuda.Stream, "synchronize", wrap("Stream.synchronize", torch.cuda.Stream.synchronize))
        yield calls


def _stacked_experts(g, F=4, dtype=torch.float32):
    """E experts' fc1 [2F, H] / fc2 [H, F] as parameters viewing one stack each (GroupedExperts'
    layout)."""
    stacks = [torch.randn(E, 2 * F, H, generator=g, dtype=dtype), torch.randn(E, H, F, generator=g, dtype=dtype)]
    params = []
    for buf in stacks:
        ps = [torch.nn.Parameter(torch.empty(0, dtype=dtype)) for _ in range(E)]
        for e, p in enumerate(ps):
            p.data = buf[e]
        params.append(ps)
    return stacks, params


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_routed_layer_makes_no_host_sync_forward_or_backward(monkeypatch):
    """Dispatch -> grouped fc1 -> SwiGLU x prob -> grouped fc2 -> combine, forward and backward, as
    `GroupedExperts` runs it where the grouped kernel exists: zero host synchronisations; megatron-
    core's unfused permute / per-expert loop through the same counter: several."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    g = torch.Generator().manual_seed(2)
    probs0, routing_map = _routing(g)
    probs0 = probs0.float()
    x0 = torch.randn(T, 1, H, generator=g)
    (s1, s2), (w1, w2) = _stacked_experts(g)

    def ours():
        x, probs = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
        d = SortedTokenDispatcher(_config(), E)
        x_J, p_J = d.token_dispatch(*d.dispatch_preprocess(x, routing_map, probs))
        x_J, counts, p_J = d.dispatch_postprocess(x_J, p_J)
        offsets = counts.cumsum(0).to(torch.int32)
        h = grouped_linear(x_J, w1, counts, offsets, grouped=True, stacked=_stacked_view(s1, w1))
        gate, lin = h.chunk(2, -1)
        h = torch.nn.functional.silu(gate) * lin * p_J[:, None]
        y = grouped_linear(h, w2, counts, offsets, grouped=True, stacked=_stacked_view(s2, w2))
        out = d.combine_postprocess(y)
        out.square().sum().backward()
        return out

    def megatron():
        x, probs = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
        x_J, p_J, idx = permute(x.view(T, H), routing_map, probs=probs, num_out_tokens=T * K)
        counts = routing_map.sum(0)
        h = grouped_linear(x_J, w1, counts, grouped=False)
        gate, lin = h.chunk(2, -1)
        y = grouped_linear(torch.nn.functional.silu(gate) * lin * p_J[:, None], w2, counts, grouped=False)
        out = unpermute(y, idx, restore_shape=(T, H), routing_map=routing_map)
        out.square().sum().backward()
        return out

    with counting_host_syncs(monkeypatch) as calls:
        out = ours()
    assert calls == [], f"host synchronisations in the routed layer: {calls}"
    for p in w1 + w2:
        p.grad = None
    with counting_host_syncs(monkeypatch) as calls:
        ref = megatron()
    assert len(calls) >= 3, calls  # masked_select x2 (map, probs), tolist of the counts, ...
    torch.testing.assert_close(out.view(T, H), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_grouped_experts_read_their_weights_in_place_and_grads_reach_each(monkeypatch):
    g = torch.Generator().manual_seed(3)
    counts = [5, 0, 9, 2, 1, 3]
    x = torch.randn(sum(counts), H, generator=g, requires_grad=True)
    (s1, _), (w1, _) = _stacked_experts(g)
    seen = []
    grouped_mm = torch._grouped_mm

    def spy(a, b, **kw):
        seen.append(b)
        return grouped_mm(a, b, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    stacked = _stacked_view(s1, w1)
    assert stacked is not None
    y = grouped_linear(x, w1, torch.tensor(counts), grouped=True, stacked=stacked)
    assert seen[0].data_ptr() == s1.data_ptr()  # the stack itself: no copy
    up = torch.randn_like(y)
    (y * up).sum().backward()
    ref_w = [w.detach().clone().requires_grad_() for w in w1]
    ref_x = x.detach().clone().requires_grad_()
    ref = grouped_linear(ref_x, ref_w, counts, grouped=False)
    (ref * up).sum().backward()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-5)
    for w, r in zip(w1, ref_w):
        torch.testing.assert_close(w.grad, r.grad, rtol=1e-5, atol=1e-5)
    # A parameter whose storage was rebound (e.g. a distributed optimizer's buffer): no view.
    w1[2].data = w1[2].data.clone()
    assert _stacked_view(s1, w1) is None


# --------------------------------------------------------------------------------------------
# the layer from the spec, in spawned ranks (slow tier)
def _layer_worker(rank: int, world_size: int, parallel: dict) -> dict:
    """Build one MoE layer under the local spec and the torch spec (same weights), run forward and
    backward on the same input, count host syncs in the torch spec's layer."""


    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    from megatron_rl.config.schema import ParallelConfig
    from megatron_rl.distributed.context import init_distributed

    ctx = init_distributed(ParallelConfig(**parallel))
    model_parallel_cuda_manual_seed(0)
    # The grouped kernel as on a GPU (torch 2.13 runs torch._grouped_mm on CPU in fp32 too).
    torch_spec.grouped_mm_supported = lambda *tensors: True
    tp = ctx.tp
    cfg = _config(tensor_model_parallel_size=tp, expert_model_parallel_size=ctx.ep,
                  sequence_parallel=ctx.sequence_parallel, moe_grouped_gemm=False, add_bias_linear=False,
                  gated_linear_unit=True, activation_func=torch.nn.functional.silu, moe_ffn_hidden_size=4,
                  ffn_hidden_size=16, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                  moe_permute_fusion=False, moe_router_fusion=False, bias_activation_fusion=False,
                  gradient_accumulation_fusion=False, params_dtype=torch.float32)
    local = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False).layer_specs[0].submodules.mlp
    ours = torch_spec.get_torch_decoder_block_spec(cfg).layer_specs[0].submodules.mlp
    layers = {}
    for name, spec in (("local", local), ("torch", ours)):
        torch.manual_seed(0)
        layers[name] = build_module(spec, config=cfg)
    layers["torch"].load_state_dict(layers["local"].state_dict())
    S, B = 8, 2
    g = torch.Generator().manual_seed(7 + mpu.get_data_parallel_rank(with_context_parallel=True))
    x0 = torch.randn(S // (tp if ctx.sequence_parallel else 1), B, H, generator=g).to(ctx.device)
    out = {"dispatcher": type(layers["torch"].token_dispatcher).__name__,
           "in_place": layers["torch"].experts.stacked_in_place()}
    for name, layer in layers.items():
        x = x0.clone().requires_grad_()
        calls = []
        patched = {}
        if name == "torch":  # count host syncs (see counting_host_syncs)
            for m in _SYNC_METHODS:
                orig = getattr(torch.Tensor, m)
                patched[m] = orig

                def counted(*a, _m=m, _orig=orig, **k):
                    if _m != "repeat_interleave" or (len(a) > 1 and torch.is_tensor(a[1])):
                        calls.append(_m)
                    return _orig(*a, **k)
                setattr(torch.Tensor, m, counted)
        try:
            y, _ = layer(x)
            y.square().sum().backward()
        finally:
            for m, orig in patched.items():
                setattr(torch.Tensor, m, orig)
        grads = {k: p.grad.clone() for k, p in layer.named_parameters()}
        out[name] = dict(y=y.detach().cpu(), gx=x.grad.cpu(), grads={k: v.cpu() for k, v in grads.items()},
                         syncs=calls)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("parallel,world,dispatcher", [
    ({}, 1, "SortedTokenDispatcher"), ({"tp": 2}, 2, "SortedTokenDispatcher"),
    ({"ep": 2}, 2, "MoEAlltoAllTokenDispatcher")], ids=["tp1", "tp2_sp", "ep2"])
def test_torch_spec_moe_layer_equals_local_spec_layer(parallel, world, dispatcher, monkeypatch):
    from megatron_rl.distributed.spawn import run_distributed

    ranks = run_distributed(_layer_worker, world, parallel)
    for r in ranks:
        assert r["dispatcher"] == dispatcher and r["in_place"]
        loc, ours = r["local"], r["torch"]
        torch.testing.assert_close(ours["y"], loc["y"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours["gx"], loc["gx"], rtol=1e-5, atol=1e-6)
        assert set(ours["grads"]) == set(loc["grads"])
        for k in loc["grads"]:
            torch.testing.assert_close(ours["grads"][k], loc["grads"][k], rtol=1e-5, atol=1e-6, msg=k)
        if dispatcher == "SortedTokenDispatcher":
            assert ours["syncs"] == [], ours["syncs"]  # the whole layer, forward and backward
        else:  # megatron-core's all-to-all needs its split sizes on the host
            assert ours["syncs"], "the sync counter saw nothing in megatron-core's EP dispatcher"


def _ddp_like(weights_in_module_order, gaps):
    """Give parameters `main_grad`s as megatron-core's DDP does: one fp32 buffer, parameters laid
    out in reverse order (`params[::-1]`), `gaps(i)` elements before the i-th (0: back to back,
    without the distributed optimizer; the same for all: its alignment; else an irregular layout)."""
    ps = weights_in_module_order[::-1]
    buf = torch.zeros(sum(p.numel() + gaps(i) for i, p in enumerate(ps)), dtype=torch.float32)
    at = 0
    for i, p in enumerate(ps):
        at += gaps(i)
        p.main_grad = buf[at:at + p.numel()].view(p.shape)
        p.grad_added_to_main_grad = False
        at += p.numel()
    return buf


def _ddp_hook(p):
    """DDP's backward post-hook (distributed_data_parallel.py `_make_backward_post_hook`)."""
    if p.grad is not None and not p.grad_added_to_main_grad:
        p.main_grad.add_(p.grad.data)
    p.grad = None


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "hooks"])
@pytest.mark.parametrize("layout", ["back_to_back", "aligned", "irregular"])
def test_expert_gradients_reach_main_grad_in_one_kernel(layout, fused, monkeypatch):
    """Wherever DDP's buffer puts the experts' `main_grad`s (reversed, aligned, with irregular
    gaps) the backward adds each projection's [E, N, K] gradient there in one operation and the
    hooks skip theirs; with the fusion off the hooks add. Either way each expert gets exactly its
    gradient summed over micro-batches, nothing else in the buffer moves, and no parameter keeps
    a .grad."""
    from megatron_rl.models.torch_spec import _main_grad_rows

    monkeypatch.setattr(torch_spec, "FUSED_EXPERT_GRAD_ACCUMULATION", fused)
    g = torch.Generator().manual_seed(5)
    n, k1, k2 = 4, (6, 5), (5, 3)
    stacks = [torch.randn(n, *k, generator=g) for k in (k1, k2)]
    fc = [[torch.nn.Parameter(s[e]) for e in range(n)] for s in stacks]
    for s, ps in zip(stacks, fc):  # the parameters are views of their stack, as GroupedExperts keeps them
        for e, p in enumerate(ps):
            p.data = s[e]
    gaps = {"back_to_back": lambda i: 0, "aligned": lambda i: 64, "irregular": lambda i: 7 * (i == 3)}[layout]
    buf = _ddp_like([p for e in range(n) for p in (fc[0][e], fc[1][e])], gaps)  # expert e: fc1, fc2
    rows = [_main_grad_rows(ps) if fused else None for ps in fc]
    assert all((r is not None) == fused for r in rows)
    for p in fc[0] + fc[1]:
        p.register_post_accumulate_grad_hook(_ddp_hook)
    coef = [torch.randn(n, *k, generator=g) for k in (k1, k2)]
    for _ in range(2):  # two micro-batches
        loss = sum((_stacked_view(s, ps, r) * c).sum() for s, ps, r, c in zip(stacks, fc, rows, coef))
        loss.backward()
        for p in fc[0] + fc[1]:
            assert p.grad is None and p.grad_added_to_main_grad == fused
    for ps, c in zip(fc, coef):
        for e, p in enumerate(ps):
            torch.testing.assert_close(p.main_grad, 2 * c[e], rtol=0, atol=1e-6)
    # the gaps stayed zero: the sum of the buffer is the sum of the expert gradients
    assert abs(buf.sum().item() - 2 * sum(c.sum().item() for c in coef)) < 1e-4


_KERNEL_CHILD = """
import sys, torch
from megatron_rl.models.triton_accumulate import accumulate_rows
E, N, K = 5, 7, 9  # N*K = 63: one partial block
g = torch.Generator().manual_seed(0)
worst = {}
for dt in (torch.bfloat16, torch.float32):
    buf = torch.full((E * N * K + 70,), 0.5)
    offsets = torch.tensor([70 + 4 * N * K, 3 * N * K + 3, 2 * N * K, N * K, 0], dtype=torch.int64)
    grad = torch.randn(E, N, K, generator=g).to(dt)
    ref = buf.double().clone()
    for e in range(E):
        ref[offsets[e]:offsets[e] + N * K] += grad[e].double().flatten()
    accumulate_rows(buf, offsets, grad)
    worst[str(dt)] = (buf.double() - ref).abs().max().item()
print(worst)
"""


@pytest.mark.slow
def test_accumulate_kernel_under_the_triton_interpreter():
    """The CUDA path of `_accumulate_main_grads` (models/triton_accumulate.py) run by Triton's
    interpreter (the triton the Makefile keeps off sys.path): each row added at its offset (rows
    reversed, one gap, a partial block), the rest of the buffer untouched, against float64."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    extras = Path(sys.prefix) / "sglang-cpu-extras"
    assert (extras / "triton").is_dir(), f"no triton in {extras} (make setup installs it)"
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(extras), str(repo), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _KERNEL_CHILD], env=env, capture_output=True, text=True,
                          timeout=300, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-4000:]
    worst = eval(proc.stdout.strip().splitlines()[-1])
    assert worst["torch.bfloat16"] == 0.0 and worst["torch.float32"] <= 1e-6, worst  # one fp32 rounding
