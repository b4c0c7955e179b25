"""R3 end to end: real SGLang rollouts (fp32, tiny Qwen3-MoE, routed experts returned) replayed
in the Megatron learner after its router weights were perturbed, at TP1, PP2, EP2, TP2+SP and
PP2 with full activation recompute.

Replay replaces only the expert *selection*; the combination weights are re-gathered from the
learner's (perturbed) router scores. Exact equality with SGLang after a perturbation therefore
needs weights that do not depend on the scores. Top-1 with normalised weights (always 1) would do,
but megatron-core rejects top-1 without pre-softmax ("Please use --moe-router-pre-softmax when
topk is 1"), and pre-softmax top-1 weighs by the score. So the model is a standard top-2 Qwen3-MoE
(`norm_topk_prob=True`) whose gate rows are tied in pairs (expert 2j+1's row = expert 2j's):
the two tied experts always score equally, top-2 always selects one tied pair, and their
normalised weights are 1/2 each whatever the scores. The perturbation adds the same seeded noise
to both rows of a pair, so it moves pairs against each other — the natural selection changes on a
clear fraction of tokens — but never the weights inside a pair. The router still learns under
replay: d w_2j / d(z_2j − z_2j+1) = 1/4, and the tied experts' outputs differ.

Checked per layout: with replay the learner's log-probs of the rollout tokens equal SGLang's
within 1e-5 (forward-only, and the training forward of `train_step`, recompute included), before
and after the perturbation; without replay the gap is > 100x larger; the routers receive non-zero
gradients under replay, the same in every layout.

Shapes: B sequences, S positions (prompt + response, right-padded), L MoE layers, k = top-k,
E experts, H hidden size.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.models.tiny import make_tiny_checkpoint

PROMPTS = [[1, 40, 41, 18, 20, 2, 5, 1, 13], [1, 33, 31, 17, 30, 98, 2, 5, 1, 13, 40],
           [1, 50, 2, 1, 13], [1, 70, 71, 72, 2, 5, 1, 13]]
N, MAX_NEW, MICRO_BATCH = 2, 12, 2
MODEL = dict(moe=True, num_layers=2, num_experts=8, topk=2, norm_topk_prob=True, init_std=0.2)
PERTURB_SEED, PERTURB_SCALE = 7, 0.2  # router-weight noise N(0, scale²); weights ~ N(0, 0.2²)
LAYOUTS = {  # name -> (world size, parallel overrides, recompute)
    "tp1": (1, {}, "none"),
    "pp2": (2, {"pp": 2}, "none"),
    "ep2": (2, {"ep": 2}, "none"),
    "tp2_sp": (2, {"tp": 2}, "none"),  # sequence parallel is on by default with TP > 1
    "pp2_recompute": (2, {"pp": 2}, "full"),
}


def make_tied_checkpoint(path):
    """The tiny Qwen3-MoE with gate rows tied in pairs: row 2j+1 := row 2j in every layer."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_checkpoint(path, **MODEL)
    weights = load_file(path / "model.safetensors")
    for name, w in weights.items():
        if name.endswith("mlp.gate.weight"):  # [E, H]
            w[1::2] = w[0::2]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def as_batch(records):
    """Right-padded [B, S] batch of prompt+response with SGLang's routes and log-probs.

    `loss_mask` marks the positions whose label is a response token; `rollout_logp` holds SGLang's
    log-prob of that label there (0 elsewhere); `row` [B] is the global row index (to reassemble
    what each data-parallel rank saw).
    """
    seqs = [r.prompt_ids.tolist() + r.response_ids.tolist() for r in records]
    B, S = len(seqs), max(map(len, seqs))
    _, L, k = records[0].routed_experts.shape
    ids = torch.zeros(B, S, dtype=torch.long)
    routes = torch.full((B, S, L, k), -1, dtype=torch.long)
    rollout_logp, mask = torch.zeros(B, S), torch.zeros(B, S)
    for i, (r, s) in enumerate(zip(records, seqs)):
        P, T = len(r.prompt_ids), len(r.response_ids)
        ids[i, : len(s)] = torch.tensor(s)
        routes[i, : P + T - 1] = r.sequence_routed_experts()
        rollout_logp[i, P - 1: P - 1 + T] = r.rollout_logp
        mask[i, P - 1: P - 1 + T] = 1.0
    return dict(input_ids=ids, labels=torch.roll(ids, -1, 1), loss_mask=mask, routed_experts=routes,
                rollout_logp=rollout_logp, row=torch.arange(B))


