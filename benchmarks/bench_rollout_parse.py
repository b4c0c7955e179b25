"""Rollout client's response parsing at the DPPO paper's scale: one SGLang /generate response body
of T = 16384 response tokens with top-20 log-probs and routed experts of a Qwen3-30B-A3B shape
(48 MoE layers, top-8 of 128 experts), P = 256 prompt tokens, built the way SGLang builds it,
in the two encodings the client can get:
- `json` (before): top-K as [logp, id, null] triples of float32 values as Python floats, routes
  base64 of int32 (SGLang 0.5.23's defaults);
- `compact` (after): SGLang's flat base64 top-K (`return_flat_raw_output_top_logprobs` +
  `return_flat_raw_top_logprobs_b64`: float32 / int32 arrays) and routes narrowed to uint8 behind
  a `uint8:` prefix (patches/sglang_fixes.py `encode_routes`).

Times (best of --repeat, one process, this machine):
- `decode`: the HTTP body → Python objects, as the client does it (orjson, cyclic GC paused),
  next to the json module with GC on (what aiohttp's `r.text()` + `r.json()` amounts to);
- `record_from_sglang` with log-probs only, + top-K, + routes, and all three;
- `client_generate`: one `RolloutClient.generate` sample end to end over local HTTP, from a
  small aiohttp app answering that body (body transfer, decode and record);
- the bytes one record keeps;
- bytes per response token on the wire (routes, top-K, the whole body), and the server's side:
  encoding the routes (detokenizer) and serializing the body (orjson, tokenizer manager).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_rollout_parse.py [--tokens 16384 --json out.json]
        [--encoding json|compact|both]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pybase64

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.rollout.client import RolloutClient, SamplingParams, _loads  # noqa: E402
from megatron_rl.rollout.records import record_from_sglang  # noqa: E402
from patches.sglang_fixes import encode_routes  # noqa: E402

ENCODINGS = ("json", "compact")


def sglang_body(T: int, K: int, P: int, L: int, k: int, E: int, vocab: int = 151936, seed: int = 0,
                encoding: str = "json"):
    """(prompt ids, JSON body bytes, parts) shaped like SGLang 0.5.23's /generate answer in
    `encoding` (module docstring); `parts`: the routes and top-K values as sent, for their sizes."""
    g = np.random.default_rng(seed)
    ids = g.integers(0, vocab, T)
    logp = (-g.exponential(1.0, T)).astype(np.float32)
    top_ids = g.integers(0, vocab, (T, K))
    top_lp = np.sort((-g.exponential(3.0, (T, K))).astype(np.float32), axis=1)[:, ::-1]
    top_ids[::2, 0], top_lp[::2, 0] = ids[::2], logp[::2]  # sampled token listed in half the rows
    # Routes: k distinct experts per (position, layer), drawn from a pool of distinct sets.
    pool = np.stack([g.permutation(E)[:k] for _ in range(256)]).astype(np.int32)
    routes = pool[g.integers(0, len(pool), (P + T - 1, L))]
    meta = {"id": "bench", "finish_reason": {"type": "length", "length": T}, "prompt_tokens": P,
            "completion_tokens": T, "cached_tokens": 0, "weight_version": "default",
            "output_token_logprobs": [[lp, i, None] for lp, i in zip(logp.tolist(), ids.tolist())]}
    if encoding == "json":
        top = {"output_top_logprobs": [[[lp, i, None] for lp, i in zip(a, b)]
                                       for a, b in zip(top_lp.tolist(), top_ids.tolist())]}
        meta["routed_experts"] = base64.b64encode(routes.tobytes()).decode()  # SGLang's detokenizer
    else:  # tokenizer_manager.py _build_flat_top_logprobs_fields_from_arrays(return_b64=True)
        top = {"output_top_logprobs_val_flat_b64": base64.b64encode(np.ascontiguousarray(top_lp).tobytes()).decode(),
               "output_top_logprobs_idx_flat_b64": base64.b64encode(top_ids.astype(np.int32).tobytes()).decode(),
               "output_top_logprobs_val_flat_b64_dtype": "float32",
               "output_top_logprobs_idx_flat_b64_dtype": "int32",
               "output_top_logprobs_shape": [T, K], "output_top_logprobs_null_prefix": 0}
        meta["routed_experts"] = encode_routes(routes)
    meta.update(top)
    body = orjson.dumps({"text": "", "output_ids": ids.tolist(), "meta_info": meta})
    parts = {"routes_bytes": len(meta["routed_experts"]), "topk_bytes": len(orjson.dumps(top)),
             "routes": routes, "meta": meta}
    return g.integers(0, vocab, P).tolist(), body, parts


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def time_client(body: bytes, prompt: list[int], a, repeat: int) -> float:
    """Best wall time of one generate() sample against a local app that answers `body`."""
    from aiohttp import web

    async def answer(request):
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async def go() -> float:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_post("/generate", answer)
        app.router.add_get("/v1/loads", lambda request: web.json_response({"loads": []}))  # the stall watchdog's probe
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        times = []
        try:
            async with RolloutClient([url], moe_topk=a.router_topk, num_experts=a.experts) as client:
                for _ in range(repeat):
                    gc.collect()
                    t = time.perf_counter()
                    await client.generate([prompt], SamplingParams(max_new_tokens=a.tokens), n=1,
                                          top_k_logprobs=a.topk, return_routed_experts=True)
                    times.append(time.perf_counter() - t)
        finally:
            await runner.cleanup()
        return min(times)

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--topk", type=int, default=20)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--router-topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    ap.add_argument("--encoding", choices=(*ENCODINGS, "both"), default="both")
    a = ap.parse_args()

    out = {}
    for enc in ENCODINGS if a.encoding == "both" else (a.encoding,):
        out[enc] = res = measure(a, enc)
        print(f"--- {enc}")
        for key, v in res.items():
            print(f"{key:24s} {v:.4f}" if isinstance(v, float) else f"{key:24s} {v}")
    if len(out) == 2:
        print(f"\n| one response, T = {a.tokens} | json (before) | compact (after) |\n|---|---|---|")
        rows = [("routes_B_per_token", "routes on the wire", "B/token"),
                ("topk_B_per_token", "top-K on the wire", "B/token"), ("body_B_per_token", "whole body", "B/token"),
                ("server_routes_encode_s", "routes encode (detokenizer)", "ms"),
                ("server_body_dumps_s", "body serialize (orjson)", "ms"),
                ("decode_client_s", "client body decode", "ms"),
                ("record_all_s", "record_from_sglang (all)", "ms"), ("decode_plus_record_s", "decode + record", "ms"),
                ("client_generate_s", "client end to end", "ms")]
        for key, what, unit in rows:
            scale = 1e3 if unit == "ms" else 1
            j, c = out["json"][key], out["compact"][key]
            print(f"| {what} ({unit}) | {j * scale:,.1f} | {c * scale:,.1f} ({c / j:.2f}x) |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


def measure(a, encoding: str) -> dict:
    prompt, body, parts = sglang_body(a.tokens, a.topk, a.prompt, a.layers, a.router_topk, a.experts,
                                      encoding=encoding)
    res = {"body_mb": len(body) / 1e6, "body_B_per_token": len(body) / a.tokens,
           "routes_B_per_token": parts["routes_bytes"] / a.tokens, "topk_B_per_token": parts["topk_bytes"] / a.tokens}
    routes = parts["routes"]
    sglang_int32 = lambda: pybase64.b64encode(routes.tobytes()).decode()  # noqa: E731  (detokenizer_manager.py)
    res["server_routes_encode_s"] = best(sglang_int32 if encoding == "json" else lambda: encode_routes(routes),
                                         a.repeat)
    doc = {"text": "", "output_ids": list(range(a.tokens)), "meta_info": parts["meta"]}
    res["server_body_dumps_s"] = best(lambda: orjson.dumps(doc), a.repeat)
    if encoding == "json":
        res["decode_json_gc_on_s"] = best(lambda: json.loads(body.decode()), a.repeat)
    res["decode_client_s"] = best(lambda: _loads(body, "bench", "/generate"), a.repeat)
    resp = _loads(body, "bench", "/generate")
    kw = dict(prompt_ids=prompt, prompt_index=0, sample_index=0, temperature=1.0, num_experts=a.experts)
    for name, top_k, moe_topk in [("logp", 0, None), ("topk", a.topk, None),
                                  ("routes", 0, a.router_topk), ("all", a.topk, a.router_topk)]:
        res[f"record_{name}_s"] = best(lambda: record_from_sglang(resp, top_k=top_k, moe_topk=moe_topk, **kw),
                                       a.repeat)
    res["client_generate_s"] = time_client(body, prompt, a, a.repeat)
    rec = record_from_sglang(resp, top_k=a.topk, moe_topk=a.router_topk, **kw)
    res["record_bytes"] = sum(t.numel() * t.element_size() for t in
                              (rec.prompt_ids, rec.response_ids, rec.rollout_logp, rec.topk_ids,
                               rec.topk_logp, rec.routes))
    res["routes_dtype"] = str(rec.routes.dtype)
    res["decode_plus_record_s"] = res["decode_client_s"] + res["record_all_s"]
    return res


if __name__ == "__main__":
    main()
