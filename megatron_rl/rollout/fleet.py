"""The rollout fleet: one component the training loop calls to generate a step's groups, push
weights and evaluate.

The model-parallel leader of every data-parallel rank is a producer: it drives its share of each
step's prompt groups over the servers (`RolloutClient`: admission, retries, dead-server
replacement, no sample lost or duplicated) and scores its responses (`RewardPool`); no rank sees
another's responses. The interface the loop uses:
- `generate(take, step)`: this producer's share of one step's groups (DAPO dynamic sampling
  included), `finish_metrics` for the step's rollout metrics;
- `sync_weights(learner, version)`: the weight push (collective; rollout/pushes.py);
- `evaluate(prompts, step)` on every server between steps, or `start_eval` / `eval_result` beside
  training (rollout/evaluation.py: on whole servers held at its weights, or a share of every
  server, the next push waiting for it);
- `pause` / `resume` (partial rollouts), `close_lane` / `abort_other_lanes` (threads that sample),
  `close`.
Where the servers come from and how many requests each takes: rollout/servers.py (rank 0 starts
local ones), rollout/admission.py (one budget for every producer of the job). rollout/placement.py
checks the placement before anything starts, and each server's own /server_info before the
weight-update group is formed. Top-K log-probs are asked for only when the divergence uses them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import socket
import threading
import time
import uuid
import zlib
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.config.schema import JobConfig
from megatron_rl.data.prompts import Prompt
from megatron_rl.distributed.collectives import all_reduce_sum
from megatron_rl.distributed.context import ParallelContext
from megatron_rl.rewards import get_reward, is_correct
from megatron_rl.rewards.pool import RewardPool
from megatron_rl.rollout import placement
from megatron_rl.rollout.admission import FleetBudget, LocalCounts, ServerKV, derived_capacity
from megatron_rl.rollout.client import RolloutClient, SamplingParams
from megatron_rl.rollout.episode import load_episode_fn, sample_episodes
from megatron_rl.rollout.evaluation import BesideTraining, eval_metrics
from megatron_rl.rollout.memory import return_large_frees
from megatron_rl.rollout.pushes import WeightPushes
from megatron_rl.rollout.records import RolloutRecord
from megatron_rl.rollout.servers import (  # noqa: F401 (server_device, server_dtype, server_extra_args: re-exported)
    local_server_gpus, server_device, server_dtype, server_extra_args, start_local_servers,
)
from megatron_rl.vocab_parallel import TOPK_DIVERGENCES
from megatron_rl.weights.fp8 import ServedWeights


def slots(cfg: JobConfig, urls: list[str]
          ) -> tuple[dict[str, int], dict[str, int], Optional[dict[str, ServerKV]]]:
    """Rank 0: each server's first slots for training and for an evaluation (at their
    max_new_tokens) and its KV pool, which the slots follow once lengths are seen
    (rollout/admission.py); rollout.max_inflight_per_server: fixed slots, no KV (None)."""
    from megatron_rl.weights.endpoint import ServerEndpoint

    n = cfg.rollout.max_inflight_per_server
    if n:
        caps = {u: n for u in urls}
        return caps, caps, None
    infos = {u: ServerEndpoint(u).server_info() for u in urls}
    train_new = cfg.rollout.max_new_tokens
    eval_new = cfg.eval.max_new_tokens or train_new
    train = {u: derived_capacity(info, train_new) for u, info in infos.items()}
    evaluation = {u: derived_capacity(info, eval_new) for u, info in infos.items()}
    kv = {u: ServerKV.from_info(info) for u, info in infos.items()}
    print("[megatron-rl] rollout slots per server, training / evaluation, until lengths are seen (then "
          "they follow them: each server's step ramp, then KV pool / the KV of a running request; rollout.max_inflight_per_server "
          "fixes them): " + ", ".join(f"{u} {train[u]} / {evaluation[u]} (KV pool {kv[u].pool})" for u in infos),
          flush=True)
    return train, evaluation, kv


def observe_lengths(budget: FleetBudget, groups: list[list[RolloutRecord]]) -> None:
    """Tell the budget the lengths of a complete set of samples: its slots follow them
    (rollout/admission.py); nothing to a budget whose slots are fixed (rollout.max_inflight_per_server).
    Not for an episode's records, which stand for several requests."""
    if getattr(budget, "kv", None) is not None:
        recs = [rec for g in groups for rec in g]
        budget.observe([rec.prompt_ids.numel() for rec in recs], [rec.num_response_tokens for rec in recs])


