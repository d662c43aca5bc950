"""Hand-built FX graphs in the shape our runtime traces, for pass tests.

``build_unit_graph`` makes a forward-like chain of units (each: per-parameter
all-gather, wait, narrow; then addmm + relu) followed by a backward-like tail
(per-parameter reduce-scatters of gradients), with fake values on every node
and our annotations on the collective chains, as Dynamo/AOTAutograd leave them.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fsdp_compile.passes.bucketing import PAD_DIM0
from fsdp_compile.passes.graph_utils import emit
from fsdp_compile.runtime import CollectiveTag, Role, ShardLayout
from fsdp_compile.runtime.vocabulary import ALL_GATHER, REDUCE_SCATTER, WAIT, aten

DIM, BATCH = 6, 3


def fake_placeholder(graph: fx.Graph, mode: FakeTensorMode, name: str, shape, dtype=torch.float32) -> fx.Node:
    """A graph input with a fake value of ``shape`` (what passes read as ``meta["val"]``)."""
    node = graph.placeholder(name)
    with mode:
        node.meta["val"] = torch.empty(shape, dtype=dtype)
    return node


def build_unit_graph(
    world_size: int,
    rank: int,
    group_name: str,
    n_units: int = 3,
    dims=(5, 6, 7),
    bias_dtype=torch.float32,
    forward_prefetched_by: dict[str, str] | None = None,
) -> tuple[fx.GraphModule, list]:
    """Returns the graph module and the (real) input shapes, in placeholder order.

    ``forward_prefetched_by`` maps a unit to the unit that hints its prefetch
    (``set_modules_to_forward_prefetch``), recorded in the all-gathers' tags."""
    hints = forward_prefetched_by or {}
    graph = fx.Graph()
    mode = FakeTensorMode()
    input_shapes = []

    def placeholder(name: str, shape, dtype=torch.float32) -> fx.Node:
        input_shapes.append(tuple(shape))
        return fake_placeholder(graph, mode, name, shape, dtype)

    def unshard(shard: fx.Node, layout: ShardLayout, unit: str, name: str) -> fx.Node:
        tag = CollectiveTag(Role.UNSHARD, f"{unit}.{name}", unit, True, hints.get(unit))
        padded = shard
        if layout.local_rows != layout.rows_per_rank:
            padded = emit(graph, PAD_DIM0, (shard, layout.rows_per_rank), tag=tag)
        gathered = emit(graph, ALL_GATHER, (padded, world_size, group_name), tag=tag)
        waited = emit(graph, WAIT, (gathered,), tag=tag)
        if layout.rows_per_rank * world_size != layout.dim0:
            waited = emit(graph, aten.slice.Tensor, (waited, 0, 0, layout.dim0), tag=tag)
        return waited

    def reduce(grad: fx.Node, layout: ShardLayout, unit: str, name: str) -> fx.Node:
        tag = CollectiveTag(Role.REDUCE_GRAD, f"{unit}.{name}", unit, True)
        full_rows = layout.rows_per_rank * world_size
        if full_rows != layout.dim0:
            grad = emit(graph, PAD_DIM0, (grad, full_rows), tag=tag)
        issued = emit(graph, REDUCE_SCATTER, (grad, "avg", world_size, group_name), tag=tag)
        waited = emit(graph, WAIT, (issued,), tag=tag)
        if layout.local_rows != layout.rows_per_rank:
            waited = emit(graph, aten.slice.Tensor, (waited, 0, 0, layout.local_rows), tag=tag)
        return waited

    x = placeholder("x", (BATCH, DIM))
    layouts, shards = [], []
    for u in range(n_units):
        out_dim = dims[u % len(dims)]
        w = ShardLayout((out_dim, DIM), world_size, rank, group_name)
        b = ShardLayout((out_dim,), world_size, rank, group_name)
        layouts.append((w, b))
        shards.append((placeholder(f"w{u}", w.local_shape), placeholder(f"b{u}", b.local_shape, bias_dtype)))
    h, outputs = x, []
    for u, ((w, b), (w_shard, b_shard)) in enumerate(zip(layouts, shards, strict=True)):
        unit = f"layers.{u}"
        w_full = unshard(w_shard, w, unit, "weight")
        b_full = unshard(b_shard, b, unit, "bias")
        if bias_dtype != torch.float32:
            b_full = emit(graph, aten._to_copy.default, (b_full,), {"dtype": torch.float32})
        wt = emit(graph, aten.t.default, (w_full,))
        y = emit(graph, aten.addmm.default, (b_full, h, wt))
        y = emit(graph, aten.relu.default, (y,))
        # Back to DIM columns so units chain: y[:, :DIM] padded / cut.
        h = emit(graph, aten.slice.Tensor, (y, 1, 0, min(DIM, y.meta["val"].shape[1])))
        if h.meta["val"].shape[1] < DIM:
            h = emit(graph, aten.constant_pad_nd.default, (h, [0, DIM - h.meta["val"].shape[1]]))
        outputs.append(h)
    # Backward-like tail: a "gradient" per parameter from the activations, then reduce.
    for u, ((w, b), _) in reversed(list(enumerate(zip(layouts, shards, strict=True)))):
        unit = f"layers.{u}"
        act = outputs[u]
        gw = emit(graph, aten.mm.default, (emit(graph, aten.t.default, (act,)), x))  # [DIM, DIM]
        gw = emit(graph, aten.slice.Tensor, (emit(graph, aten.repeat.default, (gw, [2, 1])), 0, 0, w.dim0))
        gb = emit(graph, aten.sum.dim_IntList, (gw, [1]))
        if bias_dtype != torch.float32:
            gb = emit(graph, aten._to_copy.default, (gb,), {"dtype": bias_dtype})
        outputs.append(reduce(gw, w, unit, "weight"))
        outputs.append(reduce(gb, b, unit, "bias"))
    graph.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), graph), input_shapes


