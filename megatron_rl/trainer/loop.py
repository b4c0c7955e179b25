"""The RL loop: generate → (reward model) → (old log-probs) → (reference log-probs) → (values) →
advantages → (train critic) → train policy → sync weights → log → evaluate → checkpoint, one named
call per stage (`Trainer.fit`).

Every learner rank runs this; rank 0 also drives the SGLang servers and scores responses, and the
rollout batch then goes to all ranks (trainer/batch.py documents its layout). Training runs
`algorithm.epochs` passes over `algorithm.mini_batches` mini-batches per rollout batch, each one
optimizer step through Megatron's schedules with the policy loss of trainer/policy.py, with the
divergences computed vocab-parallel on the logit shards. Router replay (MoE): r3 replays the
engine's routes in every training forward; r2 records the old-log-prob pass and replays it.

The four-model PPO setup: `algorithm.kl_coef > 0` builds a frozen reference policy;
`reward_model.enabled` a frozen sequence-classification reward model whose score joins the rule
reward; `algorithm.advantage = gae` a critic (value model) whose values feed GAE and which trains on
the same mini-batches as the policy (first, so the policy's step sees the same batch). All of them
share the policy's parallel layout. With `algorithm.kl_in_reward` the KL penalty is subtracted
from the per-token rewards (estimator on the rollout log-probs) instead of added to the loss.

Modes (`trainer.mode`) swap the rollout source, not the loop: `train` (live SGLang),
`rollout_only` (live, batches saved to rollouts_dir, no training), `train_only` (batches read
back from rollouts_dir, no servers).
"""

from __future__ import annotations

import copy
import inspect
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from megatron_rl.algorithms.registry import get
from megatron_rl.config.schema import JobConfig
from megatron_rl.distributed.context import ParallelContext, init_distributed
from megatron_rl.learner.learner import Learner
from megatron_rl.trainer import batch as batching
from megatron_rl.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_rl.trainer.metrics import MetricsLogger, nonfinite
from megatron_rl.trainer.policy import TOPK_DIVERGENCES, PolicyLoss
from megatron_rl.trainer.prompts import PromptStream, load_examples, tokenize
from megatron_rl.trainer.signals import StopRequest


class TrainingError(RuntimeError):
    pass


class Timer:
    def __init__(self):
        self.metrics: dict[str, float] = {}
        self.start = time.perf_counter()

    @contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        yield
        self.metrics[f"time/{name}"] = time.perf_counter() - t

    def total(self) -> dict[str, float]:
        return {**self.metrics, "time/step": time.perf_counter() - self.start}


def _check_kwargs(field: str, given, kind: str, name: str, tensors: tuple[str, ...],
                  extra: tuple[str, ...] = ()) -> None:
    """`algorithm.<field>` may set only keyword-only arguments of the registered `kind` function
    `name` (the `tensors` among them come from the trainer) and `extra`."""
    params = inspect.signature(get(kind.replace(" ", "_"), name)).parameters
    valid = sorted(k for k, p in params.items() if p.kind is p.KEYWORD_ONLY and k not in tensors)
    valid += list(extra)
    for k in given:
        if k not in valid:
            raise ValueError(f"algorithm.{field}.{k} is not an argument of {kind} {name!r}; "
                             f"valid: {', '.join(valid) or '(none)'}")