def _routers(learner):
    """(global layer number, router weight [E, H]) of this rank's MoE layers."""
    from megatron_rl.learner.router_replay import _unwrap

    for chunk in learner.model:
        for layer in _unwrap(chunk).decoder.layers:
            for name, p in layer.named_parameters():
                if "router.weight" in name:
                    yield layer.layer_number, p


def perturb_tied_routers(learner, seed: int, scale: float) -> None:
    """Add seeded noise to every `router.weight`, the same to both rows of a tied pair. The
    noise depends on the global layer number only: every rank and layout perturbs alike."""
    for layer_number, p in _routers(learner):
        g = torch.Generator().manual_seed(seed * 1000 + layer_number)
        noise = scale * torch.randn(p.shape[0] // 2, p.shape[1], generator=g)
        with torch.no_grad():
            p.add_(noise.repeat_interleave(2, dim=0).to(p.device, p.dtype))


def capture_loss(denom: float, seen: dict):
    """NLL of the labels; keeps the training forward's log-probs by global row (last stage)."""
    from megatron_rl.learner.losses import token_logprobs

    def loss_fn(logits_BSV, mb, tp_group, vocab_size):
        logp = token_logprobs(logits_BSV, mb["labels"], tp_group, vocab_size)
        for row, lp in zip(mb["row"].tolist(), logp.detach()):
            seen[row] = lp.float().cpu()
        return -(logp * mb["loss_mask"]).sum() / denom, {}

    return loss_fn


def layout_worker(rank, world_size, layouts, path, batch):
    """Every layout in `layouts`, one after the other in this process group (Megatron's parallel
    state is rebuilt for each); returns per layout what this rank saw."""
    from megatron_rl.config.schema import JobConfig, ParallelConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner

    results = {}
    for name in layouts:
        _, parallel, recompute = LAYOUTS[name]
        cfg = JobConfig()
        cfg.model.hf_path = path
        cfg.model.recompute = recompute
        cfg.parallel = ParallelConfig(**parallel)
        cfg.learner.micro_batch_size = MICRO_BATCH
        learner = Learner(cfg, init_distributed(cfg.parallel), run_dir="/nonexistent")
        res = {"unperturbed_replayed": learner.forward_logprobs(batch, routing="replay")}
        perturb_tied_routers(learner, PERTURB_SEED, PERTURB_SCALE)
        res["natural"], res["recorded"] = learner.forward_logprobs(batch, routing="record")
        res["replayed"] = learner.forward_logprobs(batch, routing="replay")
        seen: dict = {}
        metrics = learner.train_step(batch, loss_fn=capture_loss(float(batch["loss_mask"].sum()), seen),
                                     routing="replay")
        res["train_logp"] = seen
        res["agreement"] = [metrics[f"router_agreement/layer{l}"] for l in range(MODEL["num_layers"])]
        res["router_grad"] = {n: p.main_grad.detach().float().cpu().clone() for n, p in _routers(learner)}
        results[name] = res
        del learner
    return results


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """(checkpoint, batch): SGLang rollouts with routed experts; the server is stopped before the
    learner runs (it would compete for the CPU)."""
    from megatron_rl.rollout.client import RolloutClient, SamplingParams
    from megatron_rl.rollout.server import EngineManager, ServerConfig

    root = tmp_path_factory.mktemp("r3")
    path = make_tied_checkpoint(root / "model")
    cfg = ServerConfig(model_path=str(path), max_total_tokens=2048, enable_return_routed_experts=True,
                       extra_args=("--enable-deterministic-inference",))  # seeded: same rollouts every run

    async def generate(url):
        async with RolloutClient([url], moe_topk=MODEL["topk"], num_experts=MODEL["num_experts"]) as client:
            return await client.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=0),
                                         n=N, return_routed_experts=True)

    with EngineManager(cfg, 1, log_dir=root / "logs") as mgr:
        records = [r for group in asyncio.run(generate(mgr.urls()[0])) for r in group]
    return str(path), as_batch(records)


