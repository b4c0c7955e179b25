"""A rollout server's admin endpoint as the weight transports see it: a URL, its TP size, POST,
and its own account of its layout (GET /server_info).

Kept to plain HTTP+JSON so the transports do not depend on the async rollout client.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass


class WeightSyncError(RuntimeError):
    pass


class ServersUnreachable(WeightSyncError):
    """A push found a server gone before it sent anything: restarting the server and pushing again
    (to a re-formed update group) loses nothing."""


@dataclass(frozen=True)
class ServerEndpoint:
    url: str  # e.g. http://127.0.0.1:30000
    tp_size: int = 1  # the server's tensor-parallel ranks (each joins the update group)

    def server_info(self, timeout: float = 60.0) -> dict:
        """SGLang's resolved server arguments and scheduler state (tp_size, dp_size, pp_size,
        enable_deterministic_inference, ...; sglang 0.5.23's /server_info)."""
        return self._request(urllib.request.Request(self.url.rstrip("/") + "/server_info", method="GET"),
                             "/server_info", timeout)

    def post(self, path: str, payload: dict | None = None, timeout: float = 600.0) -> dict:
        req = urllib.request.Request(self.url.rstrip("/") + path, data=json.dumps(payload or {}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        return self._request(req, path, timeout)

    def _request(self, req: urllib.request.Request, path: str, timeout: float) -> dict:
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            raise WeightSyncError(f"{self.url}{path}: HTTP {e.code}: {e.read()[:500]!r}") from None
        except (urllib.error.URLError, OSError) as e:
            raise WeightSyncError(f"{self.url}{path}: {e}") from None
        try:
            out = json.loads(body) if body else {}
        except json.JSONDecodeError:  # some admin routes (e.g. /flush_cache) answer in plain text
            out = {"text": body.decode(errors="replace")}
        if isinstance(out, dict) and out.get("success") is False:
            raise WeightSyncError(f"{self.url}{path}: {out.get('message')}")
        return out