def node_signature(graph: fx.Graph) -> set:
    """Nodes and edges, independent of order (for 'moves nodes only' checks)."""
    return {(n.name, str(n.target), tuple(str(a) for a in n.all_input_nodes)) for n in graph.nodes}


def build_root_used_apart_graph(
    world_size: int, rank: int, group_name: str, n_layers: int = 2, with_norm: bool = True
) -> fx.GraphModule:
    """A root unit (``""``) whose parameters are used apart, as a decoder's token
    embedding and output projection: the root's all-gathers are traced together at the
    step's start, ``embed`` used first, ``norm`` (unless ``with_norm=False``) and ``head``
    after every layer; each layer a unit of its own. Backward-like tail: ``head``'s and
    ``norm``'s gradients reduced first, then the layers', ``embed``'s last.
    ``embed``/``head`` have 7 rows (rank 1 of 2 pads them); the shapes carry fake values
    only (structure tests)."""
    graph = fx.Graph()
    mode = FakeTensorMode()

    def unshard(shard: fx.Node, layout: ShardLayout, unit: str, name: str) -> fx.Node:
        tag = CollectiveTag(Role.UNSHARD, f"{unit}.{name}" if unit else name, unit, False)
        padded = shard
        if layout.local_rows != layout.rows_per_rank:
            padded = emit(graph, PAD_DIM0, (shard, layout.rows_per_rank), tag=tag)
        waited = emit(graph, WAIT, (emit(graph, ALL_GATHER, (padded, world_size, group_name), tag=tag),), tag=tag)
        if layout.rows_per_rank * world_size != layout.dim0:
            waited = emit(graph, aten.slice.Tensor, (waited, 0, 0, layout.dim0), tag=tag)
        return waited

    def reduce(grad: fx.Node, layout: ShardLayout, unit: str, name: str) -> None:
        tag = CollectiveTag(Role.REDUCE_GRAD, f"{unit}.{name}" if unit else name, unit, False)
        full_rows = layout.rows_per_rank * world_size
        if full_rows != layout.dim0:
            grad = emit(graph, PAD_DIM0, (grad, full_rows), tag=tag)
        outputs.append(emit(graph, WAIT, (emit(graph, REDUCE_SCATTER, (grad, "avg", world_size, group_name), tag=tag),), tag=tag))

    x = fake_placeholder(graph, mode, "x", (BATCH, DIM))
    shapes = {"embed": (7, DIM), "norm": (DIM,), "head": (7, DIM)} if with_norm else {"embed": (7, DIM), "head": (7, DIM)}
    shapes.update({f"layers.{i}.weight": (DIM, DIM) for i in range(n_layers)})
    layouts = {name: ShardLayout(shape, world_size, rank, group_name) for name, shape in shapes.items()}
    shards = {name: fake_placeholder(graph, mode, name.replace(".", "_"), layouts[name].local_shape) for name in shapes}
    outputs: list[fx.Node] = []
    root = {name: unshard(shards[name], layouts[name], "", name) for name in shapes if "." not in name}
    h = emit(graph, aten.mm.default, (x, emit(graph, aten.t.default, (emit(graph, aten.slice.Tensor, (root["embed"], 0, 0, DIM)),))))
    for i in range(n_layers):
        w = unshard(shards[f"layers.{i}.weight"], layouts[f"layers.{i}.weight"], f"layers.{i}", "weight")
        h = emit(graph, aten.relu.default, (emit(graph, aten.mm.default, (h, emit(graph, aten.t.default, (w,)))),))
    if with_norm:
        h = emit(graph, aten.mul.Tensor, (h, root["norm"]))
    logits = emit(graph, aten.mm.default, (h, emit(graph, aten.t.default, (root["head"],))))
    outputs.append(logits)
    g_head = emit(graph, aten.mm.default, (emit(graph, aten.t.default, (logits,)), h))  # [7, DIM]
    reduce(g_head, layouts["head"], "", "head")
    if with_norm:
        reduce(emit(graph, aten.sum.dim_IntList, (h, [0])), layouts["norm"], "", "norm")
    g = emit(graph, aten.mm.default, (emit(graph, aten.t.default, (h,)), h))  # [DIM, DIM]
    for i in reversed(range(n_layers)):
        g = emit(graph, aten.relu.default, (g,))
        reduce(g, layouts[f"layers.{i}.weight"], f"layers.{i}", "weight")
    g_embed = emit(graph, aten.slice.Tensor, (emit(graph, aten.repeat.default, (g, [2, 1])), 0, 0, 7))
    reduce(g_embed, layouts["embed"], "", "embed")
    graph.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), graph)
