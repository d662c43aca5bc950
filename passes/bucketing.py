"""Bucketing: merge a unit's per-parameter collectives into one collective per bucket.

FSDP2 issues one all-gather and one reduce-scatter per unit; traced per
parameter, a compiled step has one of each per parameter instead, each paying
the collective's latency. These passes merge them back.

Copies (one pass over the bytes each way, as FSDP2's copy-in/copy-out):

* all-gather: copy-in (``fsdp_compile::all_gather_copy_in``, an opaque op so
  Inductor cannot fuse it into unrelated compute and delay the collective)
  writes the members' local shards, zero-padded, into one flat buffer
  (``local bytes``; the runtime's per-parameter padding ``pad_dim0`` is folded in); copy-out
  (``fsdp_compile::all_gather_copy_out``, opaque too: as traced slices and clones each
  member was a C++ kernel of its own to compile) takes each member's column block of the
  ``[world_size, total]`` result into its own contiguous tensor (``gathered
  bytes``), since each member's rows are spread over every rank's block.
* all-reduce (HSDP's replicate dimension, replicated parameters): the members'
  gradients back to back (the all-gather copy-in without padding), one
  all-reduce, each member a slice of the result; issued where the last member was.
* reduce-scatter: copy-in lays each member's (zero-padded) gradient, viewed as
  ``[world_size, numel / world_size]``, side by side into ``[world_size, total]``
  (``gathered bytes``, padding folded in as well); copy-out is
  free: each member's shard is a contiguous slice of the reduced buffer.

Invariant kept by both passes: every member's consumers receive a tensor of
the same shape, dtype and values as before (bitwise on 2 ranks: each element
is reduced over the same ranks in the same order); collectives that are not
ours, or that do not share unit, group, dtype and reduce op, are untouched;
an all-gather bucket is issued where its first member was (a reduce-scatter
bucket where its last was, once every gradient exists), so the issue
sequence is a function of the (rank-independent) order of the original
collectives: every rank issues the same sequence even though ranks whose
shard needs padding have extra nodes.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from fsdp_compile.base.compat import stable_topological_sort
from fsdp_compile.passes.graph_utils import emit, inputs_after, move_before
from fsdp_compile.runtime import bucket_copies  # noqa: F401  (registers the copy-in ops)
from fsdp_compile.runtime.vocabulary import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    WAIT,
    Collective,
    CollectiveTag,
    aten,
    is_call,
    is_zero_constructor,
    our_collectives,
    tag_of,
    val,
)

log = logging.getLogger("fsdp_compile.passes.bucketing")

ALL_GATHER_COPY_IN = torch.ops.fsdp_compile.all_gather_copy_in.default
ALL_GATHER_COPY_OUT = torch.ops.fsdp_compile.all_gather_copy_out.default
SUM_RECEIVED_SLICES = torch.ops.fsdp_compile.sum_received_slices.default
REDUCE_SCATTER_COPY_IN = torch.ops.fsdp_compile.reduce_scatter_copy_in.default
PAD_DIM0 = torch.ops.fsdp_compile.pad_dim0.default


@dataclass
class Bucket:
    """Collectives merged into one: same kind, unit, group, dtype and reduce op."""

    members: list[Collective]
    #: An all-gather run split off its unit (:func:`split_by_use`): issued where its
    #: parameters are first used (reordering then prefetches it), not at its first member.
    issue_at_use: bool = False

    @property
    def kind(self) -> str:
        return self.members[0].kind

    @property
    def input_bytes(self) -> int:
        return sum(m.input_bytes for m in self.members)


def bucket_key(c: Collective) -> tuple:
    """Collectives may share a bucket only if they agree on all of these."""
    return (c.kind, c.tag.unit_fqn, c.tag.role, c.group_name, c.world_size, c.reduce_op, c.dtype)


def first_use(c: Collective) -> fx.Node | None:
    """The first consumer of all-gather ``c``'s result outside our own chain (the
    runtime's unpadding slices and views are traced right after the wait, which may sit
    at the unit's start, its parameter used much later); ``None`` if nothing uses it."""
    first, stack, seen = None, [c.wait], set()
    while stack:
        for user in stack.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if tag_of(user) is not None:
                stack.append(user)
            elif first is None or user < first:
                first = user
    return first


