"""The scalar-head models over real gloo processes: the Megatron reward model against HF
transformers' `Qwen3ForSequenceClassification`, and the PPO critic (layout invariance, GAE from its
values against a float64 reference, learning a fixed target).

One spawn per layout (TP1, TP2 with sequence parallel, PP2, DP2) runs everything on that layout:
reward scores, critic values, one critic step. The TP1 run then trains the critic PPO-style for
LEARN_BATCHES x EPOCHS steps: old values from the critic, returns from GAE over them, EPOCHS
clipped-value-loss steps per batch (so the clip can bind from the second one on).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.models.tiny import make_tiny_checkpoint
from megatron_rl.models.tiny_reward import make_tiny_reward_checkpoint

B_RM, S_RM = 8, 13
LEARN_BATCHES, EPOCHS = 10, 2
LAYOUTS = {"tp1": (1, {}), "tp2_sp": (2, {"tp": 2}), "pp2": (2, {"pp": 2}), "dp2": (2, {})}
GAMMA, LAM = 1.0, 0.95


def reward_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded rows of different lengths (one full row); pad id 0 only in the padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 99, (B_RM, S_RM), generator=g)
    lengths = torch.randint(3, S_RM + 1, (B_RM,), generator=g)
    lengths[1] = S_RM
    mask = torch.arange(S_RM)[None, :] < lengths[:, None]
    return dict(input_ids=torch.where(mask, ids, torch.zeros_like(ids)), attention_mask=mask.long())


def critic_batch(n: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Synthetic-task prompts "a+b%10=" with random digit responses of 1-4 tokens + <|im_end|>.

    The outcome reward (on the last response token) is (a − 4.5)/4.5: it depends on the prompt
    only, so the value of every response state is learnable. Layout as in learner/critic.py:
    `response_mask[:, t]` marks the positions whose *next* token is a response token.
    """
    from megatron_rl.data.synthetic import make_problems
    from megatron_rl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    rng = random.Random(seed)
    rows, masks, rewards = [], [], []
    for p in make_problems(n, seed=seed, modulo=10):
        prompt = tok(p.prompt)["input_ids"]
        resp = tok("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 4))))["input_ids"]
        resp = resp + [tok.convert_tokens_to_ids("<|im_end|>")]
        rows.append(prompt + resp)
        masks.append((len(prompt) - 1, len(prompt) - 1 + len(resp)))
        rewards.append((int(p.prompt.split("+")[0]) - 4.5) / 4.5)
    S = max(len(r) for r in rows)
    ids = torch.zeros(n, S, dtype=torch.long)
    response_mask = torch.zeros(n, S, dtype=torch.bool)
    token_rewards = torch.zeros(n, S, dtype=torch.float64)
    for i, (r, (lo, hi)) in enumerate(zip(rows, masks)):
        ids[i, :len(r)] = torch.tensor(r)
        response_mask[i, lo:hi] = True
        token_rewards[i, hi - 1] = rewards[i]
    return dict(input_ids=ids, response_mask=response_mask, token_rewards=token_rewards)


def reference_gae(rewards, values, mask, gamma, lam):
    """Textbook GAE per row over its valid positions, in Python floats; returns (A, A + V)."""
    adv = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        last, next_v = 0.0, 0.0
        for t in reversed([t for t in range(rewards.shape[1]) if mask[i, t]]):
            delta = float(rewards[i, t]) + gamma * next_v - float(values[i, t])
            last = delta + gamma * lam * last
            adv[i, t] = last
            next_v = float(values[i, t])
    return adv, torch.where(mask, adv + values, torch.zeros_like(adv))


def worker(rank, world_size, policy_path, rm_path, parallel, learn_batches):
    import copy

    from megatron_rl.algorithms import get
    from megatron_rl.config.schema import JobConfig, ParallelConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.critic import Critic
    from megatron_rl.learner.reward_model import RewardModel

    cfg = JobConfig()
    cfg.parallel = ParallelConfig(**parallel)
    cfg.learner.micro_batch_size = 2
    cfg.optim.lr, cfg.optim.adam_eps, cfg.optim.clip_grad = 1e-3, 1e-3, 1.0
    ctx = init_distributed(cfg.parallel)

    rm_cfg = copy.deepcopy(cfg)
    rm_cfg.model.hf_path = rm_path
    rm = RewardModel(rm_cfg, ctx, run_dir="/nonexistent")
    scores = rm.score(reward_batch())

    cfg.model.hf_path = policy_path
    critic = Critic(cfg, ctx, run_dir="/nonexistent", value_loss="clipped", value_clip=0.2)
    data = critic_batch()
    mask, rewards = data["response_mask"], data["token_rewards"]
    monte_carlo = torch.where(mask, rewards.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(rewards))

    def ppo_batch():
        values = critic.forward_values(data).double()
        adv, ret = get("advantage", "gae")(rewards, mask, values_BT=values, gamma=GAMMA, lam=LAM,
                                          whiten=False)
        batch = dict(input_ids=data["input_ids"], response_mask=mask, returns=ret, old_values=values)
        return batch, values, adv

    def mse(values):
        return float(((values - monte_carlo)[mask]).square().mean())

    batch, values0, adv0 = ppo_batch()
    first = critic.train_step(batch)
    curve, steps = [mse(values0)], []
    for _ in range(learn_batches):
        batch, values, _ = ppo_batch()
        curve.append(mse(values))
        steps.append([critic.train_step(batch) for _ in range(EPOCHS)])
    rm_critic_values = None
    if learn_batches:
        curve.append(mse(critic.forward_values(data).double()))
        # A critic initialised from the reward model takes its score head ("auto").
        rm_critic_values = Critic(rm_cfg, ctx, run_dir="/nonexistent").forward_values(reward_batch())
    if rank != 0:
        return None
    return dict(scores=scores.cpu(), values0=values0.cpu(), adv0=adv0.cpu(), first=first,
                mse=curve, steps=steps, layout=ctx.describe(), rm_critic_values=rm_critic_values)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    policy = make_tiny_checkpoint(tmp_path_factory.mktemp("policy"), num_layers=2)
    # Tied embeddings (like small Qwen3 reward models): the head must not inherit the tie.
    rm = make_tiny_reward_checkpoint(tmp_path_factory.mktemp("rm"), num_layers=2,
                                     tie_word_embeddings=True, seed=1)
    return str(policy), str(rm)


def layouts_worker(rank, world_size, policy_path, rm_path, layouts):
    """`worker` for every layout of `layouts` ({name: (parallel, learn_batches)}) in turn."""
    return {name: worker(rank, world_size, policy_path, rm_path, parallel, learn)
            for name, (parallel, learn) in layouts.items()}


@pytest.fixture(scope="module")
def layout(checkpoints):
    """layout(name) -> rank 0's results on that layout. The layouts of one world size run one after
    the other in one spawned process group (Megatron's parallel state rebuilt for each)."""
    cache = {}

    def run(name):
        if name not in cache:
            world = LAYOUTS[name][0]
            mine = {n: (p, LEARN_BATCHES if n == "tp1" else 0) for n, (w, p) in LAYOUTS.items() if w == world}
            cache.update(run_distributed(layouts_worker, world, *checkpoints, mine)[0])
        return cache[name]

    return run


@pytest.fixture(scope="module")
def hf_rewards(checkpoints):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(checkpoints[1], dtype=torch.float32)
    batch = reward_batch()
    with torch.no_grad():
        return model(**batch).logits[:, 0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_reward_model_matches_hf(name, layout, hf_rewards):
    out = layout(name)
    diff = (out["scores"] - hf_rewards).abs().max().item()
    print(f"{out['layout']}: reward max |Megatron - HF| = {diff:.2e}")
    assert out["scores"].shape == (B_RM,)
    assert diff <= 1e-4, f"{name}: rewards differ from HF by {diff}"
    assert hf_rewards.std() > 0.1  # rewards are O(1): the tolerance is a real test


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2_sp", "pp2", "dp2"])
def test_critic_layout_invariance(name, layout):
    """Same values, value loss and grad norm after one step as at TP=1."""
    ref, out = layout("tp1"), layout(name)
    torch.testing.assert_close(out["values0"], ref["values0"], rtol=1e-5, atol=1e-5)
    a, b = ref["first"], out["first"]
    print(f"{name}: value_loss {a['value_loss']:.8f} vs {b['value_loss']:.8f}; "
          f"grad_norm {a['grad_norm']:.8f} vs {b['grad_norm']:.8f}")
    for key in ("value_loss", "grad_norm", "explained_variance", "value_mse"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert a["grad_norm"] > 0 and a["value_clip_frac"] == 0.0  # V = V_old: nothing clipped yet


@pytest.mark.slow
def test_gae_from_critic_values_matches_float64_reference(layout):
    out = layout("tp1")
    data = critic_batch()
    adv, _ = reference_gae(data["token_rewards"], out["values0"].double(), data["response_mask"],
                           GAMMA, LAM)
    torch.testing.assert_close(out["adv0"], adv, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_critic_learns_fixed_target(layout):
    out = layout("tp1")
    mse = out["mse"]
    data = critic_batch()
    target = data["token_rewards"].flip(-1).cumsum(-1).flip(-1)[data["response_mask"]]
    var = float(target.var(unbiased=False))
    last = [s[-1] for s in out["steps"]]
    print("critic value MSE per batch:", " ".join(f"{m:.4f}" for m in mse),
          f"(target variance {var:.4f})")
    print("explained variance:", " ".join(f"{s['explained_variance']:.3f}" for s in last))
    print("clip fraction (2nd epoch):", " ".join(f"{s['value_clip_frac']:.2f}" for s in last))
    assert all(math.isfinite(m) for m in mse)
    assert mse[-1] < 0.1 * mse[0], mse
    assert mse[-1] < 0.1 * var, (mse[-1], var)  # far better than the best constant prediction
    assert last[-1]["explained_variance"] > 0.8
    # The clip binds once the critic moves more than ε within a batch, and never in its 1st epoch.
    assert any(s["value_clip_frac"] > 0 for s in last)
    assert all(s[0]["value_clip_frac"] == 0 for s in out["steps"])


@pytest.mark.slow
def test_critic_initialised_from_reward_model(layout, hf_rewards):
    values = layout("tp1")["rm_critic_values"]
    last = reward_batch()["attention_mask"].sum(-1) - 1
    torch.testing.assert_close(values[torch.arange(B_RM), last], hf_rewards, rtol=0, atol=1e-4)


def test_last_token_index_checks_padding():
    from megatron_rl.learner.reward_model import last_token_index

    assert last_token_index(torch.tensor([[1, 1, 0], [1, 1, 1]])).tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"rows \[1\] are not right-padded"):
        last_token_index(torch.tensor([[1, 0, 0], [0, 1, 1]]))
    with pytest.raises(ValueError, match=r"rows \[0\] have no token"):
        last_token_index(torch.tensor([[0, 0, 0], [1, 0, 0]]))
