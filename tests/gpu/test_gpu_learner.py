"""(a) The learner on one GPU over NCCL: Megatron-Core with the local (non-TE) layer spec, bf16
parameters with fp32 main grads, against transformers on the same device; and the same model and
a tiny MoE under `model.spec=torch` (SDPA attention, grouped expert GEMMs, models/torch_spec.py),
forward only, against transformers with the same tolerances.

Logits tolerance. Both models compute in bf16 with fp32 accumulation, in different op orders
(fused QKV, Megatron's unfused softmax attention vs transformers' SDPA, other reduction orders),
so neither is "right": the reference is transformers in fp32 on the same device, and Megatron in
bf16 must be within 4x transformers' own bf16 error of it (+ 1e-3 for rounding at tiny errors),
for the max and the mean |Δ log-softmax| and for the loss. 4x, not 1x: Megatron's local attention
rounds the scores to bf16 before its fp32 softmax, where SDPA keeps them in fp32. bf16 rounding
(unit roundoff 2^-8) gives ~1e-2; a mapping or kernel error is O(1) (seen: a garbage rotary
buffer moved the log-softmax by 0.3, 55x transformers' bf16 error, on the CPU dry run's model). Megatron in fp32 must match transformers in fp32 to
2e-4 (fp32 rounding, different op order; TF32 stays off, torch's default), which checks the weight
mapping itself. The torch spec's bf16 MoE runs its experts through `torch._grouped_mm` where the
device has the grouped kernel (CUDA 9.0+): the number of grouped calls is recorded and checked
(none on CPU, where the per-expert loop runs).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest

import gpu_common

SHAPES = {
    # A Qwen3-shaped model big enough for real GEMM tiles and flash-attention blocks, small
    # enough to build in seconds.
    "cuda": dict(model=dict(num_layers=4, hidden=512, heads=8, kv_heads=4, head_dim=64, ffn=1536,
                            vocab_size=8192, max_positions=512),
                 batch=8, seq=256, micro_batch=4),
    "cpu": dict(model=dict(num_layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128,
                           vocab_size=256, max_positions=128),
                batch=4, seq=32, micro_batch=2),
}
MOE = dict(moe=True, num_experts=4, topk=2, moe_ffn=64)
STEPS = 5


def _config(hf_path: Path, dtype: str, micro_batch: int, spec: str = "local"):
    from megatron_rl.config.load import load_config, to_object

    return to_object(load_config("tiny_cpu", [
        f"model.hf_path={hf_path}", f"model.spec={spec}", f"model.dtype={dtype}", "optim.lr=1e-3",
        "optim.clip_grad=1.0", f"learner.micro_batch_size={micro_batch}"]))


def _batch(vocab: int, batch: int, seq: int):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq)
    mask[:, -1] = 0  # the last position predicts nothing
    return dict(input_ids=ids, labels=torch.roll(ids, -1, 1), loss_mask=mask)


def _megatron_lsm(learner, batch, vocab):
    """log-softmax over the real vocabulary of the learner's logits, [B, S, vocab] float64."""
    import torch

    for m in learner.model:
        m.eval()

    def collect(logits_BSV, mb, tp_group, vocab_size):
        return logits_BSV.new_zeros(()), {"logits": logits_BSV.detach().float().clone()}

    with torch.no_grad():
        per_mb = learner.run_micro_batches(batch, collect, forward_only=True)
    S = batch["input_ids"].shape[1]
    logits = torch.cat([m["logits"] for m in per_mb])[:, :S, :vocab]
    return torch.log_softmax(logits.double(), -1)


def _hf_lsm(hf_path, dtype, batch, vocab, dev):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=dtype).to(dev).eval()
        logits = model(batch["input_ids"].to(dev)).logits
    del model
    return torch.log_softmax(logits[..., :vocab].double(), -1)


def _errors(lsm, ref, batch):
    import torch

    mask = batch["loss_mask"].to(lsm.device) > 0
    d = (lsm - ref).abs()[mask]
    nll = lambda x: float(-(x.gather(-1, batch["labels"].to(x.device)[..., None])[..., 0])[mask].mean())
    return {"max": float(d.max()), "mean": float(d.mean()), "loss": nll(lsm), "loss_ref": nll(ref)}