def use_position(c: Collective, order: dict[fx.Node, int]) -> int:
    """Where the graph needs ``c``: an all-gather's :func:`first_use`, a reduce-scatter's
    or all-reduce's own position (right after its gradient exists)."""
    if c.kind != "all_gather":
        return order[c.issue]
    use = first_use(c)
    return order[c.wait] if use is None else order[use]


def split_by_use(members: list[Collective], others: list[int], position, min_gathered_bytes: int) -> list[list[Collective]]:
    """``members`` (one bucket group) in runs used together: sorted by ``position``, a new run
    starts wherever a position in ``others`` (other units' collectives of the same kind)
    falls between two consecutive members. A run gathering fewer than
    ``min_gathered_bytes`` (unsharded bytes: input bytes x world size; an all-reduce's
    input bytes) joins the run before it (the first run, the one after it), so no run
    is small. Pure: positions in, runs (in use order, each in the members' original
    order) out; every member in exactly one run."""
    ranked = sorted(members, key=position)
    others = sorted(others)
    runs: list[list[Collective]] = [[ranked[0]]]
    for a, b in itertools.pairwise(ranked):
        if bisect.bisect_right(others, position(a)) != bisect.bisect_left(others, position(b)):
            runs.append([])
        runs[-1].append(b)

    def small(run: list[Collective]) -> bool:
        return sum(m.input_bytes for m in run) * (run[0].world_size or 1) < min_gathered_bytes  # all-reduce: None

    merged: list[list[Collective]] = []
    for run in runs:
        if merged and (small(run) or small(merged[-1])):
            merged[-1].extend(run)
        else:
            merged.append(run)
    index = {id(m): i for i, m in enumerate(members)}
    return [sorted(run, key=lambda m: index[id(m)]) for run in merged]


def plan_buckets(collectives: list[Collective], cap_bytes: int | None = None, split_min_bytes: int | None = None) -> list[Bucket]:
    """Group ``collectives`` by :func:`bucket_key` (first appearance order); with
    ``split_min_bytes``, split each group into runs used together (:func:`split_by_use`);
    then split each into consecutive buckets of at most ``cap_bytes`` input bytes (a
    member larger than the cap gets a bucket of its own). ``None``: one bucket per
    group, or per run. Rank-independent: a split compares positions only with one
    another, and padding nodes (the only per-rank difference) hold no collective."""
    groups: dict[tuple, list[Collective]] = {}
    for c in collectives:
        groups.setdefault(bucket_key(c), []).append(c)
    if split_min_bytes is not None and collectives:
        order = {n: i for i, n in enumerate(collectives[0].issue.graph.nodes)}
        where = {id(c): use_position(c, order) for c in collectives}

        def position(c: Collective) -> int:
            return where[id(c)]

        by_kind_and_unit: dict[tuple[str, str], list[int]] = {}
        for c in collectives:
            by_kind_and_unit.setdefault((c.kind, c.tag.unit_fqn), []).append(position(c))
        runs: list[tuple[list[Collective], bool]] = []
        for key, members in groups.items():
            others = [p for (kind, unit), ps in by_kind_and_unit.items() if kind == key[0] and unit != key[1] for p in ps]
            split = split_by_use(members, others, position, split_min_bytes)
            runs.extend((run, i > 0 and key[0] == "all_gather") for i, run in enumerate(split))
    else:
        runs = [(members, False) for members in groups.values()]
    buckets = []
    for members, at_use in runs:
        current: list[Collective] = []
        size = 0
        for m in members:
            if current and cap_bytes is not None and size + m.input_bytes > cap_bytes:
                buckets.append(Bucket(current, at_use))
                current, size = [], 0
            current.append(m)
            size += m.input_bytes
        buckets.append(Bucket(current, at_use))
    return buckets


