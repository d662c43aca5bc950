"""Reordering: issue collectives early and wait for them late, within a memory bound.

Traced code waits for each collective right after issuing it, so all
communication is exposed. This pass moves nodes (it never adds, removes or
rewires one) so that Inductor's code overlaps communication with compute:

* every wait, with the copy-out that follows it, sinks to just before the
  first use of its result;
* the all-gather of bucket ``k`` (with its copy-in) is issued just before the
  wait of bucket ``k - prefetch_depth``, i.e. while bucket ``k - depth``'s
  compute runs (FSDP2's prefetch); the first ``depth`` buckets go to the top
  of the graph, where in backward they overlap the loss gradient;
  ``max_inflight_bytes`` lowers the depth for a bucket whose gathered bytes
  would exceed it; a prefetch hint (``set_modules_to_forward_prefetch`` /
  ``_backward_prefetch``, carried in the tag) overrides both: the hinted
  all-gather, and any all-gather between the two, is issued before the wait
  of the hinting unit's all-gather;
* a prefetch does not delay a collective that is not ours (tensor
  parallelism's, which the next matmul waits on): where one lies between the
  prefetch's place and the all-gather's own, the all-gather goes to the first
  point (there, or right after one of those collectives' waits) from which,
  by the cost model (``hardware_profile``), it is done before the next of them
  is issued, else after the last of them;
* each all-reduce of gradients (HSDP's replicate dimension, replicated
  parameters) is waited at its first use;
* each reduce-scatter is issued as soon as its gradients exist (bucketing
  already places it there) and waited at its first use, but before the issue
  of reduce-scatter ``k + reduce_scatter_depth``, so at most that many
  full-size gradient buffers are alive at once.

Invariant: the same nodes and edges, a valid topological order, and the same
relative order of collective issues as before (so every rank, making the same
decisions from the same graph, issues the same sequence).
"""

from __future__ import annotations

import logging

import torch.fx as fx

from fsdp_compile.base.compat import stable_topological_sort
from fsdp_compile.passes.cost_model import collective_seconds, compute_seconds, get_profile
from fsdp_compile.passes.graph_utils import inputs_after, move_before
from fsdp_compile.runtime.vocabulary import (
    WAIT,
    Collective,
    is_backward_graph,
    is_call,
    is_collective_issue,
    our_collectives,
    tag_of,
)

log = logging.getLogger("fsdp_compile.passes.reordering")

# FX nodes compare by their position in the graph (``a < b``: ``a`` comes first),
# kept current as nodes move.


def tail_of(c: Collective) -> list[fx.Node]:
    """The wait and the copy-out chain traced with it (same role), in graph order."""
    tail, stack = [c.wait], list(c.wait.users)
    while stack:
        node = stack.pop()
        tag = tag_of(node)
        if node in tail or not is_call(node) or tag is None or tag.role is not c.tag.role:
            continue
        tail.append(node)
        stack.extend(node.users)
    return sorted(tail)


def sink_tail(c: Collective) -> None:
    """Move the wait and its copy-out to just before the first outside use of the result."""
    tail = tail_of(c)
    members = set(tail)
    outside_users = [u for n in tail for u in n.users if u not in members]
    if outside_users:
        move_before(tail, min(outside_users))


def head_of(c: Collective, before: fx.Node) -> list[fx.Node] | None:
    """The issue and every input it needs that sits after ``before``, or ``None`` if one
    of those is real compute (the issue then cannot move above ``before``)."""
    return inputs_after(c.issue, before)


def hinted_prefetch_source(all_gathers: list[Collective], k: int, hint_key: str) -> int | None:
    """Index of the all-gather (before ``k``) of the unit that asked to prefetch
    all-gather ``k`` (tag field ``hint_key``), or ``None`` without a usable hint."""
    by = getattr(all_gathers[k].tag, hint_key)
    if by is None:
        return None
    for j in range(k):
        if all_gathers[j].tag.unit_fqn == by:
            return j
    log.debug(
        "prefetch hint ignored: unit %r asked to prefetch unit %r, but has no all-gather before it in this graph",
        by or "(root)",
        all_gathers[k].tag.unit_label,
    )
    return None


def _prefetch_target(all_gathers: list[Collective], k: int, depth: int, max_inflight_bytes: int | None) -> int | None:
    """Index of the all-gather whose wait all-gather ``k`` goes before (``-1``: the top of
    the graph), or ``None`` if it stays where it is."""
    if depth < 1:
        return None
    j = k - depth
    if max_inflight_bytes is not None:
        gathered = [c.input_bytes * c.world_size for c in all_gathers]
        while j < k and sum(gathered[max(j, 0) : k + 1]) > max_inflight_bytes:
            j += 1
        if j == k:
            log.debug(
                "all-gather of unit %r not prefetched: max_inflight_bytes=%d would be exceeded",
                all_gathers[k].tag.unit_label,
                max_inflight_bytes,
            )
            return None
    return j


