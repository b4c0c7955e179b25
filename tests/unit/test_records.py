"""Rollout records from SGLang-shaped responses, and the client around them, without SGLang.

Responses are built here the way SGLang 0.5.23 builds them (tokenizer_manager.py: [logp, id,
null] triples, base64 int32 routes; orjson) from known arrays, which are the reference. The
client tests serve such bodies from a small local aiohttp app: what they test is the client's
side (request identity in errors, no retry of a server bug, on_record, concurrency cap,
derived timeouts, continuing aborted samples), which needs answers a real server would not give
on demand. SGLang's own
answers are checked against HF in tests/e2e/test_sglang_rollout.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import base64

import numpy as np
import orjson
import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout import client as client_mod
from megatron_rl.rollout.client import RolloutClient, RolloutError, SamplingParams, request_timeout_s
from megatron_rl.rollout.records import (
    NO_ROUTE_U8,
    UNKNOWN_VERSION,
    RolloutRecord,
    force_sampled_into_topk,
    no_route,
    record_from_sglang,
    route_dtype,
    token_versions,
    version_number,
)
from megatron_rl.rollout.wire import MalformedResponse, decode_routed_experts

L, KR, E, K = 3, 2, 8, 4  # MoE layers, router top-k, experts, top-K log-probs


def sglang_response(prompt, T, *, seed=0, top_k=K, experts=E, finish="length", spans=(("7", 0, None),)):
    """(response as orjson parses SGLang's body, reference arrays). `spans`: (version, start, end)
    as SGLang's `meta_info.weight_versions` (end None: T); None leaves them out (an older server)."""
    g = np.random.default_rng(seed)
    P = len(prompt)
    out_ids = g.integers(0, 1000, T)
    logp = (-g.exponential(1.0, T)).astype(np.float32)
    top_ids = np.stack([g.permutation(1000)[:top_k] for _ in range(T)])
    top_lp = np.sort((-g.exponential(2.0, (T, top_k))).astype(np.float32), axis=1)[:, ::-1].copy()
    top_ids[::2, 1] = out_ids[::2]  # even rows list the sampled token, odd rows (mostly) not
    routes = np.stack([[g.permutation(experts)[:KR] for _ in range(L)] for _ in range(P + T - 1)])
    meta = {"id": "abc", "finish_reason": {"type": finish, "length": T} if finish == "length" else {"type": finish},
            "prompt_tokens": P, "completion_tokens": T, "weight_version": "7",
            "output_token_logprobs": [[float(a), int(b), None] for a, b in zip(logp, out_ids)],
            "output_top_logprobs": [[[float(a), int(b), None] for a, b in zip(ra, rb)]
                                    for ra, rb in zip(top_lp, top_ids)],
            "routed_experts": base64.b64encode(routes.astype(np.int32).tobytes()).decode()}
    if spans is not None:  # utils/weight_versions.py: add_weight_versions_to_meta_info
        meta["weight_versions"] = [{"version": v, "start": a, "end": T if b is None else b} for v, a, b in spans]
        meta["weight_version"] = spans[-1][0]
    body = orjson.dumps({"text": "...", "output_ids": out_ids.tolist(), "meta_info": meta})
    return orjson.loads(body), dict(out_ids=out_ids, logp=logp, top_ids=top_ids, top_lp=top_lp,
                                    routes=routes)


def build(resp, prompt, top_k=K, moe_topk=KR, num_experts=E):
    return record_from_sglang(resp, prompt_ids=prompt, prompt_index=3, sample_index=1, temperature=0.7,
                              top_k=top_k, moe_topk=moe_topk, num_experts=num_experts)


def test_record_fields_layouts_and_dtypes():
    prompt = [5, 6, 7, 8, 9]
    P, T = len(prompt), 7
    resp, ref = sglang_response(prompt, T)
    rec = build(resp, prompt)
    assert (rec.prompt_index, rec.sample_index, rec.finish_reason, rec.weight_version) == (3, 1, "length", "7")
    assert rec.prompt_ids.tolist() == prompt and rec.prompt_ids.dtype == torch.int64
    assert rec.response_ids.tolist() == ref["out_ids"].tolist() and rec.response_ids.dtype == torch.int64
    assert rec.rollout_logp.dtype == torch.float32 and np.array_equal(rec.rollout_logp.numpy(), ref["logp"])
    # top-K: int32 / float32; a row without the sampled token gets it (and its log-prob) last.
    assert rec.topk_ids.dtype == torch.int32 and rec.topk_logp.dtype == torch.float32
    forced = 0
    for t in range(T):
        ids, lp = ref["top_ids"][t].tolist(), ref["top_lp"][t].tolist()
        if ref["out_ids"][t] not in ids:
            ids[-1], lp[-1] = int(ref["out_ids"][t]), float(ref["logp"][t])
            forced += 1
        assert rec.topk_ids[t].tolist() == ids and rec.topk_logp[t].tolist() == lp
    assert forced >= 2
    # Routes: one uint8 tensor over all P+T-1 input positions; the two fields are views of it.
    assert rec.routes.dtype == torch.uint8 and rec.routes.shape == (P + T - 1, L, KR)
    assert np.array_equal(rec.routes.numpy(), ref["routes"])
    assert rec.sequence_routed_experts() is rec.routes
    assert rec.routed_experts.shape == (T, L, KR) and rec.prompt_routed_experts.shape == (P - 1, L, KR)
    base = rec.routes.untyped_storage().data_ptr()
    assert rec.routed_experts.untyped_storage().data_ptr() == base == rec.prompt_routed_experts.untyped_storage().data_ptr()
    assert rec.routed_experts.data_ptr() == rec.routes[P - 1].data_ptr()
    # One weight version for the whole response.
    assert rec.versions.dtype == torch.int32 and rec.versions.tolist() == [7] * T and rec.oldest_version == 7
    with pytest.raises(AttributeError):
        rec.routed_experts = rec.routes
    # Dense / not requested: no top-K, no routes.
    plain = build(resp, prompt, top_k=0, moe_topk=None, num_experts=None)
    assert plain.topk_ids is None and plain.routes is None and plain.routed_experts is None
    with pytest.raises(ValueError, match="no routed experts"):
        plain.sequence_routed_experts()


def test_route_dtypes_and_sentinels():
    assert route_dtype(128) == torch.uint8 and route_dtype(255) == torch.uint8
    assert route_dtype(256) == torch.int16 and route_dtype(32767) == torch.int16
    assert no_route(torch.uint8) == NO_ROUTE_U8 == 255 and no_route(torch.int16) == -1
    for bad in (0, 32768):
        with pytest.raises(ValueError, match="num_experts"):
            route_dtype(bad)
    with pytest.raises(ValueError, match="uint8 or int16"):
        no_route(torch.int64)
    # 300 experts: int16, ids above 255 kept exactly.
    arr = np.array([[[299, 0]], [[256, 17]]], dtype=np.int32)
    out = decode_routed_experts(base64.b64encode(arr.tobytes()).decode(), 2, 2, 300)
    assert out.dtype == torch.int16 and out.tolist() == arr.tolist()
    # 255 experts: the largest id, 254, is still below the sentinel.
    arr = np.array([[[254, 0]]], dtype=np.int32)
    assert decode_routed_experts(base64.b64encode(arr.tobytes()).decode(), 1, 2, 255).tolist() == [[[254, 0]]]


def test_decode_routed_experts_layout_and_errors():
    arr = np.arange(5 * 3 * 2, dtype=np.int32).reshape(5, 3, 2) % 7
    b64 = base64.b64encode(arr.tobytes()).decode()
    assert torch.equal(decode_routed_experts(b64, 5, 2, 7), torch.from_numpy(arr.astype(np.uint8)))
    with pytest.raises(MalformedResponse, match="not 4 rows"):
        decode_routed_experts(b64, 4, 2, 7)
    bad = arr.copy()
    bad[3, 1, 0] = -2  # negative: caught by the same one-pass check as ids >= num_experts
    with pytest.raises(MalformedResponse, match=r"row 3 \(input position 3\), layer 1 names expert -2"):
        decode_routed_experts(base64.b64encode(bad.tobytes()).decode(), 5, 2, 7)
    with pytest.raises(MalformedResponse, match="not valid base64"):
        decode_routed_experts(b64[:-3] + "*==", 5, 2, 7)


def test_force_sampled_into_topk():
    ids = torch.tensor([[7, 3, 9], [1, 2, 4]], dtype=torch.int32)
    logp = torch.tensor([[-0.1, -0.5, -0.9], [-0.2, -0.3, -0.4]])
    new_ids, new_logp = force_sampled_into_topk(ids, logp, torch.tensor([3, 8], dtype=torch.int32),
                                                torch.tensor([-0.5, -3.0]))
    assert new_ids.tolist() == [[7, 3, 9], [1, 2, 8]]
    assert new_logp.tolist()[1] == pytest.approx([-0.2, -0.3, -3.0])
    assert ids.tolist() == [[7, 3, 9], [1, 2, 4]]  # inputs untouched


def _set(path):
    """A mutation setting the value at `path` (keys / indices) of the response."""
    *head, last = path

    def mutate(resp, value):
        node = resp
        for p in head:
            node = node[p]
        if value is KeyError:
            del node[last]
        else:
            node[last] = value
    return mutate


def _routes_with(resp, rows_delta=0, bad_id=None):
    raw = np.frombuffer(base64.b64decode(resp["meta_info"]["routed_experts"]), np.int32).copy()
    raw = raw.reshape(-1, L, KR)
    if rows_delta:
        raw = raw[:rows_delta]
    if bad_id is not None:
        raw[6, 2, 1] = bad_id
    resp["meta_info"]["routed_experts"] = base64.b64encode(raw.tobytes()).decode()


MI = "meta_info"
MALFORMED = {
    # name: (mutation of the response, field named, detail pattern)
    "missing_output_ids": (lambda r: _set(["output_ids"])(r, KeyError), "output_ids", "missing"),
    "logp_id_is_string": (lambda r: _set([MI, "output_token_logprobs", 4, 1])(r, "17"),
                          "meta_info.output_token_logprobs[4][1]", "expected a token id .*str '17'"),
    "logp_is_string": (lambda r: _set([MI, "output_token_logprobs", 5, 0])(r, "-0.5"),
                       "meta_info.output_token_logprobs[5][0]", "expected a log-prob .*str '-0.5'"),
    "logp_is_null": (lambda r: _set([MI, "output_token_logprobs", 2, 0])(r, None),
                     "meta_info.output_token_logprobs[2][0]", "got NoneType None"),
    "logp_id_mismatch": (lambda r: _set([MI, "output_token_logprobs", 3, 1])(r, 1001),
                         "meta_info.output_token_logprobs[3][1]", "differs from output_ids"),
    "topk_row_too_short": (lambda r: r[MI]["output_top_logprobs"][6].pop(),
                           "meta_info.output_top_logprobs[6]", f"expected {K} .* got {K - 1} entries"),
    "topk_id_is_float": (lambda r: _set([MI, "output_top_logprobs", 1, 2, 1])(r, 3.0),
                         "meta_info.output_top_logprobs[1][2][1]", "expected a token id .*float"),
    "topk_missing": (lambda r: _set([MI, "output_top_logprobs"])(r, KeyError),
                     "meta_info.output_top_logprobs", "missing"),
    "routes_wrong_size": (lambda r: _routes_with(r, rows_delta=-1), "meta_info.routed_experts",
                          "not 11 rows"),
    "routes_bad_expert": (lambda r: _routes_with(r, bad_id=E), "meta_info.routed_experts",
                          f"row 6 \\(input position 6\\), layer 2 names expert {E}, outside \\[0, {E}\\)"),
    "routes_missing": (lambda r: _set([MI, "routed_experts"])(r, KeyError), "meta_info.routed_experts",
                       "--enable-return-routed-experts"),
    "unknown_finish_reason": (lambda r: _set([MI, "finish_reason"])(r, {"type": "eos"}),
                              "meta_info.finish_reason", "'eos'"),
    "no_meta_info": (lambda r: _set([MI])(r, KeyError), "meta_info", "missing"),
}
PROMPT = [5, 6, 7, 8, 9]  # P = 5, T = 7 below: 11 route rows


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_response_names_the_field(name):
    mutate, field, detail = MALFORMED[name]
    resp, _ = sglang_response(PROMPT, 7)
    mutate(resp)
    with pytest.raises(MalformedResponse, match=detail) as e:
        build(resp, PROMPT)
    assert e.value.field == field


def test_version_number():
    assert [version_number(v) for v in ("0", "7", "123", str(2 ** 31 - 1))] == [0, 7, 123, 2 ** 31 - 1]
    # Not a trainer step: a fresh server, evaluate.py's version, non-canonical or out-of-range text.
    for v in ("default", "eval", "", "07", "+7", "-1", " 7", "7.0", "٣", str(2 ** 31), 7, None):
        assert version_number(v) == UNKNOWN_VERSION == -1, v


def test_versions_from_weight_version_spans():
    """A response generated across two weight loads: each token gets its span's version; a
    fresh server's "default" is unknown (−1); without spans the one weight_version holds."""
    resp, _ = sglang_response(PROMPT, 7, spans=[("default", 0, 2), ("4", 2, 3), ("5", 3, 7)])
    rec = build(resp, PROMPT)
    assert rec.versions.tolist() == [-1, -1, 4, 5, 5, 5, 5] and rec.versions.dtype == torch.int32
    assert rec.weight_version == "5" and rec.oldest_version == -1
    resp, _ = sglang_response(PROMPT, 7, spans=[("4", 0, 6), ("5", 6, 7)])
    assert build(resp, PROMPT).oldest_version == 4
    for version, expect in (("3", 3), ("default", -1)):
        resp, _ = sglang_response(PROMPT, 7, spans=None)
        resp["meta_info"]["weight_version"] = version
        rec = build(resp, PROMPT)
        assert rec.versions.tolist() == [expect] * 7 and rec.weight_version == version
    # The loss mask picks the tokens oldest_version reads (an episode's environment rows are −1).
    rec.versions = torch.tensor([2, 3, -1, -1, 3, 4, 4], dtype=torch.int32)
    rec.loss_mask = torch.tensor([1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)
    assert rec.oldest_version == 2


def _sglang_weight_versions():
    """The installed SGLang's utils/weight_versions.py (the scheduler's span computation and the
    tokenizer's meta_info writer), run from its source: importing `sglang` needs the CPU server
    patches (triton, torchvision ops); this module needs only msgspec, and its one sglang import
    (a pydantic schema hook) is not used here."""
    import importlib.util
    import sys
    import types
    from pathlib import Path

    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    path = Path(spec.origin).parent / "srt" / "utils" / "weight_versions.py"
    src = path.read_text().replace("from sglang.srt.utils.msgspec_utils import msgspec_struct_pydantic_core_schema",
                                   "msgspec_struct_pydantic_core_schema = None")
    mod = types.ModuleType("_sglang_weight_versions")
    sys.modules[mod.__name__] = mod  # dataclasses looks its module up
    exec(compile(src, str(path), "exec"), mod.__dict__)
    return mod


def test_versions_match_sglangs_own_spans():
    """Spans made by SGLang's own code from weight-version events (a load after n output tokens
    records (old version, n)); the record's versions are the reference per-token list."""
    wv = _sglang_weight_versions()
    Ev = wv.WeightVersionEvent
    cases = [  # (events, version at finish, T, expected versions)
        ([Ev("default", 2), Ev("4", 3)], "5", 7, [-1, -1, 4, 5, 5, 5, 5]),
        ([Ev("3", 3)], "4", 3, [3, 3, 3]),  # loaded after the last token: no token of "4"
        ([Ev("3", 3), Ev("4", 3)], "5", 6, [3, 3, 3, 5, 5, 5]),  # two loads between two tokens
        (wv.truncate_weight_version_events([Ev("3", 5), Ev("4", 6)], 4), "5", 6, [3] * 4 + [5] * 2),
        ([], "9", 7, [9] * 7),
    ]
    for events, current, T, expect in cases:
        meta = {}
        wv.add_weight_versions_to_meta_info(meta, wv.compute_weight_version_spans(events, current, T), T)
        resp, _ = sglang_response(PROMPT, T, spans=None)
        resp["meta_info"].update(orjson.loads(orjson.dumps(meta)))
        rec = build(resp, PROMPT)
        assert rec.versions.tolist() == expect and rec.weight_version == meta["weight_version"], (events, meta)
    # A request aborted in the waiting queue: no token, one empty span.
    meta = {}
    wv.add_weight_versions_to_meta_info(meta, wv.compute_weight_version_spans([], "4", 0), 0)
    assert token_versions(meta, 0).tolist() == []


BAD_SPANS = {
    # name: (spans as SGLang's JSON, field named, detail pattern); T = 7
    "not_a_list": ({"version": "1", "start": 0, "end": 7}, "meta_info.weight_versions", "non-empty list"),
    "empty": ([], "meta_info.weight_versions", "non-empty list"),
    "span_not_object": ([["1", 0, 7]], "meta_info.weight_versions[0]", "expected {version, start, end}"),
    "version_not_string": ([{"version": 1, "start": 0, "end": 7}], "meta_info.weight_versions[0].version",
                           "expected a version string, got int"),
    "start_missing": ([{"version": "1", "end": 7}], "meta_info.weight_versions[0].start", "token index"),
    "end_is_float": ([{"version": "1", "start": 0, "end": 7.0}], "meta_info.weight_versions[0].end",
                     "token index, got float"),
    "gap": ([{"version": "1", "start": 0, "end": 3}, {"version": "2", "start": 4, "end": 7}],
            "meta_info.weight_versions[1].start", "is 4, expected 3"),
    "not_from_zero": ([{"version": "1", "start": 1, "end": 7}], "meta_info.weight_versions[0].start",
                      "is 1, expected 0"),
    "empty_span": ([{"version": "1", "start": 0, "end": 0}, {"version": "2", "start": 0, "end": 7}],
                   "meta_info.weight_versions[0].end", "is 0: a span ends after its start"),
    "beyond_output": ([{"version": "1", "start": 0, "end": 8}], "meta_info.weight_versions[0].end",
                      "at most at the 7 output tokens"),
    "short": ([{"version": "1", "start": 0, "end": 5}], "meta_info.weight_versions",
              r"cover output tokens \[0, 5\), not all 7"),
    "newest_differs": ([{"version": "2", "start": 0, "end": 7}], "meta_info.weight_version",
                       "'7' differs from the last span's version '2'"),
}


@pytest.mark.parametrize("name", list(BAD_SPANS))
def test_malformed_weight_version_spans(name):
    spans, field, detail = BAD_SPANS[name]
    resp, _ = sglang_response(PROMPT, 7)
    resp["meta_info"]["weight_versions"] = spans  # weight_version stays "7"
    with pytest.raises(MalformedResponse, match=detail) as e:
        build(resp, PROMPT)
    assert e.value.field == field


def test_record_checks_versions():
    resp, _ = sglang_response(PROMPT, 7)
    rec = build(resp, PROMPT)
    kw = {f: getattr(rec, f) for f in ("prompt_index", "sample_index", "prompt_ids", "response_ids", "rollout_logp",
                                       "topk_ids", "topk_logp", "routes", "finish_reason", "weight_version",
                                       "temperature")}
    with pytest.raises(ValueError, match=r"versions must be \[T=7\] int32, got \(7,\) torch.int64"):
        RolloutRecord(**kw, versions=torch.zeros(7, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"versions must be \[T=7\] int32, got \(6,\)"):
        RolloutRecord(**kw, versions=torch.zeros(6, dtype=torch.int32))
    with pytest.raises(ValueError, match="versions holds -2"):
        RolloutRecord(**kw, versions=torch.full((7,), -2, dtype=torch.int32))
    assert RolloutRecord(**kw).oldest_version is None


# --- the client, against a local app serving SGLang-shaped bodies -----------------------------
class FakeSGLang:
    """/generate answers an SGLang-shaped body for the request's prompt; `mutate[(i, j)]` edits
    the answer to sample (i, j) (read from the rid the client sends), `hold[(i, j)]` is awaited
    first. Counts requests and the most requests in flight at once."""

    def __init__(self, mutate=None, hold=None, delay=0.0, body=None, script=None, capacity=None, hung=False):
        self.mutate, self.hold, self.delay, self.body = mutate or {}, hold or {}, delay, body
        # capacity: requests decoded at once (the rest queue inside the server, as in SGLang's
        # waiting queue); hung: accepts requests and never answers them, nor /v1/loads.
        self.capacity = None if capacity is None else asyncio.Semaphore(capacity)
        self.hung, self.load_probes = hung, 0
        self._unhang = asyncio.Event()  # set on exit: the server's handlers end (its cleanup waits for them)
        # script[(i, j)]: the answers to that sample's successive requests, each (T, finish,
        # weight version, last token or None[, mutation of the answer]); then the default
        # (7 tokens, "length", "7").
        self.script = {k: list(v) for k, v in (script or {}).items()}
        self.requests: list[str] = []
        self.payloads: dict[str, dict] = {}  # rid: the request
        self.refs: dict[str, dict] = {}  # rid: the reference arrays of the answer
        self.inflight = self.max_inflight = 0
        self.version = "7"  # the weights it holds: default answers and /get_model_info

    async def generate(self, request):
        from aiohttp import web

        req = await request.json()
        _, i, j, _ = req["rid"].rsplit("-", 3)
        key = (int(i), int(j))
        self.requests.append(req["rid"])
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self.hung:
                await self._unhang.wait()
            if key in self.hold:
                await self.hold[key]()
            if self.capacity is not None:
                async with self.capacity:
                    await asyncio.sleep(self.delay)
            else:
                await asyncio.sleep(self.delay)
        finally:
            self.inflight -= 1
        if self.body is not None:
            return web.Response(body=self.body, content_type="application/json")
        self.payloads[req["rid"]] = req
        T, finish, version, last, *edit = self.script[key].pop(0) if self.script.get(key) else (7, "length", self.version, None)
        if T == 0:  # aborted while queued (tokenizer_manager._handle_abort_req): no token, no route
            meta = {"id": req["rid"], "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                    "weight_version": version, "prompt_tokens": len(req["input_ids"]), "completion_tokens": 0,
                    "output_token_logprobs": [], "output_top_logprobs": [],
                    "weight_versions": [{"version": version, "start": 0, "end": 0}]}
            return web.Response(body=orjson.dumps({"text": "", "output_ids": [], "meta_info": meta}),
                                content_type="application/json")
        resp, ref = sglang_response(req["input_ids"], T, seed=(hash(key) + 7 * len(req["input_ids"])) % 1000,
                                    top_k=req.get("top_logprobs_num", K), finish=finish,
                                    spans=[(version, 0, None)])
        if last is not None:  # the last token is `last` (an EOS / stop id)
            resp["output_ids"][-1] = resp["meta_info"]["output_token_logprobs"][-1][1] = last
            ref["out_ids"][-1] = last
        self.refs[req["rid"]] = ref
        for f in edit:
            f(resp)
        if key in self.mutate:
            self.mutate[key](resp)
        return web.Response(body=orjson.dumps(resp), content_type="application/json")

    async def abort_request(self, request):  # and /health
        from aiohttp import web

        return web.json_response({})

    async def model_info(self, request):
        from aiohttp import web

        return web.json_response({"weight_version": self.version})

    async def loads(self, request):  # the scheduler's answer (SGLang's /v1/loads)
        from aiohttp import web

        self.load_probes += 1
        if self.hung:
            await self._unhang.wait()
        return web.json_response({"loads": [{"dp_rank": 0, "num_running_reqs": self.inflight}]})

    async def __aenter__(self):
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_get("/health", self.abort_request)  # a timed-out server is probed
        app.router.add_get("/v1/loads", self.loads)  # the stall watchdog's probe
        app.router.add_get("/get_model_info", self.model_info)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self._unhang.set()
        await self.runner.cleanup()


PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16]]


def _run(server: FakeSGLang, n=2, client_kw=None, sampling=None, **gen_kw):
    async def go():
        async with server:
            async with RolloutClient([server.url], moe_topk=KR, num_experts=E, backoff_initial=0.05,
                                     **(client_kw or {})) as client:
                out = await client.generate(PROMPTS, sampling or SamplingParams(max_new_tokens=7), n=n,
                                            top_k_logprobs=K, return_routed_experts=True, **gen_kw)
                return out, client
    return asyncio.run(go())


@pytest.mark.parametrize("name", ["missing_output_ids", "logp_id_is_string", "topk_row_too_short",
                                  "routes_wrong_size", "routes_bad_expert", "unknown_finish_reason"])
def test_client_names_request_and_field_and_does_not_retry(name):
    mutate, field, detail = MALFORMED[name]
    server = FakeSGLang(mutate={(1, 0): mutate})
    with pytest.raises(RolloutError) as e:
        _run(server)
    msg = str(e.value)
    (rid,) = [r for r in server.requests if r.rsplit("-", 3)[1:3] == ["1", "0"]]  # sent once
    assert rid.endswith("-1-0-a0")
    assert f"sample (prompt 1, sample 0): request {rid} to {server.url}/generate" in msg, msg
    assert f": {field}: " in msg and isinstance(e.value.__cause__, MalformedResponse), msg
    assert e.value.__cause__.field == field


def test_client_invalid_json_body_names_request():
    server = FakeSGLang(body=b'{"text": "x", "output_ids": [1, 2')
    with pytest.raises(RolloutError, match=r"sample \(prompt \d, sample \d\): request \w+-\d-\d-a0 to "
                       r"http://127.0.0.1:\d+/generate got a malformed .*\(body\): .*invalid JSON"):
        _run(server)


def test_on_record_is_called_once_per_sample_as_each_finishes():
    """Sample (0, 0) is held on the server until on_record has seen every other sample: a client
    that delivered records only at the end would never release it (the test would time out)."""
    seen: list = []
    release = asyncio.Event()
    n = 3

    def on_record(rec):
        seen.append((rec.prompt_index, rec.sample_index, rec))
        if len(seen) == len(PROMPTS) * n - 1:
            release.set()

    async def hold():
        await asyncio.wait_for(release.wait(), 10)

    out, _ = _run(FakeSGLang(hold={(0, 0): hold}), n=n, on_record=on_record)
    assert [k[:2] for k in seen[-1:]] == [(0, 0)]  # the held one came last
    assert sorted(k[:2] for k in seen) == [(i, j) for i in range(len(PROMPTS)) for j in range(n)]
    assert [id(r) for *_, r in sorted(seen, key=lambda s: s[:2])] == [id(r) for row in out for r in row]

    def boom(rec):
        raise RuntimeError("reward scorer failed")

    with pytest.raises(RuntimeError, match="reward scorer failed"):
        _run(FakeSGLang(), on_record=boom)


def test_inflight_cap_per_server():
    server = FakeSGLang(delay=0.5)
    _run(server, n=4, client_kw=dict(max_inflight_per_server=3))
    assert server.max_inflight == 3 and len(server.requests) == 8
    server = FakeSGLang(delay=0.5)
    _run(server, n=4)  # default 64: all 8 at once
    assert server.max_inflight == 8
    with pytest.raises(ValueError, match="max_inflight_per_server"):
        RolloutClient(["http://x"], max_inflight_per_server=0)


def test_inflight_cap_holds_across_concurrent_calls():
    """Seeded sampling and episodes make one generate call per prompt / turn, all at once."""
    server = FakeSGLang(delay=0.5)

    async def go():
        async with server:
            async with RolloutClient([server.url], max_inflight_per_server=3) as client:
                await asyncio.gather(*(client.generate([p], SamplingParams(max_new_tokens=7), n=2)
                                       for p in PROMPTS))

    asyncio.run(go())
    assert server.max_inflight == 3 and len(server.requests) == 2 * len(PROMPTS)


def test_request_timeout_derived_from_max_new_tokens(monkeypatch):
    cfg = RolloutConfig()
    assert cfg.request_timeout is None and cfg.max_inflight_per_server == 0
    assert request_timeout_s(RolloutConfig(max_new_tokens=16384)) == 300 + 16384 / 8 == 2348
    assert request_timeout_s(RolloutConfig(max_new_tokens=16384, request_timeout=90.0)) == 90.0
    # The client derives each call's timeout the same way: with a 0.4 s base, max_new_tokens=7
    # allows 0.4 + 7/8 ≈ 1.3 s; the first attempt of (0, 1) takes 2 s, so it is retried.
    monkeypatch.setattr(client_mod, "TIMEOUT_BASE_S", 0.4)
    calls = []

    async def slow_once():
        calls.append(1)
        if len(calls) == 1:
            await asyncio.sleep(2)

    out, client = _run(FakeSGLang(hold={(0, 1): slow_once}), client_kw=dict(stall_timeout=None))
    assert len(calls) == 2 and [e.reason for e in client.retry_events] == ["no answer within 1s"]
    assert out[0][1].sample_index == 1


@pytest.mark.slow
def test_producer_returns_large_transient_buffers_to_the_system():
    """After glibc's first large free, parsed bodies would stay resident (its dynamic mmap
    threshold); `return_large_frees` (called by every producer) hands them back."""
    import subprocess
    import sys

    script = r'''
import sys
from megatron_rl.rollout.memory import return_large_frees
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
if sys.argv[1] == "fixed":
    assert return_large_frees()
junk = bytearray(20 << 20); del junk
base = rss()
for i in range(20):
    buf = bytearray(8 << 20); buf[::4096] = b"x" * len(buf[::4096]); del buf
    small = [bytes(100) for _ in range(1000)]
print((rss() - base) >> 20)
'''
    kept = {mode: int(subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True,
                                     check=True).stdout) for mode in ("dynamic", "fixed")}
    assert kept["dynamic"] >= 8 and kept["fixed"] < 4, kept


