"""The job's key for its SGLang servers: only the job's own processes may generate, load weights
or pause them.

SGLang servers listen on the network (a disaggregated server on every interface of its node), and
any process that reaches one could otherwise generate, load weights from any path, or pause it.
Each job has one secret, `MRL_SGLANG_API_KEY`: the sbatch script makes it (or the user sets it), and
a trainer without one makes it on rank 0 and hands it to the other ranks. Servers get it through
their environment (rollout/launch_server.py sets SGLang's `api_key` from it: never on a command
line, where `ps` would show it), SGLang then refuses every request without `Authorization: Bearer
<key>` but its health and metrics probes, and this process's clients (rollout/client.py,
weights/endpoint.py) send it. SGLang logs its arguments at start; patches/sglang_fixes.py redacts
the key there. SGLang 0.5.23 marks no route admin-only, so one key serves for everything.

A key a trainer makes lives in this module, not in os.environ: only the job's own processes send it.
"""

from __future__ import annotations

import os
import secrets
from typing import Optional

ENV = "MRL_SGLANG_API_KEY"
_key: Optional[str] = None


def set_job_key(key: Optional[str]) -> None:
    global _key
    _key = key or None


def job_key() -> Optional[str]:
    """The key set for this job (share_job_key), else the environment's (a tool run inside an sbatch
    script, whose servers inherit the same variable), else None."""
    return _key or os.environ.get(ENV) or None


def new_key() -> str:
    return secrets.token_urlsafe(32)


def server_env() -> dict[str, str]:
    """The environment that gives a server this job's key (ServerConfig.env of the servers a job
    starts; {} outside a job)."""
    key = job_key()
    return {ENV: key} if key else {}


def headers() -> dict[str, str]:
    """The Authorization header of this job's requests ({} outside a job)."""
    key = job_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def share_job_key(environ=os.environ) -> str:
    """Collective when torch.distributed is initialised: the job's key on every rank: the
    environment's (the sbatch script's, or the user's), else one rank 0 makes and broadcasts."""
    import torch.distributed as dist

    key = environ.get(ENV)
    if not key:
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [new_key() if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0)
            key = box[0]
        else:
            key = new_key()
    set_job_key(key)
    return key
