"""Bucketed collectives for eager runs: one all-gather and one reduce-scatter per bucket.

A compiled step gets its buckets from :mod:`fsdp_compile.passes.bucketing`; the
parameter-level buckets are :mod:`fsdp_compile._eager_buckets`.
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

from fsdp_compile.base.compat import NO_ANNOTATION, annotating, c10d_functional, fx_annotate, in_compiled_autograd
from fsdp_compile.runtime.bucket_copies import all_gather_copy_in, reduce_scatter_copy_in, sum_received_slices
from fsdp_compile.runtime.collectives import (
    CollectiveSpec,
    ShardLayout,
    as_movable,
    issue_all_gather,
    issue_all_reduce,
    issue_reduce_scatter,
    issue_reduce_scatter_halves,
    post_reduce_hook_op,
    sums_reduce_scatter_here,
)


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
        spec.grad_predivide,
        spec.grad_postdivide,
        spec.reduce_group_names,
        spec.all_reduce_ops(),
        spec.post_reduce_hook,
        local.requires_grad,
    )


@dataclass(eq=False)
class AllGatherInFlight:
    """A bucket's all-gather, issued and not yet waited on (eager prefetch: the next
    unit's gather runs while this one computes). :meth:`wait` returns the
    full tensors (dim 0 first), each with its own storage (a bucket of one: the
    collective's output); every issued all-gather must be waited on once."""

    gathered: torch.Tensor  # the collective's output, written asynchronously
    layouts: list[ShardLayout]
    dtype: torch.dtype  # the shards' (``gathered`` may be its uint8 view, see ``as_movable``)

    def wait(self) -> list[torch.Tensor]:
        gathered = c10d_functional.wait_tensor(self.gathered).view(self.dtype)
        world_size = self.layouts[0].world_size
        if len(self.layouts) == 1:  # one member: its rank-major rows are the buffer itself
            (layout,) = self.layouts
            return [gathered.view(world_size * layout.rows_per_rank, *layout.full_shape[1:])[: layout.dim0]]
        padded = [layout.padded_numel for layout in self.layouts]
        # Copy-out: one op fills every member's padded full tensor (rank-major rows).
        padded_fulls = [
            gathered.new_empty((world_size * layout.rows_per_rank, *layout.full_shape[1:])) for layout in self.layouts
        ]
        torch.split_with_sizes_copy(
            gathered.view(world_size, -1), padded, dim=1, out=[t.view(world_size, -1) for t in padded_fulls]
        )
        return [full[: layout.dim0] for full, layout in zip(padded_fulls, self.layouts, strict=True)]


def issue_all_gather_bucket(
    shards: list[torch.Tensor], layouts: list[ShardLayout], param_dtype: torch.dtype | None = None
) -> AllGatherInFlight:
    """Copy ``shards`` (unpadded local shards, cast to ``param_dtype`` first if given)
    into one buffer and issue its all-gather over their shared group, without waiting."""
    if param_dtype is not None:
        shards = [s.to(param_dtype) for s in shards]
    flat = all_gather_copy_in([s.contiguous() for s in shards], [layout.padded_numel for layout in layouts])
    gathered = issue_all_gather(as_movable(flat), layouts[0].world_size, layouts[0].group_name)
    return AllGatherInFlight(gathered, list(layouts), flat.dtype)


@dataclass(eq=False)
class ReduceScatterInFlight:
    """A bucket's reduce-scatter, issued and not yet waited on (eager: waited on one unit
    later, as FSDP2 does). :meth:`wait` finishes the reduction: this rank's shard of each
    gradient, all-reduced over each replicate group (HSDP), cast to each shard's dtype."""

    reduced: torch.Tensor  # the collective's output, written asynchronously
    layouts: list[ShardLayout]
    reduce_group_names: tuple[str, ...]
    reduce_group_ops: tuple[str, ...]
    postdivide: float | None
    shard_dtypes: list[torch.dtype]
    halves_op: str | None = None  # ``reduced`` holds both ranks' halves to reduce so (``sums_reduce_scatter_here``)

    post_reduce_hook: str | None = None  # the key of FSDP2's all-reduce hook, called on the flat result

    def wait(self) -> list[torch.Tensor]:
        out = c10d_functional.wait_tensor(self.reduced)
        if self.halves_op is not None:
            out = sum_received_slices(out, 2, self.halves_op == "avg")
        reduce_groups = zip(self.reduce_group_names, self.reduce_group_ops, strict=True)
        if self.post_reduce_hook is not None:
            # As FSDP2's: the hook gets the whole reduced buffer (each shard padded to the
            # group's row count), after the all-reduces, and changes it in place.
            for group_name, op in reduce_groups:
                out = c10d_functional.wait_tensor(issue_all_reduce(out.contiguous(), op, group_name))
            post_reduce_hook_op(out, self.post_reduce_hook)
        shards, offset = [], 0
        for layout in self.layouts:
            width = layout.padded_numel
            shards.append(out[offset : offset + width].view(layout.padded_local_shape)[: layout.local_rows])
            offset += width
        if self.post_reduce_hook is None:
            for group_name, op in reduce_groups:
                shards = _all_reduce_bucket(shards, op, group_name)
        if self.postdivide is not None:
            shards = [s / self.postdivide for s in shards]
        return [s.to(dtype) for s, dtype in zip(shards, self.shard_dtypes, strict=True)]


def issue_reduce_scatter_bucket(
    grads: list[torch.Tensor], spec: CollectiveSpec, layouts: list[ShardLayout], shard_dtypes: list[torch.dtype]
) -> ReduceScatterInFlight:
    """Cast ``grads`` (full gradients of one bucket) to ``spec.reduce_dtype``, pre-scale them,
    copy them into one buffer and issue its reduce-scatter over their shared group, without
    waiting."""
    if spec.reduce_dtype is not None:
        grads = [g.to(spec.reduce_dtype) for g in grads]
    if spec.grad_scale is not None:
        grads = [g * spec.grad_scale for g in grads]
    if spec.grad_predivide is not None:
        grads = [g / spec.grad_predivide for g in grads]
    world_size, group_name = layouts[0].world_size, layouts[0].group_name
    flat = reduce_scatter_copy_in(
        [g.contiguous() for g in grads], [layout.padded_numel * world_size for layout in layouts], world_size
    )
    halves = sums_reduce_scatter_here(flat, spec.reduce_op, world_size, group_name)
    if halves:
        reduced = issue_reduce_scatter_halves(flat, group_name)
    else:
        reduced = issue_reduce_scatter(flat, spec.reduce_op, world_size, group_name)
    return ReduceScatterInFlight(
        reduced,
        list(layouts),
        spec.reduce_group_names,
        spec.all_reduce_ops(),
        spec.grad_postdivide,
        list(shard_dtypes),
        spec.reduce_op if halves else None,
        spec.post_reduce_hook,
    )


def _all_reduce_bucket(shards: list[torch.Tensor], reduce_op: str, group_name: str) -> list[torch.Tensor]:
    flat = torch.cat([s.reshape(-1) for s in shards])
    flat = c10d_functional.wait_tensor(issue_all_reduce(flat, reduce_op, group_name))
    return [part.view(s.shape) for part, s in zip(flat.split([s.numel() for s in shards]), shards, strict=True)]


#: How many arguments of :class:`_GatherBucketWithGradSync` come before its tensors.
_OPTIONS = 8

#: The one input that makes a deferred bucket's outputs require grad: its shards go in
#: detached (their gradients reach the parameters later, see ``deliver``).
_GRAD_ANCHOR = torch.empty(0, requires_grad=True)


class _GatherBucketWithGradSync(torch.autograd.Function):
    """Forward: the full tensors of a bucket's shards, in ``param_dtype``.
    Backward: their gradients (plus each member's ``pending`` gradient, accumulated by
    earlier micro-batches without sync), in ``reduce_dtype`` and pre-scaled,
    reduce-scattered together, all-reduced together over each replicate group, cast to
    each shard's dtype. With ``accumulators`` (gradient sync off) nothing is reduced:
    each full gradient goes to its member's accumulator leaf instead. A member whose output got
    no gradient (unused by this backward) is left out of the reduction and gets none,
    as in an unsharded model; with ``reduce_unused`` it reduces zeros instead (FSDP2's
    ``set_reduce_scatter_unused_params``: every rank then issues the same collective
    even where ranks used different members).

    With ``deliver``, the shards come in detached after an anchor, and the backward
    hands ``deliver`` the function that issues the reduce-scatter, and the indices of
    the members it reduces, instead of issuing and waiting itself (``deliver`` issues it
    when it has room; whoever waits on it then passes the gradients on to those shards)."""

    @staticmethod
    def forward(
        specs: tuple[CollectiveSpec, ...],
        in_flight: AllGatherInFlight | None,
        deliver,
        reduce_unused: bool,
        pendings: tuple[torch.Tensor | None, ...] | None,
        n_accumulators: int,
        kept: tuple[torch.Tensor, ...] | None,
        shared,
        *tensors,
    ):
        if kept is not None:  # still gathered (reshard_after_backward=False, unshard()): no all-gather
            return tuple(k.view_as(k) for k in kept)
        shards = tensors[1 if deliver is not None else 0 : len(tensors) - n_accumulators]
        if in_flight is None:
            in_flight = issue_all_gather_bucket(list(shards), [spec.layout for spec in specs], specs[0].param_dtype)
        return tuple(in_flight.wait())

    @staticmethod
    def setup_context(ctx, inputs, output):
        # (A ``setup_context`` of its own: ``torch.func`` transforms, ``jvp`` among them, need it.)
        specs, _, deliver, reduce_unused, pendings, n_accumulators, _, shared, *tensors = inputs
        shards = tensors[1 if deliver is not None else 0 : len(tensors) - n_accumulators]
        ctx.specs, ctx.deliver, ctx.shard_dtypes, ctx.n_tensors = specs, deliver, [s.dtype for s in shards], len(tensors)
        ctx.reduce_unused, ctx.device = reduce_unused, shards[0].device
        ctx.pendings, ctx.accumulates, ctx.shared = pendings, n_accumulators > 0, shared
        ctx.first_shard = 1 if deliver is not None else 0
        ctx.set_materialize_grads(False)  # an unused member's gradient stays None

    @staticmethod
    def jvp(ctx, *tangents):
        """Forward mode: the gather is linear; the outputs' tangents are the gathers of the
        shards' (none where the shards have none, as parameters do)."""
        shard_tangents = tangents[_OPTIONS + ctx.first_shard : _OPTIONS + ctx.first_shard + len(ctx.shard_dtypes)]
        if all(t is None for t in shard_tangents):
            return (None,) * len(ctx.shard_dtypes)
        layouts = [spec.layout for spec in ctx.specs]
        filled = [
            torch.zeros(layout.local_shape, dtype=d, device=ctx.device) if t is None else t
            for t, d, layout in zip(shard_tangents, ctx.shard_dtypes, layouts, strict=True)
        ]
        return tuple(issue_all_gather_bucket(filled, layouts, ctx.specs[0].param_dtype).wait())

    @staticmethod
    def backward(ctx, *grads):
        specs, first = ctx.specs, ctx.specs[0]
        if ctx.accumulates:  # gradient sync off: into the accumulators, nothing reduced
            to_accumulators = [None if g is None else g.to(d) for g, d in zip(grads, ctx.shard_dtypes, strict=True)]
            return (None,) * (_OPTIONS + len(grads)) + tuple(to_accumulators)
        if ctx.pendings is not None:
            grads = tuple(
                g if pending is None else pending if g is None else g.to(pending.dtype) + pending
                for g, pending in zip(grads, ctx.pendings, strict=True)
            )
        if ctx.shared is not None and not in_compiled_autograd():  # several forwards' gathers: the last reduces the sum
            grads = ctx.shared.arrive(grads)
            if grads is None:
                return (None,) * (_OPTIONS + ctx.n_tensors)
        if ctx.reduce_unused:
            grads = tuple(
                g if g is not None else torch.zeros(spec.layout.full_shape, dtype=first.param_dtype or dtype, device=ctx.device)
                for g, spec, dtype in zip(grads, specs, ctx.shard_dtypes, strict=True)
            )
        members = [i for i, g in enumerate(grads) if g is not None]
        if not members:  # every output reached backward without a gradient: nothing to reduce
            return (None,) * (_OPTIONS + ctx.n_tensors)
        with fx_annotate(first.reduce_meta) if annotating() else NO_ANNOTATION:

            def issue() -> ReduceScatterInFlight:
                return issue_reduce_scatter_bucket(
                    [grads[i] for i in members], first, [specs[i].layout for i in members], [ctx.shard_dtypes[i] for i in members]
                )

            if ctx.deliver is not None:
                ctx.deliver(issue, members)
                return (None,) * (_OPTIONS + ctx.n_tensors)
            reduced = dict(zip(members, issue().wait(), strict=True))
            return (None,) * _OPTIONS + tuple(reduced.get(i) for i in range(len(grads)))


def gather_bucket_with_grad_sync(
    shards: list[torch.Tensor],
    specs: list[CollectiveSpec],
    in_flight: AllGatherInFlight | None = None,
    deliver=None,
    reduce_unused: bool = False,
    pendings: list[torch.Tensor | None] | None = None,
    accumulators: list[torch.Tensor] | None = None,
    kept: list[torch.Tensor] | None = None,
    shared=None,
) -> list[torch.Tensor]:
    """The full tensors (dim 0 first) of ``shards``, whose specs share one
    :func:`bucket_key`, with one all-gather; their gradients are reduced back with
    one reduce-scatter (see :class:`_GatherBucketWithGradSync`). ``in_flight``: the
    all-gather of these same shards, already issued (a prefetch): it is waited on
    instead of issuing one. ``deliver``: called in backward with a function that
    issues the reduce-scatter and returns its :class:`ReduceScatterInFlight`, and the
    indices of the members it reduces, instead of issuing and waiting for it; ``shards``
    then get no gradient from autograd (pass them detached). ``reduce_unused``: reduce
    zeros for members that got no gradient instead of leaving them out.

    Gradient accumulation: ``pendings`` (one per member, or ``None``) are the unsharded
    gradients earlier micro-batches accumulated without sync, added before this
    reduction; with ``accumulators`` (one leaf per member, gradient sync off) the
    gradients go to their ``.grad`` and nothing is reduced. ``kept``: the members' full
    tensors still gathered (dim 0 first), returned instead of gathering, with the same
    backward. ``shared``: the bucket's :class:`~fsdp_compile._eager_reduce.SharedReduction`,
    which sums the gradients of its gathers in several forwards before reducing them once."""
    tensors = (_GRAD_ANCHOR, *shards) if deliver is not None else tuple(shards)
    accumulators = tuple(accumulators or ())
    kept = None if kept is None else tuple(kept)
    pendings = tuple(pendings) if pendings is not None and any(p is not None for p in pendings) else None
    return list(
        _GatherBucketWithGradSync.apply(
            tuple(specs), in_flight, deliver, reduce_unused, pendings, len(accumulators), kept, shared, *tensors, *accumulators
        )
    )