EOS, STOP = 2, 999  # the model's EOS; an extra stop id of the call
CONTINUE = dict(continue_aborted=True, eos_token_ids=[EOS])


def test_aborted_sample_continues_as_prompt_plus_its_tokens():
    """Sample (1, 0) is aborted three times (a pause around each of two weight pushes, once while
    queued): the client re-sends prompt + the tokens so far with the remaining budget and the same
    seed, and merges the segments into one record whose every row comes from its segment."""
    script = {(1, 0): [(3, "abort", "4", None), (0, "abort", "4", None), (2, "abort", "5", None),
                       (2, "length", "5", None)]}
    server = FakeSGLang(script=script)
    seen = []
    out, client = _run(server, client_kw=CONTINUE, sampling=SamplingParams(max_new_tokens=7, seed=11),
                       on_record=lambda r: seen.append((r.prompt_index, r.sample_index)))
    rids = [r for r in server.requests if r.rsplit("-", 3)[1:3] == ["1", "0"]]
    assert [r.rsplit("-", 1)[1] for r in rids] == ["a0", "s1a0", "s1a1", "s2a0"]  # the empty abort: a retry
    sent = [server.payloads[r] for r in rids]
    prompt = PROMPTS[1]
    seg_ids = [server.refs[r]["out_ids"].tolist() for r in (rids[0], rids[2], rids[3])]
    assert [p["input_ids"] for p in sent] == [prompt, prompt + seg_ids[0], prompt + seg_ids[0],
                                              prompt + seg_ids[0] + seg_ids[1]]
    assert [p["sampling_params"]["max_new_tokens"] for p in sent] == [7, 4, 4, 2]
    assert {p["sampling_params"]["sampling_seed"] for p in sent} == {11 + 1 * 2 + 0}
    rec = out[1][0]
    refs = [server.refs[r] for r in (rids[0], rids[2], rids[3])]
    assert rec.response_ids.tolist() == sum(seg_ids, [])
    assert np.array_equal(rec.rollout_logp.numpy(), np.concatenate([r["logp"] for r in refs]))
    assert rec.versions.tolist() == [4, 4, 4, 5, 5, 5, 5] and rec.oldest_version == 4
    assert (rec.finish_reason, rec.weight_version, rec.loss_mask) == ("length", "4,5", None)
    assert [s.num_response_tokens for s in rec.segments] == [3, 2, 2]
    # Routes: every row of the first version-5 segment (its request held P+3 tokens, it sampled
    # 2), then the last segment's rows after it; the version-4 segment's routes are not kept.
    P, cut = len(prompt), len(prompt) + 3 + 2 - 1
    assert np.array_equal(rec.routes.numpy(), np.concatenate([refs[1]["routes"], refs[2]["routes"][cut:]]))
    assert rec.routes.shape[0] == P + 7 - 1
    # Delivered once, with the others; those were not continued.
    assert sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r.segments is None and r.finish_reason == "length" for row in out for r in row if r is not rec)
    assert [e.reason for e in client.retry_events] == ["aborted by the server ({'type': 'abort', "
                                                       "'message': 'Abort in waiting queue'})"]


