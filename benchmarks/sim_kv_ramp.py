"""How full can admission keep a server's KV cache within one synchronous step? A simulation.

    .venv/bin/python benchmarks/sim_kv_ramp.py [--requests 1024] [--seeds 5] [--targets 0.9 0.95]

Issue 41 asks for KV use >= 0.85 at the 30B shape. `benchmarks/bench_fleet.py` measures 0.68 "KV
full" for today's rule (rollout/admission.py: slots = the most requests whose KV at a random moment
of the steady state fits the pool) within one step, against 0.91 in that steady state. This script
asks what any admission that never overfills the pool could reach within the step, by simulating
one server through one step at the 30B shape with no client, network or SGLang in the way:
- a server with a KV pool of 2,000,000 tokens and max_running_requests 1,024 gets its share of a
  step, 1,024 requests (bench_fleet's 256 x 16 samples over 4 servers), 512-token prompts and
  responses lognormal (median 4,096 = max_new_tokens / 4, sigma 0.84, cut at 16,384: bench_fleet's
  draw); every running sequence decodes at the same speed, one tick = DT tokens each, and holds
  prompt + decoded tokens of KV until it ends;
- the rules see a previous step's 8,192 lengths (the statistics the fleet keeps), not the step's own.

Rules:
- `following (today)`: `admission.kv_capacity` of those lengths (the code's own function), a fixed
  number of slots refilled as requests end;
- `age-aware`: a request is admitted while the expected KV of every admitted request, projected over
  all its future ages from the length distribution (a request of age a holds p + a + x tokens x
  ticks later with probability S(a + x) / S(a), S the survival of the lengths), stays under
  `target` x pool at every future moment. It knows every running request's age: the best any rule
  that does not overfill on average can do with what the fleet knows;
- `schedule by ticks`: the same projection run once on the expected values (a fluid model), giving
  slots as a function of the step's age alone, cap(t); the server then keeps cap(t) running;
- `schedule by ends`: the same, the step's age read from the requests that have ended since the
  server was empty (counted: no decode speed needed);
- `admission.ramp`: the fleet's own (rollout/admission.py), which is the schedule by ends computed
  from the histogram the statistics keep, and the steady state's slots past one longest response.

Reported per rule (mean over seeds): the step's duration against today's rule, KV full (KV tokens
over the pool while requests still waited, past the first median response time, as bench_fleet
defines it), KV use over the whole step, the highest fill, and the ticks the pool was overfilled
(SGLang would retract there).
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from megatron_rl.rollout.admission import LengthStats, ServerKV, kv_capacity, ramp

MAX_NEW, PROMPT, POOL, MAX_RUNNING = 16384, 512, 2_000_000, 1024
DT = 64  # tokens each running sequence decodes per tick


def draw(rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
    x = np.round(scale * np.exp(rng.normal(math.log(MAX_NEW / 4), 0.84, n)))
    return np.clip(x, 1, MAX_NEW).astype(np.int64)


class Lengths:
    """What the rules know: a previous step's lengths, as the survival S and the expected KV g of
    a request at each age on the tick grid."""

    def __init__(self, seen: np.ndarray):
        self.K = MAX_NEW // DT + 1
        ages = np.arange(self.K) * DT
        self.S = (seen[None, :] > ages[:, None]).mean(1)
        self.g = (PROMPT + ages) * self.S
        stats = LengthStats.of([PROMPT] * len(seen), seen.tolist())
        self.slots = kv_capacity(ServerKV(POOL, MAX_RUNNING), stats)
        self.ramp = ramp(ServerKV(POOL, MAX_RUNNING), stats)  # the fleet's, as built
        self.kv_steady = stats.kv_per_request()[0]

    def projection(self, ages: np.ndarray) -> np.ndarray:
        """[K] expected KV of requests of these ages, 0..K-1 ticks from now."""
        if not len(ages):
            return np.zeros(self.K)
        a = ages // DT
        idx = a[:, None] + np.arange(self.K)[None, :]
        g = np.where(idx < self.K, self.g[np.minimum(idx, self.K - 1)], 0.0)
        return (g / np.maximum(self.S[a], 1e-12)[:, None]).sum(0)

    def admissible(self, base: np.ndarray, limit: float) -> int:
        """New requests (age 0 now) whose expected KV fits beside `base` at every future tick."""
        live = self.g > 0
        return max(0, int(math.floor(((limit - base[live]) / self.g[live]).min())))

    def schedule(self, limit: float) -> tuple[np.ndarray, np.ndarray]:
        """cap(t) of the fluid model over one longest response's ticks (admit what the projection
        allows, expected values only), and the requests expected to have ended by each tick. Past
        those ticks the first wave is gone: the steady state's slots at the same fill."""
        ticks = self.K
        admitted = np.zeros(ticks)
        future = np.zeros(ticks + self.K)
        caps = np.zeros(ticks, dtype=np.int64)
        ended = np.zeros(ticks)
        for t in range(ticks):
            lo = max(0, t - self.K + 1)
            running = float((admitted[lo:t] * self.S[t - np.arange(lo, t)]).sum()) if t else 0.0
            ended[t] = admitted[:t].sum() - running
            n = min(self.admissible(future[t:t + self.K], limit), MAX_RUNNING - running)
            admitted[t] = max(0.0, n)
            future[t:t + self.K] += admitted[t] * self.g
            caps[t] = int(running + admitted[t])
        steady = int(limit / self.kv_steady)
        return caps, ended, steady


