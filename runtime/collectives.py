"""Traceable collectives with autograd: the ops a sharded parameter goes through.

Eager and compiled runs execute exactly these functions. Each one issues a
functional collective (``torch.ops._c10d_functional.*``) followed directly by
its ``wait_tensor``; moving the wait later is the passes' job, not the runtime's.

Every op is traced inside :func:`fsdp_compile._compat.fx_annotate` with a
:func:`collective_annotation` so that FX passes can tell our collectives from any
other collective in the same graph (a user's all-reduce, tensor parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_compile._compat import c10d_functional, fx_annotate
from fsdp_compile.runtime.bucket_copies import pad_dim0

#: Key under ``node.meta["custom"]`` holding a :func:`collective_annotation` entry.
ANNOTATION_KEY = "fsdp_compile"


def collective_annotation(
    role: str,
    param_fqn: str,
    unit_fqn: str,
    reshard_after_forward: bool,
    forward_prefetched_by: str | None = None,
    backward_prefetched_by: str | None = None,
) -> dict:
    """The ``node.meta["custom"]`` entry our collectives are traced under.

    ``role`` is ``"unshard"`` for the forward all-gather chain (pad, gather,
    wait, narrow), ``"reduce_grad"`` for the backward gradient reduction and
    ``"replicate_grad"`` for HSDP's all-reduce over the replicate dimension
    that follows it (left alone by the bucketing and reordering passes).
    ``forward_prefetched_by`` / ``backward_prefetched_by`` name the unit whose
    forward / backward should issue this all-gather
    (``FSDPModule.set_modules_to_forward_prefetch`` and ``_backward_prefetch``
    hints, honoured by the reordering pass). A plain dict of constants, so
    Dynamo can trace building it.
    """
    return {
        ANNOTATION_KEY: {
            "role": role,
            "param_fqn": param_fqn,
            "unit_fqn": unit_fqn,
            "reshard_after_forward": reshard_after_forward,
            "forward_prefetched_by": forward_prefetched_by,
            "backward_prefetched_by": backward_prefetched_by,
        }
    }


def _as_role(annotation: dict, role: str) -> dict:
    """The same annotation with another role (the backward of an unshard is a reduce)."""
    entry = dict(annotation[ANNOTATION_KEY])
    entry["role"] = role
    return {ANNOTATION_KEY: entry}


def tag_of(node: torch.fx.Node) -> dict | None:
    """The :func:`collective_annotation` entry an FX node was traced under, if any."""
    custom = node.meta.get("custom")
    if not isinstance(custom, dict):
        return None
    return custom.get(ANNOTATION_KEY)


@dataclass(frozen=True)
class ShardLayout:
    """How one parameter is split along dim 0 over a group of ``world_size`` ranks.

    Rank ``r`` holds rows ``[r * rows_per_rank, (r + 1) * rows_per_rank)`` of
    the full tensor, clipped to ``dim0`` (``torch.chunk`` semantics, which is
    what ``DTensor``'s ``Shard(0)`` uses). Collectives need equal-size inputs,
    so each rank's chunk is zero-padded to ``rows_per_rank`` rows; only the
    tail ranks ever need padding.
    """

    full_shape: tuple[int, ...]
    world_size: int
    rank: int
    group_name: str

    @property
    def dim0(self) -> int:
        return self.full_shape[0]

    @property
    def rows_per_rank(self) -> int:
        return -(-self.dim0 // self.world_size)

    @property
    def local_rows(self) -> int:
        start = self.rank * self.rows_per_rank
        return max(0, min(self.dim0, start + self.rows_per_rank) - start)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.local_rows, *self.full_shape[1:])

    @property
    def padded_local_shape(self) -> tuple[int, ...]:
        return (self.rows_per_rank, *self.full_shape[1:])

    @property
    def padded_numel(self) -> int:
        """Elements each rank contributes to (and receives from) a collective."""
        n = self.rows_per_rank
        for s in self.full_shape[1:]:
            n *= s
        return n


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` rows (no copy when none are needed)."""
    if rows == t.shape[0]:
        return t.contiguous()
    return pad_dim0(t, rows)


def _remember_gradient_mode(ctx, meta, local, pending, accumulator) -> None:
    """What backward needs: the shard's dtype, whether to reduce, the pending sum."""
    ctx.meta, ctx.shard_dtype = meta, local.dtype
    ctx.sync, ctx.has_pending = accumulator is None, pending is not None
    if pending is not None:
        ctx.save_for_backward(pending)


def _gradient_to_reduce(ctx, grad, reduce_dtype, grad_scale):
    """The gradient as it enters the reduction: plus the gradient accumulated without
    sync, in ``reduce_dtype``, pre-scaled by ``grad_scale``."""
    if ctx.has_pending:
        (pending,) = ctx.saved_tensors
        grad = grad.to(pending.dtype) + pending
    if reduce_dtype is not None and reduce_dtype != grad.dtype:
        grad = grad.to(reduce_dtype)
    if grad_scale is not None:
        grad = grad * grad_scale
    return grad


class _AllGatherShard(torch.autograd.Function):
    """Forward: all-gather dim-0 shards into the full tensor (cast to ``param_dtype``
    first, so a bf16 policy gathers half the bytes).

    Backward, gradient sync on: reduce-scatter the full gradient (plus
    ``pending``, the unsharded gradient accumulated by earlier no-sync
    micro-batches) back into the local shard with ``reduce_op`` (``"avg"`` over
    the data-parallel group, as FSDP2), in ``reduce_dtype``, then cast to the
    shard's dtype. Gradient sync off: no communication; the full gradient goes
    to ``accumulator`` (a leaf whose ``.grad`` autograd accumulates) and the
    shard gets none.
    """

    @staticmethod
    def forward(ctx, local, pending, accumulator, meta):
        dim0, rows_per_rank, local_rows, world_size, group_name, reduce_op, annotation, param_dtype, _, _, _ = meta
        _remember_gradient_mode(ctx, meta, local, pending, accumulator)
        if param_dtype is not None and param_dtype != local.dtype:
            local = local.to(param_dtype)
        padded = _pad_rows(local, rows_per_rank)
        gathered = c10d_functional.all_gather_into_tensor(padded, world_size, group_name)
        gathered = c10d_functional.wait_tensor(gathered)
        if gathered.shape[0] != dim0:
            gathered = gathered.narrow(0, 0, dim0)
        return gathered

    @staticmethod
    def backward(ctx, grad_full):
        _, rows_per_rank, local_rows, world_size, group_name, reduce_op, annotation, _, reduce_dtype, grad_scale, replicate_group = ctx.meta
        if not ctx.sync:
            return None, None, grad_full.to(ctx.shard_dtype), None
        with fx_annotate(_as_role(annotation, "reduce_grad")):
            grad_full = _gradient_to_reduce(ctx, grad_full, reduce_dtype, grad_scale)
            padded = _pad_rows(grad_full, rows_per_rank * world_size)
            shard = c10d_functional.reduce_scatter_tensor(padded, reduce_op, world_size, group_name)
            shard = c10d_functional.wait_tensor(shard)
            if shard.shape[0] != local_rows:
                shard = shard.narrow(0, 0, local_rows)
        if replicate_group is not None:
            with fx_annotate(_as_role(annotation, "replicate_grad")):
                shard = c10d_functional.wait_tensor(c10d_functional.all_reduce(shard.contiguous(), reduce_op, replicate_group))
        with fx_annotate(_as_role(annotation, "reduce_grad")):
            if shard.dtype != ctx.shard_dtype:
                shard = shard.to(ctx.shard_dtype)
        return shard, None, None, None


class _AllReduceGrad(torch.autograd.Function):
    """Forward: identity (the tensor is replicated), cast to ``param_dtype``.
    Backward: all-reduce the gradient (plus ``pending``) over each of the
    groups in turn (HSDP: shard group, then replicate group), or with gradient sync
    off, hand it to ``accumulator`` (see :class:`_AllGatherShard`)."""

    @staticmethod
    def forward(ctx, local, pending, accumulator, meta):
        group_names, reduce_op, annotation, param_dtype, _, _ = meta
        _remember_gradient_mode(ctx, meta, local, pending, accumulator)
        if param_dtype is not None and param_dtype != local.dtype:
            return local.to(param_dtype)
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        group_names, reduce_op, annotation, _, reduce_dtype, grad_scale = ctx.meta
        if not ctx.sync:
            return None, None, grad.to(ctx.shard_dtype), None
        with fx_annotate(_as_role(annotation, "reduce_grad")):
            out = _gradient_to_reduce(ctx, grad, reduce_dtype, grad_scale).contiguous()
            for group_name in group_names:
                out = c10d_functional.wait_tensor(c10d_functional.all_reduce(out, reduce_op, group_name))
            if out.dtype != ctx.shard_dtype:
                out = out.to(ctx.shard_dtype)
        return out, None, None, None


def all_gather_shard(
    local: torch.Tensor,
    layout: ShardLayout,
    annotation: dict,
    reduce_op: str = "avg",
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    pending: torch.Tensor | None = None,
    accumulator: torch.Tensor | None = None,
    grad_scale: float | None = None,
    replicate_group_name: str | None = None,
) -> torch.Tensor:
    """The full tensor from every rank's dim-0 shard; its gradient is reduce-scattered.

    ``local`` is this rank's unpadded shard (``layout.local_shape``);
    ``annotation`` comes from :func:`collective_annotation`; the dtypes are a
    mixed-precision policy's (``None``: keep the shard's / the gradient's).
    Gradient accumulation: with ``accumulator`` the gradient is not reduced but
    accumulated into ``accumulator.grad``; ``pending`` (that accumulated
    gradient) is added before the next reduction. ``grad_scale`` multiplies the
    gradient before the reduction (``set_gradient_divide_factor``).
    HSDP: ``replicate_group_name`` names the group the reduce-scattered shard
    is then all-reduced over.
    """
    meta = (
        layout.dim0,
        layout.rows_per_rank,
        layout.local_rows,
        layout.world_size,
        layout.group_name,
        reduce_op,
        annotation,
        param_dtype,
        reduce_dtype,
        grad_scale,
        replicate_group_name,
    )
    with fx_annotate(annotation):
        return _AllGatherShard.apply(local, pending, accumulator, meta)


def replicate_with_grad_sync(
    local: torch.Tensor,
    group_names: tuple[str, ...],
    annotation: dict,
    reduce_op: str = "avg",
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    pending: torch.Tensor | None = None,
    accumulator: torch.Tensor | None = None,
    grad_scale: float | None = None,
) -> torch.Tensor:
    """A replicated tensor whose gradient is all-reduced over each of ``group_names``
    (0-dim parameters, HSDP's replicate dimension, ``replicate``); the other
    arguments are :func:`all_gather_shard`'s."""
    meta = (tuple(group_names), reduce_op, annotation, param_dtype, reduce_dtype, grad_scale)
    with fx_annotate(annotation):
        return _AllReduceGrad.apply(local, pending, accumulator, meta)