def worker(shapes: dict) -> dict:
    """Both models in one process: transformers' references first, then Megatron.

    The order matters on CPU only: megatron-core's CPU layer (installed by start_group) wraps
    torch's factory functions, and from_pretrained under it leaves the rotary inv_freq buffer
    uninitialised (seen: garbage logits). On GPU the layer is not installed.
    """
    import torch

    from megatron_rl.learner.learner import Learner
    from megatron_rl.models.tiny import make_tiny_checkpoint

    dev = torch.device(gpu_common.device())
    tmp = Path(tempfile.mkdtemp())
    vocab = shapes["model"]["vocab_size"]
    batch = _batch(vocab, shapes["batch"], shapes["seq"])
    hf = make_tiny_checkpoint(tmp / "dense", **shapes["model"])
    hf_moe = make_tiny_checkpoint(tmp / "moe", **shapes["model"], **MOE)
    ref = _hf_lsm(hf, torch.float32, batch, vocab, dev)
    hf_bf16 = _hf_lsm(hf, torch.bfloat16, batch, vocab, dev)
    ref_moe = _hf_lsm(hf_moe, torch.float32, batch, vocab, dev)
    hf_moe_bf16 = _hf_lsm(hf_moe, torch.bfloat16, batch, vocab, dev)

    ctx = gpu_common.start_group()
    out: dict = {"backend": torch.distributed.get_backend()}
    learner = Learner(_config(hf, "bfloat16", shapes["micro_batch"]), ctx, run_dir=str(tmp), total_steps=STEPS)
    modules = {type(m).__module__ + "." + type(m).__name__ for c in learner.model for m in c.modules()}
    out["te_modules"] = sorted(m for m in modules if m.startswith("transformer_engine"))
    out["local_attention"] = "megatron.core.transformer.dot_product_attention.DotProductAttention" in modules
    out["param_dtypes"] = sorted({str(p.dtype) for c in learner.model for p in c.parameters()})
    out["param_devices"] = sorted({p.device.type for c in learner.model for p in c.parameters()})

    out["hf_bf16"] = _errors(hf_bf16, ref, batch)
    out["megatron_bf16"] = _errors(_megatron_lsm(learner, batch, vocab), ref, batch)
    fp32 = Learner(_config(hf, "float32", shapes["micro_batch"]), ctx, run_dir=str(tmp), trainable=False)
    out["megatron_fp32"] = _errors(_megatron_lsm(fp32, batch, vocab), ref, batch)
    del fp32

    losses, grad_norms = [], []
    for _ in range(STEPS):
        m = learner.train_step(batch)
        losses.append(m["loss"])
        grad_norms.append(m["grad_norm"])
        out.setdefault("update_skipped", []).append(m["update_skipped"])
    out["losses"], out["grad_norms"] = losses, grad_norms
    main = [p.main_grad for c in learner.model for p in c.parameters()]
    out["main_grad_dtypes"] = sorted({str(g.dtype) for g in main})
    out["main_grads_finite"] = all(bool(torch.isfinite(g).all()) for g in main)
    out["main_grads_nonzero"] = sum(bool(g.abs().sum() > 0) for g in main) / len(main)
    opts = getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])
    out["optimizers"] = sorted({type(o).__name__ for o in opts})
    masters = [p for o in opts for g in getattr(o, "fp32_from_float16_groups", []) for p in g]
    out["master_dtypes"] = sorted({str(p.dtype) for p in masters})
    out["master_count"], out["param_count"] = len(masters), len(main)
    del learner

    moe = Learner(_config(hf_moe, "float32", shapes["micro_batch"]), ctx, run_dir=str(tmp), trainable=False)
    experts = {type(m).__name__ for c in moe.model for m in c.modules() if "experts" in type(m).__module__}
    out_moe = {"experts": sorted(experts), "megatron_fp32": _errors(_megatron_lsm(moe, batch, vocab), ref_moe, batch)}
    del moe
    return {"dense": out, "moe": out_moe, "torch_spec": _torch_spec(ctx, hf, hf_moe, tmp, shapes, batch,
                                                                 dict(dense=ref, moe=ref_moe),
                                                                 dict(dense=hf_bf16, moe=hf_moe_bf16))}


def _torch_spec(ctx, hf, hf_moe, tmp, shapes, batch, ref, hf_bf16) -> dict:
    """model.spec=torch, forward only: {model: {dtype: errors vs transformers fp32}}, the modules
    it built, and how many torch._grouped_mm calls the bf16 MoE forward made."""
    import torch

    from megatron_rl.learner.learner import Learner

    vocab = shapes["model"]["vocab_size"]
    calls = [0]
    grouped_mm = getattr(torch, "_grouped_mm", None)

    def counting(*args, **kwargs):
        calls[0] += 1
        return grouped_mm(*args, **kwargs)

    out = {"modules": set()}
    for model, path in (("dense", hf), ("moe", hf_moe)):
        out[model] = {"hf_bf16": _errors(hf_bf16[model], ref[model], batch)}
        for dtype in ("float32", "bfloat16"):
            learner = Learner(_config(path, dtype, shapes["micro_batch"], spec="torch"), ctx,
                              run_dir=str(tmp), trainable=False)
            out["modules"] |= {type(m).__name__ for c in learner.model for m in c.modules()}
            if grouped_mm is not None:
                torch._grouped_mm = counting
            try:
                out[model][dtype] = _errors(_megatron_lsm(learner, batch, vocab), ref[model], batch)
            finally:
                if grouped_mm is not None:
                    torch._grouped_mm = grouped_mm
            if model == "moe" and dtype == "bfloat16":
                out["moe_bf16_grouped_mm_calls"] = calls[0]
            calls[0] = 0
            del learner
    out["grouped_kernel_here"] = bool(torch.cuda.is_available() and grouped_mm is not None
                                      and torch.cuda.get_device_capability() >= (9, 0))
    out["modules"] = sorted(out["modules"])
    return out


