"""Copy ops around our collectives, as opaque custom ops: the dim-0 padding of an
uneven shard, and the copy-ins and the all-gather copy-out of bucketed collectives.

Why the padding is an op of its own: a rank whose shard has zero rows pads
an empty tensor, and Inductor simplifies ``cat([empty, zeros])`` to the
constant ``zeros``; two such parameters then feed identical constant inputs
to two all-gathers, and common-subexpression elimination merged those
collectives into one on that rank only (a different collective sequence on
each rank: a hang). ``pad_dim0`` always takes the shard itself as input, so
every padded collective input stays distinct.

Why custom ops rather than ``aten.cat``: Inductor freely fuses a pointwise
``cat`` into whatever kernel it likes, and on CPU it fused a bucket's copy-in
into the *previous* unit's activation kernel, which delayed the prefetched
all-gather until after the compute it was meant to overlap. An opaque op is
an extern kernel that Inductor schedules where the graph puts it.

Why the all-gather copy-out is one op: as traced ops (a strided slice, then a
clone, per member) Inductor generated one C++ kernel per member, each with its own
constant offsets, so no two were alike and every one went through the C++ compiler:
on a 4-layer Llama that doubled the step's kernels and added ~20 s to a cold compile
(more than the unsharded model's whole C++ compile). One extern op copies every member
with ``split_with_sizes_copy``, as FSDP2's copy-out does.

Why the all-to-all transport's reduction is an op
(``sum_received_slices``): traced, its ``sum`` over the ranks' slices was one more C++
kernel per bucket size for Inductor to compile.

Each writes every byte once, zero padding of uneven shards included (the
traced per-parameter padding ``cat`` is folded in; see
``fsdp_compile.passes.bucketing``).

Why defined with ``torch.library.Library`` rather than ``torch.library.custom_op``: a
``custom_op`` registers a Python autograd kernel, which every call went through (its
grad-mode checks and a Python redispatch, ~20 us a call), compiled graphs' calls
included. These ops need no autograd (their inputs never require a gradient where they
run); with a ``CompositeExplicitAutograd`` kernel only the kernel itself is Python.
"""

from __future__ import annotations

import torch

from fsdp_compile.base.compat import chunk_cat

_LIBRARY = torch.library.Library("fsdp_compile", "FRAGMENT")  # kept alive: it holds the registrations


def _op(schema: str, fake):
    """Define ``fsdp_compile::<schema>`` with the decorated function as its kernel on every
    backend (``CompositeExplicitAutograd``) and ``fake`` for tracing; returns the op
    (``torch.ops.fsdp_compile.<name>``), which eager code calls like the function."""

    def define(kernel):
        name = _LIBRARY.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
        _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"fsdp_compile::{name}", fake, lib=_LIBRARY)
        return getattr(torch.ops.fsdp_compile, name)

    return define


def _pad_dim0_fake(t, rows):
    return t.new_empty((rows, *t.shape[1:]))


