"""The rollout fleet at the paper's shapes: how the producers' requests meet the servers.

    .venv/bin/python benchmarks/bench_fleet.py [--shape 30b|8b|both] [--rate TOK_PER_S] [--quick]

The REAL `RolloutClient`s (one per producer, each on its own thread and event loop, as the
trainer's producers) against stand-in SGLang servers in a process of their own. A stand-in decodes
`slots` sequences at once, each at a fixed `rate` tokens/s, and queues the rest in arrival order
(SGLang's waiting queue); it answers the client's /v1/loads probes (the stall watchdog) at once. A
response's length is drawn per (producer, prompt, sample), lognormal with median max_new_tokens/4
and sigma 0.84, cut at max_new_tokens (bench_async.py's histogram), the same in every design; the
body carries one token per `TOKEN_SCALE` decoded tokens, so the client parses real SGLang-shaped
answers without 16k-token bodies.

Two designs, the same requests:
- `per-producer`: each client its own slots, 64 per server (the trainer before rollout/admission.py):
  16 producers put 1,024 requests on a server that runs 128, the rest waiting in its queue;
- `fleet`: one FleetBudget of `slots` per server for all clients, counted in a real c10d TCPStore
  (rollout/admission.py): requests wait in their producer for the next free slot anywhere.
Rounds:
- `train`: every producer generates its share of one step (prompts x samples / producers) at once;
- `eval`: rank 0's evaluation (60 x 32 samples) alone on every server (the last step's);
- `train + eval beside`: the step on all servers but one, the evaluation on that one
  (eval.servers=1), started together: training does not wait for it.
Reported per round: wall time, requests and decoded tokens per server (max/min over the servers;
tokens also depend on which server drew the long samples of the last wave), slot use (decoding
slot-seconds over slots x wall), the spread of the producers' finish times, retries and servers
marked down (all healthy here: any is a false alarm). Times are scaled: `rate` tokens/s per
sequence stands for SGLang's tens; ratios between designs are what carries over.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOKEN_SCALE = 64  # decoded tokens per token in a response body
PER_PRODUCER_SLOTS = 64  # the client's own per-server cap before the fleet budget (its old default)
SHAPES = {  # producers, servers, slots per server, prompts, samples, max_new_tokens, eval prompts x k
    "30b": dict(producers=16, servers=4, slots=128, prompts=256, samples=16, max_new=16384, eval=(60, 32)),
    "8b": dict(producers=8, servers=8, slots=128, prompts=256, samples=16, max_new=8192, eval=(60, 32)),
}


def length(max_new: int, producer: int, prompt: int, sample: int) -> int:
    g = random.Random(producer * 1_000_003 + prompt * 1_009 + sample)
    return max(1, min(max_new, int(round(math.exp(math.log(max_new / 4) + 0.84 * g.gauss(0, 1))))))


# ============================================================================ stand-in servers
def serve(n: int, slots: int, rate: float, max_new: int) -> None:
    """n stand-in servers in this process; prints their ports as one JSON line, then serves until
    killed. GET /stats: what each decoded."""
    import orjson
    from aiohttp import web

    class Server:
        def __init__(self):
            self.sem = asyncio.Semaphore(slots)
            self.tokens = self.requests = self.running = self.max_running = self.waiting = self.max_waiting = 0
            self.busy = 0.0  # slot-seconds decoding

        async def generate(self, request):
            req = await request.json()
            ids = req["input_ids"]
            j = int(req["rid"].rsplit("-", 3)[2])
            L = length(max_new, ids[0], ids[1], j)
            self.waiting += 1
            self.max_waiting = max(self.max_waiting, self.waiting)
            async with self.sem:
                self.waiting -= 1
                self.running += 1
                self.max_running = max(self.max_running, self.running)
                try:
                    await asyncio.sleep(L / rate)
                finally:
                    self.running -= 1
            self.tokens += L
            self.requests += 1
            self.busy += L / rate
            T = max(1, -(-L // TOKEN_SCALE))
            finish = "length" if L >= max_new else "stop"
            meta = {"id": req["rid"], "finish_reason": {"type": finish, "length": T} if finish == "length" else {"type": finish},
                    "prompt_tokens": len(ids), "completion_tokens": T, "weight_version": "0",
                    "output_token_logprobs": [[-0.5, 7, None]] * T,
                    "weight_versions": [{"version": "0", "start": 0, "end": T}]}
            return web.Response(body=orjson.dumps({"text": "", "output_ids": [7] * T, "meta_info": meta}),
                                content_type="application/json")

        async def loads(self, request):
            return web.json_response({"loads": [{"dp_rank": 0, "num_running_reqs": self.running}]})

        async def ok(self, request):
            return web.json_response({})

    async def main():
        servers, ports = [Server() for _ in range(n)], []
        for s in servers:
            app = web.Application(client_max_size=1 << 24)
            app.router.add_post("/generate", s.generate)
            app.router.add_get("/v1/loads", s.loads)
            app.router.add_get("/health", s.ok)
            app.router.add_post("/abort_request", s.ok)

            async def stats(request, servers=servers):
                return web.json_response([dict(tokens=x.tokens, requests=x.requests, busy=x.busy,
                                               max_running=x.max_running, max_waiting=x.max_waiting)
                                          for x in servers])
            app.router.add_get("/stats", stats)

            async def reset(request, servers=servers):  # a new round: its own maxima
                for x in servers:
                    x.max_running, x.max_waiting = x.running, x.waiting
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


class Fleet:
    def __init__(self, n: int, slots: int, rate: float, max_new: int):
        self.proc = subprocess.Popen([sys.executable, __file__, "serve", str(n), str(slots), str(rate), str(max_new)],
                                     stdout=subprocess.PIPE, text=True)
        self.urls = [f"http://127.0.0.1:{p}" for p in json.loads(self.proc.stdout.readline())]

    def stats(self) -> list[dict]:
        """What each server decoded so far; its maxima since the last call."""
        import urllib.request

        with urllib.request.urlopen(self.urls[0] + "/stats") as r:
            out = json.loads(r.read())
        urllib.request.urlopen(urllib.request.Request(self.urls[0] + "/reset", method="POST")).close()
        return out

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


# ============================================================================ producers
def produce(jobs: list[dict], shape: dict) -> list[dict]:
    """Run every job at once, each on its own thread, event loop and client; a job: urls, budget,
    producer id, prompts, samples. Returns per job: finish time, retries, servers marked down."""
    from megatron_rl.rollout.client import RolloutClient, SamplingParams

    out: list[dict] = [{} for _ in jobs]
    start = threading.Barrier(len(jobs) + 1)
    t0 = [0.0]

    def run(k: int, job: dict) -> None:
        async def go():
            async with RolloutClient(job["urls"], budget=job["budget"], backoff_initial=0.05) as client:
                prompts = [[job["producer"], i, 1, 2, 3] for i in range(job["prompts"])]
                start.wait()
                await client.generate(prompts, SamplingParams(max_new_tokens=shape["max_new"]), n=job["samples"])
                out[k] = dict(done=time.monotonic() - t0[0], retries=len(client.retry_events), down=len(client._down))
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


def budgets(design: str, shape: dict, store, name: str, count: int):
    from megatron_rl.rollout.admission import FleetBudget

    if design == "per-producer":
        return [FleetBudget.local(PER_PRODUCER_SLOTS) for _ in range(count)]
    shared = FleetBudget(store, f"fleet/{name}", shape["slots"])
    return [shared.clone() for _ in range(count)]


def round_stats(fleet: Fleet, before: list[dict], urls: list[str], wall: float, shape: dict, rate: float) -> dict:
    after = fleet.stats()
    idx = [fleet.urls.index(u) for u in urls]
    tokens = [after[i]["tokens"] - before[i]["tokens"] for i in idx]
    requests = [after[i]["requests"] - before[i]["requests"] for i in idx]
    busy = sum(after[i]["busy"] - before[i]["busy"] for i in idx)
    return dict(wall=wall, tokens=tokens, load=max(tokens) / max(1, min(tokens)), requests=requests,
                req_load=max(requests) / max(1, min(requests)),
                slot_use=busy / (len(idx) * shape["slots"] * wall),
                max_running=max(after[i]["max_running"] for i in idx),
                max_waiting=max(after[i]["max_waiting"] for i in idx))


def run_shape(name: str, shape: dict, rate: float) -> dict:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    fleet = Fleet(shape["servers"], shape["slots"], rate, shape["max_new"])
    P, share = shape["producers"], shape["prompts"] // shape["producers"]
    results = {}
    try:
        for design in ("per-producer", "fleet"):
            # train: every producer's share of one step, on every server
            bs = budgets(design, shape, store, f"{design}-train", P)
            before = fleet.stats()
            done = produce([dict(urls=fleet.urls, budget=b, producer=k, prompts=share, samples=shape["samples"])
                            for k, b in enumerate(bs)], shape)
            wall = max(d["done"] for d in done)
            train = round_stats(fleet, before, fleet.urls, wall, shape, rate)
            train |= dict(first_done=min(d["done"] for d in done), retries=sum(d["retries"] for d in done),
                          down=sum(d["down"] for d in done))
            # eval: rank 0's evaluation alone on every server (its own budget)
            ep, ek = shape["eval"]
            (eb,) = budgets(design, shape, store, f"{design}-eval", 1)
            before = fleet.stats()
            done = produce([dict(urls=fleet.urls, budget=eb, producer=1000, prompts=ep, samples=ek)], shape)
            ev = round_stats(fleet, before, fleet.urls, done[0]["done"], shape, rate)
            ev |= dict(retries=done[0]["retries"], down=done[0]["down"])
            results[design] = dict(train=train, eval=ev)
        # train + eval beside (fleet design): eval.servers=1
        bs = budgets("fleet", shape, store, "beside-train", P)
        (eb,) = budgets("fleet", shape, store, "beside-eval", 1)
        train_urls, eval_urls = fleet.urls[:-1], fleet.urls[-1:]
        before = fleet.stats()
        jobs = [dict(urls=train_urls, budget=b, producer=k, prompts=share, samples=shape["samples"])
                for k, b in enumerate(bs)]
        jobs.append(dict(urls=eval_urls, budget=eb, producer=1000, prompts=shape["eval"][0], samples=shape["eval"][1]))
        done = produce(jobs, shape)
        t_train = max(d["done"] for d in done[:-1])
        beside = round_stats(fleet, before, train_urls, t_train, shape, rate)
        beside |= dict(eval_wall=done[-1]["done"], retries=sum(d["retries"] for d in done),
                       down=sum(d["down"] for d in done))
        results["beside"] = beside
    finally:
        fleet.close()
    return results


def report(name: str, shape: dict, rate: float, res: dict) -> None:
    print(f"\n== {name}: {shape['producers']} producers, {shape['servers']} servers x {shape['slots']} slots, "
          f"{shape['prompts']} x {shape['samples']} samples up to {shape['max_new']} tokens, eval "
          f"{shape['eval'][0]} x {shape['eval'][1]}; {rate:g} tokens/s per sequence")
    print(f"{'round':<28} {'wall s':>7} {'requests max/min':>16} {'tokens max/min':>14} {'slot use':>8} "
          f"{'max run':>7} {'max queued':>10} {'first done':>10} {'retries':>7} {'down':>4}")
    for design in ("per-producer", "fleet"):
        for kind in ("train", "eval"):
            r = res[design][kind]
            first = f"{r['first_done']:.1f}" if "first_done" in r else "-"
            print(f"{design + ' ' + kind:<28} {r['wall']:>7.1f} {r['req_load']:>16.3f} {r['load']:>14.3f} {r['slot_use']:>8.2f} "
                  f"{r['max_running']:>7} {r['max_waiting']:>10} {first:>10} {r['retries']:>7} {r['down']:>4}")
    b = res["beside"]
    print(f"{'fleet train + eval beside':<28} {b['wall']:>7.1f} {b['req_load']:>16.3f} {b['load']:>14.3f} {b['slot_use']:>8.2f} "
          f"{b['max_running']:>7} {b['max_waiting']:>10} {'-':>10} {b['retries']:>7} {b['down']:>4}"
          f"   (training on {shape['servers'] - 1} servers; the evaluation on 1 took {b['eval_wall']:.1f} s)")
    f, p = res["fleet"]["train"], res["per-producer"]["train"]
    print(f"fleet vs per-producer, one step: {p['wall'] / f['wall']:.2f}x faster; per-server tokens "
          f"{f['tokens']} (fleet) vs {p['tokens']}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        n, slots, rate, max_new = sys.argv[2:6]
        serve(int(n), int(slots), float(rate), int(max_new))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=["30b", "8b", "both"], default="both")
    ap.add_argument("--rate", type=float, default=2000.0, help="decoded tokens per second per sequence")
    ap.add_argument("--quick", action="store_true", help="a quarter of the prompts, for a smoke run")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    os.environ.setdefault("MRL_QUIET", "1")
    import logging

    logging.basicConfig(level=logging.ERROR)
    out = {}
    for name in (["30b", "8b"] if args.shape == "both" else [args.shape]):
        shape = dict(SHAPES[name])
        if args.quick:
            shape |= dict(prompts=shape["prompts"] // 4, eval=(shape["eval"][0] // 4, shape["eval"][1]))
        res = run_shape(name, shape, args.rate)
        report(name, shape, args.rate, res)
        out[name] = dict(shape=shape, rate=args.rate, results=res)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