def test_aborted_segment_ending_on_eos_stop_id_or_budget_is_finished():
    """SGLang takes an abort before its stop checks: a segment that ended on EOS or a stop id is
    "stop", one that used the whole budget "length"; none is sent again."""
    script = {(0, 0): [(3, "abort", "7", EOS)], (0, 1): [(7, "abort", "7", None)],
              (1, 1): [(2, "abort", "7", STOP)]}
    server = FakeSGLang(script=script)
    out, _ = _run(server, client_kw=CONTINUE, sampling=SamplingParams(max_new_tokens=7, stop_token_ids=[STOP]))
    assert len(server.requests) == 4
    assert [[r.finish_reason for r in row] for row in out] == [["stop", "length"], ["length", "stop"]]
    assert out[0][0].response_ids.tolist()[-1] == EOS and out[0][0].num_response_tokens == 3
    assert out[0][0].segments is None  # one segment: the record as parsed


def test_aborted_segment_without_routes_is_sent_again():
    """An abort answered by the tokenizer for a request queued after a retraction holds tokens
    but no routes: that segment is re-sent from the tokens before it, not continued or parsed."""
    drop_routes = _set([MI, "routed_experts"])
    script = {(0, 0): [(2, "abort", "4", None), (3, "abort", "4", None, lambda r: drop_routes(r, KeyError)),
                       (5, "length", "5", None)]}
    server = FakeSGLang(script=script)
    out, client = _run(server, client_kw=CONTINUE)
    rids = [r for r in server.requests if r.rsplit("-", 3)[1:3] == ["0", "0"]]
    assert [r.rsplit("-", 1)[1] for r in rids] == ["a0", "s1a0", "s1a1"]
    first = server.refs[rids[0]]["out_ids"].tolist()
    assert server.payloads[rids[2]]["input_ids"] == PROMPTS[0] + first
    assert server.payloads[rids[2]]["sampling_params"]["max_new_tokens"] == 5
    rec = out[0][0]
    assert rec.response_ids.tolist() == first + server.refs[rids[2]]["out_ids"].tolist()
    assert rec.versions.tolist() == [4, 4, 5, 5, 5, 5, 5] and len(client.retry_events) == 1


