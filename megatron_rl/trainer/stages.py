"""The algorithm's stages on one step's batch, each a named call of `Trainer.fit`: the reward model's
scores, π_old's and π_ref's log-probs, the critic's values, the advantages, the critic's and the
policy's training steps.

Every learner rank runs them on its own data-parallel share of the batch (collective over the
model-parallel group through the learner, over the data-parallel group for batch-wide statistics:
rewards normalised by the reward model, group statistics, whitening, metric means). The policy's
steps run `algorithm.mini_batches` mini-batches x `algorithm.epochs`, each one optimizer step
through Megatron's schedules with the loss of trainer/policy.py. A non-finite loss, gradient norm or
reward-model score stops the run (`TrainingError`), never trains.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from megatron_rl import batch as batching
from megatron_rl.algorithms.advantages import spread_over
from megatron_rl.algorithms.registry import get
from megatron_rl.config.schema import JobConfig
from megatron_rl.distributed.collectives import all_gather_varlen, all_reduce_sum
from megatron_rl.distributed.context import ParallelContext
from megatron_rl.run.metrics import nonfinite
from megatron_rl.trainer.policy import PolicyLoss
from megatron_rl.vocab_parallel import resolve_kernel


class TrainingError(RuntimeError):
    pass


class Stages:
    def __init__(self, cfg: JobConfig, ctx: ParallelContext, models, out_dir: Path):
        """`models`: trainer/setup.py's `Models` (the policy learner, and the reference, critic and
        reward model where the config asks for them)."""
        self.cfg, self.ctx, self.out_dir = cfg, ctx, out_dir
        self.learner, self.reference, self.critic, self.reward_model = (
            models.policy, models.reference, models.critic, models.reward_model)
        self.loss_kernel = resolve_kernel(cfg.learner.loss_kernel, ctx.device)

    def score_with_reward_model(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, float]:
        """Collective: the reward model scores prompt+response; its score joins the rule reward."""
        from megatron_rl.rewards.model_rewards import combine_rewards

        rm = self.cfg.reward_model
        scores = self.reward_model.score(batch)
        if not bool(torch.isfinite(scores).all()):
            raise TrainingError(f"step {step}: reward model scores are not finite for groups "
                                f"{batch['group_ids'][~torch.isfinite(scores)].tolist()}")
        batch["rm_scores"] = scores
        # Batch normalisation and the metrics see every rank's sequences (two small all-gathers).
        (rule, lo), (every, _) = self._gather_seq(batch["rewards"]), self._gather_seq(scores)
        rewards, metrics = combine_rewards(rule, every, weight=rm.weight, rule_weight=rm.rule_weight,
                                           normalize=rm.normalize, clip=rm.clip)
        batch["rewards"] = rewards[lo:lo + len(batch)]
        return metrics

    def _gather_seq(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A per-sequence tensor of every data-parallel rank, concatenated in rank order, and where
        this rank's part starts in it."""
        if self.ctx.dp == 1:
            return x, 0
        parts = all_gather_varlen(x, self.ctx.dp_group, self.ctx.device)
        return torch.cat(parts), sum(p.numel() for p in parts[:self.ctx.dp_rank])

    def _mean(self, total: float, count: float) -> float:
        """A mean over every data-parallel rank's sequences from this rank's (sum, count)."""
        v = torch.tensor([total, count], dtype=torch.float64)
        if self.ctx.dp > 1:
            v = all_reduce_sum(v, self.ctx.dp_group, self.ctx.device)
        return float(v[0] / v[1].clamp(min=1))

    def compute_advantages(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        a = self.cfg.algorithm
        metrics: dict[str, float] = {}
        if a.overlong_buffer:
            # DAPO's soft overlong punishment joins the outcome reward before the advantages (the
            # dynamic-sampling filter has already judged the groups by their rule rewards, as
            # DAPO's filter judges them by accuracy).
            from megatron_rl.algorithms.dapo import overlong_soft_punishment

            penalty = overlong_soft_punishment(batch["response_len"], max_length=self.cfg.rollout.max_new_tokens,
                                               buffer_length=a.overlong_buffer, factor=a.overlong_penalty)
            batch["rewards"] = (batch["rewards"].double() + penalty).float()
            n = len(batch)
            metrics["reward/overlong_penalty_mean"] = self._mean(float(penalty.double().sum()), n)
            metrics["reward/shaped_mean"] = self._mean(float(batch["rewards"].double().sum()), n)
        rewards = batching.token_rewards(batch)
        mask = batch["loss_mask"]
        if a.kl_in_reward:
            from megatron_rl.algorithms.kl import kl_penalty_rewards

            logp = batch.get("old_logp", batch["rollout_logp"])
            rewards = kl_penalty_rewards(rewards, logp, batch["ref_logp"], coef=a.kl_coef,
                                         estimator=a.kl_estimator, response_mask=mask)
            metrics["reward/with_kl_penalty_mean"] = self._mean(float(rewards.double().sum()), mask.shape[0])
        values = batch.get("old_values")
        # Groups may be split across data-parallel ranks (rebalancing): group statistics and batch
        # whitening see the whole batch.
        spread = spread_over(self.ctx.dp_group, self.ctx.device) if self.ctx.dp > 1 else nullcontext()
        with spread:
            adv, returns = get("advantage", a.advantage)(rewards, mask, group_ids_B=batch["group_ids"],
                                                         **({"values_BT": values} if values is not None else {}),
                                                         **a.advantage_kwargs)
        batch["advantages"] = adv.float()
        if values is not None:
            batch["returns"] = returns.float()
        if a.overlong_filter:
            # DAPO's overlong filtering: truncated responses (finish_reason == length) train on
            # nothing. Applied after the advantages, so they still count in their group's
            # statistics (their reward is real, only its truncation makes the credit unreliable).
            from megatron_rl.algorithms.dapo import overlong_filter_mask

            batch["loss_mask"] = overlong_filter_mask(batch["loss_mask"], batch["truncated"]).float()
            metrics["reward/overlong_filtered_frac"] = self._mean(float(batch["truncated"].double().sum()), len(batch))
        return metrics

    def old_logprobs(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """π_old recompute (for mismatch corrections) and R2's recording pass."""
        a = self.cfg.algorithm
        if not (a.recompute_old_logp or a.router_replay == "r2"):
            return {}
        T = self.cfg.rollout.temperature
        if a.router_replay == "r2":
            old, batch["routed_experts"] = self.learner.forward_logprobs(batch, routing="record", temperature=T)
        else:
            routing = "replay" if a.router_replay == "r3" else None
            old = self.learner.forward_logprobs(batch, routing=routing, temperature=T)
        if a.recompute_old_logp:
            batch["old_logp"] = torch.where(batch["loss_mask"] > 0, old, torch.zeros_like(old))
        mask = batch["loss_mask"] > 0
        diff = (old - batch["rollout_logp"]).abs()[mask].double()
        return {"mismatch/old_vs_rollout_abs_logp": self._mean(float(diff.sum()), diff.numel())}

    def reference_logprobs(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """log π_ref of the sampled tokens (at the rollout temperature) for the KL penalty; logs
        kl/rollout_vs_ref, the estimator's mean over response tokens with μ's log-probs."""
        a = self.cfg.algorithm
        if self.reference is None:
            return {}
        routing = "replay" if a.router_replay == "r3" else None
        ref = self.reference.forward_logprobs(batch, routing=routing, temperature=self.cfg.rollout.temperature)
        mask = batch["loss_mask"] > 0
        batch["ref_logp"] = torch.where(mask, ref, torch.zeros_like(ref))
        kl = get("kl", a.kl_estimator)(batch["rollout_logp"].double(), batch["ref_logp"].double())
        return {"kl/rollout_vs_ref": self._mean(float(kl[mask].sum()), int(mask.sum()))}

    def train_critic(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, float]:
        """The critic's value-loss steps: one per mini-batch and epoch, as the policy's."""
        def one(mb):
            crit = mb.select(torch.arange(len(mb)))
            crit["response_mask"] = mb["loss_mask"]
            out = self.critic.train_step(crit)
            bad = nonfinite({k: v for k, v in out.items() if k != "explained_variance"})
            if bad:
                raise TrainingError(f"step {step}: critic non-finite {', '.join(bad)}")
            return out

        return {f"critic/{k}": v for k, v in self._mini_batch_steps(batch, one)[0].items()}

    def _mini_batch_steps(self, batch: dict[str, torch.Tensor], one) -> tuple[dict[str, float], dict[str, float]]:
        """`one(mini_batch) -> metrics` on algorithm.mini_batches mini-batches x algorithm.epochs;
        returns (metrics averaged over the steps, the first step's metrics)."""
        a = self.cfg.algorithm
        outs = [one(mb) for _ in range(a.epochs) for mb in batching.mini_batches(batch, a.mini_batches)]
        keys = dict.fromkeys(k for o in outs for k in o)
        return {k: sum(o.get(k, 0.0) for o in outs) / len(outs) for k in keys}, outs[0]

    def train_policy(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, float]:
        a = self.cfg.algorithm
        routing = "replay" if a.router_replay != "none" else None
        split = self.cfg.trainer.max_staleness > 0 and "versions" in batch
        every = self.cfg.trainer.token_log_every
        records: list[list[dict]] = []

        def one(mb):
            loss_fn = PolicyLoss(a, mb, self.cfg.rollout.temperature, self.cfg.rollout.max_new_tokens,
                                 dp_group=self.ctx.dp_group, device=self.ctx.device,
                                 split_at_step=step if split else None,
                                 record=every > 0 and step % every == 0,
                                 kernel=self.loss_kernel)
            out = self.learner.train_step(mb, loss_fn, routing=routing)
            out |= loss_fn.finish(self.learner)
            if loss_fn.records is not None:
                records.append(loss_fn.records)
            bad = nonfinite(out)
            if bad:
                raise TrainingError(f"step {step}: non-finite {', '.join(bad)} "
                                    f"(loss/total={out.get('loss/total')}, grad_norm={out.get('grad_norm')})")
            return out

        mean, first = self._mini_batch_steps(batch, one)
        if records and self.ctx.is_last_stage and self.ctx.tp_rank == 0:
            path = self.out_dir / "tokens" / f"step{step}.dp{self.ctx.dp_rank}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"step": step, "mini_batches": records}, path)
        # The first mini-batch runs on exactly the weights that sampled its fresh tokens: their
        # |log π − log μ| is the trainer-vs-engine mismatch (R3 drives it to ~0). Stale tokens
        # (asynchronous training) differ by the updates since, which is no mismatch.
        key = "fresh/abs_logp_diff/mean" if split else "abs_logp_diff/mean"
        if key in first and (not split or first.get("fresh/tokens", 0.0) > 0):
            mean["mismatch/train_vs_rollout_abs_logp"] = first[key]
        return mean
