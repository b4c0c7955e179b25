"""Compact rollout records on the wire: SGLang's flat base64 top-K log-probs (rollout/wire.py reads
them, client.py asks for them) and routed experts narrowed to uint8 / int16 behind a width
prefix (patches/sglang_fixes.py writes them, wire.py `decode_routed_experts` reads them).

The flat fields are built here the way SGLang 0.5.23 builds them (tokenizer_manager.py
`_build_flat_top_logprobs_fields` with `return_b64`: float32 / int32 arrays of the same rows it
would send nested); INSTALLED_SGLANG_CHECK at the end builds them with SGLang's own functions and
runs the patched `DetokenizerManager.handle_batch_token_id_out` on a real `BatchTokenIDOutput`, in
the fresh interpreter of tests/unit/test_sglang_patches.py `test_applies_to_installed_sglang`.
"""

from __future__ import annotations

import base64
import textwrap

import numpy as np
import orjson
import pytest
import torch

from megatron_rl.rollout.http import _loads
from megatron_rl.rollout.wire import MalformedResponse, decode_routed_experts
from patches.sglang_fixes import _narrow_routes, encode_routes
from test_records import K, KR, L, build, sglang_response

FLAT = "output_top_logprobs_"
MI = "meta_info."


def flat_topk(resp: dict) -> dict:
    """The response as SGLang answers a request with return_flat_raw_output_top_logprobs and
    return_flat_raw_top_logprobs_b64: the same top-K rows, flat base64, no nested field."""
    out = orjson.loads(orjson.dumps(resp))
    meta = out["meta_info"]
    rows = meta.pop("output_top_logprobs")
    val = np.asarray([[e[0] for e in row] for row in rows], dtype=np.float32)
    idx = np.asarray([[e[1] for e in row] for row in rows], dtype=np.int32)
    meta.update({FLAT + "val_flat_b64": base64.b64encode(val.tobytes()).decode(),
                 FLAT + "idx_flat_b64": base64.b64encode(idx.tobytes()).decode(),
                 FLAT + "val_flat_b64_dtype": "float32", FLAT + "idx_flat_b64_dtype": "int32",
                 FLAT + "shape": [val.shape[0], val.shape[1]], FLAT + "null_prefix": 0})
    return out


