"""Backward tags: give our gradient reductions their own tag where AOTAutograd dropped it.

Our runtime traces a parameter's gradient reduction (``_GatherWithGradSync.backward``:
the cast and scale, the reduce-scatter, the all-reduces) under ``fx_annotate`` with a
gradient role (``REDUCE_GRAD`` / ``REPLICATE_GRAD``), and the passes find the
reductions by it. torch 2.13 keeps that annotation beside the forward node's own on
every backward node. torch 2.11 keeps only the forward node's: each node of the
reduction then carries the gather's tag (role ``UNSHARD``), so no reduce-scatter was
bucketed (one per parameter, 75 a step on an 8-layer Llama on one GPU).

:func:`restore_backward_tags` gives those nodes the tag they were traced under: the
gather's, with the gradient role. A node is one of them when it depends on a tangent
(it is computed in the backward from the loss's gradient) and carries a gather's tag;
the re-gathers of resharded parameters carry that tag too but depend on the shards
alone, and keep it. It does nothing on a graph where any node already carries a
gradient tag (a torch that keeps the annotations).

Invariant: the same nodes, edges and order; only ``node.meta["custom"]`` changes.
"""

from __future__ import annotations

import torch.fx as fx

from fsdp_compile.runtime.vocabulary import GRAD_TAG_KEY, TAG_KEY, WAIT, Role, collective_kind, is_call, is_tangent, tag_of

__all__ = ["restore_backward_tags"]


def _tangent_descendants(graph: fx.Graph) -> set[fx.Node]:
    """Every node computed from a tangent input (a joint or backward graph's
    ``tangents_*`` placeholders), in one pass over the topologically ordered graph."""
    seen: set[fx.Node] = set()
    for node in graph.nodes:
        if is_tangent(node) or any(arg in seen for arg in node.all_input_nodes):
            seen.add(node)
    return seen


def _is_all_reduce(node: fx.Node) -> bool:
    """An all-reduce issue, or the wait on one."""
    if is_call(node) and node.target is WAIT:
        return isinstance(node.args[0], fx.Node) and collective_kind(node.args[0]) == "all_reduce"
    return collective_kind(node) == "all_reduce"


def restore_backward_tags(graph: fx.Graph) -> int:
    """Tag each node of a gradient reduction that carries only its gather's tag with the
    gradient role it was traced under; returns how many nodes it tagged.

    Only parameters whose gradient is reduced in this graph count: without gradient sync
    the backward casts the gradient for its accumulator and reduces nothing, and that
    cast keeps the gather's tag, as torch 2.13 leaves it. The all-reduces (and their
    waits) get ``REPLICATE_GRAD`` when that parameter's gradient is also reduce-scattered
    (HSDP's replicate dimension), ``REDUCE_GRAD`` when it is all-reduced instead (a
    replicated parameter); every other node ``REDUCE_GRAD``.
    """
    if any(isinstance(n.meta.get("custom"), dict) and GRAD_TAG_KEY in n.meta["custom"] for n in graph.nodes):
        return 0
    from_tangents = _tangent_descendants(graph)
    tagged = [n for n in graph.nodes if n in from_tangents and is_call(n) and TAG_KEY in (n.meta.get("custom") or {})]
    reduced = {tag_of(n).param_fqn for n in tagged if collective_kind(n) is not None}
    scattered = {tag_of(n).param_fqn for n in tagged if collective_kind(n) == "reduce_scatter"}
    reduction = [n for n in tagged if tag_of(n).param_fqn in reduced]
    for node in reduction:
        tag = tag_of(node)
        role = Role.REDUCE_GRAD
        if _is_all_reduce(node) and tag.param_fqn in scattered:
            role = Role.REPLICATE_GRAD
        node.meta["custom"] = {**node.meta["custom"], **tag.as_meta(role)}
    return len(reduction)
