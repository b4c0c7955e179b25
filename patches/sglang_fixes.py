"""SGLang fixes every server needs, on CPU and GPU (applied by `megatron_rl.rollout.launch_server`).

- Reward-model score head without a bias. SGLang's Qwen2 / Qwen3 `ForSequenceClassification`
  build `score = nn.Linear(hidden, num_labels)` with a bias, while transformers' classes (and so
  every HF checkpoint, e.g. Skywork-Reward-V2) have none. The checkpoint then has no `score.bias`
  to load, and the bias keeps its random initialisation: every score served is off by one random
  constant per server start (measured on a tiny reward model: −0.113 on every sequence). The
  fixed classes build the head without a bias, as transformers does.
- Prompt exit on SIGTERM. The HTTP server's SIGTERM handler only sets a flag, and
  `TokenizerManager.sigterm_watchdog` looks at it every 5 s (`asyncio.sleep(5)`), so every stop
  and every restart of a server waited 0-5 s (measured: SIGTERM -> exit 4.1 s on an idle CPU server)
  before the drain began. The fixed watchdog looks every 0.1 s and then runs SGLang's own drain and
  shutdown unchanged (requests still in flight are still waited for).
- API keys out of the logs. SGLang logs its resolved arguments at start (`engine.py`
  `_server_args_for_logging`), redacting only the watermark secrets: a server started with an API
  key (rollout/auth.py) wrote it into its log, which lands in the run folder. The fixed function
  also redacts `api_key` and `admin_api_key`.
- Routed experts in one byte. The detokenizer sends each request's routes (R3) as base64 of int32
  [positions, L, k] (`DetokenizerManager._b64_encode_per_request`): 2,048 B per token at
  Qwen3-30B-A3B's 48 layers × top-8, though its 128 expert ids fit a byte. The fixed
  `handle_batch_token_id_out` encodes `routed_experts` itself (`indexer_topk` stays SGLang's
  int32): as uint8 when every id is in [0, 255], int16 when in [0, 32767], behind a `uint8:` /
  `int16:` prefix (':' is outside base64's alphabet; rollout/wire.py `decode_routed_experts`
  reads the width from it), else unprefixed int32 as before. Measured (benchmarks/
  bench_rollout_parse.py, a 16k-token response of 16,639 positions × 48 × 8, 2026-11-28):
  520 B per response token on the wire instead of 2,080, encoded in 24–30 ms instead of
  138 ms (int32), and read in 8–17 ms instead of 26–31. A server started without the fix (or with
  `--skip-tokenizer-init`, where the tokenizer encodes) still answers int32, which the client
  still reads.
"""

from __future__ import annotations

from patches._guard import pinned, require_version

SUPPORTED = pinned("sglang")
CLASSIFICATION_MODULES = ("sglang.srt.models.qwen2_classification", "sglang.srt.models.qwen3_classification")


def _without_score_bias(init):
    def __init__(self, config, *args, **kwargs):
        import torch

        init(self, config, *args, **kwargs)
        if self.score.bias is not None:
            w = self.score.weight
            self.score = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype, device=w.device)

    __init__._megatron_rl_fixed = True
    return __init__


SIGTERM_POLL_S = 0.1


def _prompt_sigterm_watchdog(watchdog):
    async def sigterm_watchdog(self):
        import asyncio

        while not self.gracefully_exit:
            await asyncio.sleep(SIGTERM_POLL_S)
        await watchdog(self)  # sees the flag at once: SGLang's drain and shutdown, unchanged

    sigterm_watchdog._megatron_rl_fixed = True
    return sigterm_watchdog


SECRET_ARGS = ("api_key", "admin_api_key")


def _redact_keys(for_logging):
    def redacted(server_args):
        out = for_logging(server_args)
        for name in SECRET_ARGS:
            if isinstance(out, dict) and out.get(name):
                out[name] = "<redacted>"
        return out

    redacted._megatron_rl_fixed = True
    return redacted


ROUTE_WIDTHS = (("uint8:", "uint8", 255), ("int16:", "int16", 2 ** 15 - 1))


def encode_routes(routes) -> str:
    """One request's routed experts (int tensor or array) → base64 in the narrowest width of
    ROUTE_WIDTHS that holds every id, behind its prefix; unprefixed int32 (SGLang's) otherwise."""
    import numpy as np
    import pybase64

    a = routes.numpy() if hasattr(routes, "numpy") else np.asarray(routes)
    if a.size and int(a.min()) >= 0:
        top = int(a.max())
        for prefix, dtype, most in ROUTE_WIDTHS:
            if top <= most:
                return prefix + pybase64.b64encode(a.astype(dtype).tobytes()).decode()
    return pybase64.b64encode(a.astype(np.int32, copy=False).tobytes()).decode()


def _narrow_routes(handle):
    def handle_batch_token_id_out(self, recv_obj):
        routes = recv_obj.routed_experts
        if not routes:
            return handle(self, recv_obj)
        recv_obj.routed_experts = None  # SGLang's int32 encoding skipped; indexer_topk keeps it
        try:
            out = handle(self, recv_obj)
        finally:
            recv_obj.routed_experts = routes
        out.routed_experts = [None if r is None else encode_routes(r) for r in routes]
        return out

    handle_batch_token_id_out._megatron_rl_fixed = True
    return handle_batch_token_id_out


def apply(version: str | None = None) -> None:
    import importlib

    require_version("sglang", SUPPORTED, "sglang_fixes", version)
    for name in CLASSIFICATION_MODULES:
        cls = importlib.import_module(name).EntryClass[0]
        if not getattr(cls.__init__, "_megatron_rl_fixed", False):
            cls.__init__ = _without_score_bias(cls.__init__)
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    if not getattr(TokenizerManager.sigterm_watchdog, "_megatron_rl_fixed", False):
        TokenizerManager.sigterm_watchdog = _prompt_sigterm_watchdog(TokenizerManager.sigterm_watchdog)
    from sglang.srt.entrypoints import engine

    if not getattr(engine._server_args_for_logging, "_megatron_rl_fixed", False):
        engine._server_args_for_logging = _redact_keys(engine._server_args_for_logging)
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager

    if not getattr(DetokenizerManager.handle_batch_token_id_out, "_megatron_rl_fixed", False):
        DetokenizerManager.handle_batch_token_id_out = _narrow_routes(DetokenizerManager.handle_batch_token_id_out)
