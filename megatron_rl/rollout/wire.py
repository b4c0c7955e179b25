"""SGLang's `/generate` answer on the wire, decoded into numpy arrays: the layouts SGLang sends,
checked field by field. records.py builds a `RolloutRecord` from these arrays (and says how they
align); http.py cuts the bulky values out of the body before it is parsed (`split_bulk_fields`).

Shapes: P prompt tokens, T response tokens, K top-K width (`top_logprobs_num`), L MoE layers,
k experts per token (the router's top-k), E experts per MoE layer.

SGLang's raw layouts:
- `output_ids`: [T] token ids (`output_ids`).
- `meta_info.output_token_logprobs`: [T] of [logp, token_id, text|null] — row t is
  `output_ids[t]`'s log-prob (`token_logprobs`; records.py checks the ids against `output_ids`).
- `meta_info.output_top_logprobs`: [T] lists of K [logp, token_id, text|null], most likely first;
  or, when the request set `return_flat_raw_output_top_logprobs` and `…_b64` (the client does),
  SGLang's flat form instead: `output_top_logprobs_val_flat_b64` (base64 of float32 [T, K]) and
  `output_top_logprobs_idx_flat_b64` (int32 [T, K]), their `…_dtype` markers, `…_shape` [T, K]
  and `…_null_prefix` 0 (213 B per token at K = 20 against ~660 of JSON). SGLang sends it only
  on the finished answer (an abort's included) and falls back to the nested form when it cannot
  build it, so both are read (`top_logprobs`).
- `meta_info.routed_experts`: base64 of int32 [P+T−1−start, L, k] — or of uint8 / int16 behind
  a `uint8:` / `int16:` prefix (patches/sglang_fixes.py narrows them); row j is the routing of the
  token at sequence position start+j (its input position). The last response token is never
  fed through the model, so it has no row. With start = 0 (what the client asks for) row j is
  input position j: rows [0, P−1) are the prompt positions 0..P−2 and rows [P−1, P−1+T)
  positions P−1..P+T−2, i.e. exactly the step that produced each response token. Prefix-cache
  hits do not change this: SGLang keeps routing beside the cached KV entries
  (`decode_routed_experts`, into `route_width(E)`).
- `meta_info.finish_reason`: {"type": "stop" | "length" | "abort", ...} (or the bare string).
- `meta_info.weight_versions` / `weight_version`: records.py (`token_versions`).
SGLang serializes with orjson, which writes NaN and ±inf as null; its log-probs are clamped to
finite values first, so a null (or any non-number) where a number belongs is a malformed response.

A malformed or missing field raises `MalformedResponse(field, detail)`, `field` being its path in
the response (e.g. `meta_info.output_token_logprobs[37][1]`); the client adds which request.
Parsing is vectorised: the nested lists orjson builds are read column-wise by C-level iteration
into `array.array` (which, unlike numpy, refuses a string where a number belongs); only when
that fails does a per-element walk run, to name the first bad element. Bulky values the client
left unparsed (`RawJSON`) are read straight into numpy; base64 is decoded by pybase64, imported
where it is used (train-only runs and the GPU suite's image need none).
"""

from __future__ import annotations

import math
from array import array
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np
import torch

FINISH_REASONS = ("stop", "length", "abort")


