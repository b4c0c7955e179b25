"""Proxies never sit between the job and its own servers.

A user's exported http_proxy / https_proxy is for downloads (pip, the hub), and they still use it.
But urllib and `requests` send every request through it unless no_proxy names the host, loopback
included: a proxy that cannot reach this node's 127.0.0.1 (or does not answer) failed SGLang's
start-up request to its own server (`requests` to /model_info, retried for minutes) and would fail
every health check and weight push. So:
- this process's requests to its servers go through `urlopen` (urllib without proxies); the rollout
  client's aiohttp session ignores proxy variables (trust_env=False, rollout/client.py);
- a process it starts (an SGLang server, which asks itself) gets `direct_env`: loopback and the
  server hosts added to no_proxy/NO_PROXY, http_proxy/https_proxy as the user set them.
The sbatch script does the same for the job's nodes (curl --noproxy, an exported no_proxy).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable, Mapping

LOOPBACK = ("localhost", "127.0.0.1", "::1")

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def urlopen(request: str | urllib.request.Request, timeout: float):
    """urllib.request.urlopen, never through a proxy (same answers and errors)."""
    return _OPENER.open(request, timeout=timeout)


def direct_env(env: Mapping[str, str], hosts: Iterable[str] = ()) -> dict[str, str]:
    """`env` with no_proxy and NO_PROXY both holding their entries, loopback and `hosts` (the job's
    server hosts); the proxies themselves are kept for every other host. Both spellings alike:
    `requests` reads only the first that is not empty (no_proxy before NO_PROXY). A "*" (no host
    through a proxy) stays alone: urllib honours it only as the whole value."""
    out = dict(env)
    entries = [e.strip() for key in ("no_proxy", "NO_PROXY") for e in env.get(key, "").split(",")]
    if "*" in entries:
        out["no_proxy"] = out["NO_PROXY"] = "*"
    else:
        out["no_proxy"] = out["NO_PROXY"] = ",".join(dict.fromkeys(e for e in (*entries, *LOOPBACK, *hosts) if e))
    return out
