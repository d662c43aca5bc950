"""Small helpers shared by the post-grad passes: what a node is, and how to add one."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx

from fsdp_compile._compat import c10d_functional, detect_fake_mode
from fsdp_compile.runtime.collectives import tag_of

aten = torch.ops.aten
ALL_GATHER = c10d_functional.all_gather_into_tensor.default
REDUCE_SCATTER = c10d_functional.reduce_scatter_tensor.default
WAIT = c10d_functional.wait_tensor.default


@dataclass
class Collective:
    """One of our collectives in a graph: its issue node, its wait, and its tag."""

    issue: fx.Node
    wait: fx.Node
    tag: dict

    @property
    def input(self) -> fx.Node:
        return self.issue.args[0]

    @property
    def kind(self) -> str:
        return "all_gather" if self.issue.target is ALL_GATHER else "reduce_scatter"

    @property
    def group_name(self) -> str:
        return self.issue.args[-1]

    @property
    def world_size(self) -> int:
        return self.issue.args[-2]

    @property
    def reduce_op(self) -> str | None:
        return self.issue.args[1] if self.kind == "reduce_scatter" else None

    @property
    def dtype(self) -> torch.dtype:
        return val(self.input).dtype

    @property
    def input_numel(self) -> int:
        return val(self.input).numel()

    @property
    def input_bytes(self) -> int:
        return self.input_numel * val(self.input).element_size()


def is_backward_graph(graph: fx.Graph) -> bool:
    """AOTAutograd names a backward graph's incoming gradients ``tangents_*``."""
    return any(n.name.startswith("tangents") for n in graph.find_nodes(op="placeholder"))


def is_collective_issue(node: fx.Node) -> bool:
    """Any functional collective that communicates (ours or not); not ``wait_tensor``."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target.namespace == "_c10d_functional"
        and target is not WAIT
    )


def val(node: fx.Node) -> torch.Tensor:
    """The (fake) tensor a node produces, recorded by tracing in ``meta["val"]``."""
    return node.meta["val"]


def our_collectives(graph: fx.Graph, kind: str | None = None) -> list[Collective]:
    """Our all-gathers / reduce-scatters (those traced under our annotation), in graph order.

    Collectives without our tag (a user's all-reduce, tensor parallelism) and
    ones whose result is not consumed by exactly one ``wait_tensor`` are left out.
    """
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in (ALL_GATHER, REDUCE_SCATTER):
            continue
        tag = tag_of(node)
        if tag is None or tag["role"] not in ("unshard", "reduce_grad"):
            continue
        users = list(node.users)
        if len(users) != 1 or users[0].target is not WAIT:
            continue
        collective = Collective(node, users[0], tag)
        if kind is None or collective.kind == kind:
            found.append(collective)
    return found


def emit(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None, *, tag: dict | None = None) -> fx.Node:
    """Add ``target(*args, **kwargs)`` at the graph's insertion point, with its ``meta["val"]``.

    The value is computed by running ``target`` on the inputs' recorded
    (fake) values, so Inductor and later passes see correct shapes.
    """
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    values = _plain(fx.node.map_arg(args, lambda n: n.meta.get("val")))
    fake_mode = _fake_mode_of(graph)
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = target(*values, **kwargs)
    if tag is not None:
        node.meta["custom"] = tag
    return node


def _plain(value):
    """FX's immutable containers as plain lists (ops reject ``immutable_list``)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value) if isinstance(value, tuple) else [_plain(v) for v in value]
    return value


_FAKE_MODES: "weakref.WeakKeyDictionary[fx.Graph, object]" = weakref.WeakKeyDictionary()


def _fake_mode_of(graph: fx.Graph):
    """The fake mode the graph's recorded values live in (from its inputs); looked up
    once per graph (``emit`` asks for every node it adds)."""
    if graph not in _FAKE_MODES:
        values = [n.meta.get("val") for n in graph.find_nodes(op="placeholder")]
        _FAKE_MODES[graph] = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    return _FAKE_MODES[graph]


def stable_topological_sort(graph: fx.Graph) -> None:
    """Reorder nodes so each comes after its inputs, otherwise keeping the current order.

    A node whose inputs are not all placed yet waits, and is placed right
    after the last of them. Rewrites insert new nodes where they are wanted
    and let this restore validity, so the result is the wanted order wherever
    that order is legal.
    """
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    waiting_on: dict[fx.Node, list[fx.Node]] = {}
    placed: set[fx.Node] = set()
    order: list[fx.Node] = []

    def missing_inputs(node: fx.Node) -> list[fx.Node]:
        return [i for i in node.all_input_nodes if i not in placed]

    def place(node: fx.Node) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            placed.add(n)
            order.append(n)
            ready = []
            for w in waiting_on.pop(n, []):
                if w not in placed and not missing_inputs(w):
                    ready.append(w)
            # Keep the original relative order among nodes released together.
            stack.extend(sorted(ready, key=position.__getitem__, reverse=True))

    for node in nodes:
        if node in placed:
            continue
        missing = missing_inputs(node)
        if missing:
            for m in missing:
                waiting_on.setdefault(m, []).append(node)
            continue
        place(node)
    if len(order) != len(nodes):
        raise RuntimeError("stable_topological_sort: the graph has a cycle")
    # Relink the nodes in the new order (no copies).
    head = next(iter(graph.nodes))
    if head is not order[0]:
        head.prepend(order[0])
    for before, node in zip(order, order[1:]):
        if before.next is not node:
            before.append(node)


# Constructors that may move with a collective's input chain (padding zeros).
_MOVABLE_CONSTRUCTORS = {aten.full.default, aten.zeros.default, aten.new_zeros.default, aten.empty.memory_format}


def is_movable(node: fx.Node) -> bool:
    """Cheap, side-effect-free nodes that may run earlier with the collective they
    feed: our own tagged nodes (padding, copy-in), views, constant constructors."""
    if node.op != "call_function":
        return False
    target = node.target
    if tag_of(node) is not None:
        return True
    if isinstance(target, torch._ops.OpOverload) and target.is_view:
        return True
    return target in _MOVABLE_CONSTRUCTORS


def inputs_after(node: fx.Node, anchor: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node] | None:
    """``node`` and every transitive input of it positioned at or after ``anchor``, in
    graph order; ``None`` if one of those inputs (other than ``node``) is not movable."""
    limit = order[anchor]
    found, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if n in seen or order[n] < limit:
            continue
        seen.add(n)
        if n is not node and not is_movable(n):
            return None
        found.append(n)
        stack.extend(n.all_input_nodes)
    return sorted(found, key=order.__getitem__)


def move_before(nodes: list[fx.Node], anchor: fx.Node) -> None:
    """Move ``nodes`` (in their order) to just before ``anchor``."""
    for n in nodes:
        if n is not anchor:
            anchor.prepend(n)
