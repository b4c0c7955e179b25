"""Episodes of a user's function (`rollout.generate`) with a real SGLang server on CPU and the
Megatron learner holding the same weights.

- Through the trainer's own `Fleet` (client, reward pool): every model token's μ and top-K
  row equal the learner's recomputed log-probs (logits / T, fp32); environment tokens have loss
  mask 0 and μ 0 in the learner's batch; a sample's reward is the episode's own when it sets one,
  else data.reward's score of the decoded response, environment tokens included.
- The real policy loss, run through the learner, gives the logits at environment positions
  exactly zero gradient, and those at model positions a non-zero one.
- Seeded episodes repeat exactly, and an episode's first turn has the single-turn path's seed.
- The example recipe (examples/calculator_tool.py) trains end to end through the CLI.
One server serves the module; the CLI run pushes its own weights, so the learner tests put the
checkpoint's weights back first.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.run.metrics import read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve()
K, T_SAMPLE = 4, 0.7
ENV_1, ENV_2, TRAILING = "=[42]\n", "ok", "never read"


async def tool_episode(prompt, episode):
    """Three model turns around two environment inserts, and a trailing one (dropped). Prompts
    whose answer is even score themselves; the others go to data.reward."""
    await episode.generate(max_new_tokens=3)
    episode.append_text(ENV_1)
    await episode.generate(max_new_tokens=2)
    episode.append_text(ENV_2)
    await episode.generate()
    episode.append_text(TRAILING)
    if int(prompt.answer) % 2 == 0:
        episode.reward = 0.25


def length_reward(response: str, answer: str) -> float:
    """data.reward for the test: a score that depends on every character of the response."""
    return len(response) / 100 + 0.001 * sum(map(ord, response))


def _config(ckpt, url, run_dir):
    from megatron_rl.config.load import load_config, to_object

    return to_object(load_config("tiny_cpu", [
        f"model.hf_path={ckpt}", f"rollout.server_urls=[{url}]", f"trainer.out_dir={run_dir}",
        f"rollout.generate={HERE}:tool_episode", f"data.reward={HERE.stem}:length_reward",
        f"rollout.top_k_logprobs={K}", "algorithm.divergence=topk_tv", f"rollout.temperature={T_SAMPLE}",
        "rollout.max_new_tokens=2", "learner.micro_batch_size=6", "algorithm.mini_batches=1"]))


def learner_worker(rank, world_size, ckpt, url, run_dir):
    from transformers import AutoTokenizer

    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner
    from megatron_rl.batch import RolloutBatch
    from megatron_rl.trainer.policy import PolicyLoss
    from megatron_rl.data.prompts import load_examples, tokenize
    from megatron_rl.rollout.fleet import Fleet
    from megatron_rl.vocab_parallel import vocab_parallel_log_probs

    # data.reward names this module by module path: its folder on sys.path, which the reward
    # pool's spawned workers inherit.
    sys.path.insert(0, str(HERE.parent))
    cfg = _config(ckpt, url, run_dir)
    ctx = init_distributed(cfg.parallel)
    tok = AutoTokenizer.from_pretrained(ckpt)
    learner = Learner(cfg, ctx, run_dir=run_dir)
    rollouts = Fleet(cfg, ctx, Path(ckpt), tok, Path(run_dir), moe_topk=None)
    examples = load_examples(cfg.data, "train")[:40]  # two prompts that score themselves, one the pool scores
    prompts = tokenize([e for e in examples if int(e.answer) % 2 == 0][:2] + [e for e in examples if int(e.answer) % 2][:1], tok)
    try:
        groups, rewards, _ = rollouts.sample(prompts, 2, rollouts.sampling(0, T_SAMPLE, 2, 1.0), top_k=K)
    finally:
        rollouts.close()
    records = [r for g in groups for r in g]
    rb = RolloutBatch.from_records(records, [x for g in rewards for x in g], group_ids=[r.prompt_index for r in records],
                                   mini_batch=[0] * len(records), pad_id=tok.pad_token_id, with_topk=True)
    mb = rb.micro_batch(torch.arange(len(records)), int(rb.seq_lens.max()))

    def logprobs(logits_BSV, m, tp_group, vocab_size):
        ids = torch.cat([m["labels"][..., None], m["topk_ids"].clamp(min=0)], dim=-1)
        logp = vocab_parallel_log_probs(logits_BSV.detach(), ids, tp_group, temperature=T_SAMPLE,
                                        vocab_size=vocab_size)
        return logits_BSV.new_zeros(()), {"logp": logp}

    for m in learner.model:
        m.eval()
    with torch.no_grad():
        logp = learner.run_micro_batches(mb, logprobs, forward_only=True)[0]["logp"]
    # The policy loss with a non-zero advantage on every sequence; the gradient that reaches the
    # logits is read by a hook.
    sign = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(records))])
    mb["advantages"] = mb["loss_mask"] * sign[:, None]
    loss_fn = PolicyLoss(cfg.algorithm, mb, T_SAMPLE, cfg.rollout.max_new_tokens)
    grads = []

    def hooked(logits_BSV, m, tp_group, vocab_size):
        logits_BSV.register_hook(lambda g: grads.append(g.detach().abs().sum(-1)))
        return loss_fn(logits_BSV, m, tp_group, vocab_size)

    learner.train_step(mb, hooked)
    return {"records": records, "rewards": rewards, "answers": [p.answer for p in prompts], "mb": mb,
            "logp": logp, "grad": grads[0], "pad": tok.pad_token_id,
            "env": [tok.encode(t, add_special_tokens=False) for t in (ENV_1, ENV_2)],
            "texts": [tok.decode(r.response_ids.tolist(), skip_special_tokens=False) for r in records]}


def runs_of(mask):
    """[(value, start, end)] of the runs of equal values."""
    out, start = [], 0
    for k in range(1, len(mask) + 1):
        if k == len(mask) or mask[k] != mask[start]:
            out.append((mask[start], start, k))
            start = k
    return out


def reset_weights(url, ckpt):
    import aiohttp

    async def post():
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/update_weights_from_disk", json={"model_path": str(ckpt)}) as r:
                assert r.status == 200, await r.text()

    asyncio.run(post())


def test_episode_logprobs_masks_rewards_and_gradients(server, tmp_path):
    ckpt, url = server
    reset_weights(url, ckpt)
    out = run_distributed(learner_worker, 1, str(ckpt), url, str(tmp_path / "run"))[0]
    records, mb, logp, grad = out["records"], out["mb"], out["logp"], out["grad"]
    env_1, env_2 = out["env"]
    assert len(records) == 6
    worst = worst_topk = 0.0
    for i, r in enumerate(records):
        P, T = r.prompt_ids.numel(), r.response_ids.numel()
        resp, model = r.response_ids.tolist(), r.loss_mask
        # Three model turns (at most 3, 2 and 2 tokens: EOS may end one early) around the two
        # environment inserts, which are exactly the masked runs; the trailing insert is gone.
        runs = runs_of(model.tolist())
        assert [m for m, _, _ in runs] == [True, False, True, False, True], runs
        (_, _, a), (_, s1, e1), (_, _, b), (_, s2, e2), (_, _, c) = runs
        assert resp[s1:e1] == env_1 and resp[s2:e2] == env_2
        assert 1 <= a <= 3 and 1 <= b - e1 <= 2 and 1 <= c - e2 <= 2 and c == T
        assert not out["texts"][i].endswith(TRAILING)
        rows = torch.arange(P - 1, P - 1 + T)
        on, off = rows[model], rows[~model]
        # The learner's batch: loss mask and μ only on the model's tokens.
        assert torch.equal(mb["loss_mask"][i, rows], model.float())
        assert (mb["rollout_logp"][i, off] == 0).all() and (mb["topk_ids"][i, off] == -1).all()
        learner_rows = logp[i, on].double()  # [model tokens, 1 + K]
        worst = max(worst, (learner_rows[:, 0] - r.rollout_logp[model].double()).abs().max().item())
        worst_topk = max(worst_topk, (learner_rows[:, 1:] - r.topk_logp[model].double()).abs().max().item())
        # Gradient at the logits: none where the environment wrote, some at every model token.
        assert (grad[i, off] == 0).all(), grad[i, off]
        assert (grad[i, on] > 0).all(), grad[i, on]
        assert (grad[i, :P - 1] == 0).all()
    print(f"episodes: max |rollout - learner| log-prob {worst:.2e}, top-K {worst_topk:.2e}")
    assert worst <= 1e-4 and worst_topk <= 1e-4
    # Rewards: the episode's own (even answers), else data.reward on the whole decoded response.
    for i, ans in enumerate(out["answers"]):
        for j in range(2):
            text = out["texts"][2 * i + j]
            want = 0.25 if int(ans) % 2 == 0 else length_reward(text, ans)
            assert out["rewards"][i][j] == pytest.approx(want, abs=1e-12), (i, j, text)


def test_seeded_episodes_repeat_and_turn_zero_has_the_single_turn_seed(server):
    from transformers import AutoTokenizer

    from megatron_rl.rollout.client import RolloutClient, SamplingParams
    from megatron_rl.rollout.episode import sample_episodes
    from megatron_rl.data.prompts import Prompt

    ckpt, url = server
    tok = AutoTokenizer.from_pretrained(ckpt)
    prompts = [Prompt(tuple(tok.encode(t)), "0", f"p{k}") for k, t in enumerate(["3+4=", "9+1=", "5+5="])]

    async def two_turns(prompt, episode):
        await episode.generate(max_new_tokens=4)
        episode.append_text(ENV_1)
        await episode.generate(max_new_tokens=4)

    async def run(seed):
        async with RolloutClient([url]) as client:
            s = SamplingParams(temperature=1.0, max_new_tokens=4, seed=seed)
            eps, _ = await sample_episodes(two_turns, client, tok, prompts, 2, s)
            single = await client.generate([p.ids for p in prompts], s, n=2)
            return eps, single

    (a, single), (b, _), (c, _) = asyncio.run(run(11)), asyncio.run(run(11)), asyncio.run(run(12))
    flat = lambda groups: [r.response_ids.tolist() for g in groups for r in g]  # noqa: E731
    assert flat(a) == flat(b) and flat(a) != flat(c)
    assert all(torch.equal(x.rollout_logp, y.rollout_logp) for ga, gb in zip(a, b) for x, y in zip(ga, gb))
    # Turn 0 of sample (i, j) is sampled with the seed the single-turn path gives sample (i, j).
    for ga, gs in zip(a, single):
        for ep, s in zip(ga, gs):
            assert ep.response_ids[:s.response_ids.numel()].tolist() == s.response_ids.tolist()


def test_calculator_recipe_trains_end_to_end(server, tmp_path):
    """The example as a user runs it (the recipe names the episode function by file path), a few
    small steps: a random policy calls the calculator on most questions; one call is one
    environment token, so the metrics of the model's and the environment's tokens must agree with
    it; the learner's log-probs of the model's tokens equal μ on the first mini-batch (environment
    tokens with μ 0 in the loss would show up there as a mismatch of ~5 nats); eval runs episodes."""
    _, url = server
    out_dir = tmp_path / "calc"
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "calculator_tool_cpu", f"trainer.out_dir={out_dir}",
           f"rollout.server_urls=[{url}]", "trainer.steps=3", "rollout.prompts_per_step=8", "rollout.n_samples=4",
           "algorithm.mini_batches=2", "learner.micro_batch_size=8", "eval.num_prompts=4", "eval.k=2",
           "eval.every=0", "trainer.progress=false", "trainer.plot=false"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    rows = read_metrics(out_dir)
    train = [r for r in rows if r["step"] >= 0 and "rollout/env_frac" in r]
    assert len(train) == 3
    for r in train:
        calls = r["rollout/env_frac"]
        assert calls >= 0.5, r  # ~118 of 128 tokens are not digits
        assert r["rollout/env_tokens_mean"] == pytest.approx(calls)
        assert r["rollout/model_tokens_mean"] == pytest.approx(1 + calls)
        assert r["rollout/response_len_mean"] == pytest.approx(1 + 2 * calls)
        assert r["mismatch/train_vs_rollout_abs_logp"] < 1e-4, r
    assert any("eval/mean@2" in r for r in rows)


def replay_worker(rank, world_size, ckpt, batch):
    from megatron_rl.config.schema import JobConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner

    cfg = JobConfig()
    cfg.model.hf_path = ckpt
    cfg.learner.micro_batch_size = batch["input_ids"].shape[0]
    learner = Learner(cfg, init_distributed(cfg.parallel), run_dir="/nonexistent")
    _, recorded = learner.forward_logprobs(batch, routing="record")
    return {"replayed": learner.forward_logprobs(batch, routing="replay"), "recorded": recorded}


def test_moe_episode_routes_replay_to_mu(moe_server):
    """R3 on an episode: the merged routes (each turn's own steps, the environment tokens from the
    next turn's prefill) are the routes the learner itself takes at every input position, and
    replaying them reproduces μ of every model token."""
    from megatron_rl.rollout.client import RolloutClient, SamplingParams
    from megatron_rl.rollout.episode import Episode
    from megatron_rl.batch import RolloutBatch

    ckpt, url = moe_server
    prompts = [[1, 40, 41, 18, 20, 2, 5, 1, 13], [1, 33, 31, 17, 30, 98, 2, 5, 1, 13, 40]]

    async def episodes():
        out = []
        async with RolloutClient([url], moe_topk=2, num_experts=4) as client:
            for k, prompt in enumerate(prompts):
                ep, turns = Episode(prompt), []
                for length, env in ((3, [60, 61, 62]), (2, [63]), (3, [64, 65])):
                    s = SamplingParams(temperature=1.0, max_new_tokens=length, seed=k)
                    turns.append((await client.generate([ep.ids], s, return_routed_experts=True))[0][0])
                    ep.add_turn(turns[-1])
                    ep.append(env)
                out.append((ep.to_record(k, 0), turns))
        return out

    got = asyncio.run(episodes())
    records = [rec for rec, _ in got]
    for rec, turns in got:
        # Every later request returned the earlier positions' rows as the turn that computed them.
        for a, b in zip(turns, turns[1:]):
            n = a.routes.shape[0]
            assert torch.equal(b.routes[:n], a.routes)
        assert rec.routes.shape[0] == rec.prompt_ids.numel() + rec.response_ids.numel() - 1
    rb = RolloutBatch.from_records(records, [0.0] * len(records), group_ids=[0, 1], mini_batch=[0, 0], pad_id=0,
                                   with_routes=True, num_experts=4)
    batch = rb.micro_batch(torch.arange(len(records)), int(rb.seq_lens.max()))
    out = run_distributed(replay_worker, 1, str(ckpt), batch)[0]
    for i, rec in enumerate(records):
        P, T = rec.prompt_ids.numel(), rec.response_ids.numel()
        mine = out["recorded"][i, :P + T - 1].sort(-1).values
        assert torch.equal(mine, rec.routes.long().sort(-1).values)
        rows = torch.arange(P - 1, P - 1 + T)[rec.loss_mask]
        gap = (out["replayed"][i, rows].double() - rec.rollout_logp[rec.loss_mask].double()).abs().max().item()
        assert gap <= 1e-5, gap


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory, shared_server):
    from megatron_rl.models.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("custom_generate_moe")
    ckpt = make_tiny_checkpoint(root / "model", moe=True, init_std=0.2)
    return ckpt, shared_server(ckpt, routed=True).urls()[0]  # deterministic inference


@pytest.fixture(scope="module")
def server(tmp_path_factory, shared_server):
    from megatron_rl.config.load import load_config, to_object
    from megatron_rl.models.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("custom_generate")
    tiny = vars(to_object(load_config("calculator_tool_cpu")).model.tiny)
    # The recipe's architecture (the CLI run pushes its own weights), with a wider init than its
    # 0.02: peaked distributions, so that a misaligned row could not match by accident.
    ckpt = make_tiny_checkpoint(root / "model", **{**tiny, "init_std": 0.2})
    return ckpt, shared_server(ckpt).urls()[0]  # deterministic inference