@pytest.fixture(scope="module")
def results(rollouts):
    """{layout: what the ranks saw, merged}: one 1-process run (TP1) and one 2-process run for
    all 2-rank layouts (saves a process start-up per layout)."""
    path, batch = rollouts
    merged = {}
    for world in (1, 2):
        layouts = [n for n, (w, _, _) in LAYOUTS.items() if w == world]
        per_rank = run_distributed(layout_worker, world, layouts, path, batch)
        for name in layouts:
            res = dict(per_rank[0][name])
            for other in per_rank[1:]:
                # Training log-probs live on the last stage (each DP rank its rows); router
                # grads on the stage owning the layer.
                res["train_logp"] = {**res["train_logp"], **other[name]["train_logp"]}
                res["router_grad"] = {**res["router_grad"], **other[name]["router_grad"]}
            merged[name] = res
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_r3_replay_reproduces_sglang_after_router_perturbation(rollouts, results, layout):
    _, batch = rollouts
    res = results[layout]
    mask = batch["loss_mask"] > 0
    target = batch["rollout_logp"].double()
    B, S = target.shape

    def gap(logp_BS):
        return (logp_BS.double() - target)[mask].abs().max().item()

    routes, valid = batch["routed_experts"], batch["routed_experts"][..., 0, 0] >= 0
    # Precondition: SGLang always picked a tied pair (the weights inside it are then 1/2 each).
    assert torch.equal(routes[valid][..., 0] // 2, routes[valid][..., 1] // 2)
    unperturbed, replay, natural = gap(res["unperturbed_replayed"]), gap(res["replayed"]), gap(res["natural"])
    train = gap(torch.stack([res["train_logp"][i][:S] for i in range(B)]))
    # Token-layers whose natural (perturbed) selection differs from SGLang's.
    flipped = (res["recorded"].sort(-1).values != routes.sort(-1).values).any(-1)[valid].float().mean().item()
    # The agreement metric of MoE layer 0 (the mean fraction of SGLang's experts that the
    # perturbed router picks itself), recomputed from the recorded natural routes. Only layer 0:
    # later layers see different inputs under replay than in the natural (recorded) forward.
    overlap = (res["recorded"][..., 0, :, None] == routes[..., 0, None, :]).any(-1).float().mean(-1)
    expected_agreement = overlap[valid].mean().item()
    grads = res["router_grad"]
    ref = results["tp1"]["router_grad"]
    grad_diff = max((grads[n] - ref[n]).abs().max().item() for n in ref)
    print(f"\n{layout}: max |learner - SGLang| log-prob over {int(mask.sum())} rollout tokens: "
          f"replay {replay:.2e} (train forward {train:.2e}, before perturbing {unperturbed:.2e}), "
          f"no replay {natural:.2e} = {natural / max(replay, 1e-12):.0f}x; natural routes differ "
          f"on {flipped:.1%} of token-layers; agreement per layer {[round(a, 3) for a in res['agreement']]}; "
          f"router max |grad| {[round(g.abs().max().item(), 5) for _, g in sorted(grads.items())]} "
          f"(vs TP1 {grad_diff:.1e})")

    assert flipped >= 0.1, flipped  # the perturbation changed the natural routing clearly
    # Regression: padding positions (S padded for SP) once entered the metric as expert-0 routes.
    assert res["agreement"][0] == pytest.approx(expected_agreement, abs=1e-6), expected_agreement
    assert all(0.0 < a < 1.0 for a in res["agreement"]), res["agreement"]
    assert unperturbed <= 1e-5 and replay <= 1e-5 and train <= 1e-5, (unperturbed, replay, train)
    assert natural > 100 * max(replay, 1e-7), (natural, replay)
    # The routers keep a gradient under replay, every layer, the same in every layout.
    assert sorted(grads) == list(range(1, MODEL["num_layers"] + 1))
    assert all(g.abs().max().item() > 1e-4 for g in grads.values())
    assert grad_diff <= 1e-6, grad_diff


def test_padding_carries_no_route():
    """Regression: padding a micro-batch to the SP / pad_to_multiple_of length filled
    `routed_experts` with 0 (= expert 0), so padded positions counted as routed tokens."""
    from types import SimpleNamespace

    from megatron_rl.learner.learner import Learner

    fake = SimpleNamespace(
        ctx=SimpleNamespace(dp=1, dp_rank=0, tp=2, sequence_parallel=True, device=torch.device("cpu")),
        cfg=SimpleNamespace(learner=SimpleNamespace(micro_batch_size=2, pad_to_multiple_of=8)))
    routes = torch.randint(0, 4, (2, 5, 3, 2))
    batch = dict(input_ids=torch.ones(2, 5, dtype=torch.long), routed_experts=routes)
    (mb,), S_pad, _ = Learner._local_micro_batches(fake, batch)
    assert S_pad == 16 and mb["routed_experts"].shape == (2, 16, 3, 2)
    assert torch.equal(mb["routed_experts"][:, :5], routes)
    assert (mb["routed_experts"][:, 5:] == -1).all() and (mb["input_ids"][:, 5:] == 0).all()
