"""Capture the forward and backward graphs that AOTAutograd hands to a compiler."""

from __future__ import annotations

import torch
import torch.fx as fx

from fsdp_compile._compat import c10d_functional


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
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

        self.frame_count += 1

        def forward_compiler(g, _):
            self.forward_graphs.append(g)
            return make_boxed_func(g)

        def backward_compiler(g, _):
            self.backward_graphs.append(g)
            return make_boxed_func(g)

        partition_fn = min_cut_rematerialization_partition if self.partitioner == "min_cut" else default_partition
        return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler, partition_fn=partition_fn)(
            gm, example_inputs
        )


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
            is_wait = node.target is c10d_functional.wait_tensor.default
            is_view = isinstance(node.target, torch._ops.OpOverload) and node.target.is_view
            if is_wait or is_view:
                origin[node] = ag
                stack.extend(node.users)
    (output,) = [n for n in forward.graph.nodes if n.op == "output"]
    saved = [origin[a] for a in output.args[0] if isinstance(a, fx.Node) and a in origin]
    return list(dict.fromkeys(saved))
