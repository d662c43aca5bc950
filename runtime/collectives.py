"""Traceable collectives with autograd: the ops a sharded parameter goes through.

Eager and compiled runs execute exactly these functions. Each one issues a
functional collective (``torch.ops._c10d_functional.*``) followed directly by
its ``wait_tensor``; moving the wait later is the passes' job, not the runtime's.

Every op is traced inside :func:`fsdp_compile.base.compat.fx_annotate` with the
parameter's :class:`~fsdp_compile.runtime.vocabulary.CollectiveTag`, so that FX
passes can tell our collectives from any other collective in the same graph
(a user's all-reduce, tensor parallelism).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from fsdp_compile.base import config
from fsdp_compile.base.compat import (
    NO_ANNOTATION,
    annotating,
    c10d_functional,
    collectives_observed,
    fx_annotate,
    group_backend,
    is_user_tensor_subclass,
    issue_c10d_collective,
)
from fsdp_compile.base.execution_mode import ExecutionMode, execution_mode
from fsdp_compile.runtime.bucket_copies import pad_dim0
from fsdp_compile.runtime.vocabulary import CollectiveTag, Role


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
    # Derived from the four fields above, once: traced code reads them as constants
    # (a property would be a function call Dynamo inlines at every parameter read).
    dim0: int = field(init=False, compare=False, repr=False)
    rows_per_rank: int = field(init=False, compare=False, repr=False)
    local_rows: int = field(init=False, compare=False, repr=False)
    local_shape: tuple[int, ...] = field(init=False, compare=False, repr=False)
    padded_local_shape: tuple[int, ...] = field(init=False, compare=False, repr=False)
    #: Elements each rank contributes to (and receives from) a collective.
    padded_numel: int = field(init=False, compare=False, repr=False)
    #: Rows of the padded full tensor: ``rows_per_rank * world_size`` (>= ``dim0``).
    padded_dim0: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        dim0 = self.full_shape[0]
        rows = -(-dim0 // self.world_size)
        start = self.rank * rows
        local_rows = max(0, min(dim0, start + rows) - start)
        rest = self.full_shape[1:]
        numel = rows
        for size in rest:
            numel *= size
        derived = {
            "dim0": dim0,
            "rows_per_rank": rows,
            "local_rows": local_rows,
            "local_shape": (local_rows, *rest),
            "padded_local_shape": (rows, *rest),
            "padded_numel": numel,
            "padded_dim0": rows * self.world_size,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)


@dataclass(frozen=True)
class CollectiveSpec:
    """How one parameter is communicated, built once per parameter (and again when its
    unit's options change) by :class:`~fsdp_compile.FSDPParam`.

    Attributes:
        layout: the dim-0 split over the shard group; ``None``: the parameter is
            replicated there (a 0-dim parameter, or ``replicate``) and its gradient
            is all-reduced instead of reduce-scattered.
        tag: what every traced node of these collectives carries (role ``UNSHARD``;
            the backward's nodes carry ``REDUCE_GRAD`` / ``REPLICATE_GRAD``).
        reduce_group_names: groups the gradient is all-reduced over after the
            reduce-scatter (HSDP's replicate dimension), or instead of it (replicated).
        reduce_op: the reduce-scatter's reduction, ``"avg"`` (FSDP2's default) or ``"sum"``.
        reduce_group_ops: each all-reduce's (``None``: ``reduce_op`` for every group).
        grad_scale: multiplies the gradient before the reduction (NCCL's ``PREMUL_SUM``).
        grad_predivide / grad_postdivide: divide the gradient before the reduction, and
            after the last all-reduce (FSDP2's sum reductions: see
            :func:`gradient_reduction`).
        param_dtype / reduce_dtype: the mixed-precision policy's (``None``: keep the
            shard's / the gradient's dtype).
        post_reduce_hook: the key (:func:`register_post_reduce_hook`) of a function called
            on the reduced gradient, in place, after the last all-reduce and before
            ``grad_postdivide`` (FSDP2's ``set_all_reduce_hook``); ``None``: none.
    """

    layout: ShardLayout | None
    tag: CollectiveTag
    reduce_group_names: tuple[str, ...] = ()
    reduce_op: str = "avg"
    reduce_group_ops: tuple[str, ...] | None = None
    grad_scale: float | None = None
    grad_predivide: float | None = None
    grad_postdivide: float | None = None
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    post_reduce_hook: str | None = None
    # The ``fx_annotate`` values of the traced nodes, built once from ``tag`` (traced
    # code then reads a constant instead of building a dict at every parameter read):
    # the gather's; the reduce-scatter's; the all-reduce's after it.
    meta: dict = field(init=False, compare=False, repr=False)
    reduce_meta: dict = field(init=False, compare=False, repr=False)
    all_reduce_meta: dict = field(init=False, compare=False, repr=False)
    #: What the gather op (:data:`gather_op`) is passed to find this spec again: its
    #: ``repr``, so equal keys mean equal specs in every process (the op's argument is
    #: in AOTAutograd's cache key).
    key: str = field(init=False, compare=False, repr=False)
    #: Nothing to communicate: no shard group, no group to all-reduce over, and a
    #: gradient that needs no scaling or cast of its own (a group of one rank). The
    #: gather is then the cast to ``param_dtype`` (or an alias), its backward autograd's.
    local_only: bool = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        key = repr(self)
        object.__setattr__(self, "key", key)
        if self.reduce_group_ops is not None and len(self.reduce_group_ops) != len(self.reduce_group_names):
            raise ValueError(f"CollectiveSpec: {len(self.reduce_group_names)} reduce groups, {len(self.reduce_group_ops)} ops")
        local_only = (
            self.layout is None
            and not self.reduce_group_names
            and self.grad_scale is None
            and self.grad_predivide is None
            and self.grad_postdivide is None
            and self.post_reduce_hook is None
        )
        object.__setattr__(self, "local_only", local_only and self.reduce_dtype in (None, self.param_dtype))
        _SPECS_BY_KEY.setdefault(key, self)
        all_reduce_role = Role.REDUCE_GRAD if self.layout is None else Role.REPLICATE_GRAD
        object.__setattr__(self, "meta", self.tag.as_meta())
        object.__setattr__(self, "reduce_meta", self.tag.as_meta(Role.REDUCE_GRAD))
        object.__setattr__(self, "all_reduce_meta", self.tag.as_meta(all_reduce_role))

    def all_reduce_ops(self) -> tuple[str, ...]:
        """The reduction of each all-reduce over :attr:`reduce_group_names`, in order."""
        return self.reduce_group_ops if self.reduce_group_ops is not None else (self.reduce_op,) * len(self.reduce_group_names)


class GradientReduction(NamedTuple):
    """How a gradient is scaled and reduced (:func:`gradient_reduction`)."""

    reduce_op: str  # the reduce-scatter's
    all_reduce_op: str  # the all-reduces' after it (HSDP's replicate dimension)
    premultiply: float | None = None  # before the reduction (NCCL's PREMUL_SUM)
    predivide: float | None = None  # before the reduction
    postdivide: float | None = None  # after the last all-reduce


def gradient_reduction(
    reduce_dtype: torch.dtype, shard_size: int, replicate_size: int, factor: float | None, force_sum: bool
) -> GradientReduction:
    """FSDP2's gradient arithmetic (``_get_gradient_divide_factors`` in torch's
    ``_fsdp_collectives.py``), so that gradients are FSDP2's bit for bit: over a
    reduce-scatter group of ``shard_size`` ranks and an all-reduce group of
    ``replicate_size``, in ``reduce_dtype``, with ``set_gradient_divide_factor(factor)``
    (``None``: the average) and ``set_force_sum_reduction_for_comms(force_sum)``.

    * float32 / bfloat16: the group's ``avg``; a factor equal to ``shard_size``: ``avg``
      over the shards and a sum over replicas; another factor: a pre-multiply by
      ``1 / factor`` and sums.
    * float16 and other dtypes (overflow risk), or ``force_sum``: sums only, the
      gradient divided by ``pre`` before them and by ``factor / pre`` after, ``pre``
      the power of two near ``sqrt(factor)`` (``pre = 1`` for ``force_sum`` in
      float32 / bfloat16: all the division after).
    * one rank in all: no reduction; a factor divides the gradient.
    """
    if shard_size * replicate_size == 1:
        return GradientReduction("sum", "sum", postdivide=None if factor is None or factor == 1 else float(factor))
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    if not overflow_risk and not force_sum:
        if factor is None:
            return GradientReduction("avg", "avg")
        if factor == shard_size:
            return GradientReduction("avg", "sum")
        # A factor of 1 (torchtitan's: sums) multiplies by nothing: x * 1.0 is x, bit for bit.
        return GradientReduction("sum", "sum", premultiply=None if factor == 1 else 1.0 / factor)
    factor = float(shard_size * replicate_size) if factor is None else float(factor)
    pre = 1
    if overflow_risk:
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
    post = factor / pre
    return GradientReduction("sum", "sum", predivide=None if pre == 1 else float(pre), postdivide=None if post == 1 else post)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` rows (no copy when none are needed)."""
    if rows == t.shape[0]:
        return t.contiguous()
    return pad_dim0(t, rows)


def _runs_eagerly(t: torch.Tensor) -> bool:
    """Whether a collective of ``t`` runs now rather than being traced: a plain tensor
    outside Dynamo (AOTAutograd traces with fake and functional tensors)."""
    return type(t) is torch.Tensor and execution_mode() is not ExecutionMode.TRACED


# [Note: eager collectives] Run eagerly, every collective goes out as FSDP2's do, through
# ``torch.distributed`` (``compat.issue_c10d_collective``): torch's ``CommDebugMode`` and
# profiler then count FSDP2's ops, and gloo runs ``_allgather_base``, not the coalesced
# all-gather the functional op takes, whose worker threads race on the group's status
# record (heap corruption with two in flight on one group). Traced code keeps the
# functional ops (compiled graphs over gloo send all-gathers as all-to-alls,
# ``config.gloo_all_to_all``); the functional ``wait_tensor`` waits for both. One eager
# exception, where nobody watches op by op: a bucket's reduce-scatter over 2 gloo ranks goes
# out as an all-to-all (:func:`sums_reduce_scatter_here`).
def issue_all_gather(shard: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """``all_gather_into_tensor`` of ``shard`` (dim 0 first), issued, not waited on (see
    [Note: eager collectives])."""
    if _runs_eagerly(shard):
        out = shard.new_empty((world_size * shard.shape[0], *shard.shape[1:]))
        return issue_c10d_collective("all_gather", out, shard.contiguous(), group_name)
    return c10d_functional.all_gather_into_tensor(shard, world_size, group_name)


def issue_reduce_scatter(full: torch.Tensor, reduce_op: str, world_size: int, group_name: str) -> torch.Tensor:
    """``reduce_scatter_tensor`` of ``full`` (contiguous, dim 0 first), issued, not waited on."""
    if _runs_eagerly(full):
        out = full.new_empty((full.shape[0] // world_size, *full.shape[1:]))
        return issue_c10d_collective("reduce_scatter", out, full, group_name, reduce_op)
    return c10d_functional.reduce_scatter_tensor(full, reduce_op, world_size, group_name)


def sums_reduce_scatter_here(full: torch.Tensor, reduce_op: str, world_size: int, group_name: str) -> bool:
    """Whether an eager reduce-scatter of ``full`` goes out as an all-to-all whose two
    halves this rank then adds (:func:`issue_reduce_scatter_halves`, then
    ``bucket_copies.sum_received_slices``, as the compiled transport does): with
    ``config.gloo_all_to_all``, a ``sum`` or ``avg`` over a gloo group of 2 ranks,
    unless watched (below). gloo's own
    reduce-scatter copies the whole input and all-reduces it (twice the bytes, on gloo's
    thread); the all-to-all sends the other rank its half. The result is gloo's bit for
    bit: one addition of two values, which is commutative, then for ``avg`` gloo's
    division of the sum by 2 (wider groups keep gloo's reduction: its order of additions
    is its own). Where collectives are watched op by op (``CommDebugMode``, any Python
    dispatch mode, a patched ``torch.distributed.reduce_scatter_single``:
    ``compat.collectives_observed``) it is FSDP2's reduce-scatter, so that counts and
    checks see FSDP2's ops."""
    return (
        config.gloo_all_to_all
        and world_size == 2
        and reduce_op in ("sum", "avg")
        and _runs_eagerly(full)
        and group_backend(group_name) == "gloo"
        and not collectives_observed()
    )


def issue_reduce_scatter_halves(full: torch.Tensor, group_name: str) -> torch.Tensor:
    """The all-to-all of :func:`sums_reduce_scatter_here`: ``full`` (contiguous, dim 0
    first, even rows) split in two along dim 0, half ``k`` sent to rank ``k``; the output
    (issued, not waited on) holds both ranks' halves for this rank, rank-major."""
    return issue_c10d_collective("all_to_all", torch.empty_like(full), full, group_name)


def issue_all_reduce(t: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    """``all_reduce`` of ``t`` (contiguous) into a new tensor, issued, not waited on."""
    if _runs_eagerly(t):
        return issue_c10d_collective("all_reduce", torch.empty_like(t), t, group_name, reduce_op)
    return c10d_functional.all_reduce(t, reduce_op, group_name)


def all_gather_as_bytes(inputs: list[torch.Tensor], world_size: int, group_name: str) -> list[torch.Tensor]:
    """All-gather ``inputs`` (any dtypes) in one collective of ``uint8``: each output is
    every rank's input concatenated on dim 0, in rank order, in the input's dtype (a
    low-precision parameter's pre-hook tensors: gloo has no float8 all-gather, and one
    buffer carries several dtypes). A tensor subclass among them is first copied into a
    plain tensor, by its own ``copy_`` (FSDP2 copies the pre hook's tensors into its plain
    all-gather buffer the same way: a ``TwoTensor`` gives the values of its last half)."""
    flat = [_plain(t).contiguous().view(-1).view(torch.uint8) for t in inputs]
    sizes = [f.numel() for f in flat]
    send = flat[0] if len(flat) == 1 else torch.cat(flat)
    gathered = c10d_functional.wait_tensor(issue_all_gather(send, world_size, group_name))
    per_rank = gathered.view(world_size, -1)
    outputs = []
    for t, part in zip(inputs, per_rank.split(sizes, dim=1), strict=True):
        outputs.append(part.contiguous().view(t.dtype).view(-1, *t.shape[1:]))
    return outputs


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor: itself, or a copy made by its subclass's ``copy_``."""
    if not is_user_tensor_subclass(t):
        return t
    plain = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    plain.copy_(t)
    return plain


#: 1-byte dtypes collectives move as they are; others of 1 byte (float8) go as ``uint8``
#: (gloo has no float8), as FSDP2's all-gathers of mixed dtypes do.
_MOVED_AS_THEY_ARE = (torch.uint8, torch.int8, torch.bool)


def as_movable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or its ``uint8`` view where it is of a 1-byte dtype that collectives may not
    support (float8): gather that, then ``.view(t.dtype)`` the result."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype not in _MOVED_AS_THEY_ARE else t


def _all_gather(local: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    padded = _pad_rows(local, layout.rows_per_rank) if layout.local_rows != layout.rows_per_rank else local.contiguous()
    sent = as_movable(padded)
    gathered = c10d_functional.wait_tensor(issue_all_gather(sent, layout.world_size, layout.group_name))
    if sent is not padded:
        gathered = gathered.view(padded.dtype)
    return gathered.narrow(0, 0, layout.dim0) if layout.padded_dim0 != layout.dim0 else gathered


def _reduce_scatter(grad_full: torch.Tensor, layout: ShardLayout, reduce_op: str) -> torch.Tensor:
    padded = _pad_rows(grad_full, layout.padded_dim0) if layout.padded_dim0 != layout.dim0 else grad_full.contiguous()
    shard = c10d_functional.wait_tensor(issue_reduce_scatter(padded, reduce_op, layout.world_size, layout.group_name))
    return shard.narrow(0, 0, layout.local_rows) if layout.local_rows != layout.rows_per_rank else shard


def post_forward_shard(full: torch.Tensor, layout: ShardLayout, group_size: int, index: int) -> torch.Tensor:
    """What a rank keeps of a gathered parameter after forward when resharding to a
    smaller group (``reshard_after_forward=<int>``, FSDP2's): the zero-padded full
    tensor (dim 0 first) cut into ``group_size`` row blocks, block ``index``.
    The all-gather's own output buffer has that layout, so the compiled graph
    slices it (``fsdp_compile.passes.reshard``); eager code pads ``full`` again."""
    padded = _pad_rows(full, layout.rows_per_rank * layout.world_size)
    rows = padded.shape[0] // group_size
    return padded.narrow(0, index * rows, rows).clone()


def gather_post_forward_shard(post: torch.Tensor, layout: ShardLayout, group_name: str, group_size: int) -> torch.Tensor:
    """The full tensor (dim 0 first) again, all-gathered from :func:`post_forward_shard`'s
    blocks over the smaller group (no autograd)."""
    gathered = c10d_functional.wait_tensor(issue_all_gather(post, group_size, group_name))
    return gathered.narrow(0, 0, layout.dim0) if gathered.shape[0] != layout.dim0 else gathered


class _GatherWithGradSync(torch.autograd.Function):
    """Forward: the full tensor in ``param_dtype`` (cast first, so a bf16 policy
    gathers half the bytes): the all-gather of every rank's dim-0 shard, or the
    replicated tensor itself.

    Backward, gradient sync on: the gradient (plus ``pending``, the unsharded
    gradient accumulated by earlier no-sync micro-batches), in ``reduce_dtype``
    and pre-scaled, is reduce-scattered back into the local shard (plus
    ``partial_pending``, what earlier micro-batches reduce-scattered without
    all-reducing), then all-reduced over each of ``reduce_group_names``, then cast
    to the shard's dtype. Gradient sync off: no communication; the full gradient
    goes to ``accumulator`` (a leaf whose ``.grad`` autograd accumulates) and the
    shard gets none. All-reduce off (``partial_accumulator``, HSDP's
    ``set_requires_all_reduce(False)``): reduce-scattered, not all-reduced; the
    result goes to ``partial_accumulator`` and the shard gets none.
    """

    @staticmethod
    def forward(local, spec: CollectiveSpec, kept, pending, accumulator, partial_pending, partial_accumulator):
        # (Dynamo traces this at every parameter read: kept short on purpose.)
        if kept is not None:  # still gathered from the last forward (reshard_after_backward=False)
            return kept.view_as(kept)
        if spec.param_dtype is not None and spec.param_dtype != local.dtype:
            local = local.to(spec.param_dtype)  # cast first: a bf16 policy gathers half the bytes
        elif spec.layout is None:
            return local.view_as(local)
        return local if spec.layout is None else _all_gather(local, spec.layout)

    @staticmethod
    def setup_context(ctx, inputs, output):
        # (A ``setup_context`` of its own: ``torch.func`` transforms need it. No ``jvp``:
        # Dynamo cannot trace a Function that defines one, and a parameter has no tangent.)
        local, spec, kept, pending, accumulator, partial_pending, partial_accumulator = inputs
        ctx.spec, ctx.shard_dtype, ctx.sync = spec, local.dtype, accumulator is None
        ctx.has_pending, ctx.has_partial_pending = pending is not None, partial_pending is not None
        ctx.all_reduce = partial_accumulator is None
        if pending is not None or partial_pending is not None:
            ctx.save_for_backward(pending, partial_pending)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        if not ctx.sync:
            return None, None, None, None, grad.to(ctx.shard_dtype), None, None
        with fx_annotate(spec.reduce_meta) if annotating() else NO_ANNOTATION:
            grad = _gradient_to_reduce(ctx, grad, spec)
            if spec.layout is not None:
                grad = _reduce_scatter(grad, spec.layout, spec.reduce_op)
        if not ctx.all_reduce:
            return None, None, None, None, None, None, grad
        if ctx.has_partial_pending:
            grad = grad + ctx.saved_tensors[1]
        if spec.reduce_group_names:
            with fx_annotate(spec.all_reduce_meta) if annotating() else NO_ANNOTATION:
                for group_name, op in zip(spec.reduce_group_names, spec.all_reduce_ops(), strict=True):
                    grad = c10d_functional.wait_tensor(issue_all_reduce(grad.contiguous(), op, group_name))
        if spec.post_reduce_hook is not None:
            grad = grad.contiguous()
            post_reduce_hook_op(grad, spec.post_reduce_hook)
        if spec.grad_postdivide is not None:
            with fx_annotate(spec.reduce_meta) if annotating() else NO_ANNOTATION:
                grad = grad / spec.grad_postdivide
        if grad.dtype != ctx.shard_dtype:
            with fx_annotate(spec.reduce_meta) if annotating() else NO_ANNOTATION:
                grad = grad.to(ctx.shard_dtype)
        return grad, None, None, None, None, None, None


def _gradient_to_reduce(ctx, grad: torch.Tensor, spec: CollectiveSpec) -> torch.Tensor:
    """The gradient as it enters the reduction: plus the gradient accumulated without
    sync, in ``reduce_dtype``, pre-scaled by ``grad_scale``."""
    if ctx.has_pending:
        pending = ctx.saved_tensors[0]
        grad = grad.to(pending.dtype) + pending
    if spec.reduce_dtype is not None and spec.reduce_dtype != grad.dtype:
        grad = grad.to(spec.reduce_dtype)
    if spec.grad_scale is not None:
        grad = grad * spec.grad_scale
    if spec.grad_predivide is not None:
        grad = grad / spec.grad_predivide
    return grad


class GradAccumulation(NamedTuple):
    """Where a gathered parameter's gradient goes besides (or instead of) its reduction,
    by the unit's sync modes (FSDP2's gradient accumulation):

    * ``pending``: the unsharded gradient earlier micro-batches accumulated without sync,
      added before this backward's reduce-scatter;
    * ``accumulator``: gradient sync off: a leaf whose ``.grad`` collects the unsharded
      gradient instead of reducing it;
    * ``partial_pending``: what earlier micro-batches reduce-scattered without all-reducing
      (HSDP), added before this backward's all-reduce;
    * ``partial_accumulator``: all-reduce off (HSDP's ``set_requires_all_reduce(False)``): a
      leaf collecting the reduce-scattered gradient instead of all-reducing it.
    """

    pending: torch.Tensor | None = None
    accumulator: torch.Tensor | None = None
    partial_pending: torch.Tensor | None = None
    partial_accumulator: torch.Tensor | None = None


#: No accumulation: the gradient is reduced into the shard (the common case).
NO_ACCUMULATION = GradAccumulation()


def gather_with_grad_sync(
    local: torch.Tensor,
    spec: CollectiveSpec,
    accumulation: GradAccumulation = NO_ACCUMULATION,
    kept: torch.Tensor | None = None,
    key: str | None = None,
    direct: bool = False,
) -> torch.Tensor:
    """The full tensor from this rank's shard ``local`` (unpadded,
    ``spec.layout.local_shape``; the whole tensor when ``spec.layout`` is ``None``);
    its gradient is reduced back (see :class:`_GatherWithGradSync`).

    ``accumulation``: where the gradient goes besides its reduction (:class:`GradAccumulation`).

    ``kept``: the full tensor (dim 0 first, in ``param_dtype``) kept gathered since
    the last forward (``set_reshard_after_backward(False)``); returned instead of
    gathering, with the same backward.

    ``key``: the :attr:`CollectiveSpec.key` of a spec equal to ``spec`` but for its tag's
    names, to trace the gather under (a sharded parameter not kept gathered).

    ``direct``: call the autograd function itself, not through :data:`gather_op` (eager code
    under a ``torch.func`` transform, which cannot run a Function inside an op's kernel).
    """
    if kept is None and spec.layout is not None and not direct:
        # the common case: see gather_op
        return gather_op(local, key or spec.key, *accumulation)
    a = accumulation
    if spec.local_only and kept is None and a.pending is a.accumulator is a.partial_pending is a.partial_accumulator is None:
        # A group of one rank, no accumulation: what the autograd function below computes,
        # forward and backward, without it (Dynamo traces that function and guards its
        # annotations at every parameter read).
        return local.view_as(local) if spec.param_dtype in (None, local.dtype) else local.to(spec.param_dtype)
    with fx_annotate(spec.meta) if annotating() else NO_ANNOTATION:
        return _GatherWithGradSync.apply(local, spec, kept, *accumulation)


# The common gather as one opaque op for Dynamo. Dynamo speculates an
# ``autograd.Function``'s forward and backward at every call, which cost more than half
# of its tracing time per sharded parameter; an op is one node for it. The op is
# CompositeImplicitAutograd: AOTAutograd (and eager) run its Python body, the same
# ``_GatherWithGradSync``, so the joint graph has the same functional collectives,
# annotated the same way, as the passes expect. Its schema returns a new tensor, so
# it is only used where the forward does not return a view of an input (see
# :func:`gather_with_grad_sync`).
_SPECS_BY_KEY: dict[str, CollectiveSpec] = {}
_LIBRARY = torch.library.Library("fsdp_compile", "DEF")
_LIBRARY.define(
    "gather_with_grad_sync(Tensor local, str spec, Tensor? pending=None, Tensor? accumulator=None, "
    "Tensor? partial_pending=None, Tensor? partial_accumulator=None) -> Tensor"
)


def _gather_with_grad_sync_op(
    local, spec_key: str, pending=None, accumulator=None, partial_pending=None, partial_accumulator=None
) -> torch.Tensor:
    spec = _SPECS_BY_KEY[spec_key]
    with fx_annotate(spec.meta) if annotating() else NO_ANNOTATION:
        return _GatherWithGradSync.apply(local, spec, None, pending, accumulator, partial_pending, partial_accumulator)


_LIBRARY.impl("gather_with_grad_sync", _gather_with_grad_sync_op, "CompositeImplicitAutograd")
#: ``torch.ops.fsdp_compile.gather_with_grad_sync``: :func:`gather_with_grad_sync` without
#: ``kept``, for a sharded parameter, with its spec passed by :attr:`CollectiveSpec.key`.
gather_op = torch.ops.fsdp_compile.gather_with_grad_sync.default


# ---------------------------------------------------------------- post-reduce hooks
#
# FSDP2's ``set_all_reduce_hook``: a user function called on a unit's reduced gradient, in
# place, after the reduce-scatter (and HSDP's all-reduce), before the post-division.
# A spec names its hook by a key (specs are compared and keyed by their ``repr``); the
# functions are held by their units (:class:`PostReduceHook`), this table only points
# at them, weakly, so that it keeps no model's state alive. Compiled graphs call the
# hook through :data:`post_reduce_hook_op`, one opaque node that mutates the gradient
# (Inductor runs it as a Python call, whatever the hook does: a ``dist.all_reduce``
# over another group, a scale, a log).

_POST_REDUCE_HOOKS: "weakref.WeakValueDictionary[str, PostReduceHook]" = weakref.WeakValueDictionary()
_post_reduce_hook_count = itertools.count()


class PostReduceHook:
    """A unit's ``set_all_reduce_hook``: ``hook(reduced)``, run on ``stream`` if given (an
    accelerator stream, ordered after the current one and before what follows)."""

    def __init__(self, hook, stream=None) -> None:
        self.hook, self.stream = hook, stream
        # The same on every rank that sets hooks in the same order (specs' keys are compared
        # across ranks), and never reused in a process.
        self.key = f"post_reduce_hook_{next(_post_reduce_hook_count)}"
        _POST_REDUCE_HOOKS[self.key] = self

    @classmethod
    def of(cls, hook, stream=None) -> "PostReduceHook":
        """The live entry for ``hook`` on ``stream`` if a unit holds one (units given the
        same function share a key, so identical blocks still compile one graph), else a new one."""
        for entry in list(_POST_REDUCE_HOOKS.values()):
            if entry.hook is hook and entry.stream is stream:
                return entry
        return cls(hook, stream)

    def __call__(self, reduced: torch.Tensor) -> None:
        if self.stream is None:
            self.hook(reduced)
            return
        device_module = torch.get_device_module(reduced.device.type)
        current = device_module.current_stream()
        self.stream.wait_stream(current)
        with device_module.stream(self.stream):
            self.hook(reduced)
        current.wait_stream(self.stream)


@torch.library.custom_op("fsdp_compile::post_reduce_hook", mutates_args=("reduced",))
def post_reduce_hook_op(reduced: torch.Tensor, hook: str) -> None:
    """Call the post-reduce hook registered as ``hook`` on ``reduced`` (in place)."""
    registered = _POST_REDUCE_HOOKS.get(hook)
    if registered is None:
        raise RuntimeError(
            f"fsdp_compile: a compiled graph calls the all-reduce hook {hook!r} of a unit that no longer "
            "exists or whose hook was replaced; recompile (torch._dynamo.reset())"
        )
    registered(reduced)


@post_reduce_hook_op.register_fake
def _(reduced: torch.Tensor, hook: str) -> None:
    return None
