"""A rollout server's admin endpoint as the weight transports see it: a URL, its TP size, POST,
and its own account of its layout (GET /server_info).

Kept to plain HTTP+JSON so the transports do not depend on the async rollout client.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from dataclasses import dataclass

from megatron_rl.rollout import auth


class WeightSyncError(RuntimeError):
    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable  # no answer at all (connection refused, reset, timed out)


class ServersUnreachable(WeightSyncError):
    """A push found a server gone before it sent anything: restarting the server and pushing again
    (to a re-formed update group) loses nothing."""


STALE_SESSION = "a weight-update session is already open"


def begin_update(server: "ServerEndpoint", timeout: float) -> dict:
    """/begin_weight_update. A session left open by a pusher that stopped between begin and end (a
    trainer killed or preempted mid-push, its servers still up) is ended first: SGLang refuses a
    second begin, and the weights this push sends replace whatever that one had loaded."""
    try:
        return server.post("/begin_weight_update", {}, timeout)
    except WeightSyncError as e:
        if STALE_SESSION not in str(e):
            raise
    logging.getLogger(__name__).warning("%s: a weight update was left open (its pusher stopped mid-push); "
                                        "ending it and beginning this one", server.url)
    server.post("/end_weight_update", {}, timeout)
    return server.post("/begin_weight_update", {}, timeout)


@dataclass(frozen=True)
class ServerEndpoint:
    url: str  # e.g. http://127.0.0.1:30000
    tp_size: int = 1  # the server's tensor-parallel ranks (each joins the update group)

    def server_info(self, timeout: float = 60.0) -> dict:
        """SGLang's resolved server arguments and scheduler state (tp_size, dp_size, pp_size,
        enable_deterministic_inference, ...; sglang 0.5.23's /server_info)."""
        return self._request(urllib.request.Request(self.url.rstrip("/") + "/server_info", method="GET",
                                                    headers=auth.headers()), "/server_info", timeout)

    def post(self, path: str, payload: dict | None = None, timeout: float = 600.0) -> dict:
        req = urllib.request.Request(self.url.rstrip("/") + path, data=json.dumps(payload or {}).encode(),
                                     headers={"Content-Type": "application/json", **auth.headers()}, method="POST")
        return self._request(req, path, timeout)

    def _request(self, req: urllib.request.Request, path: str, timeout: float) -> dict:
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            raise WeightSyncError(f"{self.url}{path}: HTTP {e.code}: {e.read()[:500]!r}") from None
        except (urllib.error.URLError, OSError) as e:
            raise WeightSyncError(f"{self.url}{path}: {e}", unreachable=True) from None
        try:
            out = json.loads(body) if body else {}
        except json.JSONDecodeError:  # some admin routes (e.g. /flush_cache) answer in plain text
            out = {"text": body.decode(errors="replace")}
        if isinstance(out, dict) and out.get("success") is False:
            raise WeightSyncError(f"{self.url}{path}: {out.get('message')}")
        return out
