"""Inductor's FX-graph cache key, made to tell our graphs apart and to agree across processes.

Inductor keys its FX-graph cache by pickling the graph with ``FxGraphCachePickler``.
:func:`make_graph_cache_keys_stable` extends that pickler (once, when the passes are
installed; never at import) so that the key

* is the same in every process for the same graph: a ``DeviceMesh`` (a ``DTensor``
  parameter brings one in) is keyed by its state without its cached ``_hash``, which
  is computed from an object that differs per process; every field it hashes stays in;
* differs for graphs that differ only in their nodes' ``fx_annotate`` values (units,
  prefetch hints), which our passes read and the pickled code does not show.
"""

from __future__ import annotations

import functools

from fsdp_compile.base.compat import device_mesh_class, fx_graph_cache_pickler

__all__ = ["make_graph_cache_keys_stable"]


def _mesh_for_cache_key(mesh):
    """A ``DeviceMesh``'s pickled state without its cached ``_hash``."""
    state = {k: v for k, v in mesh.__getstate__().items() if k != "_hash"}
    return _identity, ((type(mesh).__qualname__, sorted(state.items())),)


def _identity(x):
    return x


def _with_annotations(reduce_graph, gm):
    """``reduce_graph(gm)`` with every node's ``fx_annotate`` value added to the pickled state."""
    fn, (state, *rest) = reduce_graph(gm)
    annotations = [(node.name, node.meta["custom"]) for node in gm.graph.nodes if node.meta.get("custom")]
    return fn, ({**state, "_annotations": repr(annotations)}, *rest)


def make_graph_cache_keys_stable() -> None:
    """Make Inductor's FX-graph cache key as the module docstring says. Idempotent."""
    pickler = fx_graph_cache_pickler()
    if getattr(pickler, "_fsdp_compile_stable_keys", False):
        return
    original_init = pickler.__init__
    mesh_class = device_mesh_class()

    def __init__(self, gm, *args, **kwargs):
        original_init(self, gm, *args, **kwargs)
        self.dispatch_table[mesh_class] = _mesh_for_cache_key
        reduce_graph = self.dispatch_table.get(type(gm), type(gm).__reduce__)
        self.dispatch_table[type(gm)] = functools.partial(_with_annotations, reduce_graph)

    pickler.__init__ = __init__
    pickler._fsdp_compile_stable_keys = True
