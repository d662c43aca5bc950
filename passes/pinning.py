"""Pinning: make the overlap survive Inductor's own scheduling.

Inductor's scheduler may pick any topological order; with
``reorder_for_peak_memory`` (on by default) it prefers one of lower
estimated peak memory, and a prefetched all-gather raises the peak by
design, so it moves each issue down next to its wait and the overlap is
gone. This pass turns the schedule the reordering pass chose into
dependencies, with Inductor's ``control_deps``:

* the first compute node after a collective's issue runs after the issue, and so
  does the first one Inductor keeps as a kernel of its own (a matmul, say: a
  pointwise node may be fused into a later kernel, and its edge is then lost);
* the wait runs after the last compute node before it, and after the last one
  Inductor keeps as a kernel of its own;
* reduce-scatter ``k + depth`` is issued after reduce-scatter ``k``'s wait
  (the in-flight bound);
* every collective in the graph (ours or not) is issued after the one
  before it. Without this, Inductor may order two independent collectives
  differently on two ranks (its memory estimates differ where some ranks
  pad their shards), and the ranks hang in mismatched collectives.

Invariant: values are unchanged (``control_deps`` only adds ordering edges);
every added edge points forward in the current (valid) order, so no cycle.
Run it last: it wraps nodes, which later structural passes would not expect.
"""

from __future__ import annotations

import itertools
import logging

import torch
import torch.fx as fx

from fsdp_compile.base.compat import preserve_node_ordering
from fsdp_compile.passes.cost_model import counts_flops
from fsdp_compile.runtime.vocabulary import is_aten_kernel, is_collective_issue, is_view, our_collectives, positions, tag_of

log = logging.getLogger("fsdp_compile.passes.pinning")


def _is_compute(node: fx.Node) -> bool:
    """A node that becomes a kernel: an aten op on tensors, not a view, not a constant
    (a ``full`` without inputs is folded into its users, so an edge on it is lost)."""
    if not is_aten_kernel(node) or is_view(node) or tag_of(node) is not None:
        return False
    return any(isinstance(i.meta.get("val"), torch.Tensor) for i in node.all_input_nodes)


def _is_own_kernel(node: fx.Node) -> bool:
    """Compute that Inductor never inlines into another kernel: a matmul, convolution or
    attention (an extern kernel or a template of its own), or a custom op (a fallback
    kernel). A pointwise or reduction node may be fused into its users' kernel, and the
    lowering of ``control_deps`` then has no operation to put the edge on: the edge is lost."""
    if not _is_compute(node):
        return False
    return node.target.namespace != "aten" or counts_flops(node.target)


def _first_and_last_anchors(nodes: list[fx.Node], between: list[int]) -> tuple[list[fx.Node], list[fx.Node]]:
    """The compute nodes that pin a collective's overlap: the first and the last between
    its issue and its wait, and the first and the last of those Inductor keeps as kernels
    of their own (see :func:`_is_own_kernel`), whose edges survive lowering."""
    own = [i for i in between if _is_own_kernel(nodes[i])]
    first = [between[0], *own[:1]]
    last = [between[-1], *own[-1:]]
    return [nodes[i] for i in dict.fromkeys(first)], [nodes[i] for i in dict.fromkeys(last)]


def schedule_constraints(
    graph: fx.Graph, reduce_scatter_depth: int = 1, first: fx.Node | None = None
) -> dict[fx.Node, list[fx.Node]]:
    """Dependent node -> nodes it must run after, to keep the current overlap."""
    nodes = list(graph.nodes)
    position = positions(graph)
    compute_positions = [i for i, n in enumerate(nodes) if _is_compute(n)]
    deps: dict[fx.Node, list[fx.Node]] = {}

    def add(dependent: fx.Node, dep: fx.Node) -> None:
        deps.setdefault(dependent, [])
        if dep not in deps[dependent]:
            deps[dependent].append(dep)

    for c in our_collectives(graph):
        lo, hi = position[c.issue], position[c.wait]
        between = [i for i in compute_positions if lo < i < hi]
        if between:
            after_issue, before_wait = _first_and_last_anchors(nodes, between)
            for node in after_issue:
                add(node, c.issue)
            for node in before_wait:
                add(c.wait, node)
    reduce_scatters = our_collectives(graph, "reduce_scatter")
    for k in range(len(reduce_scatters) - reduce_scatter_depth):
        add(reduce_scatters[k + reduce_scatter_depth].issue, reduce_scatters[k].wait)
    issues = [n for n in nodes if is_collective_issue(n)]
    for earlier, later in itertools.pairwise(issues):
        add(later, earlier)
    if first is not None and issues:
        add(issues[0], first)  # e.g. the consistency check runs before any collective
    return deps


def pin_schedule(graph: fx.Graph, reduce_scatter_depth: int = 1, first: fx.Node | None = None) -> None:
    """Add the :func:`schedule_constraints` edges to ``graph``; ``first`` (if given)
    runs before every collective."""
    deps = schedule_constraints(graph, reduce_scatter_depth, first)
    log.debug("pinned the schedule with %d ordering edge(s)", sum(len(v) for v in deps.values()))
    if deps:
        preserve_node_ordering(graph, deps)