class MalformedResponse(ValueError):
    """A field of an SGLang response is missing or does not have the documented layout."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"{field}: {detail}")
        self.field, self.detail = field, detail


def describe(x: Any) -> str:
    """A value's type and (shortened) repr, for a MalformedResponse's detail."""
    s = repr(x)
    return f"{type(x).__name__} {s[:60] + '…' if len(s) > 60 else s}"


def finish_reason(response: Any) -> str:
    """The finish kind ("stop" | "length" | "abort") of an SGLang /generate response."""
    if not isinstance(response, dict):
        raise MalformedResponse("(response)", f"expected a JSON object, got {describe(response)}")
    meta = response.get("meta_info")
    if not isinstance(meta, dict):
        raise MalformedResponse("meta_info", "missing" if meta is None else
                                f"expected an object, got {describe(meta)}")
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind not in FINISH_REASONS:
        raise MalformedResponse("meta_info.finish_reason",
                                f"{fr!r} is not one of {FINISH_REASONS} (or {{'type': one of them}})")
    return kind


def output_ids(out_ids: Any) -> np.ndarray:
    """SGLang's `output_ids` → [T] int64."""
    try:
        if type(out_ids) is list:
            return np.frombuffer(array("q", out_ids), dtype=np.int64)
    except (TypeError, OverflowError):
        t = next((t for t, x in enumerate(out_ids) if isinstance(x, bool) or not isinstance(x, int)
                  or not -2 ** 63 <= x < 2 ** 63), None)
        raise MalformedResponse("output_ids" if t is None else f"output_ids[{t}]",
                                f"expected a token id, got {describe(out_ids[t or 0])}") from None
    if out_ids is None:
        raise MalformedResponse("output_ids", "missing (the token ids of the response)")
    raise MalformedResponse("output_ids", f"expected a list of token ids, got {describe(out_ids)}")


def token_logprobs(meta: dict[str, Any], T: int) -> tuple[np.ndarray, np.ndarray]:
    """`meta_info.output_token_logprobs` → ([T] logp float32, [T] ids int32)."""
    if "output_token_logprobs" not in meta:
        raise MalformedResponse("meta_info.output_token_logprobs", "missing (the request sets return_logprob)")
    return _logprob_columns(meta["output_token_logprobs"], "meta_info.output_token_logprobs", T, None)


def top_logprobs(meta: dict[str, Any], T: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """SGLang's top-K, flat base64 or nested (raw bytes or parsed) → ([T, K] logp float32, [T, K]
    ids int32), fresh and writable, columns in SGLang's order (most likely first)."""
    if any(FLAT_TOPK + name in meta for name in FLAT_TOPK_FIELDS):
        lp, ids = _topk_from_flat(meta, T, K)
    elif "output_top_logprobs" not in meta:
        raise MalformedResponse("meta_info.output_top_logprobs", "missing (the request sets top_logprobs_num)")
    else:
        rows = meta["output_top_logprobs"]
        fast = _topk_from_raw(rows, T, K) if isinstance(rows, RawJSON) else None
        if fast is None and isinstance(rows, RawJSON):
            import orjson  # parsing only, as pybase64 in decode_routed_experts

            rows = orjson.loads(bytes(rows))  # not in the expected form: parse it for the precise error
        lp, ids = fast if fast is not None else _logprob_columns(rows, "meta_info.output_top_logprobs", T, K)
    return lp.reshape(T, K), ids.reshape(T, K)


ROUTE_WIDTHS = {"uint8:": np.uint8, "int16:": np.int16}
"""Prefixes of narrowed routes (patches/sglang_fixes.py); ':' is outside base64's alphabet, so an
unprefixed string is SGLang's own int32."""
MAX_EXPERTS = 2 ** 15 - 1
"""The most experts per MoE layer whose ids int16 routes hold (with −1 left free)."""


def route_width(num_experts: int) -> np.dtype:
    """The integer type `decode_routed_experts` narrows the routes of a model with `num_experts`
    experts per MoE layer to (records.py keeps them so: `route_dtype`): uint8 while ids 0..E−1
    leave 255 free for a batch's "no route" value, else int16."""
    if not 0 < num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts = {num_experts}: routes are stored for 1..{MAX_EXPERTS} "
                         "experts per MoE layer")
    return np.dtype(np.uint8 if num_experts <= 255 else np.int16)


