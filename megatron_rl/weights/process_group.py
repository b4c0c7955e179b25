"""An extra process group beside the learner's default one, shared with the rollout servers.

The learner already has its default world; the weight-update group (learner rank 0 + server
ranks) is a second, independent group formed by TCP rendezvous. This is the same construction
SGLang's `init_custom_process_group` uses on the server side, written against torch alone so the
learner never imports the inference engine.
"""

from __future__ import annotations

from datetime import timedelta

from torch.distributed.distributed_c10d import (
    Backend, PrefixStore, _new_process_group_helper, _world, rendezvous,
)


def new_side_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                   timeout: timedelta = timedelta(minutes=30)):
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, timeout=timeout)
    # Group ranks are the ranks in this group (collectives name src/dst in group ranks).
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