@pytest.fixture(scope="module")
def results():
    return gpu_common.run_isolated(worker, SHAPES[gpu_common.device()], timeout=480)


@pytest.fixture(scope="module")
def dense(results):
    return results["dense"]


def test_bf16_params_fp32_main_grads_local_spec_over_the_expected_backend(dense):
    assert dense["backend"] == ("nccl" if gpu_common.cuda() else "gloo")
    assert dense["te_modules"] == [] and dense["local_attention"], dense
    assert dense["param_dtypes"] == ["torch.bfloat16"]
    assert dense["param_devices"] == [gpu_common.device()]
    assert dense["main_grad_dtypes"] == ["torch.float32"]
    assert dense["optimizers"] == ["Float16OptimizerWithFloat16Params"], dense["optimizers"]
    assert dense["master_dtypes"] == ["torch.float32"] and dense["master_count"] == dense["param_count"]


def test_logits_and_loss_match_transformers_within_bf16_tolerance(dense):
    hf, meg, meg32 = dense["hf_bf16"], dense["megatron_bf16"], dense["megatron_fp32"]
    gpu_common.record("a_learner", {"logsoftmax_error_vs_hf_fp32": {
        "megatron_bf16": meg, "hf_bf16": hf, "megatron_fp32": meg32}})
    assert meg32["max"] <= 2e-4, meg32  # the mapping: fp32 against fp32
    for k in ("max", "mean"):
        assert meg[k] <= 4 * hf[k] + 1e-3, (k, meg, hf)
    # The loss is a mean: transformers' own error may cancel to ~0 by chance, hence a 5e-3 floor
    # (the loss is ~log V = 9; a wrong weight moves it by O(0.1)).
    assert abs(meg["loss"] - meg["loss_ref"]) <= 4 * abs(hf["loss"] - hf["loss_ref"]) + 5e-3, (meg, hf)


def test_optimizer_steps_lower_the_loss_with_finite_grads(dense):
    losses, norms = dense["losses"], dense["grad_norms"]
    gpu_common.record("a_learner", {"fixed_batch_losses": losses, "grad_norms": norms})
    assert all(math.isfinite(x) for x in losses + norms) and min(norms) > 0, (losses, norms)
    assert dense["update_skipped"] == [0.0] * STEPS
    assert dense["main_grads_finite"] and dense["main_grads_nonzero"] > 0.9, dense
    assert all(b < a for a, b in zip(losses, losses[1:])), losses  # Adam on one fixed batch
    assert losses[-1] < losses[0] - 0.05, losses


def test_moe_logits_match_transformers_fp32(results):
    """The tiny Qwen3-MoE (4 experts, top-2) with the local spec's SequentialMLP experts: the
    expert/router weight mapping and routing on this device, fp32 against fp32."""
    out = results["moe"]
    gpu_common.record("a_learner", {"moe_logsoftmax_error_vs_hf_fp32": out["megatron_fp32"]})
    assert "SequentialMLP" in out["experts"] and "GroupedMLP" not in out["experts"], out
    assert out["megatron_fp32"]["max"] <= 2e-4, out


def test_torch_spec_logits_match_transformers(results):
    """model.spec=torch (SDPA, grouped experts), dense and MoE: fp32 within 2e-4 of transformers
    fp32 (the mapping and the kernels' maths), bf16 within 4x transformers' own bf16 error (+1e-3),
    the bounds of the local spec above; the bf16 MoE's experts through the grouped GEMM where this
    device has it, the per-expert loop where not."""
    out = results["torch_spec"]
    gpu_common.record("a_learner", {"torch_spec_logsoftmax_error_vs_hf_fp32": out})
    assert {"SDPAttention", "GroupedExperts"} <= set(out["modules"]), out["modules"]
    assert not {"DotProductAttention", "SequentialMLP"} & set(out["modules"]), out["modules"]
    for model in ("dense", "moe"):
        e32, e16, hf = out[model]["float32"], out[model]["bfloat16"], out[model]["hf_bf16"]
        assert e32["max"] <= 2e-4, (model, e32)
        for k in ("max", "mean"):
            assert e16[k] <= 4 * hf[k] + 1e-3, (model, k, e16, hf)
    n_layers = SHAPES[gpu_common.device()]["model"]["num_layers"]
    if out["grouped_kernel_here"]:
        # two projections per MoE layer per micro-batch
        assert out["moe_bf16_grouped_mm_calls"] >= 2 * n_layers, out
    else:
        assert out["moe_bf16_grouped_mm_calls"] == 0, out


