"""Benchmark: vocab-parallel log-probs and divergences on CPU over gloo (TP=2 processes), or on
one GPU (--device cuda: one process, TP=1, NCCL; tests/gpu runs it at Qwen3's V = 151936).

For each local-shard vocabulary size it times, on logits [T, V_local] fp32 per rank:
  (a) log pi(a_t) only                          vocab_parallel_policy_stats, forward + backward
  (b) (a) + binary TV and KL                    same call, divergences=binary_tv, binary_kl
  (c) (b) + top-K (K=20) TV and KL              same call, all four divergences, topk_distinct=True
                                                (the learner's setting: RolloutBatch checked the
                                                engine's top-K lists once per step); c_sort: the
                                                same without it (per-row sorted duplicate search)
  (d) naive reference: all-gather the full vocabulary, log_softmax, then the same quantities
  (e) megatron-core vocab_parallel_cross_entropy (Megatron's TP log-prob), forward + backward
  (f) log pi(a_t) + entropy (no gradient) + top-K TV: the learner's DPPO top-K call with
      entropy_coef = 0 (torch path, inplace_logits); f_bf16: bf16 logits (not in place)
  (g) (f) with the entropy's gradient (loss + 0.01 H; torch path, not in place)
  *_triton: the same call with kernel="triton" (megatron_rl/vocab_parallel/triton_kernels.py: one
      read of the logits forward, one read + the gradient write backward); run with --triton
      (default on CUDA). On CPU Triton's interpreter runs them (TRITON_INTERPRET=1, triton on
      sys.path): a check that the code runs, its times mean nothing.
Times are the minimum over --reps repetitions of the slowest rank (barrier before each run, the
variants interleaved within each repetition in a shuffled order); forward-only times are reported
too. Ratios are also
given as the median over repetitions of the ratio within one repetition (neighbouring runs see the
same machine load). Inputs that a variant overwrites (inplace_logits, Megatron's fp32 path) are
copied outside the timed region into one buffer that every such variant reuses (same pages for
all). (d) runs forward only under no_grad: with autograd the full-vocabulary copies would need ~4x
the memory again, and the divergences take no gradient.

Peak memory: the PyTorch profiler with profile_memory=True records every CPU-allocator
allocation and free made by torch ops (sizes and timestamps); the running sum of those events gives
the peak of live bytes allocated during the measured call on top of what existed before (inputs
excluded, outputs and the gradient of the logits included). Compared with one fp32
[chunk, V_local] scratch buffer. On CUDA the same quantity is the caching allocator's
max_memory_allocated during the call minus memory_allocated before it; times there are taken
between torch.cuda.synchronize() calls.

    .venv/bin/python benchmarks/bench_vocab_parallel.py            # T=4096, V_local 16384, 75968
    .venv/bin/python benchmarks/bench_vocab_parallel.py --vocab 16384 --reps 9 --pairs 201
    python3 benchmarks/bench_vocab_parallel.py --device cuda --tp 1 --vocab 151936 --reps 10 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_rl.distributed.spawn import run_distributed  # noqa: E402
from megatron_rl.vocab_parallel import (  # noqa: E402
    binary_kl,
    binary_tv,
    topk_kl,
    topk_support,
    topk_tv,
    vocab_parallel_policy_stats,
)

VARIANTS = {
    "a": "log-prob only",
    "b": "+ binary TV/KL",
    "c": "+ top-K TV/KL",
    "a_inplace": "log-prob only, inplace_logits",
    "b_inplace": "+ binary TV/KL, inplace_logits",
    "c_inplace": "+ top-K TV/KL, inplace_logits",
    "c_sort_inplace": "+ top-K TV/KL, inplace_logits, general duplicate search",
    "d": "naive full gather",
    "e": "megatron vocab_parallel_cross_entropy",
    "f": "log-prob + entropy + top-K TV, inplace_logits",
    "g": "log-prob + entropy (grad) + top-K TV",
    "f_bf16": "log-prob + entropy + top-K TV, bf16 logits",
    "a_triton": "log-prob only, triton",
    "c_triton": "+ top-K TV/KL, triton",
    "f_triton": "log-prob + entropy + top-K TV, triton",
    "f_triton_inplace": "log-prob + entropy + top-K TV, triton, inplace_logits",
    "g_triton": "log-prob + entropy (grad) + top-K TV, triton",
    "f_triton_bf16": "log-prob + entropy + top-K TV, triton, bf16 logits",
}
TRITON_VARIANTS = [k for k in VARIANTS if "_triton" in k]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_bytes(fn, device: torch.device = torch.device("cpu")) -> int:
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = top = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        top = max(top, live)
    return top


def _timed(make_run, reps: int, group, device: torch.device = torch.device("cpu")) -> float:
    """Min over reps of the slowest rank's time of make_run()() (make_run itself is untimed)."""
    best = float("inf")
    for _ in range(reps):
        fn = make_run()
        _sync(device)
        dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)  # the slowest rank sets the pace
        best = min(best, dt.item())
    return best