@_op("pad_dim0(Tensor t, SymInt rows) -> Tensor", _pad_dim0_fake)
def pad_dim0(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` rows (``t`` may have none)."""
    out = t.new_empty((rows, *t.shape[1:]))
    out[: t.shape[0]].copy_(t)
    out[t.shape[0] :].zero_()
    return out


def _all_gather_copy_in_fake(shards, padded_numels, copies=1):
    return shards[0].new_empty(copies * sum(padded_numels))


@_op("all_gather_copy_in(Tensor[] shards, SymInt[] padded_numels, SymInt copies=1) -> Tensor", _all_gather_copy_in_fake)
def all_gather_copy_in(shards: list[torch.Tensor], padded_numels: list[int], copies: int = 1) -> torch.Tensor:
    """The all-gather input: each member's local shard, zero-padded to its padded
    size, back to back (a member's padding is a piece of zeros); ``copies`` times over,
    each copy written from the shards (the all-to-all transport sends one to each rank,
    ``fsdp_compile.passes.transport``)."""
    pieces = []
    for shard, padded in zip(shards, padded_numels, strict=True):
        pieces.append(shard.reshape(-1))
        if padded > shard.numel():
            pieces.append(shard.new_zeros(padded - shard.numel()))
    if copies == 1:
        return torch.cat(pieces)
    out = shards[0].new_empty((copies, sum(padded_numels)))
    for block in out:
        torch.cat(pieces, out=block)
    return out.view(-1)


def _reduce_scatter_copy_in_fake(grads, padded_numels, world_size):
    return grads[0].new_empty(sum(padded_numels))


@_op("reduce_scatter_copy_in(Tensor[] grads, SymInt[] padded_numels, SymInt world_size) -> Tensor", _reduce_scatter_copy_in_fake)
def reduce_scatter_copy_in(grads: list[torch.Tensor], padded_numels: list[int], world_size: int) -> torch.Tensor:
    """The reduce-scatter input: ``[world_size, sum(padded_i / world_size)]`` flattened,
    where member ``i``'s columns hold its full gradient zero-padded to ``padded_i``
    elements (so rank ``r``'s shards of every member are contiguous): ``torch.chunk``'s
    layout along dim 0 (:class:`~fsdp_compile.runtime.collectives.ShardLayout`'s), so
    one ``chunk_cat`` (FSDP2's copy-in). Members without elements contribute nothing."""
    members = [grad for grad, padded in zip(grads, padded_numels, strict=True) if padded]
    for grad, padded in zip(grads, padded_numels, strict=True):
        if padded and (grad.dim() == 0 or _chunked_width(grad, world_size) * world_size != padded):
            raise ValueError(
                f"reduce_scatter_copy_in: a gradient of shape {tuple(grad.shape)} padded to {padded} "
                f"elements is not torch.chunk's dim-0 layout over {world_size} ranks"
            )
    if not members:
        return grads[0].new_empty(0)
    return chunk_cat(members, 0, world_size).reshape(-1)


def _chunked_width(grad: torch.Tensor, world_size: int) -> int:
    """Elements of one ``torch.chunk`` block of ``grad`` along dim 0 (the first, padded)."""
    rows_per_rank = -(-grad.shape[0] // world_size)
    return rows_per_rank * (grad.numel() // grad.shape[0])


def _sum_received_slices_fake(received, world_size, average):
    return received.new_empty((received.shape[0] // world_size, *received.shape[1:]))


@_op("sum_received_slices(Tensor received, SymInt world_size, bool average) -> Tensor", _sum_received_slices_fake)
def sum_received_slices(received: torch.Tensor, world_size: int, average: bool) -> torch.Tensor:
    """A reduce-scatter's result from the all-to-all that replaced it (compiled graphs'
    gloo transport, and eager buckets over 2 gloo ranks): ``received`` is ``world_size``
    ranks' slices for this rank, stacked along dim 0; their sum, added in rank order
    (on 2 ranks one addition, gloo's own bits), then divided by ``world_size`` where
    ``average``. One op rather than a traced ``sum``: Inductor generated a C++ kernel
    for each bucket size."""
    first, *others = received.view(world_size, received.shape[0] // world_size, *received.shape[1:]).unbind(0)
    reduced = first + others[0] if others else first.clone()
    for other in others[1:]:
        reduced.add_(other)
    return reduced.div_(world_size) if average else reduced


def _all_gather_copy_out_fake(gathered, padded_numels, world_size, own=None, own_rank=-1):
    return [gathered.new_empty(world_size * n) for n in padded_numels]


@_op(
    "all_gather_copy_out(Tensor gathered, SymInt[] padded_numels, SymInt world_size, Tensor? own=None, int own_rank=-1) "
    "-> Tensor[]",
    _all_gather_copy_out_fake,
)
def all_gather_copy_out(
    gathered: torch.Tensor,
    padded_numels: list[int],
    world_size: int,
    own: torch.Tensor | None = None,
    own_rank: int = -1,
) -> list[torch.Tensor]:
    """The members of a bucketed all-gather's output, each contiguous: ``gathered`` is
    ``[world_size, sum(padded_numels)]`` flattened (every rank's copy-in, one after
    the other); member ``i`` is its column block, ``world_size * padded_numels[i]``
    elements (the member's padded full tensor, flattened). One read and one write per byte.

    With ``own``, ``gathered`` holds the other ranks' copy-ins only (``world_size - 1``
    rows, rank order, ``own_rank``'s left out) and ``own`` starts with this rank's
    (the copy-in itself: the gloo transport's all-to-all sends a rank nothing of its own,
    ``fsdp_compile.passes.transport``)."""
    total = sum(padded_numels)
    outs = [gathered.new_empty(world_size * n) for n in padded_numels]
    grids = [o.view(world_size, n) for o, n in zip(outs, padded_numels, strict=True)]
    if own is None:
        sources = [(gathered.view(world_size, total), 0, world_size)]
    else:
        peers = gathered.view(world_size - 1, total)
        sources = [
            (peers[:own_rank], 0, own_rank),
            (own.reshape(-1)[:total].view(1, total), own_rank, own_rank + 1),
            (peers[own_rank:], own_rank + 1, world_size),
        ]
    for source, first, end in sources:
        if end > first:
            torch.split_with_sizes_copy(source, padded_numels, dim=1, out=[grid[first:end] for grid in grids])
    return outs