def test_micro_batches_made_one_ahead_arrive_whole_while_the_stream_is_busy():
    """learner.Prefetched on this device: micro-batch i+1 is copied (pinned memory, non-blocking,
    a side stream) while the compute stream is busy with work queued for i; every micro-batch the
    compute stream reads holds exactly the host's values (the stream waits on the copy's event).
    Records how long the host is held per micro-batch against the GPU work queued per step."""
    import time

    import torch

    from megatron_rl.learner.learner import Prefetched, to_device

    dev = gpu_common.device()
    g = torch.Generator().manual_seed(0)
    rows, cols = (16, 16384) if gpu_common.cuda() else (4, 256)
    host = [{"input_ids": torch.randint(0, 1 << 30, (rows, cols), generator=g),
             "loss_mask": torch.rand(rows, cols, generator=g)} for _ in range(6)]
    makers = [lambda h=h: to_device(h, dev) for h in host]
    n = 4096 if gpu_common.cuda() else 64
    a = torch.randn(n, n, device=dev) / n ** 0.5
    sums, held = [], []
    start = time.perf_counter()
    for make in Prefetched(makers, dev):
        t = time.perf_counter()
        mb = make()
        held.append(time.perf_counter() - t)
        sums.append((mb["input_ids"].sum(), mb["loss_mask"].double().sum()))  # read on the compute stream
        for _ in range(10):  # the micro-batch's "compute": keeps the stream busy past the next copy
            a = torch.tanh(a @ a)
    gpu_common.synchronize()
    wall = time.perf_counter() - start
    for (ids, mask), h in zip(sums, host):
        assert int(ids) == int(h["input_ids"].sum()) and float(mask) == float(h["loss_mask"].double().sum())
    gpu_common.record("a_learner", {"prefetched_micro_batches": {
        "bytes_per_micro_batch": sum(v.numel() * v.element_size() for v in host[0].values()),
        "host_held_per_next_ms": [round(1e3 * x, 3) for x in held], "wall_s": wall}})


def test_expert_gradients_accumulate_into_main_grads_at_any_offsets():
    """The torch spec's expert-gradient accumulation (`_accumulate_main_grads`: one Triton kernel per
    projection on CUDA, index_add_ elsewhere) against per-expert adds in float64, bf16 and fp32
    gradients, rows in DDP's reversed order with irregular gaps and an [E, N, K] of N·K not a
    multiple of the kernel's block: every row gets exactly its gradient, the gaps stay untouched."""
    import torch

    from megatron_rl.models.torch_spec import _accumulate_main_grads, _main_grad_rows

    dev = gpu_common.device()
    g = torch.Generator().manual_seed(0)
    E, N, K = (16, 96, 130) if gpu_common.cuda() else (4, 6, 5)
    for dtype in (torch.bfloat16, torch.float32):
        gaps = [0, 3, 0, 64] * (E // 4)
        buf = torch.full((E * N * K + sum(gaps),), 0.5, dtype=torch.float32, device=dev)
        weights, at = [None] * E, 0
        for i, e in enumerate(reversed(range(E))):  # DDP lays the parameters out in reverse
            at += gaps[i]
            w = torch.nn.Parameter(torch.zeros(N, K, device=dev))
            w.main_grad, w.grad_added_to_main_grad = buf[at:at + N * K].view(N, K), False
            weights[e], at = w, at + N * K
        before = buf.double().clone()
        rows = _main_grad_rows(weights)
        grads = [torch.randn(E, N, K, generator=g).to(dev, dtype) for _ in range(2)]
        for grad in grads:  # two micro-batches
            _accumulate_main_grads(grad, weights, rows)
        for e, w in enumerate(weights):
            want = 0.5 + sum(grad[e].double() for grad in grads)
            assert (w.main_grad.double() - want).abs().max().item() <= 1e-6, (dtype, e)
            assert w.grad_added_to_main_grad
        expert_sum = sum(grad.double().sum() for grad in grads)
        assert abs((buf.double() - before).sum().item() - expert_sum.item()) <= 1e-3 * (1 + abs(expert_sum.item()))