def _unpadded_source(c: Collective) -> fx.Node:
    """The collective's input before the runtime's zero padding (``pad_dim0``); the
    copy-in then pads in the same pass."""
    node = c.input
    if is_call(node) and node.target is PAD_DIM0:
        return node.args[0]
    return node


def _bucket_tag(bucket: Bucket) -> CollectiveTag:
    """The first member's tag, naming every member."""
    return dataclasses.replace(
        bucket.members[0].tag,
        param_fqn=",".join(m.tag.param_fqn for m in bucket.members),
        bucket_size=len(bucket.members),
    )


def _merge_all_gather(graph: fx.Graph, bucket: Bucket) -> None:
    members = bucket.members
    ws, group = members[0].world_size, members[0].group_name
    numels = [m.input_numel for m in members]
    tag = _bucket_tag(bucket)
    anchor = _use_anchor(members) if bucket.issue_at_use else _all_gather_anchor(members)
    with graph.inserting_before(anchor):
        sources = [_unpadded_source(m) for m in members]
        copy_in = emit(graph, ALL_GATHER_COPY_IN, (sources, numels), tag=tag)
        issue = emit(graph, ALL_GATHER, (copy_in, ws, group), tag=tag)
        wait = emit(graph, WAIT, (issue,), tag=tag)
        copy_out = emit(graph, ALL_GATHER_COPY_OUT, (wait, numels, ws), tag=tag)
        for i, m in enumerate(members):
            flat = emit(graph, operator.getitem, (copy_out, i), tag=tag)
            full = emit(graph, aten.view.default, (flat, list(val(m.wait).shape)), tag=tag)
            m.wait.replace_all_uses_with(full)
    _erase_members(graph, members)


def _erase_members(graph: fx.Graph, members: list[Collective]) -> None:
    """Remove the replaced collectives, and their padding nodes once unused."""
    for m in members:
        source = m.input
        graph.erase_node(m.wait)
        graph.erase_node(m.issue)
        _erase_if_unused(graph, source)