def decode_routed_experts(b64: Any, num_rows: int, moe_topk: int, num_experts: int,
                          field: str = "meta_info.routed_experts") -> torch.Tensor:
    """SGLang's base64 routed experts → [num_rows, L, moe_topk] in `route_width(num_experts)`:
    int32 (unprefixed, SGLang's own), or uint8 / int16 after a `ROUTE_WIDTHS` prefix.

    Every id must lie in [0, num_experts); the values are range-checked and narrowed in numpy,
    with no wider intermediate. Raises MalformedResponse naming `field`.
    """
    narrow = route_width(num_experts)
    if not isinstance(b64, (str, bytes)):
        raise MalformedResponse(field, f"expected a base64 string, got {type(b64).__name__}")
    head = b64[:8] if isinstance(b64, str) else bytes(b64[:8]).decode(errors="replace")
    wire, text = np.dtype(np.int32), b64
    if ":" in head:
        prefix = head[:head.index(":") + 1]
        if prefix not in ROUTE_WIDTHS:
            raise MalformedResponse(field, f"width prefix {prefix!r} is not one of {list(ROUTE_WIDTHS)} "
                                    "(or none: int32)")
        wire = np.dtype(ROUTE_WIDTHS[prefix])
        text = b64[len(prefix):] if isinstance(b64, str) else memoryview(b64)[len(prefix):]
    try:
        import pybase64  # parsing only: train_only runs (and the GPU suite's image) need none

        raw = pybase64.b64decode_as_bytearray(text, validate=True)  # writable: no copy below
    except ValueError as e:  # binascii.Error is a ValueError
        raise MalformedResponse(field, f"is not valid base64 ({e})") from None
    if len(raw) % wire.itemsize:
        raise MalformedResponse(field, f"decodes to {len(raw)} bytes, not a whole number of {wire.name}")
    flat = np.frombuffer(raw, dtype=wire)
    per_row = moe_topk * max(num_rows, 1)
    if num_rows <= 0 or flat.size == 0 or flat.size % per_row:
        raise MalformedResponse(field, (
            f"holds {flat.size} {wire.name} values, which is not {num_rows} rows (positions) × L layers "
            f"× {moe_topk} experts for any L ≥ 1; check moe_topk (num_experts_per_tok) and that the "
            "request asked for routed_experts_start_len=0"))
    # One pass: a negative id viewed as unsigned is ≥ 2^(bits−1) > E, so `max < E` checks both bounds.
    as_unsigned = flat.view(wire.str.replace("i", "u"))
    if int(as_unsigned.max()) >= num_experts:
        bad = int(np.argmax(as_unsigned >= num_experts))
        L = flat.size // per_row
        row, rest = divmod(bad, L * moe_topk)
        raise MalformedResponse(field, (
            f"row {row} (input position {row}), layer {rest // moe_topk} names expert "
            f"{int(flat[bad])}, outside [0, {num_experts}); check num_experts"))
    return torch.from_numpy(flat.astype(narrow, copy=False)).view(num_rows, -1, moe_topk)


def _locate_bad_entry(rows: Any, field: str, T: int, K: int | None, cause: BaseException | None):
    """Walk SGLang's log-prob rows element by element and raise MalformedResponse at the first
    one that is not [logp, token_id, text|null] with a finite float32 logp and an int32 id ≥ 0
    (the slow path, run only after the vectorised parse failed)."""
    if not isinstance(rows, list):
        raise MalformedResponse(field, f"expected a list of {T} rows, got {describe(rows)}")
    if len(rows) != T:
        raise MalformedResponse(field, f"has {len(rows)} rows for {T} output tokens (output_ids)")
    f32_max = float(np.finfo(np.float32).max)
    for t, row in enumerate(rows):
        if K is None:
            entries = [(f"{field}[{t}]", row)]
        else:
            if not isinstance(row, list) or len(row) != K:
                got = f"{len(row)} entries" if isinstance(row, list) else describe(row)
                raise MalformedResponse(f"{field}[{t}]", f"expected {K} [logp, token_id, text] "
                                        f"entries (top_logprobs_num), got {got}")
            entries = [(f"{field}[{t}][{c}]", e) for c, e in enumerate(row)]
        for path, e in entries:
            if not isinstance(e, list) or len(e) != 3:
                raise MalformedResponse(path, f"expected [logp, token_id, text|null], got {describe(e)}")
            logp, tok = e[0], e[1]
            if isinstance(logp, bool) or not isinstance(logp, (int, float)):
                raise MalformedResponse(f"{path}[0]", f"expected a log-prob (number), got {describe(logp)}")
            if not (math.isfinite(logp) and abs(logp) <= f32_max):
                raise MalformedResponse(f"{path}[0]", f"log-prob {logp!r} is not a finite float32")
            if isinstance(tok, bool) or not isinstance(tok, int):
                raise MalformedResponse(f"{path}[1]", f"expected a token id (integer), got {describe(tok)}")
            if not 0 <= tok < 2 ** 31:
                raise MalformedResponse(f"{path}[1]", f"token id {tok} is outside [0, 2^31)")
    raise MalformedResponse(field, f"could not be parsed ({cause!r})")


