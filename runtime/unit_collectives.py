"""Bucketed collectives for eager runs: one all-gather and one reduce-scatter per bucket.

A compiled step gets its buckets from :mod:`fsdp_compile.passes.bucketing`.
Eager code gathers a whole unit when its forward starts (FSDP2's pre-forward),
so it can bucket up front, as FSDP2 does: the unit's shards are copied into one
buffer (``all_gather_copy_in``), all-gathered once, and copied out into one full
tensor per parameter; in the backward the gradients are copied into one buffer
(``reduce_scatter_copy_in``), reduce-scattered once, and each shard's gradient
is a view of the output (then all-reduced once per replicate group, for HSDP).

Members of a bucket share what one collective must share (:func:`bucket_key`):
the group, the gathered dtype, and the gradient's reduction. The per-member
arithmetic is the per-parameter path's (:func:`~fsdp_compile.runtime.collectives.gather_with_grad_sync`):
cast, pre-scale, reduce, cast back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_compile._compat import c10d_functional, fx_annotate
from fsdp_compile.runtime.bucket_copies import all_gather_copy_in, reduce_scatter_copy_in
from fsdp_compile.runtime.collectives import CollectiveSpec, ShardLayout


def bucket_key(spec: CollectiveSpec, local: torch.Tensor) -> tuple | None:
    """What the members of one bucket must share; ``None``: the parameter is not
    bucketed (replicated: nothing to all-gather)."""
    layout = spec.layout
    if layout is None:
        return None
    return (
        layout.group_name,
        layout.world_size,
        local.device,
        spec.param_dtype or local.dtype,
        spec.reduce_dtype,
        spec.reduce_op,
        spec.grad_scale,
        spec.reduce_group_names,
        local.requires_grad,
    )


@dataclass(eq=False)
class AllGatherInFlight:
    """A bucket's all-gather, issued and not yet waited on (eager prefetch: the next
    unit's gather runs while this one computes). :meth:`wait` returns what
    :func:`all_gather_bucket` returns; every issued all-gather must be waited on once."""

    gathered: torch.Tensor  # the collective's output, written asynchronously
    layouts: list[ShardLayout]

    def wait(self) -> list[torch.Tensor]:
        gathered = c10d_functional.wait_tensor(self.gathered)
        world_size = self.layouts[0].world_size
        padded = [layout.padded_numel for layout in self.layouts]
        # Copy-out: one op fills every member's padded full tensor (rank-major rows).
        padded_fulls = [gathered.new_empty((world_size * layout.rows_per_rank, *layout.full_shape[1:])) for layout in self.layouts]
        torch.split_with_sizes_copy(gathered.view(world_size, -1), padded, dim=1, out=[t.view(world_size, -1) for t in padded_fulls])
        return [full[: layout.dim0] for full, layout in zip(padded_fulls, self.layouts)]


def issue_all_gather_bucket(
    shards: list[torch.Tensor], layouts: list[ShardLayout], param_dtype: torch.dtype | None = None
) -> AllGatherInFlight:
    """Copy ``shards`` (unpadded local shards, cast to ``param_dtype`` first if given)
    into one buffer and issue its all-gather over their shared group, without waiting."""
    if param_dtype is not None:
        shards = [s.to(param_dtype) for s in shards]
    flat = all_gather_copy_in([s.contiguous() for s in shards], [layout.padded_numel for layout in layouts])
    return AllGatherInFlight(c10d_functional.all_gather_into_tensor(flat, layouts[0].world_size, layouts[0].group_name), list(layouts))


def all_gather_bucket(
    shards: list[torch.Tensor], layouts: list[ShardLayout], param_dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """The full tensors (dim 0 first) of ``shards`` (unpadded local shards), cast to
    ``param_dtype`` first if given, with one all-gather over their shared group; each
    output has its own storage."""
    return issue_all_gather_bucket(shards, layouts, param_dtype).wait()


def reduce_scatter_bucket(grads: list[torch.Tensor], layouts: list[ShardLayout], reduce_op: str) -> list[torch.Tensor]:
    """This rank's shard of each of ``grads`` (full gradients, one dtype), reduced with
    one reduce-scatter over their shared group: views of its output."""
    world_size, group_name = layouts[0].world_size, layouts[0].group_name
    widths = [layout.padded_numel for layout in layouts]
    flat = reduce_scatter_copy_in([g.contiguous() for g in grads], [w * world_size for w in widths], world_size)
    out = c10d_functional.wait_tensor(c10d_functional.reduce_scatter_tensor(flat, reduce_op, world_size, group_name))
    shards, offset = [], 0
    for layout, width in zip(layouts, widths):
        shards.append(out[offset : offset + width].view(layout.padded_local_shape)[: layout.local_rows])
        offset += width
    return shards


def _all_reduce_bucket(shards: list[torch.Tensor], reduce_op: str, group_name: str) -> list[torch.Tensor]:
    flat = torch.cat([s.reshape(-1) for s in shards])
    flat = c10d_functional.wait_tensor(c10d_functional.all_reduce(flat, reduce_op, group_name))
    return [part.view(s.shape) for part, s in zip(flat.split([s.numel() for s in shards]), shards)]


class _GatherBucketWithGradSync(torch.autograd.Function):
    """Forward: the full tensors of a bucket's shards, in ``param_dtype``.
    Backward: their gradients, in ``reduce_dtype`` and pre-scaled, reduce-scattered
    together, all-reduced together over each replicate group, cast to each shard's dtype
    (gradient sync on; a bucket is never built with it off)."""

    @staticmethod
    def forward(ctx, specs: tuple[CollectiveSpec, ...], in_flight: AllGatherInFlight | None, *shards):
        ctx.specs, ctx.shard_dtypes = specs, [s.dtype for s in shards]
        if in_flight is not None:
            return tuple(in_flight.wait())
        return tuple(all_gather_bucket(list(shards), [spec.layout for spec in specs], specs[0].param_dtype))

    @staticmethod
    def backward(ctx, *grads):
        specs, first = ctx.specs, ctx.specs[0]
        with fx_annotate(first.reduce_meta):
            if first.reduce_dtype is not None:
                grads = [g.to(first.reduce_dtype) for g in grads]
            if first.grad_scale is not None:
                grads = [g * first.grad_scale for g in grads]
            shards = reduce_scatter_bucket(list(grads), [spec.layout for spec in specs], first.reduce_op)
            for group_name in first.reduce_group_names:
                shards = _all_reduce_bucket(shards, first.reduce_op, group_name)
        return (None, None, *(s.to(dtype) for s, dtype in zip(shards, ctx.shard_dtypes)))


def gather_bucket_with_grad_sync(
    shards: list[torch.Tensor], specs: list[CollectiveSpec], in_flight: AllGatherInFlight | None = None
) -> list[torch.Tensor]:
    """The full tensors (dim 0 first) of ``shards``, whose specs share one
    :func:`bucket_key`, with one all-gather; their gradients are reduced back with
    one reduce-scatter (see :class:`_GatherBucketWithGradSync`). ``in_flight``: the
    all-gather of these same shards, already issued (a prefetch): it is waited on
    instead of issuing one."""
    return list(_GatherBucketWithGradSync.apply(tuple(specs), in_flight, *shards))