def test_without_continue_an_aborted_sample_restarts():
    script = {(0, 1): [(3, "abort", "7", None)]}
    server = FakeSGLang(script=script)
    out, client = _run(server)
    rids = [r for r in server.requests if r.rsplit("-", 3)[1:3] == ["0", "1"]]
    assert [r.rsplit("-", 1)[1] for r in rids] == ["a0", "a1"]
    assert server.payloads[rids[1]]["input_ids"] == PROMPTS[0]
    assert server.payloads[rids[1]]["sampling_params"]["max_new_tokens"] == 7
    assert out[0][1].response_ids.tolist() == server.refs[rids[1]]["out_ids"].tolist()
    assert out[0][1].num_response_tokens == 7 and len(client.retry_events) == 1
    with pytest.raises(ValueError, match="continue_aborted needs eos_token_ids"):
        RolloutClient(["http://x"], continue_aborted=True)


def test_requests_past_every_slot_spread_over_the_servers():
    """4 servers x 2 slots, 40 samples: the 32 that find no free slot wait at the server with the
    fewest requests assigned (waiting or in flight), not all at the first URL."""
    servers = [FakeSGLang(delay=0.2) for _ in range(4)]

    async def go():
        async with servers[0], servers[1], servers[2], servers[3]:
            async with RolloutClient([s.url for s in servers], max_inflight_per_server=2,
                                     backoff_initial=0.05) as client:
                start = time.monotonic()
                out = await client.generate(PROMPTS, SamplingParams(max_new_tokens=7), n=20)
                return out, time.monotonic() - start, client

    out, wall, client = asyncio.run(go())
    assert sum(len(row) for row in out) == 40
    assert [len(s.requests) for s in servers] == [10, 10, 10, 10]  # was 34/2/2/2
    assert all(s.max_inflight == 2 for s in servers)
    assert client.budget.loads([s.url for s in servers]) == [0, 0, 0, 0]  # every slot given back
    print(f"40 samples over 4 servers x 2 slots at 0.2 s each: {wall:.2f} s (ideal 1.0 s)")