def validate(cfg: JobConfig) -> None:
    """Config checks that need no process group (also run by `dry-run`)."""
    a, r = cfg.algorithm, cfg.rollout
    _check_kwargs("loss_kwargs", a.loss_kwargs, "policy loss", a.policy_loss,
                  tensors=("divergence", "old_logp", "response_mask"),
                  extra=("entropy_eps",) if a.policy_loss == "aspo" else ())
    _check_kwargs("advantage_kwargs", a.advantage_kwargs, "advantage", a.advantage,
                  tensors=("group_ids_B", "values_BT"))
    if a.router_replay not in ("none", "r2", "r3"):
        raise ValueError(f"algorithm.router_replay={a.router_replay!r}; valid: none, r2, r3")
    if a.divergence in TOPK_DIVERGENCES and r.top_k_logprobs <= 0:
        raise ValueError(f"algorithm.divergence={a.divergence} needs rollout.top_k_logprobs > 0 (e.g. 20)")
    if a.correction and not a.recompute_old_logp:
        raise ValueError(f"algorithm.correction={a.correction} needs algorithm.recompute_old_logp=true")
    get("kl", a.kl_estimator)
    if a.kl_in_reward and not a.kl_coef:
        raise ValueError("algorithm.kl_in_reward=true needs algorithm.kl_coef > 0")
    if a.advantage == "gae":
        get("value_loss", cfg.critic.value_loss)
    rm = cfg.reward_model
    if cfg.data.reward == "none" and not rm.enabled:
        raise ValueError("data.reward=none (no rule reward) needs reward_model.enabled=true")
    if rm.enabled:
        from megatron_rl.rewards.model_rewards import NORMALIZE

        if rm.backend not in ("megatron", "sglang"):
            raise ValueError(f"reward_model.backend={rm.backend!r}; valid: megatron, sglang")
        if rm.normalize not in NORMALIZE:
            raise ValueError(f"reward_model.normalize={rm.normalize!r}; valid: {', '.join(NORMALIZE)}")
        if r.dynamic_sampling:
            raise ValueError("rollout.dynamic_sampling filters groups by their rule rewards before the "
                             "reward model scores them; it cannot be combined with reward_model.enabled")
    if a.overlong_buffer and not 0 < a.overlong_buffer <= r.max_new_tokens:
        raise ValueError(f"algorithm.overlong_buffer={a.overlong_buffer} must lie in 1..rollout.max_new_tokens "
                         f"({r.max_new_tokens}): the punishment ramps over the last overlong_buffer tokens")
    if r.prompts_per_step % a.mini_batches:
        raise ValueError(f"rollout.prompts_per_step={r.prompts_per_step} is not divisible by "
                         f"algorithm.mini_batches={a.mini_batches} (mini-batches hold whole groups)")
    from megatron_rl.models.bridge import SPECS

    if cfg.model.spec not in SPECS:
        raise ValueError(f"model.spec={cfg.model.spec!r}; valid: {', '.join(SPECS)}")
    if cfg.trainer.mode not in ("train", "rollout_only", "train_only"):
        raise ValueError(f"trainer.mode={cfg.trainer.mode!r}; valid: train, rollout_only, train_only")
    if cfg.trainer.mode != "train_only":  # train_only contacts no server
        from megatron_rl.rollout.placement import check_placement

        check_placement(cfg)