def _same_record(a, b):
    for name in ("prompt_ids", "response_ids", "rollout_logp", "topk_ids", "topk_logp", "routes", "versions"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert (a.finish_reason, a.weight_version) == (b.finish_reason, b.weight_version)


def test_flat_topk_equals_the_nested_path():
    prompt = [5, 6, 7, 8, 9]
    nested, ref = sglang_response(prompt, 9)
    flat = flat_topk(nested)
    assert "output_top_logprobs" not in flat["meta_info"]
    a, b = build(nested, prompt), build(flat, prompt)
    _same_record(a, b)
    # the sampled token forced in where SGLang's top-K misses it (odd rows), as on the nested path
    missing = [t for t in range(9) if ref["out_ids"][t] not in ref["top_ids"][t]]
    assert missing and all(int(b.topk_ids[t, -1]) == ref["out_ids"][t] for t in missing)
    assert all(float(b.topk_logp[t, -1]) == float(ref["logp"][t]) for t in missing)
    # through the client's body parse too (split_bulk_fields leaves the flat strings to orjson)
    body = orjson.dumps(flat)
    _same_record(build(_loads(body, "u", "/generate"), prompt), a)
    # an answer with both (never sent) reads the flat form, which the request asked for
    both = flat_topk(nested)
    both["meta_info"]["output_top_logprobs"] = [[[0.0, 1, None]] * K] * 9
    _same_record(build(both, prompt), a)


def _put(field, value):
    def edit(r):
        if value is KeyError:
            del r["meta_info"][field]
        else:
            r["meta_info"][field] = value(r["meta_info"][field]) if callable(value) else value
    return edit


def _b64_of(arr):
    return base64.b64encode(np.asarray(arr).tobytes()).decode()


T9 = 9
FLAT_FAULTS = {
    "val_dtype": (_put(FLAT + "val_flat_b64_dtype", "float16"), FLAT + "val_flat_b64_dtype", "'float16'.*'float32'"),
    "idx_dtype_missing": (_put(FLAT + "idx_flat_b64_dtype", KeyError), FLAT + "idx_flat_b64_dtype", "None.*'int32'"),
    "shape_rows": (_put(FLAT + "shape", [T9 - 1, K]), FLAT + "shape", rf"\[{T9 - 1}, {K}\], expected \[{T9}, {K}\]"),
    "shape_width": (_put(FLAT + "shape", [T9, K + 1]), FLAT + "shape", rf"expected \[{T9}, {K}\]"),
    "shape_bool": (_put(FLAT + "shape", [T9, True]), FLAT + "shape", "expected"),
    "shape_missing": (_put(FLAT + "shape", KeyError), FLAT + "shape", "NoneType"),
    "null_prefix": (_put(FLAT + "null_prefix", 2), FLAT + "null_prefix", "is int 2, expected 0"),
    "val_missing": (_put(FLAT + "val_flat_b64", KeyError), FLAT + "val_flat_b64", "missing"),
    "val_not_string": (_put(FLAT + "val_flat_b64", [1.0]), FLAT + "val_flat_b64", "expected a base64 string"),
    "val_not_base64": (_put(FLAT + "val_flat_b64", lambda s: "*" + s[1:]), FLAT + "val_flat_b64", "not valid base64"),
    "val_short": (_put(FLAT + "val_flat_b64", _b64_of(np.zeros((T9, K - 1), np.float32))), FLAT + "val_flat_b64",
                  rf"decodes to {T9 * (K - 1) * 4} bytes, not \[{T9}, {K}\] float32"),
    "val_nan": (_put(FLAT + "val_flat_b64", _b64_of(np.where(np.arange(T9 * K) == 2 * K + 1, np.nan, -1.0)
                                                    .astype(np.float32))),
                FLAT + "val_flat_b64", "row 2, column 1: log-prob nan is not finite"),
    "val_inf": (_put(FLAT + "val_flat_b64", _b64_of(np.full(T9 * K, -np.inf, np.float32))),
                FLAT + "val_flat_b64", "row 0, column 0: log-prob -inf"),
    "idx_negative": (_put(FLAT + "idx_flat_b64", _b64_of(np.where(np.arange(T9 * K) == 3 * K, -5, 1).astype(np.int32))),
                     FLAT + "idx_flat_b64", r"row 3, column 0: token id -5 is outside \[0, 2\^31\)"),
    "idx_wide": (_put(FLAT + "idx_flat_b64", _b64_of(np.ones(T9 * K, np.int64))), FLAT + "idx_flat_b64",
                 "decodes to .* bytes, not .* int32"),
}


@pytest.mark.parametrize("fault", list(FLAT_FAULTS))
def test_malformed_flat_topk_names_the_field(fault):
    edit, field, detail = FLAT_FAULTS[fault]
    prompt = [5, 6, 7]
    resp = flat_topk(sglang_response(prompt, T9)[0])
    edit(resp)
    with pytest.raises(MalformedResponse, match=detail) as err:
        build(resp, prompt)
    assert err.value.field == MI + field


def test_flat_topk_without_topk_asked_is_ignored_and_a_record_without_either_is_refused():
    prompt = [5, 6, 7]
    resp = flat_topk(sglang_response(prompt, 4)[0])
    assert build(resp, prompt, top_k=0).topk_ids is None
    for name in ("val_flat_b64", "idx_flat_b64", "val_flat_b64_dtype", "idx_flat_b64_dtype", "shape", "null_prefix"):
        del resp["meta_info"][FLAT + name]
    with pytest.raises(MalformedResponse, match="missing") as err:
        build(resp, prompt)
    assert err.value.field == "meta_info.output_top_logprobs"


# --- routes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("experts, prefix, wire", [(8, "uint8:", np.uint8), (256, "uint8:", np.uint8),
                                                   (300, "int16:", np.int16), (32767, "int16:", np.int16)])
