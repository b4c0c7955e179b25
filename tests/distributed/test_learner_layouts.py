"""The Megatron learner against HF transformers, at every parallel layout, over real gloo processes.

Independent reference: the HF transformers model on the same batch (fp32) for logits, loss and
grad norm, and a plain torch Adam step after `clip_grad_norm_` for the updated weights. Each
layout runs in its own spawned process group: TP2 (sequence parallel), PP2, PP2xVPP2, DP2 for
dense Qwen3; EP2 and TP2xEP2 (sequence parallel) for Qwen3-MoE; plus activation recompute.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.models.tiny import make_tiny_checkpoint

LR, ADAM_EPS, CLIP = 1e-3, 1e-3, 1.0  # ε large so the first Adam step is smooth in the gradient
B, S = 8, 11


def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 99, (B, S), generator=g)
    lengths = torch.randint(5, S + 1, (B,), generator=g)
    valid = torch.arange(S)[None, :] < lengths[:, None]
    ids = torch.where(valid, ids, torch.zeros_like(ids))  # right padding with the pad id
    labels = torch.roll(ids, -1, dims=1)
    loss_mask = (valid & torch.roll(valid, -1, dims=1)).float()
    loss_mask[:, -1] = 0
    return dict(input_ids=ids, labels=labels, loss_mask=loss_mask)


def layout_worker(rank, world_size, hf_path, parallel, recompute, dist_opt=False, save_to=None):
    import torch.distributed as dist

    from megatron_rl.config.schema import JobConfig, ParallelConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner

    cfg = JobConfig()
    cfg.model.hf_path = hf_path
    cfg.model.recompute = recompute
    cfg.parallel = ParallelConfig(**parallel)
    cfg.optim.lr, cfg.optim.adam_eps, cfg.optim.clip_grad = LR, ADAM_EPS, CLIP
    cfg.optim.use_distributed_optimizer = dist_opt
    cfg.learner.micro_batch_size = 2
    ctx = init_distributed(cfg.parallel)
    learner = Learner(cfg, ctx, run_dir="/nonexistent")
    batch = make_batch()

    def collect_logits(logits_BSV, mb, tp_group, vocab_size):
        return logits_BSV.new_zeros(()), {"logits": logits_BSV.detach()}

    # Full logits for the comparison only (the RL path never gathers the vocabulary).
    per_mb = learner.run_micro_batches(batch, collect_logits, forward_only=True)
    logits = None
    if ctx.is_last_stage:
        local = torch.cat([m["logits"] for m in per_mb])
        shards = [torch.empty_like(local) for _ in range(ctx.tp)]
        dist.all_gather(shards, local, group=ctx.tp_group)
        local = torch.cat(shards, dim=-1)
        rows = [torch.empty_like(local) for _ in range(ctx.dp)]
        dist.all_gather(rows, local, group=ctx.dp_group)
        logits = torch.cat(rows)[:, :S, : learner.vocab_size]

    exported_before = {k: v.clone() for k, v in learner.export_hf_weights()}
    if save_to is not None:
        from megatron_rl.models.bridge import save_hf_checkpoint

        save_hf_checkpoint(learner.bridge, learner.model, save_to, tokenizer_src=hf_path)
    metrics = learner.train_step(batch)
    exported_after = {k: v.clone() for k, v in learner.export_hf_weights()}
    if rank != 0 and not (ctx.is_last_stage and ctx.tp_rank == 0 and ctx.dp_rank == 0):
        return None
    return dict(logits=logits, metrics=metrics, before=exported_before, after=exported_after,
                layout=ctx.describe())


def checkpoint_tensors(path) -> dict[str, torch.Tensor]:
    """Tensors of a HF checkpoint folder under their on-disk names."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def hf_reference(hf_path, scratch):
    """Logits, loss, grad norm and weights after one clipped Adam step, from HF transformers.

    Weights are compared under the checkpoint's on-disk names (transformers 5 fuses MoE experts
    in memory and splits them again in save_pretrained), so the reference goes through a save.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    original = checkpoint_tensors(hf_path)
    batch = make_batch()
    logits = model(batch["input_ids"]).logits
    logp = torch.log_softmax(logits.double(), -1).gather(-1, batch["labels"][..., None])[..., 0]
    loss = -(logp * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=ADAM_EPS, betas=(0.9, 0.999))
    opt.step()
    model.save_pretrained(scratch)
    after = checkpoint_tensors(scratch)
    return dict(logits=logits.detach(), loss=float(loss), grad_norm=float(grad_norm),
                original=original, after=after)


def _run_layout(hf_path, world_size, parallel, recompute="none", dist_opt=False, save_to=None):
    results = run_distributed(layout_worker, world_size, str(hf_path), parallel, recompute,
                              dist_opt, None if save_to is None else str(save_to))
    return next(r for r in results if r is not None and r["logits"] is not None)


def _check_against_hf(out, ref, label):
    # Logits after HF -> Megatron import.
    diff = (out["logits"] - ref["logits"]).abs().max().item()
    assert diff <= 1e-4, f"{label}: logits differ from HF by {diff}"
    # Export of the imported weights is exact.
    assert set(out["before"]) == set(ref["original"]), f"{label}: exported names differ"
    for name, w in out["before"].items():
        assert torch.equal(w, ref["original"][name]), f"{label}: export of {name} is not exact"
    # One training step: loss and grad norm, then the weights after the optimizer step.
    m = out["metrics"]
    assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5), label
    assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), label
    worst = max((out["after"][k] - ref["after"][k]).abs().max().item() for k in ref["after"])
    assert worst <= 1e-6, f"{label}: weights after one step differ from the reference by {worst}"


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("dense"), num_layers=4)
    return path, hf_reference(path, tmp_path_factory.mktemp("dense_after"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    # norm_topk_prob=False exercises the routing fix (Megatron pre-softmax routing).
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), moe=True, norm_topk_prob=False)
    return path, hf_reference(path, tmp_path_factory.mktemp("moe_after"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size,parallel",
    [
        (1, {}),
        (2, {"tp": 2}),
        (2, {"pp": 2}),
        (2, {"pp": 2, "vpp": 2}),
        (2, {}),  # DP2
    ],
    ids=["tp1", "tp2_sp", "pp2", "pp2_vpp2", "dp2"],
)
def test_dense_layouts_match_hf(dense, world_size, parallel):
    path, ref = dense
    _check_against_hf(_run_layout(path, world_size, parallel), ref, str(parallel))


@pytest.mark.slow
def test_distributed_optimizer_matches_hf(dense):
    path, ref = dense
    _check_against_hf(_run_layout(path, 2, {}, dist_opt=True), ref, "dp2 distributed optimizer")


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size,parallel",
    [(1, {}), (2, {"tp": 2}), (2, {"pp": 2}), (2, {"ep": 2}), (2, {"tp": 2, "ep": 2})],
    ids=["moe_tp1", "moe_tp2_sp", "moe_pp2", "ep2", "tp2_ep2_sp"],
)
def test_moe_layouts_match_hf(moe, world_size, parallel):
    path, ref = moe
    _check_against_hf(_run_layout(path, world_size, parallel), ref, str(parallel))


@pytest.mark.slow
def test_activation_recompute_gives_identical_step(dense):
    path, _ = dense
    plain = _run_layout(path, 2, {"pp": 2}, recompute="none")
    recomputed = _run_layout(path, 2, {"pp": 2}, recompute="full")
    assert recomputed["metrics"]["grad_norm"] == plain["metrics"]["grad_norm"]
    for k, w in plain["after"].items():
        assert torch.equal(recomputed["after"][k], w), f"recompute changed the update of {k}"


@pytest.mark.slow
def test_saved_hf_checkpoint_reloads_exactly(moe, tmp_path):
    """Megatron (TP2 x EP2) -> save_hf_checkpoint -> transformers reload == the original model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, ref = moe
    out = tmp_path / "exported"
    _run_layout(path, 2, {"tp": 2, "ep": 2}, save_to=out)
    saved = checkpoint_tensors(out)
    assert set(saved) == set(ref["original"])
    for name, w in saved.items():
        assert torch.equal(w, ref["original"][name]), name
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(reloaded(make_batch()["input_ids"]).logits, ref["logits"])
    original_tok, saved_tok = AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(out)
    assert saved_tok("12+7=")["input_ids"] == original_tok("12+7=")["input_ids"]
