"""One reduce-scatter for a parameter read twice in a step, where autograd adds the two.

A parameter read twice in one compiled step (a block called twice) traces a gather per
read, each with its gradient's reduce-scatter, and autograd adds their results:
``add(wait(RS(g1)), wait(RS(g2)))``. The reduction is linear, so this is
``wait(RS(g1 + g2))``: the parameter's bytes reduced once instead of twice, and eager's
arithmetic (which sums a unit's gradients from every use before one reduction, as
FSDP2's accumulation into the unsharded gradient does). Reductions whose results meet
otherwise (two forwards of a whole model in one compiled function: the root's) stay apart.
"""

from __future__ import annotations

import logging

import torch.fx as fx

from fsdp_compile.passes.graph_utils import emit
from fsdp_compile.runtime.vocabulary import REDUCE_SCATTER, Collective, aten, is_call, our_collectives, val

log = logging.getLogger("fsdp_compile.passes.repeated_reads")


def _same_reduction(a: Collective, b: Collective) -> bool:
    """Reductions of the same parameter's gradient, over the same group, alike in shape."""
    return (
        a.tag.param_fqn == b.tag.param_fqn
        and a.tag.unit_fqn == b.tag.unit_fqn
        and a.issue.args[1:] == b.issue.args[1:]  # reduce op, group size, group name
        and val(a.input).shape == val(b.input).shape
        and val(a.input).dtype == val(b.input).dtype
    )


def _summed_pair(node: fx.Node, waited: dict[fx.Node, Collective]) -> tuple[Collective, Collective] | None:
    """The two reduce-scatters ``node`` adds the results of, if it is such an add."""
    if not (is_call(node) and node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs):
        return None
    first, second = (waited.get(arg) if isinstance(arg, fx.Node) else None for arg in node.args)
    if first is None or second is None or first is second:
        return None
    if len(first.wait.users) != 1 or len(second.wait.users) != 1 or not _same_reduction(first, second):
        return None
    return first, second


def sum_gradients_before_reducing(graph: fx.Graph) -> int:
    """Rewrite each ``add(wait(RS(g1)), wait(RS(g2)))`` of two of our reduce-scatters of
    the same parameter into ``wait(RS(g1 + g2))``, chains of more reads included; returns
    how many reduce-scatters were removed.

    Invariant: the add's users receive a tensor of the same shape and dtype and, up to
    rounding, the same values (the sum is taken before the reduction instead of after);
    the later reduce-scatter stays where it was, with its tag; every other node and
    collective is untouched."""
    removed = 0
    changed = True
    while changed:
        changed = False
        waited = {c.wait: c for c in our_collectives(graph, "reduce_scatter") if c.issue.target is REDUCE_SCATTER}
        for node in list(graph.nodes):
            pair = _summed_pair(node, waited)
            if pair is None:
                continue
            earlier, later = sorted(pair, key=lambda c: c.issue)  # (nodes order by position)
            with graph.inserting_before(later.issue):
                summed = emit(graph, aten.add.Tensor, (earlier.input, later.input))
            later.issue.replace_input_with(later.input, summed)
            node.replace_all_uses_with(later.wait)
            graph.erase_node(node)
            graph.erase_node(earlier.wait)
            graph.erase_node(earlier.issue)
            removed += 1
            changed = True
            break  # the collectives changed: find them again
    if removed:
        log.debug("summed %d gradient(s) of parameters read more than once before their reduce-scatter", removed)
    return removed