def step(lengths: np.ndarray, known: Lengths, rule: str, limit: float, plan=None) -> dict:
    """One server through one step: ticks, KV full, KV use, highest fill, ticks overfilled."""
    n = len(lengths)
    ages = np.zeros(0, dtype=np.int64)
    ends = np.zeros(0, dtype=np.int64)
    nxt, t, kv, waiting = 0, 0, [], []
    while nxt < n or len(ages):
        if rule == "following":
            room = known.slots - len(ages)
        elif rule == "built":
            room = known.ramp.cap(nxt - len(ages)) - len(ages)
        elif rule == "age-aware":
            room = min(known.admissible(known.projection(ages), limit), MAX_RUNNING - len(ages))
        else:
            caps, expected_ended, steady = plan
            # the step's clock: ticks (decode speed known), or the requests that ended (counted)
            at = t if rule == "schedule" else int(np.searchsorted(expected_ended, nxt - len(ages), side="right")) - 1
            room = (int(caps[at]) if at < len(caps) else steady) - len(ages)
        take = max(0, min(room, n - nxt))
        ages = np.concatenate([ages, np.zeros(take, dtype=np.int64)])
        ends = np.concatenate([ends, lengths[nxt:nxt + take]])
        nxt += take
        kv.append(float((PROMPT + ages).sum()))
        waiting.append(nxt < n)
        ages = ages + DT
        alive = ages < ends
        ages, ends = ages[alive], ends[alive]
        t += 1
    kv = np.array(kv) / POOL
    waiting = np.array(waiting)
    waiting[: (MAX_NEW // 4) // DT] = False  # past the first median response time (bench_fleet)
    return dict(ticks=t, kv_full=float(kv[waiting].mean()) if waiting.any() else float("nan"),
                kv_use=float(kv.mean()), peak=float(kv.max()), overfilled=int((kv > 1).sum()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1024, help="one server's share of a step")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--longer", type=float, default=0.0,
                    help="the step's responses this much longer than the lengths the rules saw (0.2: 20 %%)")
    ap.add_argument("--targets", type=float, nargs="+", default=[0.9, 0.95],
                    help="fills of the pool the projecting rules keep the expected KV under")
    args = ap.parse_args()
    known = Lengths(draw(np.random.default_rng(12345), 8192))
    print(f"30B shape: pool {POOL:,} tokens, max_running {MAX_RUNNING}, {args.requests} requests a step, "
          f"prompt {PROMPT}, lengths lognormal median {MAX_NEW // 4} sigma 0.84 cut at {MAX_NEW}; "
          f"today's slots {known.slots} (steady KV per request {known.kv_steady:,.0f})"
          + (f"; the step's responses {args.longer:.0%} longer than those seen" if args.longer else ""))
    rows = [("following (today)", "following", 0.0)]
    rows += [(f"age-aware, target {x:g}", "age-aware", x) for x in args.targets]
    rows += [(f"schedule by ticks, target {x:g}", "schedule", x) for x in args.targets]
    rows += [(f"schedule by ends, target {x:g}", "by-ends", x) for x in args.targets]
    rows += [("admission.ramp (as built, 0.9)", "built", 0.9)]
    base = None
    print(f"{'rule':<34} {'step':>6} {'KV full':>8} {'KV use':>7} {'peak':>6} {'overfilled':>10}  slots over the step")
    for label, rule, target in rows:
        plan = known.schedule(target * POOL) if rule in ("schedule", "by-ends") else None
        res = [step(draw(np.random.default_rng(seed), args.requests, 1 + args.longer), known, rule, target * POOL, plan)
               for seed in range(args.seeds)]
        mean = {k: float(np.mean([r[k] for r in res])) for k in res[0]}
        base = base or mean["ticks"]
        slots = (f"{plan[0][0]} at the start, {plan[0].min()} at the lowest (tick {plan[0].argmin()}), then {plan[2]}"
                 if plan is not None else f"{known.slots}" if rule == "following" else
                 f"{known.ramp.caps[0]} at the start, {min(known.ramp.caps)} at the lowest, then {known.ramp.steady}"
                 if rule == "built" else "")
        print(f"{label:<34} {mean['ticks'] / base:>5.3f}x {mean['kv_full']:>8.3f} {mean['kv_use']:>7.3f} "
              f"{mean['peak']:>6.3f} {mean['overfilled']:>10.1f}  {slots}")


if __name__ == "__main__":
    main()