def _naive(logits, target, rollout_logp, topk_ids, topk_logp, group, world):
    """Gather the whole vocabulary, then plain full-vocabulary math (forward, no grad)."""
    with torch.no_grad():
        parts = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(parts, logits, group=group)
        full = torch.cat(parts, dim=-1)
        del parts
        lsm = torch.log_softmax(full, dim=-1)
        del full
        logp = lsm.gather(-1, target[:, None])[:, 0]
        ids, keep = topk_support(target, topk_ids)
        pi_S = lsm.gather(-1, ids)
        del lsm
        mu_S = torch.cat([rollout_logp[:, None], topk_logp], -1)
        return (logp, binary_tv(rollout_logp, logp), binary_kl(rollout_logp, logp),
                topk_tv(mu_S, pi_S, keep), topk_kl(mu_S, pi_S, keep))


def use_triton_interpreter() -> None:
    """In a CPU process of its own: Triton's interpreter, with the triton the Makefile keeps off
    sys.path (requirements/sglang-cpu-extras.txt). Before triton is first imported.
    Only triton is taken from that folder: the torchvision beside it is SGLang's, built for
    another torch (transformers would import it and fail), so the folder leaves sys.path again
    once triton is imported (its submodules load through the package's own __path__)."""
    os.environ["TRITON_INTERPRET"] = "1"
    extras = os.path.join(sys.prefix, "sglang-cpu-extras")
    sys.path.insert(0, extras)
    try:
        import triton  # noqa: F401
    finally:
        sys.path.remove(extras)


def worker(rank, world, args):
    """One rank of the CPU run (spawned, gloo already up): set Megatron's TP group, measure."""
    torch.set_num_threads(1)  # 2 ranks on a 2-core machine
    if args.triton:
        use_triton_interpreter()
    from megatron.core import parallel_state

    megatron_error = None
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    except Exception as e:  # report what stands in the way instead of hiding it
        megatron_error = f"{type(e).__name__}: {e}"
    return measure(rank, world, args, megatron_error)