class _InRotation:
    """The producers' server pool (RolloutClient's `urls()`, read at every pick): every server
    but the excluded ones (held by an evaluation beside training)."""

    def __init__(self, base, excluded):
        self._base, self._excluded = base, excluded

    def urls(self) -> list[str]:
        excluded = self._excluded()
        return [u for u in self._base() if u not in excluded]



class Fleet:
    generations = 0  # steps' generations this producer finished (rank 0's: `follow_training`)

    def __init__(self, cfg: JobConfig, ctx: ParallelContext, hf_path: Path, tokenizer,
                 out_dir: Path, moe_topk: Optional[int], num_experts: Optional[int] = None):
        self.cfg, self.ctx, self.tokenizer = cfg, ctx, tokenizer
        self.driver = ctx.rank == 0  # starts local servers, pushes weights, evaluates
        # Every data-parallel rank's model-parallel leader produces that rank's share of groups.
        self.producer = dist.get_rank(ctx.mp_group) == 0 if dist.is_initialized() else True
        self.manager = None
        self.moe_topk, self.num_experts = moe_topk, num_experts
        self.rewards = None
        get_reward(cfg.data.reward)  # an unknown name fails here, with the valid names
        # A user's episode function (multi-turn, tools; rollout/episode.py), or None: one sampled
        # response per sample.
        self.episode_fn = load_episode_fn(cfg.rollout.generate) if cfg.rollout.generate else None
        self.weight_version: Optional[str] = None  # what every server in rotation holds
        # Servers out of the producers' rotation (held by an evaluation beside training, or not
        # reached by the last push), and the evaluation's clients, which keep the version they
        # started with.
        self._excluded: frozenset = frozenset()
        self._pinned: set = set()
        self.evals = BesideTraining(self)  # evaluation beside training (eval.servers > 0; rank 0)
        r = cfg.rollout
        device = server_device(cfg)
        where = placement.check_placement(cfg, device)
        # Collective (every rank reports its GPU) before the non-drivers leave.
        gpu_ids = local_server_gpus(cfg, self.driver) if where == "local" and device == "cuda" else None
        # FP8 rollouts (weights/fp8.py): CUDA servers serve block-scaled e4m3 and start from an FP8
        # copy of the checkpoint; CPU servers get the weights rounded through the same blocks.
        self.served = ServedWeights(r.quantization, "serve" if device == "cuda" else "round")
        server_model = hf_path
        if self.driver and not r.server_urls and self.served.mode == "serve" and r.quantization == "fp8":
            from megatron_rl.weights.fp8 import write_fp8_checkpoint

            server_model = write_fp8_checkpoint(hf_path, out_dir / "rollout_model_fp8")
        if self.driver and not r.server_urls:
            self.manager = start_local_servers(cfg, server_model, out_dir, device, gpu_ids)
        self.pushes = WeightPushes(cfg, self.driver, self.manager, self.served)
        caps = None
        if self.driver:
            # Each server's own layout (TP, dp 1, seeded / R3 flags) against the config, before the
            # first request: a mismatch is one clear error here, not a rendezvous hang later.
            placement.checked_endpoints(self.urls(), cfg)
            caps, eval_caps, kv = slots(cfg, self.urls())
            self._eval_budget = FleetBudget.local(eval_caps, kv=kv)  # an evaluation's own (rank 0 evaluates)
            self.evals.describe(len(self.urls()))  # a bad eval.share fails here, not at the first evaluation
        # The producers' server list (rank 0's local servers, reachable on its host only, or the
        # launcher's), each server's first slots and KV pool, and the name the counts go under: a
        # small object broadcast once.
        shared = [(self.urls(), socket.gethostname(), caps, kv, uuid.uuid4().hex[:8]) if self.driver else None]
        multi = dist.is_initialized() and dist.get_world_size() > 1
        if multi:
            dist.broadcast_object_list(shared, src=0)
        urls, host, caps, kv, name = shared[0]
        if not self.producer:
            return
        # One budget for every producer of the job (rollout/admission.py), in the job's store.
        store = dist.distributed_c10d._get_default_store() if multi else LocalCounts()
        self._budget = FleetBudget(store, f"fleet/{name}", caps, kv=kv)
        if self.manager is None and not r.server_urls and socket.gethostname() != host:
            raise ValueError(f"rollout.placement=local serves from rank 0's node ({host}); the producer on "
                             f"{socket.gethostname()} cannot reach its servers: use "
                             "rollout.placement=disaggregated with rollout.server_urls on multi-node jobs")
        # What the producers' clients see: every server but those held for an evaluation beside
        # training (`start_eval`; the set reaches every rank with each weight push).
        base = self.manager.urls if self.manager else (lambda: list(urls))
        self._servers = _InRotation(base, lambda: self._excluded)
        # Each thread that samples (the producer's, rank 0's main thread for eval and pauses) has
        # its own client and event loop: aiohttp sessions and asyncio primitives are loop-bound.
        self._lanes = threading.local()
        self._all_lanes: list[tuple[RolloutClient, asyncio.AbstractEventLoop]] = []
        self._lanes_lock = threading.Lock()
        self.client  # the main thread's, made now: a bad server list fails here
        return_large_frees()  # parsed bodies go back to the system (rollout/memory.py)
        # Rewards are scored in worker processes as responses arrive (a per-call timeout: a
        # pathological answer cannot hang the step).
        self.rewards = RewardPool(cfg.data.reward, cfg.data.reward_workers, cfg.data.reward_timeout,
                                  on_error=cfg.data.reward_on_error)
        self._calls = itertools.count()


    # ------------------------------------------------------------------------------------------
    def urls(self) -> list[str]:
        return self.manager.urls() if self.manager else list(self.cfg.rollout.server_urls)

    @property
    def client(self) -> Optional[RolloutClient]:
        """This thread's client (None on ranks that do not produce)."""
        if not self.producer:
            return None
        lane = getattr(self._lanes, "lane", None)
        if lane is None:
            r = self.cfg.rollout
            eos = self._eos_token_ids() if r.partial_rollouts else ()
            own = getattr(self._lanes, "urls", None)  # an evaluation's held servers
            client = RolloutClient(own or self._servers, request_timeout=r.request_timeout, stall_timeout=r.stall_timeout,
                                   moe_topk=self.moe_topk, num_experts=self.num_experts,
                                   budget=(self._eval_budget if own else self._budget).clone(),
                                   continue_aborted=r.partial_rollouts, eos_token_ids=eos)
            client.expected_version = self.weight_version
            if own:
                self._pinned.add(client)
            lane = self._lanes.lane = (client, asyncio.new_event_loop())
            with self._lanes_lock:
                self._all_lanes.append(lane)
        return lane[0]


    def _eos_token_ids(self) -> list[int]:
        """The model's end-of-sequence ids: the tokenizer's and generation_config.json's (an
        aborted segment that ended on one is finished, not continued)."""
        ids = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        try:
            from transformers import GenerationConfig

            g = GenerationConfig.from_pretrained(self.tokenizer.name_or_path).eos_token_id
            ids |= set(g if isinstance(g, (list, tuple)) else [g] if g is not None else [])
        except OSError:  # no generation_config.json
            pass
        if not ids:
            raise ValueError("rollout.partial_rollouts needs the model's EOS token id (tokenizer.eos_token_id "
                             "or generation_config.json): a cut response that ended on it is finished")
        return sorted(ids)

    def _run(self, coro):
        self.client  # noqa: B018 - makes this thread's lane
        return self._lanes.lane[1].run_until_complete(coro)

    def close_lane(self) -> None:
        """Close this thread's client and loop (a producer thread, as it exits)."""
        lane = getattr(self._lanes, "lane", None)
        if lane is None:
            return
        self._lanes.lane = None
        with self._lanes_lock:
            self._all_lanes.remove(lane)
            self._pinned.discard(lane[0])
        if lane[1].is_closed():  # the run's close() closed it: this thread outlived a stop's wait
            return
        try:
            lane[1].run_until_complete(lane[0].close())
        finally:
            lane[1].close()

    def abort_other_lanes(self, timeout: float = 30.0) -> None:
        """Abort the generation of every other thread's client (the producer's, when the run
        stops early): its running calls raise GenerationAborted."""
        mine = getattr(self._lanes, "lane", None)
        with self._lanes_lock:
            others = {lane[0] for lane in self._all_lanes if lane is not mine}
        self.abort_other_lanes_of(others, timeout)

    def abort_other_lanes_of(self, clients, timeout: float = 30.0) -> None:
        """Abort the generation of these clients (other threads' lanes)."""
        with self._lanes_lock:
            lanes = [lane for lane in self._all_lanes if lane[0] in clients]
        for client, loop in lanes:
            if loop.is_running():
                try:
                    asyncio.run_coroutine_threadsafe(client.abort(), loop).result(timeout)
                except Exception:  # noqa: BLE001 - the loop may finish meanwhile; nothing to abort then
                    pass

    def pause(self, mode: str) -> None:
        """Rank 0: pause every server's generation (`abort` cuts requests in flight, which the
        producers' clients continue after `resume`; requests sent meanwhile wait). A server that
        does not answer is dead: its requests are retried elsewhere by the clients, and a
        restarted one is found out by its version at the next check. A share-mode evaluation ends first."""
        self.evals.before_pause()
        self._broadcast_control("pause_generation", mode=mode)

    def resume(self) -> None:
        self._broadcast_control("continue_generation")

    def _broadcast_control(self, method: str, **kwargs) -> None:
        import logging

        urls = self._servers.urls()  # in rotation: a server held for an evaluation is not paused
        client = self.client

        async def call():
            return await asyncio.gather(*(getattr(client.server(u), method)(**kwargs) for u in urls),
                                        return_exceptions=True)

        for url, out in zip(urls, self._run(call())):
            if isinstance(out, BaseException):
                logging.getLogger(__name__).warning("%s %s failed (%s); treating the server as down", url,
                                                    method, out)

    # ------------------------------------------------------------------------------------------
    def sampling(self, step: int, temperature: float, max_new_tokens: int, top_p: float,
                 salt: int = 0) -> SamplingParams:
        seed = None
        if self.cfg.rollout.seeded:
            seed = (self.cfg.trainer.seed * 1_000_003 + step * 7_919 + salt * 104_729) % (2 ** 31)
        return SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                              seed=seed)

    def sample(self, prompts: list[Prompt], n: int, sampling: SamplingParams, top_k: int = 0,
               routes: bool = False, first_index: Optional[list[int]] = None, deadline_s: Optional[float] = None
               ) -> tuple[list[list[RolloutRecord]], list[list[float]], dict[str, float]]:
        """n samples of each prompt and their rewards (scored by the pool while the other samples
        are still generating); metrics: reward/timeouts, time/reward_wait. `first_index`: the
        prompts' indices in the whole round, so that a seeded sample's seed does not depend on
        which producer draws it. With rollout.generate each sample is an episode of the user's
        function (rollout/episode.py); one that sets its own reward is not sent to the pool.
        `deadline_s` (plain generation only): what is not finished by then is aborted and left out
        (a prompt's lists hold its finished samples only); metrics["missing_samples"] counts them."""
        call = next(self._calls)
        own: dict[tuple[int, int, int], float] = {}  # rewards episodes set themselves

        def scorer(offset: int):
            def on_record(rec: RolloutRecord, reward: Optional[float] = None) -> None:
                i = offset + rec.prompt_index
                if reward is not None:
                    own[(call, i, rec.sample_index)] = reward
                    return
                text = self.tokenizer.decode(rec.response_ids.tolist(), skip_special_tokens=False)
                self.rewards.submit((call, i, rec.sample_index), text, prompts[i].answer)
            return on_record

        if self.episode_fn is not None:
            groups, _ = self._run(sample_episodes(
                self.episode_fn, self.client, self.tokenizer, prompts, n, sampling, top_k=top_k,
                routes=routes, seed_index=first_index, on_record=scorer(0)))
        elif first_index is not None and self.cfg.rollout.seeded:
            # Seeds follow (prompt, sample) within the round (client: seed + i·n + j): one concurrent
            # call per prompt with the seed shifted to that prompt's index.
            async def calls():
                return await asyncio.gather(*(
                    self.client.generate([p.ids], dataclasses.replace(sampling, seed=sampling.seed + i * n),
                                         n=n, top_k_logprobs=top_k, return_routed_experts=routes,
                                         on_record=scorer(k))
                    for k, (p, i) in enumerate(zip(prompts, first_index))))

            groups = [g for out in self._run(calls()) for g in out]
        elif deadline_s is not None:
            groups, missing = self._run(self.client.generate_until(
                deadline_s, [p.ids for p in prompts], sampling, n=n, top_k_logprobs=top_k,
                return_routed_experts=routes, on_record=scorer(0)))
            if missing:
                self.close_lane()  # the aborted client is spent; this thread makes a new one when it next asks
            got = self.rewards.collect([(call, i, rec.sample_index) for i, g in enumerate(groups) for rec in g])
            rewards = [[got.scores[(call, i, rec.sample_index)] for rec in g] for i, g in enumerate(groups)]
            return groups, rewards, got.metrics() | {"missing_samples": float(missing)}
        else:
            groups = self._run(self.client.generate([p.ids for p in prompts], sampling, n=n, top_k_logprobs=top_k,
                                                    return_routed_experts=routes, on_record=scorer(0)))
        got = self.rewards.collect([(call, i, j) for i in range(len(prompts)) for j in range(n)
                                    if (call, i, j) not in own])
        scores = got.scores | own
        rewards = [[scores[(call, i, j)] for j in range(n)] for i in range(len(prompts))]
        return groups, rewards, got.metrics()

    def generate(self, take, step: int, agree=None) -> tuple[list[RolloutRecord], list[float], list[int], dict]:
        """Producers (one per data-parallel rank, collective over them): this rank's share of one
        step's groups. Prompt j of each round is generated and scored by producer j mod DP; `take(n)`
        draws the same prompts on every producer. DAPO dynamic sampling keeps generating (at most
        rollout.max_generation_rounds rounds) until the batch holds prompts_per_step groups whose
        rewards are not all equal — the producers agree on which groups are informative with one
        small all-reduce per round; short of that, equal-reward groups fill the rest (their
        advantages are zero). Returns this rank's (records, rewards, global group ids, metric
        sums over its groups; `finish_metrics` turns the producers' sums into the step's metrics).
        `agree(name, int64 tensor)` sums a tensor over the producers (default: an all-reduce; the
        producer thread passes a store-based sum, trainer/producer.py `StoreSum`)."""
        r, a = self.cfg.rollout, self.cfg.algorithm
        group = self.ctx.dp_group if dist.is_initialized() else None
        dp = self.ctx.dp
        me = self.ctx.dp_rank
        want = r.prompts_per_step
        order: list[tuple[int, int]] = []  # (round, prompt) of every kept group, in batch order
        spare: list[tuple[int, int]] = []
        mine: dict[tuple[int, int], tuple[list[RolloutRecord], list[float]]] = {}
        drawn: dict[tuple[int, int], Prompt] = {}
        rounds, timeouts, errors, reward_wait = 0, 0, 0, 0.0
        start = time.perf_counter()
        retries0 = len(self.client.retry_events)
        top_k = r.top_k_logprobs if a.divergence in TOPK_DIVERGENCES else 0
        while len(order) < want and rounds < (r.max_generation_rounds if r.dynamic_sampling else 1):
            prompts = take(want - len(order) if rounds else want)
            drawn.update({(rounds, j): p for j, p in enumerate(prompts)})
            js = list(range(me, len(prompts), dp))
            groups, rewards, scored = self.sample(
                [prompts[j] for j in js], r.n_samples,
                self.sampling(step, r.temperature, r.max_new_tokens, r.top_p, salt=rounds),
                top_k=top_k, routes=a.router_replay == "r3", first_index=js)
            timeouts += scored["reward/timeouts"]
            errors += scored["reward/errors"]  # scored 0 (data.reward_on_error=zero)
            reward_wait += scored["time/reward_wait"]
            informative = torch.zeros(len(prompts), dtype=torch.int64)
            for j, g, rw in zip(js, groups, rewards):
                mine[(rounds, j)] = (g, rw)
                informative[j] = int(len(set(rw)) > 1)
            if agree is not None:
                informative = agree(f"{step}/{rounds}", informative)
            elif group is not None and dp > 1:
                informative = all_reduce_sum(informative, group, self.ctx.device)
            for j in range(len(prompts)):
                (order if informative[j] or not r.dynamic_sampling else spare).append((rounds, j))
            rounds += 1
        order = (order + spare)[:want]
        if self.episode_fn is None:  # every sample of this share is finished: a fair draw of lengths
            observe_lengths(self.client.budget, [g for g, _ in mine.values()])
        self.generations += 1
        uids = {key: p.uid for key, p in drawn.items()}
        records, rewards, gids, correct = [], [], [], 0
        for gi, key in enumerate(order):
            if key in mine:
                g, rw = mine[key]
                for rec in g:
                    rec.prompt_index = gi  # group ids follow the batch order
                records += g
                rewards += map(float, rw)  # plain floats; the verdicts are counted here
                correct += sum(is_correct(x, self.cfg.data.correct_threshold) for x in rw)
                gids += [gi] * len(g)
        rw = torch.tensor(rewards, dtype=torch.float64)
        sums = torch.tensor([
            len(records), float(rw.sum()), float(correct),
            sum(len(set(mine[k][1])) > 1 for k in order if k in mine), len([k for k in order if k in mine]),
            float(sum(rec.num_response_tokens for rec in records)),
            float(sum(rec.finish_reason == "length" for rec in records)),
            float(len(self.client.retry_events) - retries0), float(timeouts), float(errors)], dtype=torch.float64)
        if self.episode_fn is not None:  # episodes: the model's and the environment's tokens
            model = [int(rec.loss_mask.sum()) for rec in records]
            env = [rec.num_response_tokens - m for rec, m in zip(records, model)]
            sums = torch.cat([sums, torch.tensor([sum(model), sum(env), sum(e > 0 for e in env)],
                                                 dtype=torch.float64)])
        # Which prompts the step trained on, as one number (every producer draws the same
        # prompts, so they agree): resume tests compare it step by step.
        digest = zlib.crc32("\n".join(uids[k] for k in order).encode()) % (1 << 24)
        return records, rewards, gids, {"_sums": sums, "rollout/generation_rounds": float(rounds),
                                         "data/prompt_digest": float(digest),
                                         "time/generate_only": time.perf_counter() - start,
                                         "time/reward_wait": reward_wait}

    @staticmethod
    def finish_metrics(sums: torch.Tensor) -> dict[str, float]:
        """The step's rollout metrics from the producers' summed `_sums` (episodes add the mean
        model and environment tokens per episode and the fraction of episodes with any
        environment token, e.g. those that called a tool). rollout/accuracy: the share of correct
        samples (rewards/__init__.py `is_correct`), not of positive rewards."""
        n, rsum, correct, informative, n_groups, length, truncated, retries, timeouts, errors = sums[:10].tolist()
        n, n_groups = max(n, 1.0), max(n_groups, 1.0)
        out = {"rollout/reward_mean": rsum / n, "rollout/accuracy": correct / n,
               "rollout/informative_groups": informative / n_groups,
               "rollout/response_len_mean": length / n, "rollout/truncated_frac": truncated / n,
               "rollout/retries": retries, "reward/timeouts": timeouts, "reward/errors": errors}
        if sums.numel() > 10:
            model, env, with_env = sums[10:].tolist()
            out |= {"rollout/model_tokens_mean": model / n, "rollout/env_tokens_mean": env / n,
                    "rollout/env_frac": with_env / n}
        return out

    def evaluate(self, prompts: list[Prompt], step: int, versions: bool = False) -> dict[str, float]:
        """Rank 0: mean@k (the mean reward) and pass@k (a correct sample among k) on held-out prompts
        (episodes of rollout.generate when set). `versions`: also eval/weight_version, the weight
        version every evaluated token came from (-1 if they differ)."""
        e = self.cfg.eval
        sampling = self.sampling(step, e.temperature, e.max_new_tokens or self.cfg.rollout.max_new_tokens, e.top_p,
                                 salt=999)
        deadline = e.timeout if self.episode_fn is None else None
        client = self.client
        training, client.budget = client.budget, self._eval_budget.clone()  # its own slots, never training's
        try:
            groups, rewards, metrics = self.sample(prompts, e.k, sampling, deadline_s=deadline)
            if self.episode_fn is None and not metrics.get("missing_samples"):  # a complete set only
                observe_lengths(client.budget, groups)
        finally:
            client.budget = training
        seen = {int(v) for g in groups for rec in g if rec.versions is not None for v in rec.versions.unique()}
        missing = int(metrics.get("missing_samples", 0))
        if missing:
            finished = sum(map(len, rewards))
            print(f"[megatron-rl] eval at step {step}: eval.timeout={e.timeout:g}s reached, {missing} of "
                  f"{len(prompts) * e.k} samples aborted; metrics over the {finished} that finished "
                  f"({sum(len(row) == e.k for row in rewards)} prompts complete)", flush=True)
        out = eval_metrics(rewards, e.k, missing, self.cfg.data.correct_threshold)
        if versions:
            out["eval/weight_version"] = float(seen.pop()) if len(seen) == 1 else -1.0
        return out

    # -- evaluation beside training (eval.servers > 0; rollout/evaluation.py) -----------------------
    def start_eval(self, prompts: list[Prompt], step: int) -> Optional[str]:
        return self.evals.start(prompts, step)

    def eval_result(self, wait: bool = False) -> Optional[tuple[int, dict, Optional[BaseException]]]:
        return self.evals.result(wait)

    def eval_running(self) -> bool:
        return self.evals.running()

    def abort_eval(self) -> None:
        self.evals.abort()

    # ------------------------------------------------------------------------------------------
    def sync_weights(self, learner, version: str) -> dict[str, float]:
        """Collective over the learner ranks: send the learner's weights to every server (every
        one that answers, for disaggregated servers), but those an evaluation beside training
        holds (rollout/pushes.py), once an evaluation that shares them has ended."""
        waited = self.evals.wait_before_push()  # every rank
        if self.driver:
            self.evals.release_hold()
        transport = self.pushes.transport
        stats, seconds = self.pushes.push(learner, version, held=self.evals.hold)
        self.evals.groups_formed += self.driver and self.pushes.transport is not transport
        pushed_to = self.pushes.pushed_to
        # Out of the producers' rotation until a push reaches them: servers held by an evaluation,
        # and those that did not answer (dead, or restarted and still starting).
        held = [sorted(set(self.urls()) - set(pushed_to)) if self.driver else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(held, src=0)  # a small list; also the push's barrier
        self._excluded = frozenset(held[0])
        # Every server in rotation now holds `version`: a client takes a down one back only then.
        self.weight_version = version
        if self.producer:
            with self._lanes_lock:
                for client, _ in self._all_lanes:
                    if client not in self._pinned:
                        client.expected_version = version
        out = {"time/weight_sync": seconds}
        if self.driver and (self.pushes.live is not None or self.evals.hold):
            out["rollout/servers_up"] = float(len(pushed_to))
        if self.driver and self.cfg.eval.servers:  # what an evaluation beside training cost the pushes
            out |= {"time/eval_wait": waited, "weight_sync/groups_formed": float(self.evals.groups_formed)}
        if stats:
            out["weight_sync/bytes"] = float(stats.get("bytes", 0))
        return out

    def close(self) -> None:
        if not self.producer:
            return
        try:
            self.close_lane()
            for client, loop in list(self._all_lanes):  # a lane whose thread did not close it
                if loop.is_running():  # still on its thread (a daemon that dies with the process)
                    continue
                try:
                    loop.run_until_complete(client.close())
                finally:
                    loop.close()
            self.rewards.close()
            self.pushes.close()
        finally:
            if self.manager is not None:
                self.manager.stop()


Rollouts = Fleet  # the name before 2026-11-27 (megatron_rl.trainer.rollouts.Rollouts)
