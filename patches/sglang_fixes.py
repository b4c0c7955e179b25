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
