"""The rollout fleet at the paper's shapes: how the producers' requests meet the servers' KV pools.

    .venv/bin/python benchmarks/bench_fleet.py [--shape 30b|8b|both] [--rate TOK_PER_S] [--quick] [--two] [--share F]
                                                [--ramp]

`--ramp`: only the following rounds (steady slots against the ramp). On a machine whose cores
cannot refill slots at the default rate (2 cores: 16 client threads), a lower `--rate` (500)
scales time further so that they can.

The REAL `RolloutClient`s (one per producer, each on its own thread and event loop, as the
trainer's producers) against stand-in SGLang servers in a process of their own. A stand-in has a
KV pool of `pool` tokens and admits as SGLang 0.5.23 does (`Server`): a request waits in its queue
until the running requests' tokens plus what each may still decode, min(max_new - decoded, 4096) x
new_token_ratio (0.7 falling to 0.098 over 600 decode steps, reset when idle), and its own fit the
pool; at most max_running_requests run; when the running requests outgrow the pool the newest are
retracted to the queue. Each running sequence decodes `rate` tokens/s; it answers the client's
/v1/loads probes at once. A response's length is drawn per (producer, prompt, step, sample),
lognormal with median max_new_tokens/4 and sigma 0.84, cut at max_new_tokens (bench_async.py's
histogram), the same in every design; the body carries one token per `TOKEN_SCALE` decoded
tokens, so the client parses real SGLang-shaped answers without 16k-token bodies.

Designs, the same requests:
- `per-producer`: each client its own 64 slots per server (the trainer before rollout/admission.py):
  16 producers put 1,024 requests on a server, SGLang's own admission decides;
- `fleet, first estimate`: one FleetBudget for all clients, counted in a real c10d TCPStore, of
  KV pool / (0.7 x max_new_tokens) slots per server for the whole run (the rule before issue 41);
- `fleet, following`: the same budget with each server's KV pool (rollout/admission.py): its first
  step at the first estimate, the next at the slots the first step's lengths give: each server's
  ramp (`admission.ramp`: slots by the requests ended since it was empty; reported as at the
  start / at the lowest / past the ramp); `steady slots` is the same step at the steady state's
  `kv_capacity` from its first request (`FleetBudget(ramps=False)`: the rule before the ramp),
  from the same lengths.
Rounds: a step is every producer generating its share (prompts x samples / producers) at once.
`eval beside on 1 of N`: the step on all servers but one while the evaluation (60 x 32 samples)
runs on that one (eval.servers=1), started together. Two servers (one rollout node of TP-4 30B
servers), half the prompts (`--two`: these rounds only): the step alone; beside an evaluation that
holds one server; beside one that takes EVAL_SHARE of every server's KV pool as fixed budgets;
and the share mode as built (rollout/evaluation.py): training's budget set to 1 - EVAL_SHARE and
the evaluation's to EVAL_SHARE with `FleetBudget.set_share`, the evaluation's following the room
training leaves (`follow_training`, synchronous training: the tail of the step, the learner's
time) by `FleetBudget.grow` (a ramp in that room), the next push waiting for it; and the same
requests with that room at the steady state's slots of the share (the rule before `grow`). A step
there is its generation, the learner's time L and the wait at the push: max(generation + L,
evaluation), against generation + L alone; reported for
L = 0 (no learner time: the worst case), 0.35 (the 2 + 1 layout of docs/cluster.md: 260 s of
learner time per 500-770 s of generation), 0.5 and 1 x the generation time of a step alone (the
evaluation's end does not depend on L, so one round gives all four).
Reported per round: wall time, slots per server, KV use (token-seconds over pool x wall, the whole
round) and KV full (the same while requests waited to be admitted anywhere, past the first median
response time, in which any rule's cache fills from empty at decode speed), decoded tokens per
server (max/min), the most requests running and queued in one server, retractions, the clients'
retries and servers marked down (all healthy here: any is a false alarm); in `--json`, each
server's timeline (every TIMELINE_S: training's and the evaluation's requests running and queued
in it, and its KV in use). Times are scaled: `rate`
tokens/s per sequence stands for SGLang's tens; ratios between designs are what carries over, on
a machine whose cores keep up with the clients (on a loaded one, slots wait for the client to
refill them and every figure falls).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOKEN_SCALE = 64  # decoded tokens per token in a response body
PER_PRODUCER_SLOTS = 64  # the client's own per-server cap before the fleet budget (its old default)
EVAL_SHARE = 0.2  # of every server's KV pool, for an evaluation beside training that shares servers
# producers, servers, KV pool tokens and max_running_requests per server, prompt tokens, prompts,
# samples, max_new_tokens, eval prompts x k. Pools: 30B-A3B on a TP-4 server (~1.8-2.1 M tokens,
# issue 41), 8B on one GPU (~50 GB of KV at 144 KiB per token).
SHAPES = {
    "30b": dict(producers=16, servers=4, pool=2_000_000, max_running=1024, prompt=512, prompts=256, samples=16,
                max_new=16384, eval=(60, 32)),
    "8b": dict(producers=8, servers=8, pool=350_000, max_running=512, prompt=512, prompts=256, samples=16,
               max_new=8192, eval=(60, 32)),
}


def length(max_new: int, producer: int, prompt: int, sample: int) -> int:
    g = random.Random(producer * 1_000_003 + prompt * 1_009 + sample)
    return max(1, min(max_new, int(round(math.exp(math.log(max_new / 4) + 0.84 * g.gauss(0, 1))))))


# ============================================================================ stand-in servers
CLIP_MAX_NEW = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: the most of max_new_tokens SGLang reserves for
INIT_RATIO, MIN_RATIO, DECAY_STEPS = 0.7, 0.7 * 0.14, 600  # SGLang's new_token_ratio: start, floor, steps
TICK_S = 0.05  # the stand-in's scheduler steps this often


EVAL_PRODUCER = 1000  # the producer id an evaluation's prompts carry (its requests are told apart by it)
TIMELINE_S = 1.0  # a server's timeline samples this often


class Req:
    __slots__ = ("length", "done", "future", "since", "eval")

    def __init__(self, length: int, future, evaluation: bool = False):
        self.length, self.done, self.future, self.since, self.eval = length, 0.0, future, 0.0, evaluation


def serve(n: int, pool: int, max_running: int, prompt: int, rate: float, max_new: int) -> None:
    """n stand-in servers in this process; prints their ports as one JSON line, then serves until
    killed. GET /stats: what each decoded; POST /reset: a new round."""
    import orjson
    from aiohttp import web

    class Server:
        """SGLang's admission over a KV pool of `pool` tokens (schedule_policy.py, sglang 0.5.23):
        a waiting request is admitted, in arrival order, while the running requests' tokens plus
        what each may still decode, min(max_new - decoded, 4096) x new_token_ratio, and its own
        fit the pool; the ratio falls from 0.7 to 0.098 over 600 decode steps (a step per decoded
        token here) and is reset when the server idles. When the running requests' tokens outgrow
        the pool the newest are retracted to the queue's front (their decoded tokens kept, as
        SGLang re-prefills them) and the ratio is raised as SGLang does."""

        def __init__(self):
            self.waiting: deque[Req] = deque()
            self.running: list[Req] = []
            self.ratio = INIT_RATIO
            self.reserved = 0.0
            self.tokens = self.requests = self.max_running = self.max_waiting = self.retracted = 0
            self.busy = 0.0  # slot-seconds decoding
            self.kv_ts = 0.0  # KV token-seconds in use
            self.round_start, self.kv_at_start = time.monotonic(), 0.0
            self.kv_sat = self.sat_s = 0.0  # KV token-seconds and seconds while work waits
            self.timeline: list[list] = []  # [s into the round, running training / eval, queued training / eval, KV]
            self.sampled = 0.0

        def used(self) -> float:
            return sum(prompt + r.done for r in self.running)

        def reserve(self, r: Req) -> float:
            return prompt + r.done + min(max_new - r.done, CLIP_MAX_NEW) * self.ratio

        def admit(self) -> None:
            """Between two steps (and as a request arrives): `reserved` is the running requests'
            as of the last step, plus what was admitted since."""
            while self.waiting and len(self.running) < max_running:
                r = self.waiting[0]
                need = self.reserve(r)
                if self.reserved + need > pool:
                    break
                self.reserved += need
                self.waiting.popleft()
                self.running.append(r)
            self.max_running = max(self.max_running, len(self.running))
            self.max_waiting = max(self.max_waiting, len(self.waiting))

        async def schedule(self) -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(TICK_S)
                now = time.monotonic()
                dt, last = now - last, now
                step = rate * dt
                used = self.used()
                self.kv_ts += used * dt
                # Requests wait (in a producer or this queue), past the cache's first filling.
                if (ROUND["arrived"] < ROUND["total"] or self.waiting) and now - self.round_start >= ramp_s:
                    self.kv_sat += used * dt
                    self.sat_s += dt
                self.busy += len(self.running) * dt
                for r in self.running:
                    r.done = min(r.length, r.done + step)
                    if r.done >= r.length and not r.future.done():
                        r.future.set_result(None)
                self.running = [r for r in self.running if r.done < r.length]
                if self.running:
                    self.ratio = max(MIN_RATIO, self.ratio - (INIT_RATIO - MIN_RATIO) / DECAY_STEPS * step)
                used = self.used()
                while used > pool and len(self.running) > 1:  # retract_decode
                    r = self.running.pop()
                    used -= prompt + r.done
                    self.waiting.appendleft(r)
                    self.retracted += 1
                    self.ratio = min(1.0, (sum(x.done for x in self.running) + 20 * len(self.running))
                                     / (max_new * len(self.running) + 1))
                if not self.running and not self.waiting:
                    self.ratio = INIT_RATIO  # idle: SGLang resets the ratio
                self.reserved = sum(map(self.reserve, self.running))
                self.admit()
                if now - self.sampled >= TIMELINE_S:
                    self.sampled = now
                    ev, wev = sum(r.eval for r in self.running), sum(r.eval for r in self.waiting)
                    self.timeline.append([round(now - self.round_start, 2), len(self.running) - ev, ev,
                                          len(self.waiting) - wev, wev, round(self.used() / pool, 3)])

        async def generate(self, request):
            req = await request.json()
            ids = req["input_ids"]
            j = int(req["rid"].rsplit("-", 3)[2])
            L = length(max_new, ids[0], ids[1] + 100_000 * ids[2], j)
            r = Req(L, asyncio.get_running_loop().create_future(), ids[0] >= EVAL_PRODUCER)
            ROUND["arrived"] += 1
            self.waiting.append(r)
            self.admit()
            await r.future
            self.tokens += L
            self.requests += 1
            T = max(1, -(-L // TOKEN_SCALE))
            finish = "length" if L >= max_new else "stop"
            meta = {"id": req["rid"], "finish_reason": {"type": finish, "length": T} if finish == "length" else {"type": finish},
                    "prompt_tokens": len(ids), "completion_tokens": T, "weight_version": "0",
                    "output_token_logprobs": [[-0.5, 7, None]] * T,
                    "weight_versions": [{"version": "0", "start": 0, "end": T}]}
            return web.Response(body=orjson.dumps({"text": "", "output_ids": [7] * T, "meta_info": meta}),
                                content_type="application/json")

        async def loads(self, request):
            return web.json_response({"loads": [{"dp_rank": 0, "num_running_reqs": len(self.running),
                                                 "num_waiting_reqs": len(self.waiting)}]})

        async def ok(self, request):
            return web.json_response({})

        def stats(self) -> dict:
            return dict(tokens=self.tokens, requests=self.requests, busy=self.busy, max_running=self.max_running,
                        max_waiting=self.max_waiting, retracted=self.retracted,
                        kv_round=self.kv_ts - self.kv_at_start, kv_sat=self.kv_sat, sat_s=self.sat_s,
                        timeline=self.timeline)

        def reset(self) -> None:
            self.max_running, self.max_waiting = len(self.running), len(self.waiting)
            self.round_start, self.kv_at_start = time.monotonic(), self.kv_ts
            self.kv_sat = self.sat_s = 0.0
            self.retracted = 0
            self.timeline = []

    ROUND = dict(total=0, arrived=0)  # the round's requests, and those sent to any server so far
    ramp_s = max_new / 4 / rate  # a median response: the time a cache takes to fill from empty

    async def main():
        servers, ports = [Server() for _ in range(n)], []
        for s in servers:
            asyncio.get_running_loop().create_task(s.schedule())
            app = web.Application(client_max_size=1 << 24)
            app.router.add_post("/generate", s.generate)
            app.router.add_get("/v1/loads", s.loads)
            app.router.add_get("/health", s.ok)
            app.router.add_post("/abort_request", s.ok)

            async def stats(request, servers=servers):
                return web.json_response([x.stats() for x in servers])
            app.router.add_get("/stats", stats)

            async def reset(request, servers=servers):  # a new round of `total` requests
                ROUND.update(total=int(request.query.get("total", 0)), arrived=0)
                for x in servers:
                    x.reset()
                return web.json_response({})
            app.router.add_post("/reset", reset)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
            await site.start()
            ports.append(site._server.sockets[0].getsockname()[1])
        print(json.dumps(ports), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def slots_of(budget, url: str) -> str:
    """A budget's slots on a server: its ramp's (at the start / at the lowest / past it) once the
    statistics give one, else the fixed number."""
    budget.loads([url])
    r = budget.ramp_of(url)
    return f"{r.caps[0]}/{min(r.caps)}/{r.steady}" if r is not None and r.caps else str(budget.cap(url))


class Fleet:
    def __init__(self, n: int, shape: dict, rate: float):
        args = [n, shape["pool"], shape["max_running"], shape["prompt"], rate, shape["max_new"]]
        self.proc = subprocess.Popen([sys.executable, __file__, "serve", *map(str, args)], stdout=subprocess.PIPE, text=True)
        self.urls = [f"http://127.0.0.1:{p}" for p in json.loads(self.proc.stdout.readline())]

    def stats(self, total: int = 0) -> list[dict]:
        """What each server decoded, its maxima and KV use in this round; starts the next, of `total`
        requests."""
        import urllib.request

        with urllib.request.urlopen(self.urls[0] + "/stats") as r:
            out = json.loads(r.read())
        urllib.request.urlopen(urllib.request.Request(self.urls[0] + f"/reset?total={total}", method="POST")).close()
        return out

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


# ============================================================================ producers
def produce(jobs: list[dict], shape: dict, first: int = 0, then=None) -> list[dict]:
    """Run every job at once, each on its own thread, event loop and client; a job: urls, budget,
    producer id, step, prompts, samples. A job's finished set of samples goes to its budget's
    length statistics (as `Fleet.generate` does). `then()` is called once the first `first` jobs
    are done. Returns per job: finish time, retries, servers marked down."""
    from megatron_rl.rollout.client import RolloutClient, SamplingParams

    out: list[dict] = [{} for _ in jobs]
    start = threading.Barrier(len(jobs) + 1)
    t0 = [0.0]
    left, lock = [first], threading.Lock()

    def run(k: int, job: dict) -> None:
        async def go():
            async with RolloutClient(job["urls"], budget=job["budget"], backoff_initial=0.05) as client:
                prompts = [[job["producer"], i, job["step"], 2, 3] for i in range(job["prompts"])]
                start.wait()
                groups = await client.generate(prompts, SamplingParams(max_new_tokens=shape["max_new"]),
                                               n=job["samples"])
                out[k] = dict(done=time.monotonic() - t0[0], retries=len(client.retry_events), down=len(client._down))
            recs = [rec for g in groups for rec in g]
            job["budget"].observe([shape["prompt"]] * len(recs),
                                  [min(shape["max_new"], rec.num_response_tokens * TOKEN_SCALE) for rec in recs])
            if k < first:
                with lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last and then is not None:
                    then()
        try:
            asyncio.run(go())
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            out[k] = dict(error=repr(e))

    threads = [threading.Thread(target=run, args=(k, j), daemon=True) for k, j in enumerate(jobs)]
    for t in threads:
        t.start()
    start.wait()
    t0[0] = time.monotonic()
    for t in threads:
        t.join()
    errors = [o["error"] for o in out if "error" in o]
    if errors:
        raise RuntimeError(errors[0])
    return out


def budgets(design: str, shape: dict, urls: list[str], store, name: str, count: int, share: float = 1.0):
    """`count` clients' budgets: `per-producer` (each its own 64 slots per server), `fixed` (one
    budget of SGLang's first estimate, today's rule before lengths are known), `follow` (one budget
    whose slots follow the lengths seen; `share` of each server's KV pool)."""
    from megatron_rl.rollout.admission import FleetBudget, ServerKV, derived_capacity

    if design == "per-producer":
        return [FleetBudget.local(PER_PRODUCER_SLOTS) for _ in range(count)]
    info = {"max_total_num_tokens": int(shape["pool"] * share), "max_running_requests": shape["max_running"]}
    first = derived_capacity(info, shape["max_new"])
    kv = {u: ServerKV.from_info(info) for u in urls} if design.startswith("follow") else None
    shared = FleetBudget(store, f"fleet/{name}", first, kv=kv, ramps=design != "follow-steady")
    return [shared.clone() for _ in range(count)]


def round_stats(fleet: Fleet, urls: list[str], wall: float, shape: dict, done: list[dict]) -> dict:
    """A round's figures over `urls` (the stats were reset as it started)."""
    after = fleet.stats()
    xs = [after[fleet.urls.index(u)] for u in urls]
    tokens = [x["tokens"] for x in xs]
    requests = [x["requests"] for x in xs]
    sat_s = sum(x["sat_s"] for x in xs)
    return dict(wall=wall, tokens=tokens, load=max(tokens) / max(1, min(tokens)), requests=requests,
                req_load=max(requests) / max(1, min(requests)),
                # KV in use over the round, and while requests waited to be admitted (what admission
                # decides), past the first median response time (the cache fills at decode speed).
                kv_use=sum(x["kv_round"] for x in xs) / (len(xs) * shape["pool"] * wall),
                kv_fill=sum(x["kv_sat"] for x in xs) / (shape["pool"] * sat_s) if sat_s > 0 else 0.0,
                max_running=max(x["max_running"] for x in xs), max_waiting=max(x["max_waiting"] for x in xs),
                retracted=sum(x["retracted"] for x in xs), timeline=[x["timeline"] for x in xs],
                retries=sum(d["retries"] for d in done), down=sum(d["down"] for d in done))


def training(fleet: Fleet, urls: list[str], bs: list, shape: dict, step: int, prompts: int, extra=(),
             then=None) -> tuple:
    """One step of every producer's share on `urls` (and `extra` jobs beside it, started together;
    `then()` once the step's generation is done)."""
    P = shape["producers"]
    jobs = [dict(urls=urls, budget=b, producer=k, step=step, prompts=prompts // P, samples=shape["samples"])
            for k, b in enumerate(bs)] + list(extra)
    fleet.stats(sum(j["prompts"] * j["samples"] for j in jobs))  # a new round
    done = produce(jobs, shape, P, then)
    wall = max(d["done"] for d in done[:P])
    return round_stats(fleet, urls, wall, shape, done), done[P:]


def run_shape(name: str, shape: dict, rate: float, two_only: bool = False, ramp_only: bool = False) -> dict:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    res = {}
    if not two_only:
        res |= four_servers(shape, rate, store, ramp_only)
    if not ramp_only:
        res |= two_servers(shape, rate, store)
    return res


def four_servers(shape: dict, rate: float, store, ramp_only: bool = False) -> dict:
    """The designs on the shape's servers, and an evaluation beside training on one of them
    (`ramp_only`: the following rounds alone, steady slots against the ramp)."""
    fleet = Fleet(shape["servers"], shape, rate)
    P, urls = shape["producers"], fleet.urls
    ep, ek = shape["eval"]
    res = {}
    try:
        for design in () if ramp_only else ("per-producer", "fixed"):
            res[design], _ = training(fleet, urls, budgets(design, shape, urls, store, design, P), shape, 1,
                                      shape["prompts"])
        # Following the lengths: the first step at the first estimate, the next at what it saw.
        bs = budgets("follow", shape, urls, store, "follow", P)
        res["follow first step"], _ = training(fleet, urls, bs, shape, 1, shape["prompts"])
        res["follow"], _ = training(fleet, urls, bs, shape, 2, shape["prompts"])
        res["follow"]["slots"] = slots_of(bs[0], urls[0])
        # The same step at the steady state's slots throughout (no ramp: the rule before it), from
        # the same step-1 lengths.
        steady = budgets("follow-steady", shape, urls, store, "follow-steady", P)
        steady[0].observe(*_lengths(shape, 1, shape["prompts"]))
        res["follow steady"], _ = training(fleet, urls, steady, shape, 2, shape["prompts"])
        res["follow steady"]["slots"] = slots_of(steady[0], urls[0])
        if ramp_only:
            return res
        res["fixed"]["slots"] = slots_of(budgets("fixed", shape, urls, store, "x", 1)[0], urls[0])
        # An evaluation beside training on one whole server (eval.servers=1): training on the rest.
        (eb,) = budgets("follow", shape, urls[-1:], store, "beside-eval", 1)
        res["beside"], ev = training(fleet, urls[:-1], bs, shape, 3, shape["prompts"],
                                     [dict(urls=urls[-1:], budget=eb, producer=EVAL_PRODUCER, step=3, prompts=ep, samples=ek)])
        res["beside"]["eval_wall"] = ev[0]["done"]
    finally:
        fleet.close()
    return res


def two_servers(shape: dict, rate: float, store) -> dict:
    """One rollout node: a step alone, and beside an evaluation held on one server, on a fixed
    share of each, and in the share mode as built (and with its added room at steady slots)."""
    P = shape["producers"]
    ep, ek = shape["eval"]
    res = {}
    # Two servers (one rollout node of TP-4 servers at 30B), half the step's prompts: training
    # alone; beside an evaluation that holds one whole server (eval.servers=1, today); beside one
    # that takes EVAL_SHARE of every server's KV pool (training the rest).
    two = Fleet(2, shape, rate)
    half = shape["prompts"] // 2
    try:
        u2 = two.urls
        bs = budgets("follow", shape, u2, store, "two", P)
        training(two, u2, bs, shape, 1, half)  # lengths seen
        res["two alone"], _ = training(two, u2, bs, shape, 2, half)
        (eb,) = budgets("follow", shape, u2[-1:], store, "two-hold-eval", 1)
        eb.observe(*_lengths(shape, 1, half))
        res["two hold"], ev = training(two, u2[:-1], bs, shape, 3, half,
                                       [dict(urls=u2[-1:], budget=eb, producer=EVAL_PRODUCER, step=3, prompts=ep, samples=ek)])
        res["two hold"]["eval_wall"] = ev[0]["done"]
        train = budgets("follow", shape, u2, store, "two-share-train", P, share=1 - EVAL_SHARE)
        (eb,) = budgets("follow", shape, u2, store, "two-share-eval", 1, share=EVAL_SHARE)
        for b in (train[0], eb):
            b.observe(*_lengths(shape, 1, half))
        res["two share"], ev = training(two, u2, train, shape, 4, half,
                                        [dict(urls=u2, budget=eb, producer=EVAL_PRODUCER, step=4, prompts=ep, samples=ek)])
        res["two share"]["eval_wall"] = ev[0]["done"]
        # The share mode as built (rollout/evaluation.py BesideTraining): one training budget of
        # the whole pool set to 1 - EVAL_SHARE for the evaluation's time, the evaluation's own at
        # EVAL_SHARE, growing into the room training's tail leaves (`FleetBudget.grow`: a ramp
        # there); and the same requests with that room at the steady state's slots (the rule before).
        for key, grow in (("two built", True), ("two built steady", False)):
            res[key] = share_mode(two, shape, store, key, half, grow)
    finally:
        two.close()
    return res


def share_mode(two: Fleet, shape: dict, store, name: str, prompts: int, grow: bool) -> dict:
    """A step of `prompts` beside the evaluation in the share mode on the two servers of `two`:
    the evaluation's added room taken by `grow` (as built) or at the steady state's slots."""
    from megatron_rl.rollout.admission import FleetBudget, ServerKV, derived_capacity
    from megatron_rl.rollout.evaluation import follow_training

    P, u2 = shape["producers"], two.urls
    ep, ek = shape["eval"]
    train = budgets("follow", shape, u2, store, name.replace(" ", "-") + "-train", P)
    info = {"max_total_num_tokens": shape["pool"], "max_running_requests": shape["max_running"]}
    eb = FleetBudget.local(derived_capacity(info, shape["max_new"]), kv={u: ServerKV.from_info(info) for u in u2})
    train[0].observe(*_lengths(shape, 1, prompts))
    eb.observe(*_lengths(shape, 1, prompts))
    control = train[0].clone()
    control.set_share(1 - EVAL_SHARE)
    eb.set_share(EVAL_SHARE)
    train[0].loads(u2)  # (its caps follow the share at its next take)
    slots = (train[0].cap(u2[0]), eb.cap(u2[0]))

    class SteadySlots:  # the added room at the steady state's slots of the share
        def __init__(self, budget):
            self.budget = budget

        def grow(self, share, urls):
            self.budget.set_share(share)

    follows = eb.clone() if grow else SteadySlots(eb.clone())
    generated, stop = threading.Event(), threading.Event()
    follower = threading.Thread(target=follow_training, daemon=True,
                                args=(follows, train[0].clone(), u2, EVAL_SHARE, lambda: not stop.is_set(),
                                      generated.is_set))
    follower.start()
    res, ev = training(two, u2, train, shape, 5, prompts,
                       [dict(urls=u2, budget=eb.clone(), producer=EVAL_PRODUCER, step=5, prompts=ep, samples=ek)],
                       then=generated.set)
    stop.set()
    follower.join()
    control.set_share(1.0)
    res["eval_wall"] = ev[0]["done"]
    res["slots"] = f"{slots[0]}+{slots[1]}"
    return res


def _lengths(shape: dict, step: int, prompts: int) -> tuple[list[int], list[int]]:
    """The prompt and response tokens of a step's samples (what the stand-ins drew for it): the
    lengths an evaluation's budget has seen from an earlier evaluation of the same distribution."""
    P = shape["producers"]
    out = [length(shape["max_new"], k, i + 100_000 * step, j)
           for k in range(P) for i in range(prompts // P) for j in range(shape["samples"])]
    return [shape["prompt"]] * len(out), out


def report(name: str, shape: dict, rate: float, res: dict) -> None:
    print(f"\n== {name}: {shape['producers']} producers, {shape['servers']} servers, KV pool {shape['pool']:,} tokens "
          f"(max_running {shape['max_running']}), prompts of {shape['prompt']} tokens, {shape['prompts']} x "
          f"{shape['samples']} samples up to {shape['max_new']} tokens, eval {shape['eval'][0]} x {shape['eval'][1]}; "
          f"{rate:g} tokens/s per sequence")
    print(f"{'round':<34} {'wall s':>7} {'slots':>13} {'KV use':>6} {'KV full':>7} {'tokens max/min':>14} "
          f"{'max run':>7} {'max queued':>10} {'retracted':>9} {'retries':>7} {'down':>4}")
    rows = [("per-producer (SGLang admits)", "per-producer"), ("fleet, first estimate (today)", "fixed"),
            ("fleet, following: first step", "follow first step"),
            ("following, next step: steady slots", "follow steady"), ("following, next step: ramp", "follow"),
            (f"following, eval beside on 1 of {shape['servers']}", "beside"),
            ("2 servers: training alone", "two alone"), ("2 servers: eval holds 1 server", "two hold"),
            (f"2 servers: eval {EVAL_SHARE:.0%} of every KV", "two share"),
            (f"2 servers: eval.share={EVAL_SHARE:g} (built)", "two built"),
            (f"  eval.share={EVAL_SHARE:g}, added room steady", "two built steady")]
    for label, key in rows:
        if key not in res:
            continue
        r = res[key]
        slots = str(r.get("slots", "-"))
        extra = f"   (eval {r['eval_wall']:.1f} s)" if "eval_wall" in r else ""
        print(f"{label:<34} {r['wall']:>7.1f} {slots:>13} {r['kv_use']:>6.2f} {r['kv_fill']:>7.2f} {r['load']:>14.3f} "
              f"{r['max_running']:>7} {r['max_waiting']:>10} {r['retracted']:>9} {r['retries']:>7} {r['down']:>4}{extra}")
    if "follow" in res:
        if "fixed" in res:
            print(f"following vs first estimate, one step: {res['fixed']['wall'] / res['follow']['wall']:.2f}x faster")
        print(f"the ramp vs steady slots, one step: {res['follow steady']['wall'] / res['follow']['wall']:.2f}x faster")
    if "two alone" not in res:
        return
    a = res["two alone"]["wall"]
    print(f"2 servers, the generation of a step beside an evaluation: {res['two hold']['wall'] / a:.2f}x (eval holds "
          f"1 server), {res['two share']['wall'] / a:.2f}x (eval {EVAL_SHARE:.0%} of every KV pool), "
          f"{res['two built']['wall'] / a:.2f}x (eval.share={EVAL_SHARE:g} as built) of one without")
    shares = [k for k in ("two built", "two built steady") if k in res]
    for k in ("two hold", *shares):
        res[k]["step_ratio"] = {}
    for frac in (0.0, 0.35, 0.5, 1.0):  # the learner's time L, as a share of a step's generation alone
        L = frac * a
        hold = (res["two hold"]["wall"] + L) / (a + L)  # the held server's evaluation never delays a push
        res["two hold"]["step_ratio"][frac] = hold
        line = (f"  a whole step (generation + learner L = {frac:g} x {a:.1f} s + the push's wait for the "
                f"evaluation): {hold:.3f}x holding 1 server")
        for k in shares:
            r = res[k]
            r["step_ratio"][frac] = max(r["wall"] + L, r["eval_wall"]) / (a + L)
            steady = " (added room at steady slots)" if k.endswith("steady") else ""
            line += (f", {r['step_ratio'][frac]:.3f}x eval.share={EVAL_SHARE:g}{steady} "
                     f"(push waits {max(0.0, r['eval_wall'] - r['wall'] - L):.1f} s)")
        print(line)


def main() -> None:
    global EVAL_SHARE
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        n, pool, max_running, prompt, rate, max_new = sys.argv[2:8]
        serve(int(n), int(pool), int(max_running), int(prompt), float(rate), int(max_new))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=["30b", "8b", "both"], default="both")
    ap.add_argument("--rate", type=float, default=2000.0, help="decoded tokens per second per sequence")
    ap.add_argument("--quick", action="store_true", help="a quarter of the prompts, for a smoke run")
    ap.add_argument("--share", type=float, default=EVAL_SHARE, help="the evaluation's share of every server")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--two", action="store_true", help="only the two-server rounds (an evaluation beside training)")
    only.add_argument("--ramp", action="store_true", help="only the following rounds: steady slots against the ramp")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    EVAL_SHARE = args.share
    os.environ.setdefault("MRL_QUIET", "1")
    import logging

    logging.basicConfig(level=logging.ERROR)
    out = {}
    for name in (["30b", "8b"] if args.shape == "both" else [args.shape]):
        shape = dict(SHAPES[name])
        if args.quick:
            shape |= dict(prompts=shape["prompts"] // 4, eval=(shape["eval"][0] // 4, shape["eval"][1]))
        res = run_shape(name, shape, args.rate, args.two, args.ramp)
        report(name, shape, args.rate, res)
        out[name] = dict(shape=shape, rate=args.rate, results=res)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
