"""Cross-rank consistency: fail fast, on every rank, instead of hanging.

If two ranks compile graphs whose collective sequences differ (a
rank-dependent branch in the model, a pass deciding differently), they block
forever in mismatched collectives. This pass bakes a fingerprint of the
graph's collective sequence (op, group, reduce op, input shapes and dtypes,
in order; on a multi-dimensional mesh a group is named by its mesh dimension,
since each rank's shard group is a different group; with the group's ranks) into a
``fsdp_compile::check_collective_sequence`` call at the top of the graph, ordered
before the first collective. The first time the graph runs, ranks exchange
fingerprints over a separate gloo group; each pair of ranks compares the collectives
of the groups they both belong to (ranks of different shard groups may legitimately
gather different sizes: uneven tensor-parallel shards), and on any difference every
rank raises an error naming the first differing collective and both ranks' versions.

Cost: two small all-gathers the first time each distinct graph runs.
Limit: a rank that runs a graph its peers never run waits for them until
``fsdp_compile.config.consistency_timeout_s`` and then raises alone.
"""

from __future__ import annotations

import json

import torch
import torch.fx as fx

from fsdp_compile.base.compat import group_ranks
from fsdp_compile.runtime import consistency  # noqa: F401  (registers the op)
from fsdp_compile.runtime.process_groups import group_label
from fsdp_compile.runtime.vocabulary import graph_name, group_of, is_collective_issue, reduce_op_of

CHECK = torch.ops.fsdp_compile.check_collective_sequence.default


def collective_fingerprint(graph: fx.Graph) -> list[list]:
    """One entry per communicating collective, in graph order: op, group, reduce op,
    inputs, and the group's global ranks (``None`` where unknown): ranks compare only the
    collectives of the groups they share (see ``runtime.consistency.shared_sequence``)."""
    entries = []
    for node in graph.nodes:
        if not is_collective_issue(node):
            continue
        group_name = group_of(node)
        group = group_label(group_name) if group_name is not None else "?"
        ranks = group_ranks(group_name) if group_name is not None else None
        reduce_op = reduce_op_of(node) or ""
        first = node.args[0]
        values = first if isinstance(first, (list, tuple)) else [first]
        shapes = []
        for v in values:
            val = v.meta.get("val") if isinstance(v, fx.Node) else None
            if isinstance(val, torch.Tensor):
                shapes.append(f"{str(val.dtype).replace('torch.', '')}{list(val.shape)}")
        entries.append([node.target._opname, group, reduce_op, ",".join(shapes), ranks])
    return entries


def insert_consistency_check(graph: fx.Graph) -> fx.Node | None:
    """Add the check at the top of ``graph``; returns it (``None`` without collectives).

    Invariant: results unchanged (the op returns an unused empty tensor); the
    caller orders the first collective after it.
    """
    fingerprint = collective_fingerprint(graph)
    if not fingerprint:
        return None
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(anchor):
        node = graph.call_function(CHECK, (graph_name(graph), json.dumps(fingerprint)))
    node.meta["val"] = torch.empty(0)
    return node
