"""The RL loop: generate → (reward model) → (old log-probs) → (reference log-probs) → (values) →
advantages → (train critic) → train policy → sync weights → log → evaluate → checkpoint, one named
call per stage (`Trainer.fit`).

Every learner rank runs this. The model-parallel leader of each data-parallel rank produces that
rank's share of whole prompt groups (drives the SGLang servers, scores the responses), the
producers exchange sequences so every mini-batch's tokens are balanced across data-parallel ranks,
and each hands its compact batch to its model-parallel peers by tensor broadcast: no rank holds the
global batch (trainer/batch.py documents the layout). Rank 0 also starts local servers, pushes
weights and evaluates. Training runs
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

Generation runs on a producer thread (trainer/producer.py) that makes step t's share as soon as
the weights of step t − `trainer.max_staleness` are on the servers: with 0 that is the synchronous
loop (each step generates after the previous push, bit for bit as before the thread existed); with
k > 0 the servers generate the next steps while the learner trains, and every token's weight
version is in the batch (`versions`) for the staleness bound, the `async/*` metrics and the
trust-region diagnostics split into `fresh/` and `stale/` tokens. A push either waits for the
generation admitted before it (drain: exactly k steps off-policy) or, with
`rollout.partial_rollouts`, cuts it and lets the client continue each response under the new
weights (`sync_weights`, the one place the two differ). The models are built by trainer/setup.py.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from megatron_rl.algorithms.registry import get
from megatron_rl.config.schema import JobConfig
from megatron_rl.distributed.context import ParallelContext, init_distributed
from megatron_rl.algorithms.advantages import spread_over
from megatron_rl.distributed.collectives import all_gather_varlen, all_reduce_sum
from megatron_rl.trainer import batch as batching
from megatron_rl.trainer.batch import RolloutBatch
from megatron_rl.trainer.checkpoint import load_checkpoint
from megatron_rl.trainer.run_dir import (Resume, check_resume, config_text, nothing_to_do, write_checkpoint_config,
                                         write_run_config)
from megatron_rl.trainer.metrics import MetricsLogger, nonfinite
from megatron_rl.trainer.policy import TOPK_DIVERGENCES, PolicyLoss
from megatron_rl.trainer.prompts import PromptStream, TokenizedPrompts, load_examples, tokenize
from megatron_rl.trainer.setup import build_models
from megatron_rl.distributed.wait import Interrupted
from megatron_rl.trainer.operations import REQUEUE_EXIT, REQUEUE_MARKER, Operations


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


def _spans_versions(rec) -> bool:
    """Whether the record's model tokens come from more than one weight version."""
    known = rec.versions[rec.versions >= 0] if rec.versions is not None else None
    return known is not None and known.numel() > 0 and int(known.min()) != int(known.max())