def test_routes_narrowed_and_read_back(experts, prefix, wire):
    g = np.random.default_rng(experts)
    routes = torch.from_numpy(g.integers(0, experts, (7, L, KR)).astype(np.int32))
    routes[3, 1, 0] = experts - 1  # the largest id survives the narrowing
    text = encode_routes(routes)
    assert text.startswith(prefix)
    assert base64.b64decode(text[len(prefix):]) == routes.numpy().astype(wire).tobytes()
    out = decode_routed_experts(text, 7, KR, experts)
    assert out.dtype == (torch.uint8 if experts <= 255 else torch.int16)
    assert out.tolist() == routes.tolist()
    assert out.numpy().flags.writeable  # decoded into a fresh buffer, no read-only view


def test_routes_outside_the_narrow_widths_stay_sglangs_int32():
    for arr in (np.array([[[40000, 1]]], np.int32), np.array([[[-1, 3]]], np.int32), np.zeros((0, 2, 2), np.int32)):
        text = encode_routes(torch.from_numpy(arr))
        assert ":" not in text and text == base64.b64encode(arr.tobytes()).decode()  # SGLang's own form
    # and an unpatched server's int32 string is still read (legacy)
    arr = np.array([[[3, 1]], [[0, 7]]], np.int32)
    assert decode_routed_experts(base64.b64encode(arr.tobytes()).decode(), 2, 2, 8).tolist() == arr.tolist()


def test_prefixed_routes_through_the_body_parse_and_record():
    prompt = [5, 6, 7, 8]
    resp, ref = sglang_response(prompt, 6)
    resp["meta_info"]["routed_experts"] = encode_routes(torch.from_numpy(ref["routes"].astype(np.int32)))
    assert resp["meta_info"]["routed_experts"].startswith("uint8:")
    parsed = _loads(orjson.dumps(resp), "u", "/generate")  # routed_experts cut out raw, prefix and all
    assert bytes(parsed["meta_info"]["routed_experts"]).startswith(b"uint8:")
    rec = build(parsed, prompt)
    assert rec.routes.dtype == torch.uint8 and np.array_equal(rec.routes.numpy(), ref["routes"])
    _same_record(rec, build(sglang_response(prompt, 6)[0], prompt))


ROUTE_FAULTS = {
    "unknown_prefix": ("int8:AAAA", r"width prefix 'int8:' is not one of \['uint8:', 'int16:'\]"),
    "empty_prefix": (":AAAA", "width prefix ':'"),
    "bad_base64": ("uint8:AA*A", "not valid base64"),
    "odd_int16": ("int16:" + _b64_of(np.zeros(3, np.uint8)), "decodes to 3 bytes, not a whole number of int16"),
    "wrong_size": ("uint8:" + _b64_of(np.zeros(5, np.uint8)), "holds 5 uint8 values, which is not 2 rows"),
    "id_too_big_u8": ("uint8:" + _b64_of(np.array([1, 2, 3, 8], np.uint8)),
                      r"row 1 \(input position 1\), layer 0 names expert 8, outside \[0, 8\)"),
    "negative_int16": ("int16:" + _b64_of(np.array([1, -2, 3, 4], np.int16)), "names expert -2, outside"),
}


@pytest.mark.parametrize("fault", list(ROUTE_FAULTS))
def test_malformed_prefixed_routes_name_the_field(fault):
    text, detail = ROUTE_FAULTS[fault]
    with pytest.raises(MalformedResponse, match=detail) as err:
        decode_routed_experts(text, 2, 2, 8)
    assert err.value.field == "meta_info.routed_experts"
    with pytest.raises(MalformedResponse) as err:  # and as bytes (the client's raw cut)
        decode_routed_experts(text.encode(), 2, 2, 8)
    assert err.value.field == "meta_info.routed_experts"


class _Batch:
    """The fields of a BatchTokenIDOutput the fix touches (the real one: the slow test below)."""

    def __init__(self, routed_experts, indexer_topk):
        self.routed_experts, self.indexer_topk = routed_experts, indexer_topk


class _Out:
    def __init__(self, routed_experts, indexer_topk):
        self.routed_experts, self.indexer_topk = routed_experts, indexer_topk