class Trainer:
    def __init__(self, cfg: JobConfig, ctx: ParallelContext):
        from transformers import AutoTokenizer

        validate(cfg)
        self.cfg, self.ctx = cfg, ctx
        t = cfg.trainer
        self.out_dir = Path(t.out_dir)
        self.rollouts_dir = Path(t.rollouts_dir or self.out_dir / "rollouts")
        if ctx.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        self.learner = Learner(cfg, ctx, run_dir=str(self.out_dir), total_steps=t.steps)
        # The frozen initial policy for the KL penalty: a second, forward-only model with the
        # policy's layout, built from the same HF checkpoint (never from a resumed checkpoint).
        self.reference = (Learner(cfg, ctx, run_dir=str(self.out_dir), trainable=False)
                          if cfg.algorithm.kl_coef else None)
        self.critic = self._build_critic() if cfg.algorithm.advantage == "gae" else None
        self.reward_model = self._build_reward_model() if cfg.reward_model.enabled else None
        if cfg.algorithm.router_replay != "none" and self.learner.router_replay is None:
            raise ValueError(f"algorithm.router_replay={cfg.algorithm.router_replay} needs an MoE model")
        self.tokenizer = AutoTokenizer.from_pretrained(self.learner.hf_path)
        self.prompts = PromptStream(tokenize(load_examples(cfg.data, "train"), self.tokenizer),
                                    seed=cfg.data.shuffle_seed)
        eval_examples = load_examples(cfg.data, "eval", cfg.eval.num_prompts) if cfg.eval.num_prompts else []
        self.eval_prompts = tokenize(eval_examples, self.tokenizer)
        self.step, self.weight_version = 0, "0"
        ckpt = latest_checkpoint(self.out_dir) if t.resume else None
        if ckpt is not None:
            state = load_checkpoint(self.learner, ckpt, others=self._others())
            self.step, self.weight_version = state["step"], state["weight_version"]
            self.prompts.load_state_dict(state["prompts"])
        self.logger = MetricsLogger(self.out_dir, t, enabled=ctx.rank == 0, start_step=self.step,
                                    run_name=cfg.name, config_dict=OmegaConf.to_container(OmegaConf.structured(cfg)))
        if ckpt is not None:
            self.logger.message(f"[megatron-rl] resumed from {ckpt} at step {self.step}")
        self.rollouts = None
        if t.mode != "train_only":
            from megatron_rl.trainer.rollouts import Rollouts

            moe_topk = self.learner.config.moe_router_topk if self.learner.config.num_moe_experts else None
            self.rollouts = Rollouts(cfg, ctx, self.learner.hf_path, self.tokenizer, self.out_dir, moe_topk)
        self.stop = StopRequest(ctx.device)
        self.history: list[dict] = []

    def _build_critic(self):
        """The value model: the policy's checkpoint (or critic.hf_path) with a scalar head."""
        from megatron_rl.learner.critic import Critic

        c = self.cfg.critic
        cfg = copy.deepcopy(self.cfg)
        cfg.model.hf_path = c.hf_path or str(self.learner.hf_path)
        cfg.optim = copy.deepcopy(c.optim)
        return Critic(cfg, self.ctx, run_dir=str(self.out_dir), total_steps=self.cfg.trainer.steps,
                      value_loss=c.value_loss, value_clip=c.value_clip, loss_agg_mode=c.loss_agg_mode,
                      max_response_length=self.cfg.rollout.max_new_tokens, head_init_std=c.head_init_std)

    def _build_reward_model(self):
        from megatron_rl.learner.reward_model import RewardModel
        from megatron_rl.rewards.served import ServedRewardModel

        rm = self.cfg.reward_model
        if rm.backend == "sglang":
            path = Path(rm.hf_path) if rm.hf_path else None if rm.server_urls else self._tiny_reward_checkpoint()
            model = ServedRewardModel(self.cfg, self.ctx, self.out_dir, path)
        else:
            cfg = copy.deepcopy(self.cfg)
            cfg.model.hf_path = rm.hf_path or str(self._tiny_reward_checkpoint())
            model = RewardModel(cfg, self.ctx, run_dir=str(self.out_dir))
        if model.vocab_size is not None and model.vocab_size != self.learner.vocab_size:
            raise ValueError(f"reward model {model.hf_path} has vocabulary {model.vocab_size}, the policy "
                             f"{self.learner.vocab_size}: the reward model must share the policy's tokenizer")
        return model

    def _tiny_reward_checkpoint(self) -> Path:
        """Collective: rank 0 writes a tiny random reward model into the run dir."""
        from megatron_rl.models.tiny_reward import make_tiny_reward_checkpoint

        t = self.cfg.reward_model.tiny
        if t.moe:
            raise ValueError("reward_model.tiny.moe: the tiny reward model is dense (Qwen3ForSequenceClassification)")
        path = self.out_dir / "tiny_reward_model"
        if self.ctx.rank == 0:
            make_tiny_reward_checkpoint(path, num_layers=t.num_layers, hidden=t.hidden, heads=t.heads,
                                        kv_heads=t.kv_heads, head_dim=t.head_dim, ffn=t.ffn,
                                        vocab_size=t.vocab_size, max_positions=t.max_positions,
                                        init_std=t.init_std, seed=t.seed)
        if dist.is_initialized():
            dist.barrier()
        return path

    def _others(self) -> dict:
        """Trained models besides the policy, checkpointed with it."""
        return {"critic": self.critic} if self.critic is not None else {}

    # ------------------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        cfg, t = self.cfg, self.cfg.trainer
        if t.mode == "train":
            # Servers may hold other weights (a resumed run; servers shared across runs): start
            # every run by giving them exactly the learner's.
            self.sync_weights()
        if self.step == 0 and self.eval_prompts and self.rollouts is not None:
            self.logger.log(-1, self.evaluate())  # the initial policy, as row "step -1"
        while self.step < t.steps:
            timer = Timer()
            with timer("generate"):
                batch, metrics = self.generate()
            if t.mode == "rollout_only":
                self.save_rollouts(batch, metrics)
            else:
                if self.reward_model is not None:
                    with timer("reward_model"):
                        metrics |= self.score_with_reward_model(batch)
                with timer("old_logp"):
                    metrics |= self.old_logprobs(batch)
                with timer("ref_logp"):
                    metrics |= self.reference_logprobs(batch)
                if self.critic is not None:
                    with timer("values"):
                        batch["old_values"] = self.critic.forward_values({"input_ids": batch["input_ids"]})
                with timer("advantages"):
                    metrics |= self.compute_advantages(batch)
                if self.critic is not None:
                    with timer("train_critic"):
                        metrics |= self.train_critic(batch)
                if self.step >= self.cfg.critic.warmup_steps or self.critic is None:
                    with timer("train"):
                        metrics |= self.train_policy(batch)
            self.step += 1
            if t.mode == "train":
                with timer("weight_sync"):
                    metrics |= self.sync_weights()
            if self.eval_due():
                metrics |= self.evaluate()
            self.log(metrics | timer.total())
            stop = self.stop.requested()
            if stop or self.step == t.steps or (t.save_every and self.step % t.save_every == 0):
                self.save()
            if stop:
                self.logger.message(f"[megatron-rl] {self.stop.name()}: checkpoint at step {self.step} "
                                    f"written; stopping (resume continues from it)")
                break
        self.close()
        return self.history

    # ------------------------------------------------------------------------------------------
    def generate(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Rank 0 generates and scores (or reads saved rollouts); every rank gets the batch.

        Every record must come from the weights just pushed (its `weight_version`): a server that
        died and was restarted serves its initial checkpoint, so a batch with stale records is
        thrown away, the weights are pushed again and the same prompts are generated again.
        """
        while True:
            position = self.prompts.state_dict()
            payload = [self._generate_on_driver() if self.ctx.rank == 0 else None]
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast_object_list(payload, src=0)
            if payload[0] != "stale":
                break
            self.logger.message(f"[megatron-rl] step {self.step}: records from stale weights (a server "
                                "was restarted); pushing weights again and regenerating")
            self.prompts.load_state_dict(position)
            self.sync_weights()
        batch, metrics = payload[0]
        position = metrics.pop("_prompt_position", None)  # absent in batches read back (train_only)
        if position is not None:
            self.prompts.load_state_dict(position)
        return batch, metrics

    def _generate_on_driver(self):
        if self.cfg.trainer.mode == "train_only":
            path = self.rollouts_dir / f"step_{self.step:08d}.pt"
            if not path.exists():
                raise FileNotFoundError(f"trainer.mode=train_only: no saved rollouts {path} "
                                        "(write them with trainer.mode=rollout_only)")
            return torch.load(path, weights_only=False)
        records, rewards, metrics = self.rollouts.generate(self.prompts.take, self.step)
        if self.cfg.trainer.mode == "train" and any(r.weight_version != self.weight_version for r in records):
            return "stale"
        batch = batching.build_batch(
            records, rewards, pad_id=self.tokenizer.pad_token_id,
            with_topk=self.cfg.rollout.top_k_logprobs > 0,
            with_routes=self.cfg.algorithm.router_replay == "r3")
        bad = ~torch.isfinite(batch["rollout_logp"]) & (batch["loss_mask"] > 0)
        if bad.any():
            i, s = bad.nonzero()[0].tolist()
            raise TrainingError(f"step {self.step}: rollout log-prob is {batch['rollout_logp'][i, s]} "
                                f"for sequence {i} position {s}; not training on it")
        # Dynamic sampling draws a variable number of prompts: other ranks copy the position.
        metrics["_prompt_position"] = self.prompts.state_dict()
        return batch, metrics

    def save_rollouts(self, batch: dict[str, torch.Tensor], metrics: dict[str, float]) -> None:
        if self.ctx.rank == 0:
            self.rollouts_dir.mkdir(parents=True, exist_ok=True)
            torch.save((batch, metrics), self.rollouts_dir / f"step_{self.step:08d}.pt")

    def score_with_reward_model(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Collective: the reward model scores prompt+response; its score joins the rule reward."""
        from megatron_rl.rewards.model_rewards import combine_rewards, sequence_attention_mask

        rm = self.cfg.reward_model
        scores = self.reward_model.score({"input_ids": batch["input_ids"],
                                          "attention_mask": sequence_attention_mask(batch["loss_mask"])})
        if not bool(torch.isfinite(scores).all()):
            raise TrainingError(f"step {self.step}: reward model scores are not finite for sequences "
                                f"{torch.nonzero(~torch.isfinite(scores)).flatten().tolist()}")
        batch["rm_scores"] = scores
        batch["rewards"], metrics = combine_rewards(batch["rewards"], scores, weight=rm.weight,
                                                    rule_weight=rm.rule_weight, normalize=rm.normalize,
                                                    clip=rm.clip)
        return metrics

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
            metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
            metrics["reward/shaped_mean"] = float(batch["rewards"].double().mean())
        rewards = batching.token_rewards(batch)
        mask = batch["loss_mask"]
        if a.kl_in_reward:
            from megatron_rl.algorithms.kl import kl_penalty_rewards

            logp = batch.get("old_logp", batch["rollout_logp"])
            rewards = kl_penalty_rewards(rewards, logp, batch["ref_logp"], coef=a.kl_coef,
                                         estimator=a.kl_estimator, response_mask=mask)
            metrics["reward/with_kl_penalty_mean"] = float(rewards.double().sum() / mask.shape[0])
        values = batch.get("old_values")
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
            metrics["reward/overlong_filtered_frac"] = float(batch["truncated"].double().mean())
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
        return {"mismatch/old_vs_rollout_abs_logp": float((old - batch["rollout_logp"]).abs()[mask].mean())}

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
        return {"kl/rollout_vs_ref": float(kl[mask].mean())}

    def train_critic(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """The critic's value-loss steps: one per mini-batch and epoch, as the policy's."""
        def step(mb):
            out = self.critic.train_step({"input_ids": mb["input_ids"], "returns": mb["returns"],
                                          "old_values": mb["old_values"], "response_mask": mb["loss_mask"]})
            bad = nonfinite({k: v for k, v in out.items() if k != "explained_variance"})
            if bad:
                raise TrainingError(f"step {self.step}: critic non-finite {', '.join(bad)}")
            return out

        return {f"critic/{k}": v for k, v in self._mini_batch_steps(batch, step)[0].items()}

    def _mini_batch_steps(self, batch: dict[str, torch.Tensor], step) -> tuple[dict[str, float], dict[str, float]]:
        """`step(mini_batch) -> metrics` on algorithm.mini_batches mini-batches x algorithm.epochs;
        returns (metrics averaged over the steps, the first step's metrics)."""
        a = self.cfg.algorithm
        outs = [step(mb) for _ in range(a.epochs) for mb in batching.mini_batches(batch, a.mini_batches)]
        keys = dict.fromkeys(k for o in outs for k in o)
        return {k: sum(o.get(k, 0.0) for o in outs) / len(outs) for k in keys}, outs[0]

    def train_policy(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        a = self.cfg.algorithm
        routing = "replay" if a.router_replay != "none" else None

        def step(mb):
            loss_fn = PolicyLoss(a, mb, self.cfg.rollout.temperature, self.cfg.rollout.max_new_tokens)
            out = self.learner.train_step(mb, loss_fn, routing=routing)
            out |= loss_fn.finish(self.learner)
            bad = nonfinite(out)
            if bad:
                raise TrainingError(f"step {self.step}: non-finite {', '.join(bad)} "
                                    f"(loss/total={out.get('loss/total')}, grad_norm={out.get('grad_norm')})")
            return out

        mean, first = self._mini_batch_steps(batch, step)
        if "abs_logp_diff/mean" in first:
            # The first mini-batch runs on exactly the weights the rollouts came from: its
            # |log π − log μ| is the trainer-vs-engine mismatch (R3 drives it to ~0).
            mean["mismatch/train_vs_rollout_abs_logp"] = first["abs_logp_diff/mean"]
        return mean

    def sync_weights(self) -> dict[str, float]:
        self.weight_version = str(self.step)
        return self.rollouts.sync_weights(self.learner, self.weight_version)

    def eval_due(self) -> bool:
        e = self.cfg.eval
        return bool(self.eval_prompts) and self.rollouts is not None and (
            self.step == self.cfg.trainer.steps or (e.every and self.step % e.every == 0))

    def evaluate(self) -> dict[str, float]:
        out = [None]
        if self.ctx.rank == 0:
            out = [self.rollouts.evaluate(self.eval_prompts, self.step)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(out, src=0)
        return out[0]

    def log(self, metrics: dict[str, float]) -> None:
        metrics["weight_version"] = float(self.weight_version)
        self.history.append({"step": self.step - 1, **metrics})
        self.logger.log(self.step - 1, metrics)

    def save(self) -> Optional[Path]:
        state = {"step": self.step, "weight_version": self.weight_version,
                 "prompts": self.prompts.state_dict()}
        return save_checkpoint(self.learner, self.out_dir, self.step, state, keep=self.cfg.trainer.keep_checkpoints,
                               others=self._others())

    def close(self) -> None:
        if self.rollouts is not None:
            self.rollouts.close()
        if hasattr(self.reward_model, "close"):
            self.reward_model.close()
        self.logger.close()
        if self.ctx.rank == 0 and self.cfg.trainer.plot and self.history:
            from megatron_rl.trainer.plot import plot_run

            plot_run(self.out_dir)
        self.stop.restore()


def train(cfg: JobConfig) -> list[dict]:
    """Entry point for every learner rank (torchrun / srun / one process)."""
    ctx = init_distributed(cfg.parallel)
    if ctx.rank == 0:
        print(f"[megatron-rl] {cfg.name}: {ctx.describe()}", flush=True)
    return Trainer(cfg, ctx).fit()