class RawJSON(bytes):
    """A JSON value the client left unparsed (`split_bulk_fields`): its raw bytes — a top-K array
    (read straight into numpy by `_topk_from_raw`) or a base64 string's characters."""


BULK_FIELDS = ("output_top_logprobs", "routed_experts")


def split_bulk_fields(body: bytes) -> tuple[bytes, dict[str, RawJSON]]:
    """Cut the two bulky values out of a /generate body before it is parsed: the top-K log-probs
    (a million small JSON lists at 16k tokens × K = 20) and the routed experts (a base64 string of
    tens of MB). Returns (the body with each replaced by null, their raw bytes). A key inside a
    string value cannot match (its closing quote would be escaped); a value that is not in the
    expected form is left in place, for the parser and its precise errors."""
    raw: dict[str, RawJSON] = {}
    spans = []
    for name in BULK_FIELDS:
        key = b'"' + name.encode() + b'":'
        at = body.find(key)
        if at < 0:
            continue
        start = at + len(key)
        if name == "routed_experts":
            if body[start:start + 1] != b'"':
                continue
            end = body.find(b'"', start + 1)
            if end < 0:
                continue
            raw[name] = RawJSON(body[start + 1:end])
            spans.append((start, end + 1))
        else:
            if body[start:start + 3] != b"[[[":
                continue
            end = body.find(b"]]]", start)
            if end < 0:
                continue
            raw[name] = RawJSON(body[start:end + 3])
            spans.append((start, end + 3))
    if not spans:
        return body, raw
    parts, at = [], 0
    for a, b in sorted(spans):
        parts += [body[at:a], b"null"]
        at = b
    parts.append(body[at:])
    return b"".join(parts), raw


def _topk_from_raw(raw: bytes, T: int, K: int) -> tuple[np.ndarray, np.ndarray] | None:
    """[T] rows of K [logp, id, null] as raw JSON → (logp float32, ids int32), flat row-major, in
    numpy; None when the text is not exactly that (the caller then parses it as JSON and reports
    the precise fault)."""
    if b'"' in raw or not raw.startswith(b"[[[") or not raw.endswith(b"]]]"):
        return None  # text entries (strings) or another shape: the general path
    rows = raw[2:-2].split(b"]],[[")
    if len(rows) != T or any(r.count(b"],[") != K - 1 for r in rows):
        return None
    flat = raw.translate(None, b"[]")
    if flat.count(b",null") != T * K:
        return None
    flat = flat.replace(b",null", b"")
    try:
        vals = np.fromstring(flat, dtype=np.float64, sep=",") if flat else np.zeros(0)
    except ValueError:
        return None
    if vals.size != 2 * T * K:
        return None
    vals = vals.reshape(-1, 2)
    logp, ids = vals[:, 0].astype(np.float32), vals[:, 1]
    if ids.size and not (np.isfinite(logp).all() and (ids >= 0).all() and (ids < 2 ** 31).all()
                         and (ids == np.floor(ids)).all()):
        return None
    return logp, ids.astype(np.int32)


FLAT_TOPK = "output_top_logprobs_"
FLAT_TOPK_FIELDS = {"val_flat_b64": "<f4", "idx_flat_b64": "<i4", "shape": None, "null_prefix": None}
"""SGLang's flat top-K fields (`meta_info.output_top_logprobs_` + name) and the little-endian
dtypes of the two arrays (their `…_dtype` markers name them: "float32", "int32")."""


