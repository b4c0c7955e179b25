"""The HTTP surface of one SGLang server: its routes and payloads (sglang 0.5.23's
http_server.py), one method each (`ServerAPI`), and the parse of its answers.

Response bodies are parsed with orjson (several times faster than json on the log-prob lists)
with Python's cyclic GC paused: a 16k-token response with top-20 log-probs is ~350 k small lists,
whose allocation otherwise triggers repeated full collections that cost 3–4x the parse itself.
The bulky fields of a /generate answer (top-K log-probs, routed experts) stay raw bytes for
wire.py to read in numpy. A non-200 answer raises `SGLangHTTPError` with the server's message.
`update_weights_from_tensor` / `update_weights_from_distributed` must run between
`begin_weight_update` and `end_weight_update` (SGLang answers 400 otherwise).

Which server gets a request, retries and the stall watchdog are the client's (client.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import math
from collections.abc import Sequence
from typing import Any

import aiohttp
import orjson

from .wire import MalformedResponse, split_bulk_fields

CONTROL_TIMEOUT_S = 600.0  # control endpoints (weights, health, ...) and /classify by default
NO_TIMEOUT = math.inf  # a request timeout that never fires (ServerAPI)


class RolloutError(RuntimeError):
    pass


class GenerationAborted(RolloutError):
    pass


class SGLangHTTPError(RolloutError):
    def __init__(self, url: str, route: str, status: int, body: str):
        super().__init__(f"{url}{route} answered {status}: {body[:500]}")
        self.url, self.route, self.status, self.body = url, route, status, body


@contextlib.contextmanager
def _gc_paused():
    """Pause cyclic GC around a large JSON parse: the hundreds of thousands of small lists it
    allocates would each time trigger full collections of the whole heap; nothing parsed forms
    a cycle, so collection can wait until the parse is done."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _loads(body: bytes, url: str, route: str) -> Any:
    bulk = {}
    if route == "/generate":
        # The bulky values stay raw bytes (wire.py reads them in numpy): parsing a 16k-token
        # answer's top-K into Python lists would cost ~2x its body in transient memory.
        body, bulk = split_bulk_fields(body)
    try:
        with _gc_paused():
            out = orjson.loads(body)
        target = out[0] if isinstance(out, list) and out else out
        if bulk and isinstance(target, dict) and isinstance(target.get("meta_info"), dict):
            target["meta_info"].update(bulk)
        return out
    except orjson.JSONDecodeError as e:
        raise MalformedResponse("(body)", f"{url}{route} answered 200 with invalid JSON ({e}); "
                                f"it begins {body[:200]!r}") from None

_CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError,
                      asyncio.TimeoutError)