def _timed(servers, n, **client_kw):
    async def go():
        async with contextlib.AsyncExitStack() as stack:
            for srv in servers:
                await stack.enter_async_context(srv)
            async with RolloutClient([srv.url for srv in servers], backoff_initial=0.05, **client_kw) as client:
                start = time.monotonic()
                out = await client.generate(PROMPTS[:1], SamplingParams(max_new_tokens=7), n=n)
                return out, time.monotonic() - start, client
    return asyncio.run(go())


def test_a_request_queued_on_a_busy_server_is_not_timed_out():
    """A server decoding one request at a time, 0.2 s each, 6 samples: the last waits 1.0 s in its
    queue. A total timeout of 0.6 s counts that wait: requests are aborted and retried, the healthy
    server is marked down, and the call fails (2 attempts here). The stall watchdog (probing every
    0.1 s) sees the server answer and leaves them alone: each sample sent once, nothing marked down."""
    with pytest.raises(RolloutError, match="failed 2 times.*no answer within 1s"):
        _timed([FakeSGLang(delay=0.2, capacity=1)], 6, stall_timeout=None, request_timeout=0.6, max_attempts=2)
    server = FakeSGLang(delay=0.2, capacity=1)
    out, wall, client = _timed([server], 6, stall_timeout=0.4)
    assert [r.sample_index for r in out[0]] == list(range(6))
    assert len(server.requests) == 6 and not client.retry_events and not client._down
    assert server.load_probes >= 8  # watched throughout (every 0.1 s), and it answered
    assert 1.1 < wall < 3, wall


