"""Reshard-after-forward: decide which gathered parameters the backward re-gathers.

Runs on the joint (forward + backward) graph before AOTAutograd partitions it.
By default the partitioner saves every collective's output for the backward
(``force_save_collectives``): a compiled FSDP would then keep every gathered
parameter alive from forward to backward, which is DDP's memory, not FSDP's.
Tagging a unit's all-gather chain ``MUST_RECOMPUTE`` makes the partitioner
re-run the chain (all-gather, wait, views) in the backward graph instead.

With ``reshard_after_forward=<int>`` (FSDP2's resharding to a smaller group),
:func:`regather_from_post_forward_shards` first makes the forward keep this
rank's block of each gathered buffer and the backward re-gather from those
blocks over the smaller group.
"""

from __future__ import annotations

import torch.fx as fx

from fsdp_compile._compat import CheckpointPolicy, is_backward_node, place_in_backward
from fsdp_compile.passes.graph_utils import emit
from fsdp_compile.runtime.vocabulary import ALL_GATHER, WAIT, Role, aten, is_call, is_view, tag_of, val

#: Recompute-region id for our chains; any value works as long as every node
#: of one chain shares it (the partitioner saves a value crossing two ids).
RESHARD_AC_GRAPH_ID = 0


def tag_reshard_after_forward(gm: fx.GraphModule) -> fx.GraphModule:
    """Tag forward nodes of resharded units' unshard chains for recomputation.

    Invariant: only nodes traced under an ``unshard`` annotation whose unit has
    ``reshard_after_forward=True`` are touched, and only their
    ``meta["recompute"]``/``meta["ac_graph_id"]``; the graph's nodes, edges and
    results are unchanged. Units with ``reshard_after_forward=False`` keep the
    partitioner's default (the gathered tensor is saved, not re-gathered).
    """
    for node in gm.graph.nodes:
        if not is_call(node) or is_backward_node(node):
            continue
        tag = tag_of(node)
        if tag is None or tag.role is not Role.UNSHARD or not tag.reshard_after_forward:
            continue
        for chain_node in [node, *_view_users(node)]:
            chain_node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            chain_node.meta["ac_graph_id"] = RESHARD_AC_GRAPH_ID
    return gm


def regather_from_post_forward_shards(gm: fx.GraphModule) -> fx.GraphModule:
    """Resharding to a smaller group: the backward gathers a unit's weights over that
    group, from blocks the forward kept. Runs after :func:`tag_reshard_after_forward`.

    For each forward all-gather whose tag names a smaller group (``reshard_to``)
    and whose gathered tensor (or a view of it) the backward reads, the forward
    keeps a copy of this rank's row block of the gathered buffer (placed after
    the buffer's first other forward use, so the gather's wait is not pulled
    earlier), and every backward read goes to a copy of the view chain rooted at
    an all-gather of those blocks over the smaller group (placed in the backward
    graph, never saved). The original chain loses its recompute tags: the
    partitioner then saves the block, the cheapest value the backward needs.
    A chain that an activation-checkpointed region also reads (recomputed
    forward nodes) is left as :func:`tag_reshard_after_forward` tagged it:
    re-gathered from the full group, as with ``reshard_after_forward=True``.

    Invariant: forward nodes and results are unchanged; every backward consumer
    receives a tensor of the same shape, dtype and values as before (gathering
    the blocks rebuilds the buffer exactly, padding included); all-gathers
    without ``reshard_to`` are untouched.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        tag = tag_of(node) if is_call(node) and node.target is ALL_GATHER and not is_backward_node(node) else None
        if tag is None or tag.role is not Role.UNSHARD or tag.reshard_to is None:
            continue
        (wait,) = node.users
        chain = sorted([wait, *_view_users(wait)])
        readers = [(c, u) for c in chain for u in c.users if u not in chain]
        backward_reads = [(c, u) for c, u in readers if is_backward_node(u)]
        forward_reads = [u for _, u in readers if not is_backward_node(u)]
        if not backward_reads or any(_recomputed_by_a_checkpoint(u) for u in forward_reads):
            continue
        group_name, group_size, index = tag.reshard_to
        rows = val(wait).shape[0] // group_size
        with graph.inserting_after(min(forward_reads, default=chain[-1])):
            block = emit(graph, aten.slice.Tensor, (wait, 0, index * rows, (index + 1) * rows))
        with graph.inserting_after(block):
            kept = emit(graph, aten.clone.default, (block,))
        with graph.inserting_before(min(u for _, u in backward_reads)):
            regathered = emit(graph, ALL_GATHER, (kept, group_size, group_name), tag=tag)
            copies = {wait: emit(graph, WAIT, (regathered,), tag=tag)}
            for c in chain[1:]:
                copies[c] = graph.node_copy(c, lambda n: copies.get(n, n))
        for new in (regathered, *copies.values()):
            place_in_backward(new)
        for c, user in backward_reads:
            user.replace_input_with(c, copies[c])
        for original in [*chain, *(n for n in graph.nodes if not is_backward_node(n) and tag_of(n) == tag)]:
            original.meta.pop("recompute", None)
            original.meta.pop("ac_graph_id", None)
    return gm


def _recomputed_by_a_checkpoint(node: fx.Node) -> bool:
    """A forward node that an activation checkpoint (not our pass) marked for recomputation."""
    policy = node.meta.get("recompute")
    return policy in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE) and tag_of(node) is None


def _view_users(node: fx.Node) -> list[fx.Node]:
    """Forward nodes that only re-view ``node`` (``t``, ``view``, ``transpose``...), transitively.

    A consumer such as ``F.linear`` first views the weight (``aten.t``); if
    only the gather were tagged, the partitioner would save that view, and
    with it the whole gathered buffer.
    """
    found, stack = [], [node]
    while stack:
        for user in stack.pop().users:
            if not is_backward_node(user) and is_view(user):
                found.append(user)
                stack.append(user)
    return found
