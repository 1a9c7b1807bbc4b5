"""A weight-update group member built the way SGLang builds its own: `init_custom_process_group`
(sglang/srt/utils/common.py, read in release 0.5.23), which SGLang's engines call in their
/init_weights_update_group and trainers written for SGLang call on their side. It rendezvouses over
a `tcp://` init method and hands torch's own `_new_process_group_helper` the store under the group's
name, so the keys it uses are torch's and SGLang's, not miles'. Nothing of SGLang is imported.
"""

from __future__ import annotations

import datetime


def join_as_sglang(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                   backend: str = "gloo", timeout_s: float = 60.0):
    """This process's member (rank `rank`) of the group; rank 0 hosts the store, as SGLang's trainers do."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
