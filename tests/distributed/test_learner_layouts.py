"""The Megatron learner against HF transformers, at every parallel layout, over real gloo processes.

Independent reference: the HF transformers model on the same batch (fp32) for logits, loss and
grad norm, and a plain torch Adam step after `clip_grad_norm_` for the updated weights. Layouts:
TP2 (sequence parallel), PP2, PP2xVPP2, DP2 (also with the distributed optimizer) for dense Qwen3;
EP2 and TP2xEP2 (sequence parallel) for Qwen3-MoE; plus activation recompute. `model.spec=torch`
(SDPA attention, grouped experts) at TP2 (SP), PP2 and PP2xVPP2 dense and TP2xEP2 (SP) MoE, against HF
and against the local spec's run of the same layout (logits, grad norm, updated weights). The layouts of one
world size run one after the other in one spawned process group (Megatron's parallel state rebuilt
for each, as a fresh process would build it): four process groups for the module, not fourteen.
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


def layout_worker(rank, world_size, hf_path, parallel, recompute="none", dist_opt=False, save_to=None,
                  spec="local", steps=1, fused_adam_on_cpu=False):
    import torch.distributed as dist

    from megatron_rl.config.schema import JobConfig, ParallelConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner

    cfg = JobConfig()
    cfg.model.hf_path = hf_path
    cfg.model.recompute = recompute
    cfg.model.spec = spec
    cfg.parallel = ParallelConfig(**parallel)
    cfg.optim.lr, cfg.optim.adam_eps, cfg.optim.clip_grad = LR, ADAM_EPS, CLIP
    cfg.optim.use_distributed_optimizer = dist_opt
    cfg.learner.micro_batch_size = 2
    ctx = init_distributed(cfg.parallel)
    learner = Learner(cfg, ctx, run_dir="/nonexistent")
    fused_groups = 0
    if fused_adam_on_cpu:  # what the learner does on CUDA (torch also has the fused kernel on CPU)
        from megatron_rl.learner.learner import fused_adam

        fused_groups = fused_adam(learner.optimizer, "cpu")
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
    for _ in range(steps):
        metrics = learner.train_step(batch)
    exported_after = {k: v.clone() for k, v in learner.export_hf_weights()}
    if rank != 0 and not (ctx.is_last_stage and ctx.tp_rank == 0 and ctx.dp_rank == 0):
        return None
    return dict(logits=logits, metrics=metrics, before=exported_before, after=exported_after,
                layout=ctx.describe(),
                modules={type(m).__name__ for c in learner.model for m in c.modules()},
                overlap=[m.ddp_config.overlap_grad_reduce for m in learner.model], fused_groups=fused_groups)


def checkpoint_tensors(path) -> dict[str, torch.Tensor]:
    """Tensors of a HF checkpoint folder under their on-disk names."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def hf_reference(hf_path, scratch):
    """Logits, loss, grad norm and weights after one clipped Adam step, from HF transformers;
    loss, grad norm and weights of a second step on the same batch (`*2`).

    Weights are compared under the checkpoint's on-disk names (transformers 5 fuses MoE experts
    in memory and splits them again in save_pretrained), so the reference goes through a save.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    original = checkpoint_tensors(hf_path)
    batch = make_batch()
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=ADAM_EPS, betas=(0.9, 0.999))
    out = dict(original=original)
    for step in ("", "2"):
        opt.zero_grad()
        logits = model(batch["input_ids"]).logits
        logp = torch.log_softmax(logits.double(), -1).gather(-1, batch["labels"][..., None])[..., 0]
        loss = -(logp * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        model.save_pretrained(Path(scratch) / f"step{step or 1}")
        out.update({f"logits{step}": logits.detach(), f"loss{step}": float(loss),
                    f"grad_norm{step}": float(grad_norm),
                    f"after{step}": checkpoint_tensors(Path(scratch) / f"step{step or 1}")})
    return out


def layouts_worker(rank, world_size, hf_path, runs):
    """Every run of `runs` ({name: layout_worker's arguments}) in turn, in this process group."""
    out = {}
    for name, kwargs in runs.items():
        out[name] = layout_worker(rank, world_size, hf_path, **kwargs)
    return out


def _run_layouts(hf_path, runs):
    """{name: (world_size, layout_worker kwargs)} -> {name: the reporting rank's result}; one
    spawned process group per world size."""
    out = {}
    for world in sorted({w for w, _ in runs.values()}):
        mine = {name: kwargs for name, (w, kwargs) in runs.items() if w == world}
        ranks = run_distributed(layouts_worker, world, str(hf_path), mine)
        for name in mine:
            out[name] = next(r[name] for r in ranks if r[name] is not None and r[name]["logits"] is not None)
    return out


DENSE_LAYOUTS = {"tp1": (1, {}), "tp2_sp": (2, {"tp": 2}), "pp2": (2, {"pp": 2}), "pp2_vpp2": (2, {"pp": 2, "vpp": 2}),
                 "dp2": (2, {})}
MOE_LAYOUTS = {"moe_tp1": (1, {}), "moe_tp2_sp": (2, {"tp": 2}), "moe_pp2": (2, {"pp": 2}), "ep2": (2, {"ep": 2}),
               "tp2_ep2_sp": (2, {"tp": 2, "ep": 2})}
# model.spec=torch runs: {name: the local-spec run of the same layout}, added to the spawned groups.
DENSE_TORCH = {"torch_tp2_sp": "tp2_sp", "torch_pp2": "pp2", "torch_pp2_vpp2": "pp2_vpp2"}
MOE_TORCH = {"torch_tp2_ep2_sp": "tp2_ep2_sp"}


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
    """(checkpoint, HF reference, {run: result}): the dense layouts, the distributed optimizer at
    DP2 and full activation recompute at PP2."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("dense"), num_layers=4)
    runs = {name: (w, dict(parallel=p)) for name, (w, p) in DENSE_LAYOUTS.items()}
    runs["dp2_dist_opt"] = (2, dict(parallel={}, dist_opt=True))
    runs["pp2_recompute"] = (2, dict(parallel={"pp": 2}, recompute="full"))
    # Two steps: megatron-core launches the overlapped gradient reduce from the backward hooks
    # only from the second step on (the first records which grads each bucket waits for).
    runs["dp2_two_steps"] = (2, dict(parallel={}, steps=2))
    runs["dp2_dist_opt_two_steps"] = (2, dict(parallel={}, dist_opt=True, steps=2))
    runs["dp2_fused_adam_two_steps"] = (2, dict(parallel={}, steps=2, fused_adam_on_cpu=True))
    for name, local in DENSE_TORCH.items():
        runs[name] = (2, dict(parallel=DENSE_LAYOUTS[local][1], spec="torch"))
    return path, hf_reference(path, tmp_path_factory.mktemp("dense_after")), _run_layouts(path, runs)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(checkpoint, HF reference, {run: result}, HF folder saved by the TP2 x EP2 run)."""
    # norm_topk_prob=False exercises the routing fix (Megatron pre-softmax routing).
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), moe=True, norm_topk_prob=False)
    saved = tmp_path_factory.mktemp("moe_saved") / "exported"
    runs = {name: (w, dict(parallel=p)) for name, (w, p) in MOE_LAYOUTS.items()}
    runs["tp2_ep2_sp"][1]["save_to"] = str(saved)  # saved before its training step
    for name, local in MOE_TORCH.items():
        runs[name] = (2, dict(parallel=MOE_LAYOUTS[local][1], spec="torch"))
    runs["ep2_two_steps"] = (2, dict(parallel={"ep": 2}, steps=2))
    runs["ep2_fused_adam_two_steps"] = (2, dict(parallel={"ep": 2}, steps=2, fused_adam_on_cpu=True))
    return path, hf_reference(path, tmp_path_factory.mktemp("moe_after")), _run_layouts(path, runs), saved


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DENSE_LAYOUTS))
def test_dense_layouts_match_hf(dense, name):
    _, ref, out = dense
    _check_against_hf(out[name], ref, f"{name} {DENSE_LAYOUTS[name][1]}")


