"""Copy-in ops for bucketed collectives, as opaque custom ops.

Why custom ops rather than ``aten.cat``: Inductor freely fuses a pointwise
``cat`` into whatever kernel it likes, and on CPU it fused a bucket's copy-in
into the *previous* unit's activation kernel, which delayed the prefetched
all-gather until after the compute it was meant to overlap. An opaque op is
an extern kernel that Inductor schedules where the graph puts it.

Each is one pass over the bytes (see ``fsdp_compile.passes.bucketing``).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("fsdp_compile::all_gather_copy_in", mutates_args=())
def all_gather_copy_in(shards: list[torch.Tensor]) -> torch.Tensor:
    """Flat concatenation of the members' local shards (the all-gather input)."""
    return torch.cat([s.reshape(-1) for s in shards])


@all_gather_copy_in.register_fake
def _(shards):
    return shards[0].new_empty(sum(s.numel() for s in shards))


@torch.library.custom_op("fsdp_compile::reduce_scatter_copy_in", mutates_args=())
def reduce_scatter_copy_in(grads: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """The members' full gradients laid out so rank ``r``'s shards are contiguous:
    ``[world_size, sum(numel_i / world_size)]``, flattened."""
    return torch.cat([g.reshape(world_size, -1) for g in grads], dim=1).reshape(-1)


@reduce_scatter_copy_in.register_fake
def _(grads, world_size):
    return grads[0].new_empty(sum(g.numel() for g in grads))
