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

#: Key under ``node.meta["custom"]`` holding a :func:`collective_annotation` entry.
ANNOTATION_KEY = "fsdp_compile"


def collective_annotation(role: str, param_fqn: str, unit_fqn: str, reshard_after_forward: bool) -> dict:
    """The ``node.meta["custom"]`` entry our collectives are traced under.

    ``role`` is ``"unshard"`` for the forward all-gather chain (pad, gather,
    wait, narrow) and ``"reduce_grad"`` for the backward gradient reduction.
    A plain dict of constants, so Dynamo can trace building it.
    """
    return {
        ANNOTATION_KEY: {
            "role": role,
            "param_fqn": param_fqn,
            "unit_fqn": unit_fqn,
            "reshard_after_forward": reshard_after_forward,
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
    missing = rows - t.shape[0]
    if missing == 0:
        return t.contiguous()
    return torch.cat([t, t.new_zeros((missing, *t.shape[1:]))])


class _AllGatherShard(torch.autograd.Function):
    """Forward: all-gather dim-0 shards into the full tensor (cast to ``param_dtype``
    first, so a bf16 policy gathers half the bytes).
    Backward: reduce-scatter the full gradient back into the local shard with
    ``reduce_op`` (``"avg"`` over the data-parallel group, as FSDP2), in
    ``reduce_dtype`` (default: the gradient's), then cast to the shard's dtype."""

    @staticmethod
    def forward(
        ctx, local, dim0, rows_per_rank, local_rows, world_size, group_name, reduce_op, annotation, param_dtype, reduce_dtype
    ):
        ctx.rows_per_rank, ctx.local_rows = rows_per_rank, local_rows
        ctx.world_size, ctx.group_name, ctx.reduce_op = world_size, group_name, reduce_op
        ctx.annotation, ctx.reduce_dtype, ctx.shard_dtype = annotation, reduce_dtype, local.dtype
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
        with fx_annotate(_as_role(ctx.annotation, "reduce_grad")):
            if ctx.reduce_dtype is not None and ctx.reduce_dtype != grad_full.dtype:
                grad_full = grad_full.to(ctx.reduce_dtype)
            padded = _pad_rows(grad_full, ctx.rows_per_rank * ctx.world_size)
            shard = c10d_functional.reduce_scatter_tensor(
                padded, ctx.reduce_op, ctx.world_size, ctx.group_name
            )
            shard = c10d_functional.wait_tensor(shard)
            if shard.shape[0] != ctx.local_rows:
                shard = shard.narrow(0, 0, ctx.local_rows)
            if shard.dtype != ctx.shard_dtype:
                shard = shard.to(ctx.shard_dtype)
        return shard, None, None, None, None, None, None, None, None, None


class _AllReduceGrad(torch.autograd.Function):
    """Forward: identity (the tensor is replicated). Backward: all-reduce the gradient."""

    @staticmethod
    def forward(ctx, local, group_name, reduce_op, annotation, param_dtype, reduce_dtype):
        ctx.group_name, ctx.reduce_op, ctx.annotation = group_name, reduce_op, annotation
        ctx.reduce_dtype, ctx.shard_dtype = reduce_dtype, local.dtype
        if param_dtype is not None and param_dtype != local.dtype:
            return local.to(param_dtype)
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        with fx_annotate(_as_role(ctx.annotation, "reduce_grad")):
            if ctx.reduce_dtype is not None and ctx.reduce_dtype != grad.dtype:
                grad = grad.to(ctx.reduce_dtype)
            out = c10d_functional.all_reduce(grad.contiguous(), ctx.reduce_op, ctx.group_name)
            out = c10d_functional.wait_tensor(out)
            if out.dtype != ctx.shard_dtype:
                out = out.to(ctx.shard_dtype)
        return out, None, None, None, None, None


def all_gather_shard(
    local: torch.Tensor,
    layout: ShardLayout,
    annotation: dict,
    reduce_op: str = "avg",
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The full tensor from every rank's dim-0 shard; its gradient is reduce-scattered.

    ``local`` is this rank's unpadded shard (``layout.local_shape``);
    ``annotation`` comes from :func:`collective_annotation`; the dtypes are a
    mixed-precision policy's (``None``: keep the shard's / the gradient's).
    """
    with fx_annotate(annotation):
        return _AllGatherShard.apply(
            local,
            layout.dim0,
            layout.rows_per_rank,
            layout.local_rows,
            layout.world_size,
            layout.group_name,
            reduce_op,
            annotation,
            param_dtype,
            reduce_dtype,
        )


def replicate_with_grad_sync(
    local: torch.Tensor,
    group_name: str,
    annotation: dict,
    reduce_op: str = "avg",
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """A replicated tensor whose gradient is all-reduced (used for 0-dim parameters)."""
    with fx_annotate(annotation):
        return _AllReduceGrad.apply(local, group_name, reduce_op, annotation, param_dtype, reduce_dtype)