def _topk_from_flat(meta: dict[str, Any], T: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """SGLang's flat base64 top-K (module docstring) → (logp float32, ids int32), flat row-major
    and writable; raises MalformedResponse naming the first bad field."""
    import pybase64  # parsing only, as in decode_routed_experts

    at = "meta_info." + FLAT_TOPK
    shape, null_prefix = meta.get(FLAT_TOPK + "shape"), meta.get(FLAT_TOPK + "null_prefix")
    if not (type(shape) is list and [type(x) for x in shape] == [int, int] and shape == [T, K]):
        raise MalformedResponse(at + "shape", f"is {describe(shape)}, expected [{T}, {K}] "
                                "(output tokens, top_logprobs_num)")
    if type(null_prefix) is not int or null_prefix != 0:
        raise MalformedResponse(at + "null_prefix", f"is {describe(null_prefix)}, expected 0 (every "
                                "output token has its top-K row)")
    out = []
    for name in ("val_flat_b64", "idx_flat_b64"):
        wire = np.dtype(FLAT_TOPK_FIELDS[name])
        marker = meta.get(FLAT_TOPK + name + "_dtype")
        if marker != wire.name:
            raise MalformedResponse(at + name + "_dtype", f"is {describe(marker)}, expected {wire.name!r}")
        b64 = meta.get(FLAT_TOPK + name)
        if not isinstance(b64, (str, bytes)):
            raise MalformedResponse(at + name, "missing" if b64 is None else
                                    f"expected a base64 string, got {describe(b64)}")
        try:
            raw = pybase64.b64decode_as_bytearray(b64, validate=True)  # writable: no copy below
        except ValueError as e:
            raise MalformedResponse(at + name, f"is not valid base64 ({e})") from None
        if len(raw) != T * K * wire.itemsize:
            raise MalformedResponse(at + name, f"decodes to {len(raw)} bytes, not [{T}, {K}] {wire.name} "
                                    f"({T * K * wire.itemsize} bytes)")
        out.append(np.frombuffer(raw, dtype=wire))
    logp, ids = out
    for name, bad, what in (("val_flat_b64", ~np.isfinite(logp), "log-prob {} is not finite"),
                            ("idx_flat_b64", ids < 0, "token id {} is outside [0, 2^31)")):
        if bad.any():
            i = int(np.argmax(bad))
            t, c, value = i // K, i % K, (logp if name == "val_flat_b64" else ids)[i].item()
            raise MalformedResponse(at + name, f"row {t}, column {c}: " + what.format(value))
    return logp, ids


def _logprob_columns(rows: Any, field: str, T: int, K: int | None) -> tuple[np.ndarray, np.ndarray]:
    """SGLang's [T] (K None) or [T][K] (logp, id, text) triples → (logp float32, ids int32), flat
    in row-major order."""
    try:
        if type(rows) is not list or len(rows) != T:
            raise ValueError("shape")
        flat = rows
        if K is not None:
            if T and set(map(len, rows)) != {K}:
                raise ValueError("width")
            flat = list(chain.from_iterable(rows))
        if flat and set(map(len, flat)) != {3}:
            raise ValueError("entry")
        logp = np.frombuffer(array("f", map(itemgetter(0), flat)), dtype=np.float32)
        ids = np.frombuffer(array("i", map(itemgetter(1), flat)), dtype=np.int32)
        if logp.size and not (np.isfinite(logp).all() and int(ids.min()) >= 0):
            raise ValueError("range")
        # array("f") rounds doubles to float32 unchecked; the finiteness test above catches
        # values beyond float32's range. array("f"/"i") refuses None, strings and (for "i")
        # floats with TypeError, and ids beyond int32 with OverflowError.
    except (TypeError, ValueError, OverflowError, IndexError, KeyError) as e:
        _locate_bad_entry(rows, field, T, K, e)
    return logp, ids