def clear_of_foreign_collectives(c: Collective, target: fx.Node, profile: str) -> fx.Node:
    """Where all-gather ``c``, to be prefetched before ``target``, goes so that it delays
    no collective that is not ours issued between ``target`` and ``c`` (module
    docstring). Costs leave out our own copies, which differ between ranks."""
    foreign = [n for n in _nodes_between(target, c.issue) if is_collective_issue(n) and tag_of(n) is None]
    if not foreign:
        return target
    hardware, notes = get_profile(profile), set()
    duration = collective_seconds(c.issue, hardware, notes)
    waits = [next((u for u in f.users if u.target is WAIT), f) for f in foreign]
    candidates = [target, *(w.next for w in waits if w.next < c.issue)]
    for anchor in candidates:
        later = [f for f in foreign if f > anchor]
        if head_of(c, anchor) is None:
            continue
        if not later:
            return anchor
        busy = sum(compute_seconds(n, hardware, notes) for n in _nodes_between(anchor, later[0]) if tag_of(n) is None)
        if busy >= duration:
            return anchor
    return candidates[-1] if head_of(c, candidates[-1]) is not None else target


def _nodes_between(first: fx.Node, end: fx.Node) -> list[fx.Node]:
    """``first`` and the nodes after it, up to (without) ``end``."""
    out, node = [], first
    while node is not end and node.op != "output":
        out.append(node)
        node = node.next
    return out


def prefetch_all_gathers(
    all_gathers: list[Collective], depth: int, max_inflight_bytes: int | None = None, profile: str | None = None
) -> None:
    """Issue all-gather ``k`` before the wait of all-gather ``k - depth``, or of the
    hinting unit's all-gather (see module docstring)."""
    if not all_gathers:
        return
    graph = all_gathers[0].issue.graph
    hint_key = "backward_prefetched_by" if is_backward_graph(graph) else "forward_prefetched_by"
    top = next(n for n in graph.nodes if n.op != "placeholder")
    for k, c in enumerate(all_gathers):
        hinted = hinted_prefetch_source(all_gathers, k, hint_key)
        if hinted is not None:
            # All-gathers between the two go first (issue order is kept: they are needed sooner).
            target = all_gathers[hinted].wait
            for between in all_gathers[hinted + 1 : k + 1]:
                if between.issue > target:
                    move_before(head_of(between, target) or [], target)
            log.debug(
                "all-gather of unit %r issued before the wait of unit %r (prefetch hint)",
                c.tag.unit_label,
                all_gathers[hinted].tag.unit_label,
            )
            continue
        j = _prefetch_target(all_gathers, k, depth, max_inflight_bytes)
        if j is None:
            continue
        target = top if j < 0 else all_gathers[j].wait
        if profile is not None:
            target = clear_of_foreign_collectives(c, target, profile)
        head = head_of(c, target)
        if head is None:
            log.debug("all-gather of unit %r not prefetched: its input needs compute that runs later", c.tag.unit_label)
            continue
        move_before(head, target)
        where = "the top of the graph" if j < 0 else f"the wait of unit {all_gathers[j].tag.unit_label!r}"
        log.debug("all-gather of unit %r issued before %s", c.tag.unit_label, where)


def bound_reduce_scatters(reduce_scatters: list[Collective], depth: int) -> None:
    """Wait for reduce-scatter ``k`` before reduce-scatter ``k + depth`` is issued."""
    for c, later in zip(reduce_scatters, reduce_scatters[depth:], strict=False):  # each with the one depth later
        tail = tail_of(c)
        if tail[0] > later.issue:
            move_before(tail, later.issue)
            log.debug(
                "reduce-scatter of unit %r waited before reduce-scatter of unit %r is issued (depth %d)",
                c.tag.unit_label,
                later.tag.unit_label,
                depth,
            )


def reorder_for_overlap(
    graph: fx.Graph,
    *,
    prefetch_depth: int = 1,
    reduce_scatter_depth: int = 1,
    max_inflight_bytes: int | None = None,
    profile: str | None = None,
) -> None:
    """Early issues, late waits (module docstring); moves nodes only. ``profile``: the
    cost model's hardware, to keep prefetches clear of others' collectives (``None``:
    prefetch regardless)."""
    all_gathers = our_collectives(graph, "all_gather")
    reduce_scatters = our_collectives(graph, "reduce_scatter")
    for c in all_gathers + reduce_scatters + our_collectives(graph, "all_reduce"):
        sink_tail(c)
    prefetch_all_gathers(all_gathers, prefetch_depth, max_inflight_bytes, profile)
    bound_reduce_scatters(reduce_scatters, reduce_scatter_depth)
    stable_topological_sort(graph)
    graph.lint()
