"""Graph editing shared by the post-grad passes: adding a node with its value, and
moving a collective's input chain. What a node *is* lives in
``fsdp_compile.runtime.vocabulary``."""

from __future__ import annotations

import weakref

import torch
import torch.fx as fx

from fsdp_compile.base.compat import detect_fake_mode
from fsdp_compile.runtime.vocabulary import CollectiveTag, is_call, is_view, is_zero_constructor, set_tag, tag_of


def emit(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None, *, tag: CollectiveTag | None = None) -> fx.Node:
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
        set_tag(node, tag)
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


def is_movable(node: fx.Node) -> bool:
    """Cheap, side-effect-free nodes that may run earlier with the collective they
    feed: our own tagged nodes (padding, copy-in), views, constant constructors."""
    return is_call(node) and (tag_of(node) is not None or is_view(node) or is_zero_constructor(node))


def inputs_after(node: fx.Node, anchor: fx.Node) -> list[fx.Node] | None:
    """``node`` and every transitive input of it positioned at or after ``anchor``, in
    graph order; ``None`` if one of those inputs (other than ``node``) is not movable.
    (FX nodes compare by position: ``a < b`` when ``a`` comes first.)"""
    found, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if n in seen or n < anchor:
            continue
        seen.add(n)
        if n is not node and not is_movable(n):
            return None
        found.append(n)
        stack.extend(n.all_input_nodes)
    return sorted(found)


def move_before(nodes: list[fx.Node], anchor: fx.Node) -> None:
    """Move ``nodes`` (in their order) to just before ``anchor``."""
    for n in nodes:
        if n is not anchor:
            anchor.prepend(n)
