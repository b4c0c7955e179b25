"""Token-budget micro-batches of rebalanced per-rank rollout batches give today's step.

Reference: one process, the whole mini-batch as the global padded dict (every micro-batch padded
to the global longest, `micro_batch_size` sequences each) — the layout the learner has always run.
Under test: the same sequences produced as whole groups by each data-parallel rank (group id mod
DP), exchanged by `rebalance` (real gloo point-to-point), cut under
`learner.max_tokens_per_micro_batch` with each micro-batch trimmed to its own longest, and the
policy loss normalised by an all-reduced count — at TP2, PP2, DP2 (dense) and EP2 with R3 replay
of engine routes (MoE). Loss, grad norm and every weight after the Adam step must agree up to
fp32 summation order. The same with each micro-batch packed (`learner.pack_sequences`: its
sequences end to end in one row, THD attention, batch/packing.py) at TP2 with sequence
parallelism, PP2 and EP2 with R3 replay (the routes packed like the tokens), on the torch spec:
no padding in any layer, and the same step.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.models.tiny import make_tiny_checkpoint

GROUPS, N, TOL = 4, 3, 1e-6


def make_batch(moe: bool, num_experts: int = 4, layers: int = 2, k: int = 2):
    """GROUPS x N sequences of very different lengths, as RolloutBatch (+ advantages)."""
    from megatron_rl.rollout.records import RolloutRecord
    from megatron_rl.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    records, rewards, gids = [], [], []
    for p in range(GROUPS):
        prompt = torch.randint(3, 99, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        for s in range(N):
            T = int(torch.randint(1, 24, (1,), generator=g))
            routes = torch.stack([torch.randperm(num_experts, generator=g)[:k]
                                  for _ in range((len(prompt) + T - 1) * layers)]).view(-1, layers, k)
            records.append(RolloutRecord(
                prompt_index=p, sample_index=s, prompt_ids=prompt,
                response_ids=torch.randint(3, 99, (T,), generator=g),
                rollout_logp=-torch.rand(T, generator=g) * 5, topk_ids=None, topk_logp=None,
                routes=routes.to(torch.uint8) if moe else None,
                finish_reason="stop", weight_version="0", temperature=1.0))
            rewards.append(float(s % 2))
            gids.append(p)
    batch = RolloutBatch.from_records(records, rewards, group_ids=gids, mini_batch=[0] * len(gids), pad_id=0,
                                      with_routes=moe, num_experts=num_experts)
    batch["advantages"] = torch.randn(len(batch), int(batch.seq_lens.max()), generator=g)
    return batch


def worker(rank, world_size, hf_path, parallel, moe, budget, pack=False):
    import torch.distributed as dist

    from megatron_rl.config.schema import JobConfig, ParallelConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner
    from megatron_rl.batch import rebalance
    from megatron_rl.trainer.policy import PolicyLoss

    cfg = JobConfig()
    cfg.model.hf_path = hf_path
    cfg.parallel = ParallelConfig(**parallel)
    cfg.optim.lr, cfg.optim.adam_eps, cfg.optim.clip_grad = 1e-3, 1e-3, 1.0
    cfg.algorithm.policy_loss, cfg.algorithm.divergence = "dppo", "binary_tv"
    cfg.learner.micro_batch_size = 4
    cfg.learner.max_tokens_per_micro_batch = budget
    if pack:
        cfg.model.spec, cfg.learner.pack_sequences = "torch", True
    ctx = init_distributed(cfg.parallel)
    learner = Learner(cfg, ctx, run_dir="/nonexistent")
    batch = make_batch(moe)
    stats = {}
    if budget:
        # Each data-parallel rank produced whole groups; then the exchange balances tokens.
        mine = (batch.seq["group_ids"] % ctx.dp == ctx.dp_rank).nonzero().flatten()
        batch = batch.select(mine)
        if ctx.dp > 1:
            batch, stats = rebalance(batch, ctx.dp_group, 1, ctx.device)
        dp_group = ctx.dp_group
    else:
        batch = batch.micro_batch(torch.arange(len(batch)), int(batch.seq_lens.max()))  # global dict
        dp_group = None
    # log π of every position, this rank's rows (the old-log-prob / reference pass), before the step
    logp = learner.forward_logprobs(batch, routing="replay" if moe else None) if budget else None
    loss_fn = PolicyLoss(cfg.algorithm, batch, 1.0, 64, dp_group=dp_group, device=ctx.device)
    packed = []  # per forward of a chunk: whether it ran packed (THD) and its tokens
    for chunk in learner.model:
        chunk.register_forward_pre_hook(lambda m, args, kw: packed.append(
            (kw.get("packed_seq_params") is not None, args[0].numel())), with_kwargs=True)
    metrics = learner.train_step(batch, loss_fn, routing="replay" if moe else None)
    metrics |= loss_fn.finish(learner)
    after = {k: v.clone() for k, v in learner.export_hf_weights()}
    tokens = torch.tensor([int(batch["seq_len"].sum()) if budget else 0], device=ctx.device)
    if budget and ctx.dp > 1:
        everyone = [torch.zeros_like(tokens) for _ in range(ctx.dp)]
        dist.all_gather(everyone, tokens, group=ctx.dp_group)
        stats["tokens_per_rank"] = [int(t) for t in everyone]
    if rank != 0:
        return None
    return dict(metrics=metrics, after=after, stats=stats, plan=[p.tolist() for p in learner._plan or []],
                packed=packed, sp=ctx.sequence_parallel, tokens=int(batch["seq_len"].sum()) if budget else 0,
                logp=logp, seq_lens=batch.seq_lens if budget else None)


def runs_worker(rank, world_size, runs):
    """`worker` for every run of `runs` ({name: (hf_path, parallel, moe, budget)}) in turn, in this
    process group (Megatron's parallel state rebuilt for each)."""
    return {name: worker(rank, world_size, *args) for name, args in runs.items()}


BUDGETED = {"tp2": {"tp": 2}, "pp2": {"pp": 2}, "dp2": {}}  # dense layouts under the token budget
PACKED = {"tp2_packed": {"tp": 2}, "pp2_packed": {"pp": 2}, "ep2_r3_packed": {"ep": 2}}  # + pack_sequences


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: rank 0's result}: the padded global steps (one process) and the token-budget steps
    (two processes), one process group each."""
    dense = str(make_tiny_checkpoint(tmp_path_factory.mktemp("dense"), num_layers=2))
    moe = str(make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), moe=True))
    out = run_distributed(runs_worker, 1, {"dense": (dense, {}, False, 0), "moe": (moe, {}, True, 0)})[0]
    budgeted = {name: (dense, parallel, False, 48) for name, parallel in BUDGETED.items()}
    budgeted["ep2_r3"] = (moe, {"ep": 2}, True, 48)
    for name, parallel in PACKED.items():
        budgeted[name] = (moe if "ep2" in name else dense, parallel, "ep2" in name, 48, True)
    return out | run_distributed(runs_worker, 2, budgeted)[0]


def _check(out, ref, label):
    for k in ("loss/total", "loss/pg", "grad_norm", "tokens/count" if "tokens/count" in ref["metrics"] else "loss/pg"):
        assert out["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-5, abs=1e-7), (label, k)
    worst = max((out["after"][k] - ref["after"][k]).abs().max().item() for k in ref["after"])
    assert worst <= TOL, f"{label}: weights after the step differ from the reference by {worst}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BUDGETED))
def test_token_budget_step_equals_the_padded_global_step(runs, name):
    out, parallel = runs[name], BUDGETED[name]
    _check(out, runs["dense"], str(parallel))
    # More than one micro-batch, each within the budget (a sequence longer than it runs alone).
    assert len(out["plan"]) > 1
    if not parallel:  # DP2: the exchange ran and evened the tokens
        assert out["stats"]["moved_sequences"] >= 0
        t = out["stats"]["tokens_per_rank"]
        assert max(t) - min(t) <= 30, t


@pytest.mark.slow
def test_token_budget_step_with_r3_replay_at_ep2(runs):
    _check(runs["ep2_r3"], runs["moe"], "ep2 r3")


def exchange_worker(rank, world_size):
    """Rank 0 produced every group, rank 1 none: rebalance, then broadcast rank 0's new batch."""
    import torch.distributed as dist

    from megatron_rl.batch import RolloutBatch, rebalance

    whole = make_batch(True)
    whole.seq["mini_batch"] = whole.seq["group_ids"] % 2
    mine = whole if rank == 0 else whole.select(torch.zeros(0, dtype=torch.int64))
    new, stats = rebalance(mine, dist.group.WORLD, 2)
    copy = RolloutBatch.broadcast(new if rank == 0 else None, 0, dist.group.WORLD, torch.device("cpu"))
    return dict(batch=new, stats=stats, copy=copy, whole=whole)


@pytest.mark.slow
def test_rebalance_moves_each_sequence_once_and_evens_every_mini_batch():
    a, b = run_distributed(exchange_worker, 2)
    whole = a["whole"]
    key = lambda batch, i: (int(batch.seq["group_ids"][i]), tuple(batch.tok["input_ids"][i].tolist()))  # noqa: E731
    got = sorted(key(x["batch"], i) for x in (a, b) for i in range(len(x["batch"])))
    assert got == sorted(key(whole, i) for i in range(len(whole)))  # none lost, none twice
    assert a["stats"]["sent_bytes"] == b["stats"]["recv_bytes"] > 0
    # Every field of a moved sequence arrives intact (routes stay uint8).
    where = {key(whole, i): i for i in range(len(whole))}
    for i in range(len(b["batch"])):
        j = where[key(b["batch"], i)]
        for name in whole.tok:
            assert torch.equal(b["batch"].tok[name][i], whole.tok[name][j]), name
            assert b["batch"].tok[name][i].dtype == whole.tok[name][j].dtype
        for name in whole.seq:
            assert b["batch"].seq[name][i] == whole.seq[name][j], name
    for m in range(2):
        loads = [int(x["batch"].seq_lens[x["batch"].seq["mini_batch"] == m].sum()) for x in (a, b)]
        longest = int(whole.seq_lens[whole.seq["mini_batch"] == m].max())
        assert abs(loads[0] - loads[1]) <= longest, (m, loads)
    # The model-parallel share: an exact copy from one tensor broadcast.
    for name in a["batch"].keys():
        assert torch.equal(b["copy"][name], a["batch"][name]), name


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PACKED))
def test_packed_micro_batches_give_the_same_step(runs, name):
    out = runs[name]
    assert len(out["plan"]) > 1 and max(len(p) for p in out["plan"]) > 1, out["plan"]
    # Every forward ran packed, on the sequences' tokens rounded up to the split (8 x TP), not on
    # b x the longest: rank 0's micro-batches of its share of the batch.
    assert out["packed"] and all(p for p, _ in out["packed"]), out["packed"]
    mult = 16 if name == "tp2_packed" else 8
    assert out["sp"] == (name == "tp2_packed")
    assert sum(n for _, n in out["packed"]) < out["tokens"] + mult * len(out["plan"]), (out["packed"], out["tokens"])
    _check(out, runs["moe" if "ep2" in name else "dense"], name)
    # The forward-only pass (old log-probs, reference) gives the padded run's log-probs at every
    # position of every sequence but its last (its label is past the sequence; with R3 it has no
    # recorded route, and the spread-out stand-in route depends on the token's place in the layout).
    padded = runs[name.removesuffix("_packed")]
    valid = torch.arange(out["logp"].shape[1])[None] < out["seq_lens"][:, None] - 1
    assert torch.equal(out["seq_lens"], padded["seq_lens"])
    worst = (out["logp"] - padded["logp"][:, : out["logp"].shape[1]])[valid].abs().max().item()
    assert worst <= 1e-5, f"{name}: forward log-probs differ from the padded run's by {worst}"