def validate(cfg: JobConfig) -> None:
    """Config checks that need no process group (also run by `dry-run`)."""
    a, r = cfg.algorithm, cfg.rollout
    _check_kwargs("loss_kwargs", a.loss_kwargs, "policy loss", a.policy_loss,
                  tensors=("divergence", "old_logp", "response_mask"),
                  extra=("entropy_eps",) if a.policy_loss == "aspo" else ())
    _check_kwargs("advantage_kwargs", a.advantage_kwargs, "advantage", a.advantage,
                  tensors=("group_ids_B", "values_BT"))
    from megatron_rl.vocab_parallel import DIVERGENCES

    if a.divergence is not None and a.divergence not in DIVERGENCES:
        raise ValueError(f"algorithm.divergence={a.divergence!r}; valid: {', '.join(DIVERGENCES)} (or null)")
    for key, kind, name in (("agg_mode", "aggregation", a.agg_mode), ("correction", "correction", a.correction)):
        if name:
            try:
                get(kind, name)
            except ValueError as e:
                raise ValueError(f"algorithm.{key}: {e}") from None
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
    for name in ("rollout_wait_timeout", "rollout_wait_log_every"):
        if getattr(cfg.trainer, name) <= 0:
            raise ValueError(f"trainer.{name}={getattr(cfg.trainer, name)} must be > 0 (seconds)")
    if cfg.data.reward_workers < 1 or cfg.data.reward_timeout <= 0:
        raise ValueError(f"data.reward_workers={cfg.data.reward_workers} must be >= 1 and data.reward_timeout="
                         f"{cfg.data.reward_timeout} > 0 (rewards are scored in worker processes, each call "
                         "killed past the timeout)")
    from megatron_rl.rewards import get_reward, reward_kind
    from megatron_rl.rewards.pool import ON_ERROR

    if cfg.data.reward_on_error not in ON_ERROR:
        raise ValueError(f"data.reward_on_error={cfg.data.reward_on_error!r}; valid: {', '.join(ON_ERROR)}")
    # The reward resolves here, in the parent, with plugins' error (a missing module or function),
    # before any reward worker starts.
    reward_kind(get_reward(cfg.data.reward), cfg.data.reward)
    if r.max_inflight_per_server < 0 or (r.request_timeout is not None and r.request_timeout <= 0):
        raise ValueError(f"rollout.max_inflight_per_server={r.max_inflight_per_server} must be >= 0 (0: derived) and "
                         f"rollout.request_timeout={r.request_timeout} null (no total timeout) or > 0")
    if r.stall_timeout is not None and not r.stall_timeout > 0:
        raise ValueError(f"rollout.stall_timeout={r.stall_timeout}: seconds > 0, or null for no watchdog "
                         "(then rollout.request_timeout, or one derived from max_new_tokens, bounds each request)")
    if cfg.learner.max_tokens_per_micro_batch < 0:
        raise ValueError(f"learner.max_tokens_per_micro_batch={cfg.learner.max_tokens_per_micro_batch}; "
                         "valid: 0 (micro_batch_size sequences per micro-batch) or a positive token budget")
    if r.prompts_per_step % a.mini_batches:
        raise ValueError(f"rollout.prompts_per_step={r.prompts_per_step} is not divisible by "
                         f"algorithm.mini_batches={a.mini_batches} (mini-batches hold whole groups)")
    from megatron_rl.models.bridge import SPECS

    if cfg.model.spec not in SPECS:
        raise ValueError(f"model.spec={cfg.model.spec!r}; valid: {', '.join(SPECS)}")
    if r.generate:  # a missing module or function, or one that is not async, fails here (dry-run too)
        from megatron_rl.rollout.episode import load_episode_fn

        load_episode_fn(r.generate)
        if a.overlong_buffer:
            raise ValueError("algorithm.overlong_buffer ramps a penalty up to rollout.max_new_tokens, the length "
                             "of one sampled response; an episode of rollout.generate has several turns and "
                             "environment tokens, which that bound does not describe")
    for flag, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(cfg.trainer, flag) and importlib.util.find_spec(package) is None:
            raise ValueError(f"trainer.{flag}=true needs the {package} package, which is not installed: "
                             f"pip install -e '.[loggers]' (tensorboard and wandb), or pip install {package}")
    from megatron_rl.vocab_parallel import KERNELS
    from megatron_rl.weights.fp8 import QUANTIZATIONS

    if cfg.learner.loss_kernel not in KERNELS:
        raise ValueError(f"learner.loss_kernel={cfg.learner.loss_kernel!r}; valid: {', '.join(KERNELS)}")
    if cfg.learner.loss_kernel == "triton" and importlib.util.find_spec("triton") is None:
        raise ValueError("learner.loss_kernel=triton needs the triton package, which is not importable here "
                         "(it comes with CUDA builds of torch); learner.loss_kernel=torch runs everywhere")

    if r.quantization not in QUANTIZATIONS:
        raise ValueError(f"rollout.quantization={r.quantization!r}; valid: {', '.join(QUANTIZATIONS)}")
    if cfg.trainer.max_staleness < 0:
        raise ValueError(f"trainer.max_staleness={cfg.trainer.max_staleness} must be >= 0 (0: synchronous)")
    if r.partial_rollouts and (cfg.trainer.max_staleness < 1 or cfg.trainer.mode != "train"):
        raise ValueError("rollout.partial_rollouts=true cuts generation in flight at a weight push; it needs "
                         "trainer.max_staleness >= 1 and trainer.mode=train (synchronously nothing is in flight "
                         "at a push)")
    e, t = cfg.eval, cfg.trainer
    if e.timeout is not None and not 0 < e.timeout < t.rollout_wait_timeout:
        raise ValueError(f"eval.timeout={e.timeout}: seconds, more than 0 and less than trainer.rollout_wait_timeout="
                         f"{t.rollout_wait_timeout:g} (the other ranks wait that long for the evaluation)")
    # The launcher passes a disaggregated layout's servers (rollout.server_urls) at launch.
    servers = len(r.server_urls) if r.server_urls else None if r.placement == "disaggregated" else r.num_servers
    if e.servers < 0 or (e.servers and servers is not None and e.servers >= servers):
        raise ValueError(f"eval.servers={e.servers}: servers an evaluation holds beside training, fewer than the "
                         f"{servers} rollout servers (at least one must serve training), or 0 to evaluate on all "
                         "of them between steps")
    if cfg.trainer.mode not in ("train", "rollout_only", "train_only"):
        raise ValueError(f"trainer.mode={cfg.trainer.mode!r}; valid: train, rollout_only, train_only")
    if cfg.trainer.mode != "train_only":  # train_only contacts no server
        from megatron_rl.rollout.placement import check_placement

        check_placement(cfg)


