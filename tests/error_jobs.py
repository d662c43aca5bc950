"""Rank-side functions for the error tests."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn


def shard_rank_dependent_model() -> str:
    from fsdp_compile import fully_shard

    rank = dist.get_rank()
    model = nn.Sequential()
    model.layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8 + rank))
    try:
        fully_shard(model)
    except ValueError as e:
        return str(e)
    return "no error"


def fail_on_rank(bad_rank: int):
    if dist.get_rank() == bad_rank:
        return 1 / 0
    dist.barrier()  # the healthy rank blocks in a collective, as it would in a real job


def rank_and_world():
    return dist.get_rank(), dist.get_world_size()
