"""What an idle SGLang CPU server costs the learner beside it, with and without --sleep-on-idle.

Colocated on one machine, the server idles while the learner trains. SGLang's scheduler spins
when idle unless `--sleep-on-idle` (then it waits on its sockets; a request wakes it at once). One
server of the embedded default's tiny model per setting; for each, in alternating rounds:
(1) the server's CPU use over an idle window (its process tree, CPU-seconds per second);
(2) a fixed learner-like workload (fp32 matmuls on torch's threads) timed while the server idles;
(3) the latency of one short generation request (what sleeping might cost).
Ratios sleep/spin are reported from one run.

    .venv/bin/python benchmarks/bench_server_idle.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def tree_cpu_seconds(pid: int) -> float:
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def idle_cpu(pid: int, seconds: float) -> float:
    a = tree_cpu_seconds(pid)
    time.sleep(seconds)
    return (tree_cpu_seconds(pid) - a) / seconds


def workload(n: int = 40) -> float:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(768, 768, generator=g), torch.randn(768, 768, generator=g)
    t = time.perf_counter()
    for _ in range(n):
        a = torch.tanh(a @ b)
    return time.perf_counter() - t


def latency(url: str) -> float:
    body = json.dumps({"input_ids": [1, 40, 41, 13], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
    req = urllib.request.Request(url + "/generate", data=body.encode(), headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    urllib.request.urlopen(req, timeout=60).read()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--idle-seconds", type=float, default=5.0)
    args = ap.parse_args()

    from megatron_rl.config.load import load_config, to_object
    from megatron_rl.models.tiny import make_tiny_checkpoint
    from megatron_rl.rollout.server import EngineManager, ServerConfig

    root = Path(tempfile.mkdtemp(prefix="bench_idle_"))
    ckpt = make_tiny_checkpoint(root / "model", **vars(to_object(load_config("tiny_cpu")).model.tiny))
    managers = {name: EngineManager(ServerConfig(model_path=str(ckpt), max_total_tokens=4096, sleep_on_idle=sleep),
                                    1, log_dir=root / name).start()
                for name, sleep in (("spin", False), ("sleep", True))}
    res = {name: {"cpu": [], "work": [], "lat": []} for name in managers}
    try:
        for name, m in managers.items():
            latency(m.urls()[0])  # warm-up
        workload(5)
        # Only one server may idle during a measurement: the other is paused (SIGSTOP) meanwhile.
        import psutil

        def tree(m):
            root_p = psutil.Process(m.servers[0].pid)
            return [root_p, *root_p.children(recursive=True)]

        for _ in range(args.rounds):
            for name, m in managers.items():
                other = [p for n, o in managers.items() if n != name for p in tree(o)]
                for p in other:
                    p.suspend()
                try:
                    time.sleep(1.0)
                    res[name]["cpu"].append(idle_cpu(m.servers[0].pid, args.idle_seconds))
                    res[name]["work"].append(workload())
                    res[name]["lat"].append(latency(m.urls()[0]))
                finally:
                    for p in other:
                        p.resume()
    finally:
        for m in managers.values():
            m.stop()
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in res.items()}
    print(f"idle SGLang CPU server (tiny_cpu model), {args.rounds} alternating rounds, medians:")
    for n in managers:
        print(f"  {n:5s}: idle CPU {med[n]['cpu']:.3f} cores; learner-like workload {med[n]['work'] * 1e3:.0f} ms; "
              f"4-token request {med[n]['lat'] * 1e3:.0f} ms")
    print(f"sleep/spin: idle CPU {med['sleep']['cpu'] / max(med['spin']['cpu'], 1e-9):.3f}, workload "
          f"{med['sleep']['work'] / med['spin']['work']:.3f}, request latency {med['sleep']['lat'] / med['spin']['lat']:.3f}")


if __name__ == "__main__":
    main()
