"""SGLang CPU servers shared across the e2e modules.

A server takes 20-40 s of the 2-core machine to start (three processes import SGLang and torch),
and most modules only need *a* server of a given architecture: `shared_server(ckpt, ...)` starts
one per (architecture, server flags) the first time it is asked and keeps it for the session (each
pytest-xdist worker has its own). Every caller gets it with `ckpt`'s weights freshly loaded
(`/update_weights_from_disk`, announced as `weight_version`), whatever the previous user pushed,
so a module sees exactly the server it would have started itself.

Modules whose tests kill, restart or count a server's processes, or need a server's own log, start
their own (EngineManager) as before.
"""

from __future__ import annotations

import hashlib
import json
import urllib.request
from pathlib import Path

import pytest

MAX_TOTAL_TOKENS = 8192  # the largest any sharing module asked for; a tiny model's KV cache is small
# Servers kept per worker, least recently used stopped first: a server holds ~1.5 GB (three processes;
# USS measured 1.4 GB idle), three per worker leave room for the trainers on a 24 GB machine.
MAX_KEPT = 3


def architecture(ckpt: str | Path) -> str:
    """What a server's model must share with `ckpt` to load its weights: the HF config without the
    init std, and the tokenizer."""
    ckpt = Path(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.pop("initializer_range", None)
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (ckpt / name).exists():
            h.update((ckpt / name).read_bytes())
    return h.hexdigest()[:16]


def load_weights(url: str, ckpt: str | Path, weight_version: str) -> None:
    body = json.dumps({"model_path": str(ckpt), "weight_version": weight_version, "flush_cache": True,
                       "abort_all_requests": True}).encode()
    req = urllib.request.Request(url + "/update_weights_from_disk", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.loads(resp.read())
    assert out.get("success"), f"{url} did not load {ckpt}: {out}"


class SharedServers:
    def __init__(self, root: Path):
        self.root = root
        self.managers: dict[tuple, object] = {}  # insertion order = least recently used first

    def __call__(self, ckpt: str | Path, *, routed: bool = False, deterministic: bool = True,
                 weight_version: str = "0"):
        """An EngineManager with one server serving `ckpt`'s weights as `weight_version`."""
        from megatron_rl.rollout.server import EngineManager, ServerConfig

        key = (architecture(ckpt), routed, deterministic)
        mgr = self.managers.pop(key, None)
        if mgr is None:
            while len(self.managers) >= MAX_KEPT:
                self.managers.pop(next(iter(self.managers))).stop()
            extra = ("--weight-version", weight_version)
            if deterministic:
                extra += ("--enable-deterministic-inference",)
            cfg = ServerConfig(model_path=str(ckpt), max_total_tokens=MAX_TOTAL_TOKENS,
                               enable_return_routed_experts=routed, extra_args=extra)
            name = f"{key[0]}{'_routed' if routed else ''}{'_det' if deterministic else ''}"
            mgr = EngineManager(cfg, 1, log_dir=self.root / name).start()
        else:
            load_weights(mgr.urls()[0], ckpt, weight_version)
        self.managers[key] = mgr  # most recently used last
        return mgr

    def stop(self) -> None:
        for mgr in self.managers.values():
            mgr.stop()


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory):
    """`shared_server(ckpt, routed=False, deterministic=True, weight_version="0")` -> EngineManager."""
    servers = SharedServers(tmp_path_factory.mktemp("shared_servers"))
    yield servers
    servers.stop()