@pytest.mark.slow
def test_distributed_optimizer_matches_hf(dense):
    _, ref, out = dense
    _check_against_hf(out["dp2_dist_opt"], ref, "dp2 distributed optimizer")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_moe_layouts_match_hf(moe, name):
    _, ref, out, _ = moe
    _check_against_hf(out[name], ref, f"{name} {MOE_LAYOUTS[name][1]}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp2_two_steps", "dp2_dist_opt_two_steps", "ep2_two_steps",
                                  "dp2_fused_adam_two_steps", "ep2_fused_adam_two_steps"])
def test_overlapped_grad_reduce_second_step_matches_hf(dense, moe, name):
    """overlap_grad_reduce: the second step's reduce runs from the backward hooks, bucket by
    bucket (DP2: dense buckets all-reduced or reduce-scattered; EP2: dense DP2 beside the
    experts' own buckets) and equals HF's second step. `*_fused_adam_*`: the same with torch's
    fused Adam kernel, as the learner steps on CUDA (every group switched: the dense and, at EP2,
    the experts' optimizer)."""
    ref, out = (moe[1], moe[2]) if name.startswith("ep2") else (dense[1], dense[2])
    out = out[name]
    assert out["overlap"] == [True], out["overlap"]
    if "fused_adam" in name:
        assert out["fused_groups"] >= (2 if name.startswith("ep2") else 1), out["fused_groups"]
    assert out["metrics"]["loss"] == pytest.approx(ref["loss2"], rel=1e-5), name
    assert out["metrics"]["grad_norm"] == pytest.approx(ref["grad_norm2"], rel=1e-5), name
    worst = max((out["after"][k] - ref["after2"][k]).abs().max().item() for k in ref["after2"])
    assert worst <= 2e-6, f"{name}: weights after two steps differ from the reference by {worst}"