def measure(rank, world, args, megatron_error=None):
    """Every variant on this rank's shard; torch.distributed and (unless megatron_error says why
    not) Megatron's TP group of `world` ranks are set up by the caller. Tensors live on
    args.device (default cpu)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    device = torch.device(getattr(args, "device", "cpu"))
    triton = getattr(args, "triton", None)
    triton = device.type == "cuda" if triton is None else triton
    group = dist.group.WORLD
    rows = []
    for v_local in args.vocab:
        # Drawn on the device itself: at V = 151936 the logits are GBs.
        g = torch.Generator(device=device).manual_seed(1000 + rank)
        T, K = args.tokens, args.k
        logits = torch.randn(T, v_local, generator=g, device=device) * 3
        gen = torch.Generator().manual_seed(7)  # same targets / rollout data on every rank
        target = torch.randint(0, v_local * world, (T,), generator=gen)
        rollout_logp = -torch.rand(T, generator=gen) * 5
        topk_ids = torch.randint(0, v_local * world, (T, K), generator=gen)
        topk_ids[:, 0] = target  # the sampled token is in mu's top-K (RolloutRecord forces it)
        while True:  # an engine's top-K ids are distinct: redraw the rows that repeat one
            srt = topk_ids.sort(-1).values
            bad = (srt[:, 1:] == srt[:, :-1]).any(-1).nonzero()[:, 0]
            if not len(bad):
                break
            topk_ids[bad, 1:] = torch.randint(0, v_local * world, (len(bad), K - 1), generator=gen)
        topk_logp = torch.sort(-torch.rand(T, K, generator=gen) * 8, dim=-1, descending=True)[0]
        grad_out = torch.randn(T, generator=gen)
        target, rollout_logp, topk_ids, topk_logp, grad_out = (
            t.to(device) for t in (target, rollout_logp, topk_ids, topk_logp, grad_out))
        divs = {"a": (), "b": ("binary_tv", "binary_kl"),
                "c": ("binary_tv", "binary_kl", "topk_tv", "topk_kl"),
                "f": ("topk_tv",), "g": ("topk_tv",)}
        logits_bf16 = logits.bfloat16() if any(k.endswith("_bf16") for k in VARIANTS) else None

        work = torch.empty_like(logits)  # the overwritable copy, same pages for every variant

        def fresh_copy():
            work.copy_(logits)
            return work.detach()

        def ours(key, backward):
            triton = "_triton" in key
            # (f) is the learner's fp32 call with entropy_coef = 0: in place on the torch path
            inplace = key.endswith("_inplace") or key == "f"
            with_entropy, entropy_grad = key[0] in "fg", key[0] == "g"
            # inplace_logits overwrites its input: give it a copy, made outside the timing.
            if key.endswith("_bf16"):
                x = logits_bf16.detach()
            else:
                x = fresh_copy() if inplace else logits.detach()
            x.requires_grad_(backward)

            def run():
                s = vocab_parallel_policy_stats(
                    x, target, group, rollout_logp=rollout_logp, topk_ids=topk_ids,
                    topk_logp=topk_logp, divergences=divs[key[0]], chunk_size=args.chunk,
                    inplace_logits=inplace, topk_distinct="_sort" not in key,
                    with_entropy=with_entropy, entropy_grad=entropy_grad,
                    kernel="triton" if triton else "torch",
                )
                if backward:
                    loss = (s.logp * grad_out).sum()
                    if entropy_grad:
                        loss = loss + 0.01 * (s.entropy * grad_out).sum()
                    loss.backward()
                    x.grad = None
            return run

        def megatron(backward):
            x = fresh_copy().requires_grad_(backward)  # it overwrites fp32 logits in place

            def run():
                loss = vocab_parallel_cross_entropy(x[:, None, :], target[:, None])
                if backward:
                    (-loss[:, 0] * grad_out).sum().backward()
            return run

        row = {"v_local": v_local, "tokens": T, "chunk": args.chunk}
        runs = {}  # (variant, measure) -> factory of a fresh run
        ours_keys = [k for k in VARIANTS if k not in ("d", "e")]
        if not triton:
            ours_keys = [k for k in ours_keys if k not in TRITON_VARIANTS]
        for key in ours_keys:
            runs[key, "fwd"] = lambda key=key: ours(key, False)
            runs[key, "fwd_bwd"] = lambda key=key: ours(key, True)
        if megatron_error is None:
            runs["e", "fwd"] = lambda: megatron(False)
            runs["e", "fwd_bwd"] = lambda: megatron(True)
        # Repetitions outermost, variants interleaved: load from other processes on a shared
        # machine then hits every variant alike instead of whichever ran during the spike.
        times = {name: [] for name in runs}
        for rep in range(args.reps):
            # A fresh order each repetition (seeded alike on every rank): a variant that frees
            # hundreds of MiB would otherwise always slow down the same successor.
            names = list(runs)
            random.Random(rep).shuffle(names)
            for name in names:
                times[name].append(_timed(runs[name], 1, group, device))
        if v_local <= args.naive_max_vocab:
            # Timed apart, a few times: its gigabytes of allocations would disturb the others,
            # and its ratio to (c) is far from 1.
            runs["d", "fwd"] = lambda: (lambda: _naive(
                logits, target, rollout_logp, topk_ids, topk_logp, group, world))
            times["d", "fwd"] = [_timed(runs["d", "fwd"], 1, group, device) for _ in range(min(3, args.reps))]
        for (key, measure), ts in times.items():
            row.setdefault(key, {})[measure] = min(ts)
            row[key]["all_" + measure] = ts
        # Paired phase (inplace path, forward + backward): (a) and the variant back to back, in
        # alternating order, many times -- the per-call spread on a shared machine (~10 %) is far
        # above the 1-5 % being measured, so only many pairs narrow the median down.
        pairs = {}
        for rep in range(args.pairs):
            for key in ("b_inplace", "c_inplace"):
                order = ("a_inplace", key) if rep % 2 == 0 else (key, "a_inplace")
                t = {k: _timed(runs[k, "fwd_bwd"], 1, group, device) for k in order}
                pairs.setdefault(key, []).append(t[key] / t["a_inplace"])
        row["pairs"] = pairs
        for (key, measure), make in runs.items():
            row[key]["mem_" + measure] = _peak_bytes(make(), device)
        row["buffer_bytes"] = min(args.chunk, T) * v_local * 4
        row["grad_bytes"] = T * v_local * 4
        row["tp"] = world
        rows.append(row)
    return {"rows": rows, "megatron_error": megatron_error,
            "triton_skipped": None if triton else TRITON_SKIPPED}


TRITON_SKIPPED = ("the triton variants were not run (--triton is off by default on CPU, where only "
                  "Triton's interpreter could run them)")


def _median_ratio(num, den, measure="fwd_bwd") -> str:
    """Median over repetitions of num/den timed within the same repetition (see _median_ci)."""
    return _median_ci([x / y for x, y in zip(num["all_" + measure], den["all_" + measure])])


def _median_ci(ratios) -> str:
    """Median of the ratios with a ~95 % distribution-free interval (order statistics
    n/2 -+ 0.98 sqrt(n) of the sorted ratios)."""
    r = sorted(ratios)
    n = len(r)
    half = 0.98 * math.sqrt(n)
    lo, hi = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half) - 1)
    return f"median {statistics.median(r):.3f}, 95% CI [{r[lo]:.3f}, {r[hi]:.3f}]"


def _fmt_table(res) -> str:
    out = []
    mb = 2.0**20
    if res["megatron_error"]:
        out.append(f"megatron-core could not be set up: {res['megatron_error']}\n")
    if res.get("triton_skipped"):
        out.append(f"{res['triton_skipped']}\n")
    for row in res["rows"]:
        buf = row["buffer_bytes"]
        tp = row.get("tp", 2)
        out.append(
            f"### T={row['tokens']}, V_local={row['v_local']} (TP={tp}, V={tp * row['v_local']}), "
            f"fp32, chunk={row['chunk']} (one fp32 [chunk, V_local] buffer = {buf / mb:.0f} MiB)\n"
        )
        out.append("| variant | fwd s | fwd+bwd s | fwd+bwd / (a) | peak extra fwd MiB | "
                   "fwd peak / buffer | peak extra fwd+bwd MiB (grad = "
                   f"{row['grad_bytes'] / mb:.0f}) |")
        out.append("|---|---|---|---|---|---|---|")
        a = row["a"]["fwd_bwd"]
        for key, name in VARIANTS.items():
            if key not in row:
                continue
            r = row[key]
            fb = r.get("fwd_bwd")
            cells = [
                f"({key}) {name}",
                f"{r['fwd']:.3f}",
                f"{fb:.3f}" if fb is not None else "—",
                f"{fb / a:.3f}" if fb is not None else "—",
                f"{r['mem_fwd'] / mb:.1f}" if "mem_fwd" in r else "—",
                f"{r['mem_fwd'] / buf:.3f}" if "mem_fwd" in r else "—",
                f"{r['mem_fwd_bwd'] / mb:.1f}" if "mem_fwd_bwd" in r else "—",
            ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        for sfx, label in (("", "recompute (default)"), ("_inplace", "inplace_logits")):
            ra, rb, rc = row["a" + sfx], row["b" + sfx], row["c" + sfx]
            line = (
                f"- {label}: fwd+bwd (b)/(a) = {rb['fwd_bwd'] / ra['fwd_bwd']:.3f} "
                f"({_median_ratio(rb, ra)}), (c)/(a) = "
                f"{rc['fwd_bwd'] / ra['fwd_bwd']:.3f} ({_median_ratio(rc, ra)}); "
                f"fwd (b)/(a) = {rb['fwd'] / ra['fwd']:.3f}, (c)/(a) = {rc['fwd'] / ra['fwd']:.3f}; "
                f"peak extra fwd of (c) = {rc['mem_fwd'] / buf:.3f} x buffer; "
                f"fwd+bwd of (c) beyond the gradient = "
                f"{(rc['mem_fwd_bwd'] - (0 if sfx else row['grad_bytes'])) / buf:.3f} x buffer"
            )
            if "e" in row:
                line += (f"; (a)/(e) fwd+bwd = {ra['fwd_bwd'] / row['e']['fwd_bwd']:.3f} "
                         f"({_median_ratio(ra, row['e'])}), "
                         f"fwd = {ra['fwd'] / row['e']['fwd']:.3f}")
            out.append(line)
        rs, ra = row["c_sort_inplace"], row["a_inplace"]
        out.append(f"- inplace_logits, general duplicate search: fwd+bwd (c_sort)/(a) = "
                   f"{rs['fwd_bwd'] / ra['fwd_bwd']:.3f} ({_median_ratio(rs, ra)})")
        for key, ratios in row["pairs"].items():
            out.append(f"- inplace_logits, {len(ratios)} back-to-back pairs: fwd+bwd "
                       f"({key.split('_')[0]})/(a) {_median_ci(ratios)}")
        if "f_triton" in row:
            f, ft, fti = row["f"], row["f_triton"], row["f_triton_inplace"]
            line = (f"- triton, log-prob + entropy + top-K TV: fwd+bwd {ft['fwd_bwd'] * 1e3:.2f} ms "
                    f"(in place {fti['fwd_bwd'] * 1e3:.2f}) vs torch (f) {f['fwd_bwd'] * 1e3:.2f} ms: "
                    f"(f_triton)/(f) = {ft['fwd_bwd'] / f['fwd_bwd']:.3f} ({_median_ratio(ft, f)}); "
                    f"bf16 logits {row['f_triton_bf16']['fwd_bwd'] * 1e3:.2f} ms vs torch "
                    f"{row['f_bf16']['fwd_bwd'] * 1e3:.2f}; peak extra beyond the gradient: "
                    f"{(ft['mem_fwd_bwd'] - row['grad_bytes']) / buf:.3f} x buffer, in place "
                    f"{fti['mem_fwd_bwd'] / buf:.3f} x buffer")
            if "e" in row:
                line += f"; (f_triton)/(e) fwd+bwd = {ft['fwd_bwd'] / row['e']['fwd_bwd']:.3f}"
            out.append(line)
        if "d" in row:
            out.append(f"- naive (d) / (c) forward = {row['d']['fwd'] / row['c']['fwd']:.2f}, "
                       f"peak {row['d']['mem_fwd'] / buf:.1f} x buffer")
        out.append("")
    return "\n".join(out)


def summary(res) -> dict:
    """The figures of each row as plain numbers (ms, MiB) for a JSON record."""
    mib = 2.0**20
    out = {"megatron_error": res["megatron_error"], "triton_skipped": res.get("triton_skipped"),
           "rows": []}
    for row in res["rows"]:
        r = {"tokens": row["tokens"], "v_local": row["v_local"], "tp": row.get("tp", 2), "chunk": row["chunk"],
             "buffer_mib": row["buffer_bytes"] / mib, "grad_mib": row["grad_bytes"] / mib, "variants": {}}
        for key, name in VARIANTS.items():
            if key in row:
                v = row[key]
                r["variants"][key] = {"name": name, **{f"{m}_ms": v[m] * 1e3 for m in ("fwd", "fwd_bwd") if m in v},
                                      **{f"peak_extra_{m}_mib": v["mem_" + m] / mib for m in ("fwd", "fwd_bwd")
                                         if "mem_" + m in v}}
        out["rows"].append(r)
    return out


def _run_cuda(args):
    """One process on one GPU: NCCL with a world of one (Megatron's TP group of size 1)."""
    from datetime import timedelta

    from megatron.core import parallel_state

    if args.tp != 1:
        raise SystemExit("--device cuda runs one process on one GPU: use --tp 1 (NCCL refuses two ranks per GPU)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=timedelta(minutes=10))
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        return measure(0, 1, args)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, nargs="+", default=[16384, 75968],
                   help="local-shard vocabulary sizes (75968 = Qwen2.5's 151936 / TP=2)")
    p.add_argument("--chunk", type=int, default=1024, help="token chunk of the scratch buffer")
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--pairs", type=int, default=0,
                   help="then time (a) next to (b) and to (c) this many times (inplace path)")
    p.add_argument("--naive-max-vocab", type=int, default=10**9,
                   help="skip (d) above this local vocab (it needs ~4 full-vocab copies)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (cuda: 1)")
    p.add_argument("--json", help="also write the figures (ms, MiB) to this file")
    p.add_argument("--triton", action=argparse.BooleanOptionalAction, default=None,
                   help="time the kernel='triton' variants too (default: on CUDA only)")
    args = p.parse_args(argv)
    if args.triton is None:
        args.triton = args.device == "cuda"
    t0 = time.perf_counter()
    if args.device == "cuda":
        res = _run_cuda(args)
        where = torch.cuda.get_device_name(0)
    else:
        res = run_distributed(worker, args.tp, args, timeout=1800)[0]
        where = f"{os.cpu_count()} CPUs, 1 intra-op thread per rank"
    print(_fmt_table(res))
    print(f"(total wall time {time.perf_counter() - t0:.0f} s, torch {torch.__version__}, {where})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary(res), f, indent=1)


if __name__ == "__main__":
    main()
