"""Reshard-after-forward: decide which gathered parameters the backward re-gathers.

Runs on the joint (forward + backward) graph before AOTAutograd partitions it.
By default the partitioner saves every collective's output for the backward
(``force_save_collectives``): a compiled FSDP would then keep every gathered
parameter alive from forward to backward, which is DDP's memory, not FSDP's.
Tagging a unit's all-gather chain ``MUST_RECOMPUTE`` makes the partitioner
re-run the chain (all-gather, wait, views) in the backward graph instead.
"""

from __future__ import annotations

import torch.fx as fx

from fsdp_compile._compat import CheckpointPolicy, is_backward_node
from fsdp_compile.runtime.vocabulary import Role, is_call, is_view, tag_of

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