def _check_against_local(out, local, label):
    """The torch spec's run against the local spec's run of the same layout: fp32 tolerance."""
    assert "SDPAttention" in out["modules"] and "DotProductAttention" not in out["modules"], label
    assert "DotProductAttention" in local["modules"], label
    assert ("GroupedExperts" in out["modules"]) == ("SequentialMLP" in local["modules"]), label
    diff = (out["logits"] - local["logits"]).abs().max().item()
    assert diff <= 1e-5, f"{label}: logits differ from the local spec's by {diff}"
    assert out["metrics"]["loss"] == pytest.approx(local["metrics"]["loss"], rel=1e-6), label
    assert out["metrics"]["grad_norm"] == pytest.approx(local["metrics"]["grad_norm"], rel=1e-5), label
    # Adam's first step moves each weight by lr·g/(|g| + ε), ε large: a gradient difference δ
    # moves it by up to δ, so equal updates check the gradients weight by weight.
    worst = max((out["after"][k] - local["after"][k]).abs().max().item() for k in local["after"])
    assert worst <= 1e-6, f"{label}: weights after one step differ from the local spec's by {worst}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DENSE_TORCH))
def test_torch_spec_dense_matches_local_spec_and_hf(dense, name):
    _, ref, out = dense
    _check_against_hf(out[name], ref, name)
    _check_against_local(out[name], out[DENSE_TORCH[name]], name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MOE_TORCH))
def test_torch_spec_moe_matches_local_spec_and_hf(moe, name):
    _, ref, out, _ = moe
    _check_against_hf(out[name], ref, name)
    _check_against_local(out[name], out[MOE_TORCH[name]], name)


@pytest.mark.slow
def test_activation_recompute_gives_identical_step(dense):
    _, _, out = dense
    plain, recomputed = out["pp2"], out["pp2_recompute"]
    assert recomputed["metrics"]["grad_norm"] == plain["metrics"]["grad_norm"]
    for k, w in plain["after"].items():
        assert torch.equal(recomputed["after"][k], w), f"recompute changed the update of {k}"


@pytest.mark.slow
def test_saved_hf_checkpoint_reloads_exactly(moe):
    """Megatron (TP2 x EP2) -> save_hf_checkpoint -> transformers reload == the original model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, ref, _, out = moe
    saved = checkpoint_tensors(out)
    assert set(saved) == set(ref["original"])
    for name, w in saved.items():
        assert torch.equal(w, ref["original"][name]), name
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(reloaded(make_batch()["input_ids"]).logits, ref["logits"])
    original_tok, saved_tok = AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(out)
    assert saved_tok("12+7=")["input_ids"] == original_tok("12+7=")["input_ids"]
