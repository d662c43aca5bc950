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

import torch
import torch.fx as fx

from fsdp_compile.base.compat import CheckpointPolicy, is_backward_node, place_in_backward
from fsdp_compile.passes.graph_utils import emit
from fsdp_compile.runtime.vocabulary import ALL_GATHER, WAIT, Role, aten, collective_kind, is_call, is_view, tag_of, val

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
    chains: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if not is_call(node) or is_backward_node(node):
            continue
        tag = tag_of(node)
        if tag is None or tag.role is not Role.UNSHARD or not tag.reshard_after_forward:
            continue
        chains.update([node, *_view_users(node)])
    low_precision = {n for n in chains if _sends_bytes(n)}
    for chain_node in [*chains, *_computed_from_gathered_alone(gm.graph, chains, low_precision)]:
        chain_node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        chain_node.meta["ac_graph_id"] = RESHARD_AC_GRAPH_ID
    return gm


#: Graph inputs this small (a low-precision weight's lookup table, its scalar mean, a
#: scale) may feed what is recomputed from a gathered parameter; larger ones are taken for
#: activations or parameters of their own (a node reading one is left to the partitioner).
_SMALL_INPUT_NUMEL = 64


def _computed_from_gathered_alone(graph: fx.Graph, chains: set[fx.Node], low_precision: set[fx.Node]) -> list[fx.Node]:
    """Forward nodes outside ``chains`` computed from a low-precision parameter's gathered
    bytes (``low_precision``: the all-gathers that send ``uint8``; see ``_low_precision``)
    alone: from chain nodes, graph inputs the chains read, and small graph inputs (its
    dequantization after the post hook, ``weight.to(dtype)``, reads a lookup table and a
    scalar mean). The backward recomputes them from the re-gathered bytes rather than keep
    a full-size dequantized copy (the joint graph's CSE merges the backward's own
    dequantization into the forward's, whose result the partitioner would otherwise
    save). Plain parameters' chains are left as they are; collectives, random and in-place
    ops are never included."""
    if not low_precision:
        return []
    chain_inputs = {i for n in chains for i in n.all_input_nodes if i.op == "placeholder"}
    derived = set(low_precision)
    found: list[fx.Node] = []
    for node in graph.nodes:
        if node in derived or not is_call(node) or is_backward_node(node) or not node.all_input_nodes:
            continue
        if collective_kind(node) is not None or _impure(node):
            continue
        inputs = node.all_input_nodes
        if not any(i in derived for i in inputs):
            continue
        if all(i in derived or i in chains or _small_or_read_by_chain(i, chain_inputs) for i in inputs):
            derived.add(node)
            if node not in chains:
                found.append(node)
    return found


def _sends_bytes(node: fx.Node) -> bool:
    """An all-gather of ``uint8``: a low-precision parameter's payload."""
    if node.target is not ALL_GATHER or not isinstance(node.args[0], fx.Node):
        return False
    value = node.args[0].meta.get("val")
    return value is not None and value.dtype == torch.uint8


def _small_or_read_by_chain(node: fx.Node, chain_inputs: set[fx.Node]) -> bool:
    if node.op != "placeholder":
        return False
    value = node.meta.get("val")
    return node in chain_inputs or (hasattr(value, "numel") and value.numel() <= _SMALL_INPUT_NUMEL)


def _impure(node: fx.Node) -> bool:
    target = node.target
    schema = getattr(target, "_schema", None)
    return bool(schema and (schema.is_mutable or getattr(target, "is_view", False) is False and "rand" in str(target)))


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
