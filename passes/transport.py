"""Transport lowering: our all-gathers and reduce-scatters as all-to-alls, for gloo.

gloo implements neither collective the way FSDP needs (``ProcessGroupGloo``):
``reduce_scatter_tensor`` clones its whole input, all-reduces it (twice the bytes a
reduce-scatter moves) and copies one chunk out; ``all_gather_into_tensor`` runs a list
all-gather through flat staging buffers. Its ``all_to_all_single`` sends each
destination its slice directly, so both are lowered to it (measured:
``python -m benchmarks.collectives``, ``BENCHMARKS.md``).

* all-gather of ``x`` (``[r, ...]``, world size ``w``) becomes an all-to-all of
  ``x`` repeated ``w`` times (every rank sends its shard to every rank): the
  output is the all-gather's, rank-major. Where ``x`` is a bucket's copy-in read by
  the all-gather alone, the copy-in writes the ``w`` copies itself; where, besides,
  the output is read by the bucket's copy-out alone and this rank's index is known, a
  rank sends itself nothing (``w - 1`` copies; the copy-out reads this rank's block from
  the copy-in): a copy-in writes half the bytes on 2 ranks and gloo copies nothing
  locally. Graphs are then per rank (Inductor's cache keys hold the rank).
* reduce-scatter of ``g`` (``[w * r, ...]``) becomes an all-to-all of ``g`` (slice
  ``k`` goes to rank ``k``): the output holds the ``w`` ranks' slices for this
  rank, ``[w, r, ...]``, summed over the first dimension after the wait (and
  divided by ``w`` for ``avg``) by one opaque op, ``fsdp_compile::sum_received_slices``.
  An all-gather input that is not a bucket's copy-in is repeated by the copy-in op
  (one member): traced, either was a C++ kernel to compile per size.

On by default: ``fsdp_compile.config.gloo_all_to_all``; only compiled graphs (Inductor's
post-grad passes) and only groups whose backend is gloo. Runs after bucketing
and reordering, before pinning: the all-to-all keeps the collective's tag and
its single ``wait_tensor``, so pinning keeps its place in the schedule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

from fsdp_compile.passes.bucketing import ALL_GATHER_COPY_IN, ALL_GATHER_COPY_OUT, SUM_RECEIVED_SLICES
from fsdp_compile.passes.graph_utils import emit
from fsdp_compile.runtime.vocabulary import ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER, aten, our_collectives, tag_of, val


def _has_static_shape(node: fx.Node) -> bool:
    return all(isinstance(size, int) for size in val(node).shape)


def lower_to_all_to_all(
    graph: fx.Graph, lowers_group: Callable[[str], bool], rank_in_group: Callable[[str], int | None] = lambda name: None
) -> int:
    """Rewrite each of our all-gathers and reduce-scatters over a group for which
    ``lowers_group(group_name)`` holds as an ``all_to_all_single``; returns how many.

    Where ``rank_in_group(group_name)`` is this rank's index in the group, a bucketed
    all-gather read only by its copy-out sends this rank nothing of its own: the copy-in
    writes ``world_size - 1`` copies, the all-to-all's split to and from this rank is
    empty, and the copy-out takes this rank's block from the copy-in (the graph is then
    this rank's own: ``FSDPPostGradPass.uuid`` keys Inductor's caches by rank).

    Invariant: every value the graph computes is unchanged (a reduce-scatter's sum
    runs in torch's order over the ranks' slices: bitwise the same on 2 ranks,
    within rounding on more); each rewritten collective keeps its tag, position
    and single ``wait_tensor``, so the collective order is the same on every
    rank. Collectives with symbolic (dynamic) shapes or no elements, and reductions
    other than ``sum`` and ``avg``, are left alone.
    """
    lowered = 0
    for c in our_collectives(graph):
        if c.issue.target not in (ALL_GATHER, REDUCE_SCATTER) or not lowers_group(c.group_name):
            continue
        if c.issue.target is REDUCE_SCATTER and c.reduce_op not in ("sum", "avg"):
            continue
        if not _has_static_shape(c.input) or val(c.input).numel() == 0:
            continue
        if c.issue.target is ALL_GATHER:
            _lower_all_gather(graph, c.issue, c.wait, rank_in_group(c.group_name))
        else:
            _lower_reduce_scatter(graph, c.issue, c.wait)
        lowered += 1
    return lowered


def _all_to_all(
    graph: fx.Graph, issue: fx.Node, payload: fx.Node, rows: int, world_size: int, group_name: str, own_rank: int | None = None
) -> fx.Node:
    """``payload``'s dim-0 slices of ``rows`` rows, slice ``k`` to rank ``k`` (none to
    and from ``own_rank``, if given), tagged as ``issue``."""
    splits = [0 if k == own_rank else rows for k in range(world_size)]
    new = emit(graph, ALL_TO_ALL, (payload, splits, splits, group_name))
    new.meta.update({key: value for key, value in issue.meta.items() if key != "val"})
    assert tag_of(new) == tag_of(issue)
    return new


def _lower_all_gather(graph: fx.Graph, issue: fx.Node, wait: fx.Node, own_rank: int | None) -> None:
    shard, world_size, group_name = issue.args[0], issue.args[1], issue.args[2]
    shape = val(shard).shape
    copy_in = shard if _is_single_copy_in(shard, issue) else None
    copy_outs = list(wait.users)
    if copy_in is None or own_rank is None or not all(_is_copy_out_of(node, wait) for node in copy_outs):
        own_rank = None  # every rank receives its own block back through the all-to-all
    copies = world_size if own_rank is None else world_size - 1
    if copy_in is not None and copies == 1:
        repeated = copy_in
    elif copy_in is not None:
        # A bucket's copy-in writes the all-to-all's copies itself, where it stood.
        with graph.inserting_before(copy_in):
            repeated = emit(graph, ALL_GATHER_COPY_IN, (*copy_in.args, copies))
        repeated.meta.update({key: value for key, value in copy_in.meta.items() if key != "val"})
    else:  # one copy-in of the shard alone, as a view of the shape the all-to-all splits
        numel = val(shard).numel()
        with graph.inserting_before(issue):
            flat = emit(graph, ALL_GATHER_COPY_IN, ([shard], [numel], world_size))
            repeated = emit(graph, aten.view.default, (flat, [world_size * shape[0], *shape[1:]]))
    with graph.inserting_before(issue):
        new = _all_to_all(graph, issue, repeated, shape[0], world_size, group_name, own_rank)
    issue.replace_all_uses_with(new)
    graph.erase_node(issue)
    if copy_in is not None and repeated is not copy_in:
        graph.erase_node(copy_in)
    if own_rank is not None:
        wait.meta["val"] = val(new)
        for copy_out in copy_outs:
            gathered, padded_numels, *_ = copy_out.args
            copy_out.args = (gathered, padded_numels, world_size, repeated, own_rank)


def _is_copy_out_of(node: fx.Node, wait: fx.Node) -> bool:
    return node.target is ALL_GATHER_COPY_OUT and node.args[0] is wait and len(node.args) == 3


def _is_single_copy_in(shard: fx.Node, issue: fx.Node) -> bool:
    """``shard`` is a bucket's copy-in (one copy) read by ``issue`` alone."""
    return shard.target is ALL_GATHER_COPY_IN and len(shard.args) == 2 and list(shard.users) == [issue]


def _lower_reduce_scatter(graph: fx.Graph, issue: fx.Node, wait: fx.Node) -> None:
    full, reduce_op, world_size, group_name = issue.args[0], issue.args[1], issue.args[2], issue.args[3]
    shape = val(full).shape
    rows = shape[0] // world_size
    with graph.inserting_before(issue):
        new = _all_to_all(graph, issue, full, rows, world_size, group_name)
    issue.replace_all_uses_with(new)
    graph.erase_node(issue)
    wait.meta["val"] = val(new)
    readers = list(wait.users)
    with graph.inserting_after(wait):
        reduced = emit(graph, SUM_RECEIVED_SLICES, (wait, world_size, reduce_op == "avg"))
    for reader in readers:
        reader.replace_input_with(wait, reduced)