class Trainer:
    def __init__(self, cfg: JobConfig, ctx: ParallelContext, resume: Optional[Resume] = None):
        """`resume`: where the run folder has this run (`check_resume`, done by `train` before
        anything starts); checked here when not given."""
        from transformers import AutoTokenizer

        validate(cfg)
        from megatron_rl.rollout.auth import share_job_key

        share_job_key()  # collective: the servers this job starts admit only its own requests (rollout/auth.py)
        self.cfg, self.ctx = cfg, ctx
        t = cfg.trainer
        self.out_dir = Path(t.out_dir)
        self.rollouts_dir = Path(t.rollouts_dir or self.out_dir / "rollouts")
        resume = resume or check_resume(cfg)
        notes = write_run_config(cfg, resume) if ctx.rank == 0 else []
        self._config_text = config_text(cfg)  # into every checkpoint it writes
        models = build_models(cfg, ctx, self.out_dir)
        self.learner, self.reference, self.critic, self.reward_model = (
            models.policy, models.reference, models.critic, models.reward_model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.learner.hf_path)
        self.prompts = PromptStream(TokenizedPrompts(load_examples(cfg.data, "train"), self.tokenizer),
                                    seed=cfg.data.shuffle_seed)
        eval_examples = load_examples(cfg.data, "eval", cfg.eval.num_prompts) if cfg.eval.num_prompts else []
        self.eval_prompts = tokenize(eval_examples, self.tokenizer)
        self.step, self.weight_version = 0, "0"
        self.feeder = None  # the rollout producer thread (trainer/producer.py), on producer ranks
        self._saved_queue: tuple[Optional[Path], dict] = (None, {})
        ckpt = resume.checkpoint
        if ckpt is not None:
            state = load_checkpoint(self.learner, ckpt, others=self._others())
            self.step, self.weight_version = state["step"], state["weight_version"]
            self.prompts.load_state_dict(state["prompts"])
            self._saved_queue = (ckpt, state.get("queue", {}))
        self.logger = MetricsLogger(self.out_dir, t, enabled=ctx.rank == 0, start_step=self.step,
                                    run_name=cfg.name, config_dict=OmegaConf.to_container(OmegaConf.structured(cfg)))
        if ckpt is not None:
            self.logger.message(f"[megatron-rl] resumed from {ckpt} at step {self.step}")
        for line in notes:
            self.logger.message(line)
        self.rollouts = None
        if t.mode != "train_only":
            from megatron_rl.trainer.rollouts import Rollouts

            moe_topk = self.learner.config.moe_router_topk if self.learner.config.num_moe_experts else None
            self.rollouts = Rollouts(cfg, ctx, self.learner.hf_path, self.tokenizer, self.out_dir, moe_topk,
                                     num_experts=self.learner.config.num_moe_experts)
        self.ops = Operations(t, ctx, self.out_dir, self.logger.message)  # checkpoints, time limit, stop signals
        self.requeue = False  # stopped before the time limit: `train` exits REQUEUE_EXIT
        self.interrupted = False  # stopped mid-step (its generation given up)
        self.history: list[dict] = []
        self._attempt = 0
        self._restarts = 0  # steps whose rollouts were made again (a server served other weights)
        self.signal = self.eval_signal = None
        if dist.is_initialized() and dist.get_world_size(ctx.mp_group) > 1:
            from megatron_rl.distributed.wait import LeaderSignal

            self.signal = LeaderSignal("rollouts", timeout_s=t.rollout_wait_timeout,
                                       log_every_s=t.rollout_wait_log_every,
                                       timeout_name="trainer.rollout_wait_timeout")
        # Data-parallel producers meet on the store before their first collective of a step.
        self.meeting = None
        if dist.is_initialized() and ctx.dp > 1 and self.producer:
            from megatron_rl.distributed.wait import StoreMeeting

            self.meeting = StoreMeeting("producers", ctx.dp_rank, ctx.dp, timeout_s=t.rollout_wait_timeout,
                                        log_every_s=t.rollout_wait_log_every, what="data-parallel producer",
                                        timeout_name="trainer.rollout_wait_timeout")

    def _others(self) -> dict:
        """Trained models besides the policy, checkpointed with it."""
        return {"critic": self.critic} if self.critic is not None else {}

    # ------------------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        t = self.cfg.trainer
        if self.rollouts is not None:
            # Servers may hold other weights (a resumed run; servers shared across runs): start
            # every run that samples (rollout_only too) by giving them exactly the learner's.
            self.sync_weights()
            # From here generation runs on a thread, up to trainer.max_staleness steps ahead.
            self._start_producer()
        if self.step == 0 and self.eval_prompts and self.rollouts is not None:
            initial = self.evaluate()
            if initial:
                self.logger.log(-1, initial)  # the initial policy, as row "step -1"
        while self.step < t.steps:
            self.ops.step_started()
            timer = Timer()
            try:
                with timer("generate"):
                    batch, metrics = self.generate()
            except Interrupted:
                self._stop_mid_step()
                break
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
                        batch["old_values"] = self.critic.forward_values(batch)
                with timer("advantages"):
                    metrics |= self.compute_advantages(batch)
                if self.critic is not None:
                    with timer("train_critic"):
                        metrics |= self.train_critic(batch)
                if self.step >= self.cfg.critic.warmup_steps or self.critic is None:
                    with timer("train"):
                        metrics |= self.train_policy(batch)
            self.step += 1
            with timer("weight_sync"):
                metrics |= self.publish()
            beside = self.finished_eval()  # an evaluation beside training that has ended
            if self.eval_due():
                if beside and self.step >= t.steps:  # the last row is the last evaluation's
                    self.log_eval_row(beside)
                    beside = {}
                metrics |= self.evaluate()
            self.log(metrics | beside | timer.total())
            decision = self.ops.between_steps(self.step, t.steps, t.save_every)
            if decision.save:
                self.save()
            if decision.stop:
                self.cut_eval()
                self.ops.finish()  # the checkpoint is complete before the run says so
                why = f" ({self.ops.why})" if decision.requeue and self.ops.why else ""
                self.logger.message(f"[megatron-rl] {decision.stop}{why}: checkpoint at step {self.step} "
                                    f"written; stopping (resume continues from it)")
                self.requeue = decision.requeue
                break
        self.close()
        return self.history

    def _stop_mid_step(self) -> None:
        """A stop arrived while the step was generating: give its generation up and checkpoint the
        state after the last completed step (Operations.interrupt)."""
        self.interrupted = True
        self.cut_eval()
        if self.feeder is not None:
            self.feeder.stop(abort=self.rollouts.abort_other_lanes, timeout=10)
        self.save()
        self.ops.finish()
        why = self.ops.stop.name() or "a stop requested on another rank"
        self.logger.message(f"[megatron-rl] {why} during step {self.step}'s generation: generation given up; "
                            f"checkpoint at step {self.step} written; stopping (resume continues from it)")

    # ------------------------------------------------------------------------------------------
    def generate(self) -> tuple[RolloutBatch, dict[str, float]]:
        """This rank's rollout batch for the step (collective) and the step's rollout metrics.

        Every model token must come from weights at most `trainer.max_staleness` steps old (its
        `versions`; with 0, exactly the weights just pushed). A server that died and was restarted
        serves its initial checkpoint (version unknown): the producer's shares from this step on
        are thrown away, the weights are pushed again and the same prompts are generated again.
        """
        while True:
            status, batch, metrics = self._produce()
            if status == "ok":
                return batch, metrics
            if status.startswith("error:"):
                raise TrainingError(status[len("error:"):])
            self.logger.message(f"[megatron-rl] step {self.step}: records from other weights (a server "
                                "was restarted); pushing weights again and regenerating")
            self._restarts += 1
            self.sync_weights()
            if self.feeder is not None:
                self.feeder.restart(self.step, self.prompts.state_dict())

    @property
    def producer(self) -> bool:
        """The model-parallel leader of each data-parallel rank produces that rank's rollouts."""
        return dist.get_rank(self.ctx.mp_group) == 0 if dist.is_initialized() else True

    def _produce(self) -> tuple[str, Optional[RolloutBatch], dict]:
        """Producers take their share of whole groups from their producer thread (or read it
        back) and exchange sequences among themselves to balance every mini-batch's tokens
        (trainer/batch.py `rebalance`); each then hands its batch to its model-parallel peers by
        tensor broadcast. Returns (status: "ok", "stale" or "error:<message>" — the same on every
        rank —, batch, metrics)."""
        ctx, t, a = self.ctx, self.cfg.trainer, self.cfg.algorithm
        shared = dist.is_initialized() and dist.get_world_size(ctx.mp_group) > 1
        batch, metrics, status = None, {}, "ok"
        leader = dist.get_global_rank(ctx.mp_group, 0) if shared else 0
        # Model-parallel peers wait for their producer on the store, not inside a collective (the
        # NCCL watchdog would kill a broadcast that outlasts its timeout while rollouts run).
        self._attempt += 1
        key = f"step{self.step}/try{self._attempt}/leader{leader}"
        if self.producer:
            with self.signal.leading(key) if shared else nullcontext():
                if t.mode == "train_only":
                    batch, metrics = self._read_rollouts()
                else:
                    batch, metrics, status = self._take_share()
                if status == "ok" and t.mode != "rollout_only" and ctx.dp > 1:
                    batch, stats = batching.rebalance(batch, ctx.dp_group, a.mini_batches, ctx.device)
                    moved = all_reduce_sum(torch.tensor([stats["recv_bytes"], batch.nbytes()], dtype=torch.float64),
                                           ctx.dp_group, ctx.device)
                    metrics["data/rebalanced_frac"] = float(moved[0] / moved[1].clamp(min=1))
        elif shared:
            self.signal.wait(key)
        if shared:
            header = [(status, self.prompts.state_dict(), metrics) if self.producer else None]
            dist.broadcast_object_list(header, src=leader, group=ctx.mp_group)
            status, position, metrics = header[0]
            if not self.producer:
                self.prompts.load_state_dict(position)
            if status == "ok":
                batch = RolloutBatch.broadcast(batch, leader, ctx.mp_group, ctx.device)
        return status, batch, metrics

    # -- the producer thread (trainer/producer.py) -------------------------------------------------
    def _start_producer(self) -> None:
        """Producer ranks: start the thread that makes each step's share ahead of the learner
        (at most trainer.max_staleness steps), from the consumer's prompt position or after the
        shares a resumed checkpoint saved."""
        from megatron_rl.rollout.client import GenerationAborted
        from megatron_rl.trainer.producer import Producer, ProducerStopped, StoreSum

        if not self.producer:
            return
        ctx = self.ctx
        agree = None
        if dist.is_initialized() and ctx.dp > 1:
            store = dist.distributed_c10d._get_default_store().clone()
            agree = StoreSum(store, f"agree/{self.cfg.name}", ctx.dp_rank, ctx.dp,
                             timeout_s=self.cfg.trainer.rollout_wait_timeout,
                             log_every_s=self.cfg.trainer.rollout_wait_log_every)
        stream = PromptStream(self.prompts.prompts, seed=self.prompts.seed)
        stream.load_state_dict(self.prompts.state_dict())
        saved = self._load_queue()
        if saved:
            stream.load_state_dict(saved[-1].position)

        def make(target: int, s: PromptStream) -> tuple[RolloutBatch, dict]:
            try:
                return self._make_share(target, s, agree)
            except (ProducerStopped, GenerationAborted):
                raise  # a stop, not a failure
            except BaseException as e:
                if agree is not None:  # the other producers' threads stop waiting for this one
                    agree.fail(f"step {target}: {type(e).__name__}: {e}")
                raise

        # Partial rollouts without dynamic sampling: the next admitted target starts in the slots
        # the current one's tail frees (trainer/producer.py, overlap).
        r = self.cfg.rollout
        self.feeder = Producer(make, stream,
                               self.cfg.trainer.max_staleness, last_target=self.cfg.trainer.steps - 1,
                               on_exit=self.rollouts.close_lane,
                               overlap=r.partial_rollouts and not r.dynamic_sampling)
        self.feeder.start(self.step, published=self.step, saved=saved)

    def _make_share(self, target: int, stream: PromptStream, agree) -> tuple[RolloutBatch, dict]:
        """Producer thread: this rank's groups of step `target` as a compact batch, with the
        versions of their tokens checked against the staleness bound (no collective here)."""
        r, a = self.cfg.rollout, self.cfg.algorithm
        records, rewards, gids, metrics = self.rollouts.generate(stream.take, target, agree=agree)
        routes = a.router_replay == "r3"
        cfg = self.learner.config
        batch = RolloutBatch.from_records(
            records, rewards, group_ids=gids, mini_batch=[g * a.mini_batches // r.prompts_per_step for g in gids],
            pad_id=self.tokenizer.pad_token_id, with_topk=a.divergence in TOPK_DIVERGENCES and r.top_k_logprobs > 0,
            with_routes=routes, num_experts=cfg.num_moe_experts if routes else None,
            route_shape=(self.learner.router_replay.num_moe_layers, cfg.moe_router_topk) if routes else None,
            with_versions=True)
        metrics["_async"] = self._version_counts(batch, records, target)
        return batch, metrics

    def _version_counts(self, batch: RolloutBatch, records, target: int) -> torch.Tensor:
        """[k+1 token counts by staleness 0..k, tokens outside the bound (older, newer or of
        unknown weights), samples continued after a cut, samples spanning several versions]."""
        k = self.cfg.trainer.max_staleness
        counts = torch.zeros(k + 4, dtype=torch.float64)
        if not len(batch):
            return counts
        mask = torch.cat(batch.tok["loss_mask"]) > 0
        v = torch.cat(batch.tok["versions"])[mask].long()
        d = target - v
        ok = (v >= 0) & (d >= 0) & (d <= k)
        counts[:k + 1] = torch.bincount(d[ok], minlength=k + 1)[:k + 1].double()
        counts[k + 1] = float((~ok).sum())
        counts[k + 2] = float(sum(len(rec.segments or ()) > 1 for rec in records))
        counts[k + 3] = float(sum(_spans_versions(rec) for rec in records))
        return counts

    def _take_share(self) -> tuple[Optional[RolloutBatch], dict, str]:
        """Producers (collective over them): this rank's share of the step from the producer
        thread, checked: every model token within the staleness bound, every μ finite."""
        ctx = self.ctx
        # Each producer waits for its own thread, then for the others on the store: a producer
        # later than the process group's timeout is waited for here, not inside the all-reduce.
        key = f"step{self.step}/try{self._attempt}"
        try:
            share = self.feeder.get(self.step, interrupt=self.ops.interrupt)
        except Interrupted:
            raise  # every producer learns it from the store (Operations.interrupt)
        except BaseException as e:
            if self.meeting:
                self.meeting.fail(f"step {self.step}: {type(e).__name__}: {e}")
            raise
        waited = self.meeting.meet(key, interrupt=self.ops.interrupt) if self.meeting else 0.0
        batch, metrics = share.batch, dict(share.metrics)
        counts = metrics.pop("_async")
        stale = self.cfg.trainer.mode == "train" and bool(counts[self.cfg.trainer.max_staleness + 1] > 0)
        bad = ""
        if not stale and len(batch):
            mask = torch.cat(batch.tok["loss_mask"]) > 0
            mu = torch.cat(batch.tok["rollout_logp"])
            if not bool(torch.isfinite(mu[mask]).all()):
                i = next(i for i, x in enumerate(batch.tok["rollout_logp"]) if not torch.isfinite(x).all())
                s_ = int((~torch.isfinite(batch.tok["rollout_logp"][i])).nonzero()[0])
                bad = (f"step {self.step}: rollout log-prob is {float(batch.tok['rollout_logp'][i][s_])} for "
                       f"group {int(batch.seq['group_ids'][i])} (a sample of data-parallel rank {ctx.dp_rank}) "
                       f"position {s_}; not training on it")
        flags = torch.tensor([float(stale), float(bool(bad))], dtype=torch.float64)
        sums = metrics.pop("_sums")
        if dist.is_initialized() and ctx.dp > 1:
            flags = all_reduce_sum(flags, ctx.dp_group, ctx.device)
            sums = all_reduce_sum(sums, ctx.dp_group, ctx.device)
            counts = all_reduce_sum(counts, ctx.dp_group, ctx.device)
        metrics |= self.rollouts.finish_metrics(sums) | self._async_metrics(counts)
        metrics["time/queue_wait"] = self.feeder.waited_s
        if self.meeting:
            metrics["time/producers_wait"] = waited  # for the other data-parallel producers, on the store
        if flags[1]:
            return None, metrics, "error:" + (bad or "a rollout log-prob is not finite on another "
                                                    "data-parallel rank (its log names it)")
        if flags[0]:
            return None, metrics, "stale"
        self.prompts.load_state_dict(share.position)
        return batch, metrics, "ok"

    def _async_metrics(self, counts: torch.Tensor) -> dict[str, float]:
        k = self.cfg.trainer.max_staleness
        counts = counts.cpu()  # all-reduced on the learner's device
        by_age = counts[:k + 1]
        n = float(by_age.sum())
        ages = torch.arange(k + 1, dtype=torch.float64)
        out = {f"async/tokens_staleness_{d}": float(by_age[d]) for d in range(k + 1)}
        out |= {"async/staleness_mean": float((by_age * ages).sum()) / max(n, 1.0),
                "async/staleness_max": float(ages[by_age > 0].max()) if n else 0.0,
                "async/old_token_frac": float(by_age[1:].sum()) / max(n, 1.0),
                "async/continued_samples": float(counts[k + 2]),
                "async/multi_version_samples": float(counts[k + 3]),
                "async/regenerated_steps": float(self._restarts),
                "async/queue_depth": float(self.feeder.depth())}
        return out

    def _rollouts_file(self, dp_rank: int) -> Path:
        return self.rollouts_dir / f"step_{self.step:08d}.dp{dp_rank}.pt"

    def save_rollouts(self, batch: RolloutBatch, metrics: dict[str, float]) -> None:
        """rollout_only: each producer writes its share (groups whole, before any rebalancing)."""
        if self.producer:
            self.rollouts_dir.mkdir(parents=True, exist_ok=True)
            batch.save(self._rollouts_file(self.ctx.dp_rank), metrics if self.ctx.dp_rank == 0 else {})

    def _read_rollouts(self) -> tuple[RolloutBatch, dict]:
        """train_only: this rank's groups (group id mod DP) of the step's saved shares — written
        with any data-parallel size."""
        files = sorted(self.rollouts_dir.glob(f"step_{self.step:08d}.dp*.pt"))
        if not files:
            raise FileNotFoundError(f"trainer.mode=train_only: no saved rollouts {self._rollouts_file(0)} "
                                    "(write them with trainer.mode=rollout_only)")
        parts, metrics = [], {}
        for f in files:
            part, m = RolloutBatch.load(f)
            parts.append(part)
            metrics |= m
        whole = RolloutBatch.cat(parts)
        mine = (whole.seq["group_ids"] % self.ctx.dp == self.ctx.dp_rank).nonzero().flatten()
        return whole.select(mine), metrics

    def score_with_reward_model(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Collective: the reward model scores prompt+response; its score joins the rule reward."""
        from megatron_rl.rewards.model_rewards import combine_rewards

        rm = self.cfg.reward_model
        scores = self.reward_model.score(batch)
        if not bool(torch.isfinite(scores).all()):
            raise TrainingError(f"step {self.step}: reward model scores are not finite for groups "
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

    def train_critic(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """The critic's value-loss steps: one per mini-batch and epoch, as the policy's."""
        def step(mb):
            crit = mb.select(torch.arange(len(mb)))
            crit["response_mask"] = mb["loss_mask"]
            out = self.critic.train_step(crit)
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
        split = self.cfg.trainer.max_staleness > 0 and "versions" in batch
        every = self.cfg.trainer.token_log_every
        records: list[list[dict]] = []

        def step(mb):
            loss_fn = PolicyLoss(a, mb, self.cfg.rollout.temperature, self.cfg.rollout.max_new_tokens,
                                 dp_group=self.ctx.dp_group, device=self.ctx.device,
                                 split_at_step=self.step if split else None,
                                 record=every > 0 and self.step % every == 0,
                                 kernel=self.cfg.learner.loss_kernel)
            out = self.learner.train_step(mb, loss_fn, routing=routing)
            out |= loss_fn.finish(self.learner)
            if loss_fn.records is not None:
                records.append(loss_fn.records)
            bad = nonfinite(out)
            if bad:
                raise TrainingError(f"step {self.step}: non-finite {', '.join(bad)} "
                                    f"(loss/total={out.get('loss/total')}, grad_norm={out.get('grad_norm')})")
            return out

        mean, first = self._mini_batch_steps(batch, step)
        if records and self.ctx.is_last_stage and self.ctx.tp_rank == 0:
            path = self.out_dir / "tokens" / f"step{self.step}.dp{self.ctx.dp_rank}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"step": self.step, "mini_batches": records}, path)
        # The first mini-batch runs on exactly the weights that sampled its fresh tokens: their
        # |log π − log μ| is the trainer-vs-engine mismatch (R3 drives it to ~0). Stale tokens
        # (asynchronous training) differ by the updates since, which is no mismatch.
        key = "fresh/abs_logp_diff/mean" if split else "abs_logp_diff/mean"
        if key in first and (not split or first.get("fresh/tokens", 0.0) > 0):
            mean["mismatch/train_vs_rollout_abs_logp"] = first[key]
        return mean

    def sync_weights(self) -> dict[str, float]:
        """Collective: push the learner's weights (version = the step) to every server. Generation
        admitted before it either finishes first (drain: its tokens all come from the weights that
        admitted it) or, with rollout.partial_rollouts, is cut by a pause and continued under the
        new weights (each token's version recorded)."""
        self.weight_version = str(self.step)
        partial = self.cfg.rollout.partial_rollouts
        start = time.perf_counter()
        if self.feeder is not None and not partial:
            self.feeder.drain()  # the learner waits here for the admitted generation: time/drain_wait
        waited = time.perf_counter() - start
        if partial and self.ctx.rank == 0:
            self.rollouts.pause("abort")
        try:
            out = self.rollouts.sync_weights(self.learner, self.weight_version)
        finally:
            if partial and self.ctx.rank == 0:
                self.rollouts.resume()
        return out | {"time/drain_wait": waited}

    def publish(self) -> dict[str, float]:
        """After a training step: the servers get its weights (trainer.mode=train) and the
        producer may start every step up to `step + max_staleness`."""
        out = self.sync_weights() if self.cfg.trainer.mode == "train" else {}
        if self.feeder is not None:
            self.feeder.published(self.step)
        return out

    def eval_due(self) -> bool:
        e = self.cfg.eval
        return bool(self.eval_prompts) and self.rollouts is not None and (
            self.step == self.cfg.trainer.steps or (e.every and self.step % e.every == 0))

    def evaluate(self) -> dict[str, float]:
        """The evaluation of the weights just pushed (version `self.step`). With eval.servers > 0
        (not at the last step) rank 0 starts it beside training and returns {} (its metrics join
        the row of the step it ends in: `finished_eval`); the other ranks go on at once. Otherwise,
        and at the last step (after any evaluation still running), rank 0 evaluates on every
        server while the other ranks wait on the store (not in a collective), then get the
        metrics."""
        if self.cfg.eval.servers and self.step < self.cfg.trainer.steps:
            if self.ctx.rank == 0:
                why = self.rollouts.start_eval(self.eval_prompts, self.step)
                if why:
                    self.logger.message(f"[megatron-rl] eval at step {self.step} skipped: {why}")
            return {}
        pending = self.finished_eval(wait=True)
        if pending:
            self.log_eval_row(pending)
        out = [None]
        multi = dist.is_initialized() and dist.get_world_size() > 1
        if multi and self.eval_signal is None:
            from megatron_rl.distributed.wait import LeaderSignal

            t = self.cfg.trainer
            self.eval_signal = LeaderSignal("eval", timeout_s=t.rollout_wait_timeout,
                                            log_every_s=t.rollout_wait_log_every,
                                            timeout_name="trainer.rollout_wait_timeout")
        key = f"step{self.step}"
        if self.ctx.rank == 0:
            with self.eval_signal.leading(key) if multi else nullcontext():
                out = [self.rollouts.evaluate(self.eval_prompts, self.step)]
        elif multi:
            self.eval_signal.wait(key)
        if multi:
            dist.broadcast_object_list(out, src=0)
        return out[0]

    def finished_eval(self, wait: bool = False) -> dict[str, float]:
        """Rank 0: the metrics of an evaluation beside training that has ended (waiting for it
        with `wait`), with eval/step, the version of the weights it evaluated; {} otherwise. A
        failed one is reported and the run goes on."""
        if self.rollouts is None or self.ctx.rank != 0 or not self.cfg.eval.servers:
            return {}
        done = self.rollouts.eval_result(wait=wait)
        if done is None:
            return {}
        step, metrics, error = done
        if error is not None:
            self.logger.message(f"[megatron-rl] eval of step {step}'s weights failed beside training "
                                f"({type(error).__name__}: {error}); training goes on")
            return {"eval/failed": 1.0, "eval/step": float(step)}
        return metrics | {"eval/step": float(step)}

    def log_eval_row(self, metrics: dict[str, float]) -> None:
        """Rank 0: an evaluation beside training that ended at the last step, in a row of its own
        before the last training row (which holds the last step's evaluation)."""
        self.history.append({"step": self.step - 1, **metrics})
        self.logger.log(self.step - 1, metrics)

    def cut_eval(self) -> None:
        """Rank 0, the run stopping: an evaluation still running beside training is aborted."""
        if self.rollouts is not None and self.ctx.rank == 0 and self.cfg.eval.servers:
            if self.rollouts.eval_running():
                self.logger.message("[megatron-rl] the evaluation running beside training is cut by the stop")
                self.rollouts.abort_eval()
                self.rollouts.eval_result(wait=True)

    def log(self, metrics: dict[str, float]) -> None:
        metrics["weight_version"] = float(self.weight_version)
        self.history.append({"step": self.step - 1, **metrics})
        self.logger.log(self.step - 1, metrics)

    def save(self) -> Optional[Path]:
        """Collective. With the producer ahead of the learner, its complete shares of the next
        steps are saved too (`queue/t<step>.dp<rank>.pt`, the same steps on every producer), so a
        resumed run trains on exactly them and generates from the step after."""
        shares = self.feeder.snapshot() if self.feeder is not None else []
        shares = [s for i, s in enumerate(shares) if s.target == self.step + i]  # contiguous
        last = torch.tensor([shares[-1].target if shares else self.step - 1
                             if self.producer else 2 ** 62], dtype=torch.int64, device=self.ctx.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(last, op=dist.ReduceOp.MIN)
        shares = [s for s in shares if s.target <= int(last)]
        state = {"step": self.step, "weight_version": self.weight_version,
                 "prompts": self.prompts.state_dict(),
                 "queue": {"targets": list(range(self.step, int(last) + 1)), "dp": self.ctx.dp}}

        def write_queue(folder: Path) -> None:
            if not shares:
                return
            (folder / "queue").mkdir(exist_ok=True)
            for s in shares:
                s.batch.save(folder / "queue" / f"t{s.target:08d}.dp{self.ctx.dp_rank}.pt",
                             {"metrics": s.metrics, "position": s.position})

        def write_extra(folder: Path) -> None:
            if self.producer:
                write_queue(folder)
            if self.ctx.rank == 0:
                write_checkpoint_config(self._config_text, folder)

        return self.ops.checkpointer.save(self.learner, self.step, state, others=self._others(), extra=write_extra)

    def _load_queue(self) -> list:
        """The shares a resumed checkpoint saved for this producer (none if the data-parallel size
        changed: they are generated again, from the same prompts)."""
        from megatron_rl.trainer.producer import StepShare

        ckpt, queue = self._saved_queue
        if ckpt is None or not queue.get("targets"):
            return []
        if queue["dp"] != self.ctx.dp:
            self.logger.message(f"[megatron-rl] the checkpoint's {len(queue['targets'])} queued rollout step(s) were "
                                f"made by {queue['dp']} data-parallel producers, this run has {self.ctx.dp}: "
                                "generating them again")
            return []
        out = []
        for t in queue["targets"]:
            batch, extra = RolloutBatch.load(ckpt / "queue" / f"t{t:08d}.dp{self.ctx.dp_rank}.pt")
            out.append(StepShare(t, batch, extra["metrics"], extra["position"]))
        return out

    def close(self) -> None:
        if self.feeder is not None:
            self.feeder.stop(abort=self.rollouts.abort_other_lanes, timeout=10 if self.interrupted else 120)
        if self.rollouts is not None:
            self.rollouts.close()
        if hasattr(self.reward_model, "close"):
            self.reward_model.close()
        self.logger.close()
        if self.ctx.rank == 0 and self.cfg.trainer.plot and self.history:
            from megatron_rl.trainer.plot import plot_run

            plot_run(self.out_dir)
        self.ops.finish()


def train(cfg: JobConfig) -> list[dict]:
    """Entry point for every learner rank (torchrun / srun / one process)."""
    from megatron_rl.models.hub import resolve_model_paths

    resolve_model_paths(cfg)  # hub ids -> the hub cache's snapshot folders (HF_HUB_OFFLINE=1: the cache only)
    if cfg.model.hf_path is None and cfg.model.base.sft_steps > 0:
        from megatron_rl.models.base import ensure_base_model

        cfg.model.hf_path = str(ensure_base_model(cfg))  # built once, then cached (file-locked)
    # Before anything starts: the run folder holds this run or none (else ResumeMismatch, naming
    # the differences), and a finished run has nothing to do (no model built, no server started).
    resume = check_resume(cfg)
    idle = nothing_to_do(cfg, resume)
    if idle is not None:
        if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0:
            print(idle, flush=True)
        return []
    from megatron_rl.models.layout import check_layout

    check_layout(cfg.model, cfg.parallel)  # what Megatron-Core would refuse after the start, said now
    from megatron_rl.distributed.context import check_gpu_python

    check_gpu_python(cfg)
    from megatron_rl.trainer.checkpoint import storage_check

    problems = storage_check(cfg)[1]  # a full disk found by the first save, hours in, is found now
    if problems:
        raise ValueError("the run's checkpoints do not fit:\n  " + "\n  ".join(problems))
    ctx = init_distributed(cfg.parallel, timeout_s=cfg.trainer.collective_timeout)
    if ctx.rank == 0:
        print(f"[megatron-rl] {cfg.name}: {ctx.describe()}", flush=True)
    trainer = Trainer(cfg, ctx, resume)
    history = trainer.fit()
    if trainer.requeue:  # checkpointed before the time limit: the sbatch requeues
        if ctx.rank == 0:
            (Path(cfg.trainer.out_dir) / REQUEUE_MARKER).write_text(f"stopped at step {trainer.step}: {trainer.ops.why}\n")
        if dist.is_initialized():
            dist.barrier()  # the marker is there before any rank leaves (srun ends the others when one exits non-zero)
        raise SystemExit(REQUEUE_EXIT)
    return history