def _erase_if_unused(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and, transitively, its inputs, while they are unused padding
    (our tagged nodes or zero constructors); never anything else."""
    stack = [node]
    while stack:
        n = stack.pop()
        is_padding = tag_of(n) is not None or is_zero_constructor(n)
        if is_call(n) and not n.users and is_padding:
            inputs = n.all_input_nodes
            graph.erase_node(n)
            stack.extend(inputs)


def _all_gather_anchor(members: list[Collective]) -> fx.Node:
    """Where a merged all-gather goes: at its first member, as FSDP2 gathers a unit
    when the unit's forward starts (a root unit's embedding is needed first, its
    output projection last). Later members' input chains (the shard, padding
    zeros) move up with it. Every rank places the bucket at the same collective,
    whatever padding nodes it has; leaving the placement to the topological sort
    instead would let ranks that pad issue buckets in another order (a hang).
    If an input chain holds real compute, the bucket goes to its last member."""
    anchor = members[0].issue
    chains = []
    for m in members[1:]:
        chain = inputs_after(m.issue, anchor)
        if chain is None:
            return members[-1].issue
        chains.extend(n for n in chain if n is not m.issue and n not in chains)
    move_before(sorted(chains), anchor)
    return anchor


def _use_anchor(members: list[Collective]) -> fx.Node:
    """Where a run split off its unit is gathered: before its members' first use. Every
    member's input precedes its issue, which precedes that use, so nothing moves; the
    final topological sort puts the members' traced unpadding chains after the
    copy-out. Every rank anchors at the same consumer (ranks differ only by padding
    nodes, never consumers), and reordering then prefetches the bucket as any other."""
    uses = [u for u in (first_use(m) for m in members) if u is not None]
    return min(uses) if uses else _all_gather_anchor(members)


def _merge_reduce_scatter(graph: fx.Graph, bucket: Bucket) -> None:
    members = bucket.members
    ws, group, op = members[0].world_size, members[0].group_name, members[0].reduce_op
    shard_numels = [m.input_numel // ws for m in members]
    tag = _bucket_tag(bucket)
    with graph.inserting_before(members[-1].issue):
        sources = [_unpadded_source(m) for m in members]
        padded = [m.input_numel for m in members]
        copy_in = emit(graph, REDUCE_SCATTER_COPY_IN, (sources, padded, ws), tag=tag)
        issue = emit(graph, REDUCE_SCATTER, (copy_in, op, ws, group), tag=tag)
        wait = emit(graph, WAIT, (issue,), tag=tag)
        offset = 0
        for m, numel in zip(members, shard_numels, strict=True):
            piece = emit(graph, aten.slice.Tensor, (wait, 0, offset, offset + numel), tag=tag)
            offset += numel
            shard = emit(graph, aten.view.default, (piece, list(val(m.wait).shape)), tag=tag)
            m.wait.replace_all_uses_with(shard)
    _erase_members(graph, members)


def _merge_all_reduce(graph: fx.Graph, bucket: Bucket) -> None:
    """Gradients all-reduced (HSDP's replicate dimension, replicated parameters): members
    back to back in one flat buffer (the all-gather copy-in's layout, without padding),
    one all-reduce, then each member's slice. Issued where the last member was."""
    members = bucket.members
    group, op = members[0].group_name, members[0].reduce_op
    numels = [m.input_numel for m in members]
    tag = _bucket_tag(bucket)
    with graph.inserting_before(members[-1].issue):
        copy_in = emit(graph, ALL_GATHER_COPY_IN, ([m.input for m in members], numels), tag=tag)
        issue = emit(graph, ALL_REDUCE, (copy_in, op, group), tag=tag)
        wait = emit(graph, WAIT, (issue,), tag=tag)
        offset = 0
        for m, numel in zip(members, numels, strict=True):
            piece = emit(graph, aten.slice.Tensor, (wait, 0, offset, offset + numel), tag=tag)
            offset += numel
            m.wait.replace_all_uses_with(emit(graph, aten.view.default, (piece, list(val(m.wait).shape)), tag=tag))
    _erase_members(graph, members)


_MERGE = {"all_gather": _merge_all_gather, "reduce_scatter": _merge_reduce_scatter, "all_reduce": _merge_all_reduce}


def apply_buckets(graph: fx.Graph, buckets: list[Bucket]) -> None:
    """Rewrite ``graph`` so each multi-member bucket is one collective (see module docstring)."""
    for bucket in buckets:
        first = bucket.members[0]
        log.debug(
            "%s bucket for unit %r: %d collective(s) -> 1, %s, %d bytes per rank: %s",
            bucket.kind,
            first.tag.unit_label,
            len(bucket.members),
            str(first.dtype).replace("torch.", ""),
            bucket.input_bytes,
            ", ".join(m.tag.param_fqn for m in bucket.members),
        )
        if len(bucket.members) >= 2:
            _MERGE[bucket.kind](graph, bucket)
        elif bucket.issue_at_use:  # a lone split-off all-gather: nothing to merge, only to move
            move_before([bucket.members[0].issue], _use_anchor(bucket.members))
    stable_topological_sort(graph)  # (a moved issue's wait and unpadding chain follow it)
    graph.lint()


def bucket_collectives(graph: fx.Graph, cap_bytes: int | None = None, split_min_bytes: int | None = None) -> list[Bucket]:
    """Plan and apply buckets for every all-gather, reduce-scatter and all-reduce of ours
    in ``graph`` (see :func:`plan_buckets`)."""
    buckets = plan_buckets(our_collectives(graph), cap_bytes, split_min_bytes)
    apply_buckets(graph, buckets)
    return buckets
