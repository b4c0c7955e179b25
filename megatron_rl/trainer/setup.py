"""The models of a run, built before the loop: the policy (trained), and as the config asks the
frozen reference policy (`algorithm.kl_coef > 0`: the KL penalty), the critic (`algorithm.advantage
= gae`: a value model trained beside the policy) and the reward model (`reward_model.enabled`:
Megatron forward-only or served by SGLang). Every one shares the policy's parallel layout; the
loop (trainer/loop.py) only calls them.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from megatron_rl.config.schema import JobConfig
from megatron_rl.distributed.context import ParallelContext
from megatron_rl.learner.learner import Learner


@dataclasses.dataclass
class Models:
    policy: Learner
    reference: Optional[Learner] = None
    critic: Optional[Any] = None  # learner.critic.Critic
    reward_model: Optional[Any] = None  # learner.reward_model.RewardModel | rewards.served.ServedRewardModel


def build_models(cfg: JobConfig, ctx: ParallelContext, out_dir: Path) -> Models:
    """Collective: every learner rank builds every model (each holds its shards)."""
    policy = Learner(cfg, ctx, run_dir=str(out_dir), total_steps=cfg.trainer.steps)
    if cfg.algorithm.router_replay != "none" and policy.router_replay is None:
        raise ValueError(f"algorithm.router_replay={cfg.algorithm.router_replay} needs an MoE model")
    # The frozen initial policy for the KL penalty: a second, forward-only model with the
    # policy's layout, built from the same HF checkpoint (never from a resumed checkpoint).
    reference = Learner(cfg, ctx, run_dir=str(out_dir), trainable=False) if cfg.algorithm.kl_coef else None
    critic = _critic(cfg, ctx, out_dir, policy) if cfg.algorithm.advantage == "gae" else None
    reward_model = _reward_model(cfg, ctx, out_dir, policy) if cfg.reward_model.enabled else None
    return Models(policy, reference, critic, reward_model)


def _critic(cfg: JobConfig, ctx: ParallelContext, out_dir: Path, policy):
    """The value model: the policy's checkpoint (or critic.hf_path) with a scalar head."""
    from megatron_rl.learner.critic import Critic

    c = cfg.critic
    cfg = copy.deepcopy(cfg)
    cfg.model.hf_path = c.hf_path or str(policy.hf_path)
    cfg.optim = copy.deepcopy(c.optim)
    return Critic(cfg, ctx, run_dir=str(out_dir), total_steps=cfg.trainer.steps,
                  value_loss=c.value_loss, value_clip=c.value_clip, loss_agg_mode=c.loss_agg_mode,
                  max_response_length=cfg.rollout.max_new_tokens, head_init_std=c.head_init_std)


def _reward_model(cfg: JobConfig, ctx: ParallelContext, out_dir: Path, policy):
    from megatron_rl.learner.reward_model import RewardModel
    from megatron_rl.rewards.served import ServedRewardModel

    rm = cfg.reward_model
    if rm.backend == "sglang":
        path = Path(rm.hf_path) if rm.hf_path else None if rm.server_urls else _tiny_reward_checkpoint(cfg, ctx, out_dir)
        model = ServedRewardModel(cfg, ctx, out_dir, path)
    else:
        cfg = copy.deepcopy(cfg)
        cfg.model.hf_path = rm.hf_path or str(_tiny_reward_checkpoint(cfg, ctx, out_dir))
        model = RewardModel(cfg, ctx, run_dir=str(out_dir))
    if model.vocab_size is not None and model.vocab_size != policy.vocab_size:
        raise ValueError(f"reward model {model.hf_path} has vocabulary {model.vocab_size}, the policy "
                         f"{policy.vocab_size}: the reward model must share the policy's tokenizer")
    return model


def _tiny_reward_checkpoint(cfg: JobConfig, ctx: ParallelContext, out_dir: Path) -> Path:
    """Collective: rank 0 writes a tiny random reward model into the run dir."""
    from megatron_rl.models.tiny_reward import make_tiny_reward_checkpoint

    t = cfg.reward_model.tiny
    if t.moe:
        raise ValueError("reward_model.tiny.moe: the tiny reward model is dense (Qwen3ForSequenceClassification)")
    path = out_dir / "tiny_reward_model"
    if ctx.rank == 0:
        make_tiny_reward_checkpoint(path, num_layers=t.num_layers, hidden=t.hidden, heads=t.heads,
                                    kv_heads=t.kv_heads, head_dim=t.head_dim, ffn=t.ffn,
                                    vocab_size=t.vocab_size, max_positions=t.max_positions,
                                    init_std=t.init_std, seed=t.seed)
    if dist.is_initialized():
        dist.barrier()
    return path

