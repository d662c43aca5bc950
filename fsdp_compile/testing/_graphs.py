"""Capture the forward and backward graphs that AOTAutograd hands to a compiler."""

from __future__ import annotations

import torch.fx as fx

from fsdp_compile.base.compat import c10d_functional
from fsdp_compile.runtime.vocabulary import WAIT, is_view
from fsdp_compile.testing._torch_internals import aot_autograd_backend


class GraphCapture:
    """A ``torch.compile`` backend that records the partitioned graphs and runs them as-is.

    ``partitioner="min_cut"`` is the partitioner Inductor uses; ``"default"``
    is ``aot_eager``'s. Our joint-graph passes run in both.
    """

    def __init__(self, partitioner: str = "min_cut") -> None:
        self.partitioner = partitioner
        self.forward_graphs: list[fx.GraphModule] = []
        self.backward_graphs: list[fx.GraphModule] = []
        self.frame_count = 0

    def __call__(self, gm: fx.GraphModule, example_inputs):
        from functorch.compile import make_boxed_func

        self.frame_count += 1

        def forward_compiler(g, _):
            self.forward_graphs.append(g)
            return make_boxed_func(g)

        def backward_compiler(g, _):
            self.backward_graphs.append(g)
            return make_boxed_func(g)

        return aot_autograd_backend(forward_compiler, backward_compiler, self.partitioner)(gm, example_inputs)


def collective_nodes(gm: fx.GraphModule, op) -> list[fx.Node]:
    """Nodes calling ``op`` (e.g. ``c10d_functional.all_gather_into_tensor``)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (op, op.default)]


def saved_all_gathers(forward: fx.GraphModule) -> list[fx.Node]:
    """All-gathers whose result (or a view of it) is a forward-graph output, i.e.
    gathered parameters the forward keeps alive for the backward."""
    origin: dict[fx.Node, fx.Node] = {}
    for ag in collective_nodes(forward, c10d_functional.all_gather_into_tensor):
        stack = list(ag.users)
        while stack:
            node = stack.pop()
            if node in origin:
                continue
            if node.target is WAIT or is_view(node):
                origin[node] = ag
                stack.extend(node.users)
    (output,) = [n for n in forward.graph.nodes if n.op == "output"]
    saved = [origin[a] for a in output.args[0] if isinstance(a, fx.Node) and a in origin]
    return list(dict.fromkeys(saved))
