"""An extra process group beside the learner's default one, shared with the rollout servers.

The learner already has its default world; the weight-update group (learner rank 0 + server
ranks) is a second, independent group formed by TCP rendezvous. This is the same construction
SGLang's `init_custom_process_group` uses on the server side, written against torch alone so the
learner never imports the inference engine.
"""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlparse

from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world


def host_store(host: str, world_size: int, port: int = 0,
               timeout: timedelta = timedelta(minutes=30)) -> TCPStore:
    """Rank 0's store, listening before any peer is told where: port 0 lets the kernel pick a free
    port as it binds (`.port` says which), so no other process can take it between a probe and the
    bind. It does not wait for the peers; the group's own rendezvous does."""
    return TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def new_side_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                   timeout: timedelta = timedelta(minutes=30), store: TCPStore | None = None):
    """Join the group; rank 0 passes the store it opened with `host_store`, or has one opened here."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    # Rank 0 hosts the store, whatever the environment says. torch's own tcp:// rendezvous obeys
    # TORCHELASTIC_USE_AGENT_STORE, which torchrun sets to True in every worker: rank 0 would then
    # open a client only, expecting torchrun's agent to host a store on this port, and the group
    # would never form.
    if store is None:
        store = TCPStore(url.hostname, url.port, world_size, is_master=rank == 0, timeout=timeout,
                         multi_tenant=True)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, timeout=timeout)
    # Group ranks are the ranks in this group (collectives name src/dst in group ranks).
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