def test_a_hung_server_is_found_by_its_silence_and_its_requests_finish_elsewhere():
    """Server 0 accepts requests and never answers, nor its load probe; server 1 is healthy. With
    no total timeout, the watchdog gives up on server 0 after stall_timeout of silence: its requests
    are retried on server 1, each sample is delivered once, server 0 is marked down."""
    hung, healthy = FakeSGLang(hung=True), FakeSGLang(delay=0.05)
    out, wall, client = _timed([hung, healthy], 6, stall_timeout=1.0)
    assert [r.sample_index for r in out[0]] == list(range(6))
    assert len(hung.requests) == 3 and len(healthy.requests) == 6  # 3 first tries there, 3 retries + 3
    assert sorted(rid.rsplit("-", 1)[1] for rid in healthy.requests) == ["a0"] * 3 + ["a1"] * 3
    assert {e.url for e in client.retry_events} == {hung.url} and len(client.retry_events) == 3
    assert all("no sign of life for 1s (stall_timeout)" in e.reason for e in client.retry_events)
    assert hung.url in client._down
    assert 1.0 < wall < 4, wall
    with pytest.raises(ValueError, match="stall_timeout"):
        RolloutClient(["http://x"], stall_timeout=0)


def test_a_restarted_server_serves_again_only_with_the_pushed_weights():
    """Server 1 was restarted (the launcher's supervisor) after the trainer's push of version "7"
    and before the client saw it go: it holds its initial checkpoint ("default"). Its answers are
    retried on server 0 and it is marked down; while it still holds "default" the probe keeps it
    out; once it holds "7" (the trainer's next push) it serves again."""
    fresh, restarted = FakeSGLang(delay=0.05), FakeSGLang(delay=0.05)
    restarted.version = "default"

    async def go():
        async with fresh, restarted:
            async with RolloutClient([fresh.url, restarted.url], backoff_initial=0.05) as client:
                client.expected_version = "7"
                first = await client.generate(PROMPTS[:1], SamplingParams(max_new_tokens=7), n=6)
                down_after_first = restarted.url in client._down
                await asyncio.sleep(client_mod.DOWN_PROBE_S)
                second = await client.generate(PROMPTS[:1], SamplingParams(max_new_tokens=7), n=4)
                n_restarted = len(restarted.requests)
                restarted.version = "7"  # the push reached it
                await asyncio.sleep(client_mod.DOWN_PROBE_S)
                third = await client.generate(PROMPTS[:1], SamplingParams(max_new_tokens=7), n=4)
                return first, second, third, down_after_first, n_restarted, client

    first, second, third, down_after_first, n_restarted, client = asyncio.run(go())
    for out, n in ((first, 6), (second, 4), (third, 4)):
        assert [r.sample_index for r in out[0]] == list(range(n))  # each sample once
        assert {str(r.weight_version) for r in out[0]} == {"7"}
    assert down_after_first and n_restarted == 3  # 3 first tries there, none while it held "default"
    assert all("weight version 'default', which no push gave it" in e.reason for e in client.retry_events)
    assert len(restarted.requests) > 3 and restarted.url not in client._down  # back in rotation


