"""A rollout server's admin endpoint as the weight transports see it: a URL, its TP size, POST,
and its own account of its layout (GET /server_info).

Kept to plain HTTP+JSON so the transports do not depend on the async rollout client. Requests go
direct, never through a user's proxy (rollout/direct.py).
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional

from megatron_rl.rollout import auth
from megatron_rl.rollout.direct import urlopen


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
        return self.get("/server_info", timeout)

    def get(self, path: str, timeout: float = 60.0) -> dict:
        return self._request(urllib.request.Request(self.url.rstrip("/") + path, method="GET",
                                                    headers=auth.headers()), path, timeout)

    def post(self, path: str, payload: dict | None = None, timeout: float = 600.0) -> dict:
        req = urllib.request.Request(self.url.rstrip("/") + path, data=json.dumps(payload or {}).encode(),
                                     headers={"Content-Type": "application/json", **auth.headers()}, method="POST")
        return self._request(req, path, timeout)

    def _request(self, req: urllib.request.Request, path: str, timeout: float) -> dict:
        try:
            with urlopen(req, timeout) as resp:
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


def nccl_version() -> Optional[str]:
    """This process's NCCL ("2.30.7"), or None where torch has none (a CPU build)."""
    import torch

    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):
        return None


VERSIONS_ROUTE = "/megatron_rl/versions"  # rollout/launch_server.py's: torch, NCCL, SGLang of the server


def check_nccl(endpoints, learner: Optional[str] = None) -> None:
    """Before the weight-update group forms: every server's NCCL is the learner's. NCCL refuses to
    connect ranks of different versions, or hangs: a server from another image (ROLLOUT_CONTAINER_IMAGE)
    is found here, named with both versions. A server not started by megatron_rl.rollout.launch_server
    (no version route) is not checked, and said so."""
    learner = nccl_version() if learner is None else learner
    for ep in endpoints:
        try:
            theirs = ep.get(VERSIONS_ROUTE)
        except WeightSyncError as e:
            if "HTTP 404" in str(e):
                logging.getLogger(__name__).warning("%s was not started by megatron_rl.rollout.launch_server: its NCCL version is not "
                            "checked against the learner's (%s)", ep.url, learner)
                continue
            raise
        if theirs.get("nccl") != learner:
            raise WeightSyncError(
                f"rollout server {ep.url} has NCCL {theirs.get('nccl') or 'none'} (torch {theirs.get('torch')}), "
                f"the learner NCCL {learner or 'none'}: the weight-update group needs one NCCL version on both "
                "sides; run the servers from the learners' image (ROLLOUT_CONTAINER_IMAGE / ROLLOUT_PYTHON) or "
                "one built from the same lock (requirements/gpu-lock.txt)")