def _upstream(self, recv_obj):
    """SGLang's handler in miniature: int32 base64 of both per-request lists."""
    enc = (lambda xs: None if xs is None else
           [None if x is None else base64.b64encode(x.numpy().tobytes()).decode() for x in xs])
    return _Out(enc(recv_obj.routed_experts), enc(recv_obj.indexer_topk))


def test_detokenizer_fix_narrows_routes_only():
    handle = _narrow_routes(_upstream)
    assert handle._megatron_rl_fixed
    routes = [torch.tensor([[[1, 7]], [[0, 3]]], dtype=torch.int32), None,
              torch.tensor([[[300, 2]]], dtype=torch.int32)]
    topk = [torch.tensor([[1, 2, 300000]], dtype=torch.int32), None, None]
    batch = _Batch(routes, topk)
    out = handle(None, batch)
    assert out.routed_experts[0] == "uint8:" + _b64_of(np.array([1, 7, 0, 3], np.uint8))
    assert out.routed_experts[1] is None
    assert out.routed_experts[2] == "int16:" + _b64_of(np.array([300, 2], np.int16))
    assert out.indexer_topk[0] == _b64_of(topk[0].numpy()) and out.indexer_topk[1] is None  # int32 as SGLang
    assert batch.routed_experts is routes  # the input is left as it came
    # no routes in the batch: SGLang's handler alone
    assert handle(None, _Batch(None, None)).routed_experts is None


# The installed SGLang, in a fresh interpreter with the patches applied: the real DetokenizerManager
# handler on a real BatchTokenIDOutput narrows routes (and only routes), and SGLang's own flat top-K
# builder gives fields that record_from_sglang reads as the nested form. Importing SGLang takes
# ~30 s, so this runs as a part of the fresh interpreter that tests/unit/test_sglang_patches.py
# `test_applies_to_installed_sglang` starts anyway (its part "compact records"), not in one of its own.
INSTALLED_SGLANG_CHECK = textwrap.dedent("""
        import base64, sys, numpy as np, torch, orjson
        sys.path.insert(0, "tests/unit")
        from patches import sglang_cpu, sglang_fixes
        sglang_cpu.apply(); sglang_fixes.apply(); sglang_fixes.apply()
        from sglang.srt.managers.detokenizer_manager import DetokenizerManager
        from sglang.srt.managers.io_struct import BatchTokenIDOutput, BatchStrOutput
        from sglang.srt.managers.tokenizer_manager import _build_flat_top_logprobs_fields
        from megatron_rl.rollout.wire import decode_routed_experts
        from test_records import sglang_response, build, K
        from test_compact_records import _same_record
        h = DetokenizerManager.handle_batch_token_id_out
        assert h._megatron_rl_fixed and not hasattr(h.__closure__[0].cell_contents, "_megatron_rl_fixed")
        fields = {f: None for f in BatchTokenIDOutput.__struct_fields__}
        routes = torch.randint(0, 128, (33, 48, 8), dtype=torch.int32)
        topk = torch.randint(0, 2 ** 20, (33, 4), dtype=torch.int32)
        fields.update(rids=[], finished_reasons=[], routed_experts=[routes], indexer_topk=[topk])
        manager = object.__new__(DetokenizerManager)  # no zmq sockets: the handler needs none here
        out = manager.handle_batch_token_id_out(BatchTokenIDOutput(**fields))
        assert isinstance(out, BatchStrOutput) and out.routed_experts[0].startswith("uint8:")
        assert torch.equal(decode_routed_experts(out.routed_experts[0], 33, 8, 128).long(), routes.long())
        assert out.indexer_topk[0] == base64.b64encode(topk.numpy().tobytes()).decode()
        # SGLang's flat top-K fields of the same rows as a nested answer
        prompt = [5, 6, 7, 8]
        nested, _ = sglang_response(prompt, 11)
        rows = nested["meta_info"]["output_top_logprobs"]
        flat = orjson.loads(orjson.dumps(nested))
        del flat["meta_info"]["output_top_logprobs"]
        flat["meta_info"].update(_build_flat_top_logprobs_fields(
            "output", [[e[0] for e in r] for r in rows], [[e[1] for e in r] for r in rows], K, return_b64=True))
        _same_record(build(orjson.loads(orjson.dumps(flat)), prompt), build(nested, prompt))
    """)