def test_with_no_other_server_up_a_restarted_one_serves_with_its_version_recorded():
    """The only server holds its initial checkpoint: waiting for a push would wait for this very
    generation, so it serves, and its records say the weights were not the pushed ones (the
    trainer pushes and generates the step again)."""
    only = FakeSGLang(delay=0.01)
    only.version = "default"

    async def go():
        async with only:
            async with RolloutClient([only.url], backoff_initial=0.05) as client:
                client.expected_version = "7"
                return await client.generate(PROMPTS[:1], SamplingParams(max_new_tokens=7), n=3), client

    out, client = asyncio.run(go())
    assert [r.sample_index for r in out[0]] == [0, 1, 2] and not client.retry_events
    assert all(str(r.weight_version) == "default" for r in out[0])


def test_generate_until_a_deadline_returns_what_finished_and_aborts_the_rest():
    """eval.timeout's generation (Fleet.evaluate): sample (0, 1) is still decoding at the 0.5 s
    deadline: the other samples come back by prompt and sample index, that one is counted missing,
    its request is aborted on the server, and the call returns at the deadline, not after it."""
    aborted = asyncio.Event()

    async def slow():  # answers only once aborted (as SGLang answers an aborted request), or after 10 s
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(aborted.wait(), 10)

    server = FakeSGLang(hold={(0, 1): slow})
    abort_request = server.abort_request

    async def note_abort(request):
        if request.path == "/abort_request":
            aborted.set()
        return await abort_request(request)

    server.abort_request = note_abort

    async def go():
        async with server:
            async with RolloutClient([server.url], backoff_initial=0.05, stall_timeout=None) as client:
                start = time.monotonic()
                out = await client.generate_until(0.5, PROMPTS, SamplingParams(max_new_tokens=7), n=2)
                return out, time.monotonic() - start

    (groups, missing), wall = asyncio.run(go())
    assert missing == 1 and aborted.is_set()
    assert [[r.sample_index for r in g] for g in groups] == [[0], [0, 1]]
    assert [r.prompt_index for r in groups[1]] == [1, 1]
    assert 0.5 <= wall < 3, wall

    async def all_in_time():
        async with FakeSGLang() as srv:
            async with RolloutClient([srv.url], stall_timeout=None) as client:
                return await client.generate_until(30, PROMPTS, SamplingParams(max_new_tokens=7), n=2)

    groups, missing = asyncio.run(all_in_time())
    assert missing == 0 and [[r.sample_index for r in g] for g in groups] == [[0, 1], [0, 1]]