class ServerAPI:
    """SGLang's HTTP endpoints on one server (sglang 0.5.23 routes and payloads). `session`: the
    rollout client's, which never goes through a user's proxy (trust_env=False, rollout/direct.py)."""

    def __init__(self, url: str, session: aiohttp.ClientSession, timeout: float = CONTROL_TIMEOUT_S):
        self.url = url.rstrip("/")
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    async def _request(self, method: str, route: str, payload: dict | None = None,
                       timeout: float | None = None, gate: asyncio.Semaphore | None = None) -> Any:
        t = (self.timeout if timeout is None else aiohttp.ClientTimeout(total=None) if timeout == NO_TIMEOUT
             else aiohttp.ClientTimeout(total=timeout))
        async with self.session.request(method, self.url + route, json=payload, timeout=t) as r:
            # `gate` bounds how many bodies are read and parsed at once: the rest wait in socket
            # buffers (aiohttp stops reading past its buffer limit), not in this process's memory.
            async with gate if gate is not None else contextlib.nullcontext():
                return await self._finish(r, route)

    async def _finish(self, r, route: str) -> Any:
        body = await r.read()
        if r.status != 200:
            raise SGLangHTTPError(self.url, route, r.status, body.decode(errors="replace"))
        if r.content_type == "application/json":
            return _loads(body, self.url, route)
        return await r.text()

    async def post(self, route: str, payload: dict | None = None, timeout: float | None = None,
                   gate: asyncio.Semaphore | None = None):
        return await self._request("POST", route, payload if payload is not None else {}, timeout, gate)

    async def get(self, route: str, timeout: float | None = None):
        return await self._request("GET", route, None, timeout)

    # --- health and info --------------------------------------------------------------------
    async def health(self, timeout: float = 5.0) -> bool:
        try:
            await self.get("/health", timeout=timeout)
            return True
        except (SGLangHTTPError, *_CONNECTION_ERRORS):
            return False

    async def get_model_info(self) -> dict:
        return await self.get("/get_model_info")

    async def get_server_info(self) -> dict:
        return await self.get("/get_server_info")

    # --- generation -------------------------------------------------------------------------
    async def generate(self, payload: dict, timeout: float | None = None) -> dict:
        return await self.post("/generate", payload, timeout)

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self.post("/abort_request", {"rid": rid, "abort_all": abort_all})

    async def pause_generation(self, mode: str = "abort") -> dict:
        """mode: "abort" (running requests end with finish_reason abort), "retract" (back to the
        queue, KV freed) or "in_place" (kept, resumed by continue_generation)."""
        return await self.post("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict:
        return await self.post("/continue_generation", {})

    async def flush_cache(self) -> str:
        return await self.post("/flush_cache")

    # --- weights ----------------------------------------------------------------------------
    async def begin_weight_update(self, selector: str = "all") -> dict:
        return await self.post("/begin_weight_update", {"selector": selector})

    async def end_weight_update(self) -> dict:
        return await self.post("/end_weight_update", {})

    async def update_weights_from_tensor(self, serialized_named_tensors: Sequence[bytes | str], *,
                                         load_format: str | None = None, flush_cache: bool = True,
                                         weight_version: str | None = None,
                                         abort_all_requests: bool = False) -> dict:
        """`serialized_named_tensors`: one entry per TP rank of the server, each SGLang's
        `MultiprocessingSerializer.serialize(named_tensors)` bytes (sent base64-encoded)."""
        enc = [base64.b64encode(s).decode() if isinstance(s, bytes) else s
               for s in serialized_named_tensors]
        return await self.post("/update_weights_from_tensor", {
            "serialized_named_tensors": enc, "load_format": load_format,
            "flush_cache": flush_cache, "weight_version": weight_version,
            "abort_all_requests": abort_all_requests})

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int, *,
                                        group_name: str = "weight_update_group",
                                        backend: str = "nccl", timeout: float | None = None) -> dict:
        """The server's ranks join a process group with the trainer (which is rank 0)."""
        return await self.post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend}, timeout)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self.post("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]], *,
                                              group_name: str = "weight_update_group",
                                              flush_cache: bool = True,
                                              weight_version: str | None = None,
                                              load_format: str | None = None,
                                              timeout: float | None = None) -> dict:
        """The server receives these tensors by broadcast from the trainer over the group."""
        return await self.post("/update_weights_from_distributed", {
            "names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
            "group_name": group_name, "flush_cache": flush_cache, "weight_version": weight_version,
            "load_format": load_format}, timeout)

    async def update_weights_from_disk(self, model_path: str, *, load_format: str | None = None,
                                       weight_version: str | None = None,
                                       flush_cache: bool = True,
                                       abort_all_requests: bool = False) -> dict:
        return await self.post("/update_weights_from_disk", {
            "model_path": model_path, "load_format": load_format, "weight_version": weight_version,
            "flush_cache": flush_cache, "abort_all_requests": abort_all_requests})

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> Any:
        return await self.post("/update_weight_version", {
            "new_version": new_version, "abort_all_requests": abort_all_requests})

    async def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return await self.post("/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return await self.post("/resume_memory_occupation", {"tags": tags})
