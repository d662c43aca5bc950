"""The graph vocabulary: what our traced nodes say about themselves, and how a pass
reads a graph.

The runtime writes a :class:`CollectiveTag` on every node it traces (through
``torch.fx.traceback.annotate``, which Dynamo supports and AOTAutograd carries
into the joint and post-grad graphs); the passes read it back with
:func:`tag_of`. Everything a pass asks of a node (is it a view, a zero
constructor, which collective, over which group) is answered here, once.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from fsdp_compile.base.compat import OpOverload, c10d_functional

#: Key under ``node.meta["custom"]`` holding a tag's fields.
TAG_KEY = "fsdp_compile"
#: The key of a gradient reduction's tag (roles ``REDUCE_GRAD`` / ``REPLICATE_GRAD``),
#: read before :data:`TAG_KEY`. AOTAutograd copies each forward node's annotations onto
#: the backward nodes its autograd node produced, the forward's winning on a shared key
#: (``copy_fwd_metadata_to_bw_nodes``): under one key, the reduce-scatter traced in the
#: gather's backward would read as an ``unshard``.
GRAD_TAG_KEY = "fsdp_compile_grad"

aten = torch.ops.aten
ALL_GATHER = c10d_functional.all_gather_into_tensor.default
ALL_GATHER_OUT = c10d_functional.all_gather_into_tensor_out.default
REDUCE_SCATTER = c10d_functional.reduce_scatter_tensor.default
ALL_REDUCE = c10d_functional.all_reduce.default
#: What ``fsdp_compile.passes.transport`` lowers our all-gathers and reduce-scatters to on gloo.
ALL_TO_ALL = c10d_functional.all_to_all_single.default
WAIT = c10d_functional.wait_tensor.default


class Role(str, enum.Enum):
    """Why the runtime issued a collective (every node traced with it carries the role)."""

    #: Forward all-gather chain of a parameter (pad, gather, wait, narrow); the reshard
    #: pass may mark it for recomputation, the bucketing and reordering passes move it.
    UNSHARD = "unshard"
    #: Eager backward's re-gather of a resharded parameter (saved-tensor hooks); never
    #: in a compiled graph.
    REGATHER = "regather"
    #: Backward gradient reduction: the reduce-scatter chain (or, for a replicated
    #: parameter, its all-reduces).
    REDUCE_GRAD = "reduce_grad"
    #: HSDP's all-reduce over the replicate dimension after the reduce-scatter.
    REPLICATE_GRAD = "replicate_grad"


_GRAD_ROLES = (Role.REDUCE_GRAD, Role.REPLICATE_GRAD)

#: The ``unit_fqn`` of a unit traced as a frame's own sharded unit: a unit compiled on
#: its own (``block.compile()``, ``torch.compile(block)``: one compiled frame per
#: transformer block). Its tags name its parameters relative to the unit, so every
#: block of one class traces the same graph, which Dynamo compiles once and reuses
#: (with the unit's full name in them, each block would recompile).
FRAME_UNIT = "(compiled unit)"


@dataclass(frozen=True)
class CollectiveTag:
    """What the passes know of a node the runtime traced.

    Attributes:
        role: see :class:`Role`.
        param_fqn: the parameter (a bucket: its members, comma-separated); relative
            to its unit under :data:`FRAME_UNIT`.
        unit_fqn: the sharding unit ("" for the root, :data:`FRAME_UNIT` for the unit
            a compiled frame runs on its own).
        reshard_after_forward: the unit's resolved setting.
        reshard_to: with ``reshard_after_forward`` an int: the smaller group the
            forward keeps a shard over, as ``(group name, group size, this rank's
            index in it)``; the backward re-gathers from that shard over that group.
        forward_prefetched_by / backward_prefetched_by: the unit whose forward /
            backward should issue this all-gather (FSDP2's prefetch hints).
        bucket_size: how many parameters' collectives one bucketed node carries.
    """

    role: Role
    param_fqn: str
    unit_fqn: str
    reshard_after_forward: bool
    forward_prefetched_by: str | None = None
    backward_prefetched_by: str | None = None
    bucket_size: int = 1
    reshard_to: tuple[str, int, int] | None = None

    def as_meta(self, role: Role | None = None) -> dict:
        """The ``node.meta["custom"]`` value (what ``fx_annotate`` takes), with ``role``
        instead of the tag's own if given: plain constants, so Dynamo traces building
        it and Inductor's caches pickle it."""
        role = role or self.role
        return {
            GRAD_TAG_KEY if role in _GRAD_ROLES else TAG_KEY: {
                "role": role.value,
                "param_fqn": self.param_fqn,
                "unit_fqn": self.unit_fqn,
                "reshard_after_forward": self.reshard_after_forward,
                "reshard_to": self.reshard_to,
                "forward_prefetched_by": self.forward_prefetched_by,
                "backward_prefetched_by": self.backward_prefetched_by,
                "bucket_size": self.bucket_size,
            }
        }

    @property
    def unit_label(self) -> str:
        """The unit's name for messages ("(root)" for the root unit)."""
        return self.unit_fqn or "(root)"


def tag_of(node: fx.Node) -> CollectiveTag | None:
    """The tag ``node`` was traced (or emitted) under, if any."""
    custom = node.meta.get("custom")
    if not isinstance(custom, dict):
        return None
    fields = custom.get(GRAD_TAG_KEY) or custom.get(TAG_KEY)
    if fields is None:
        return None
    reshard_to = fields.get("reshard_to")
    return CollectiveTag(
        **{**fields, "role": Role(fields["role"]), "reshard_to": None if reshard_to is None else tuple(reshard_to)}
    )


def set_tag(node: fx.Node, tag: CollectiveTag) -> None:
    node.meta["custom"] = tag.as_meta()


# ------------------------------------------------------------------ node kinds


#: Ops that are views in effect although their schema does not declare aliasing.
_VIEW_LIKE = {aten._unsafe_view.default, aten.alias.default}

#: Constructors without tensor inputs (padding zeros, scratch buffers): free to
#: move, cost nothing, and erased with the padding they build.
ZERO_CONSTRUCTORS = {
    aten.full.default,
    aten.zeros.default,
    aten.new_zeros.default,
    aten.empty.memory_format,
    aten.scalar_tensor.default,
}


def is_call(node: fx.Node) -> bool:
    return node.op == "call_function"


def is_view(node: fx.Node) -> bool:
    """A node whose result aliases its first input (``t``, ``view``, ``slice``...)."""
    target = node.target
    return is_call(node) and ((isinstance(target, OpOverload) and target.is_view) or target in _VIEW_LIKE)


def is_alias(node: fx.Node) -> bool:
    """Shares its first input's memory: a view, a ``wait_tensor``, a tuple item."""
    return is_view(node) or node.target is WAIT or node.target is operator.getitem


def is_zero_constructor(node: fx.Node) -> bool:
    return is_call(node) and node.target in ZERO_CONSTRUCTORS


def is_aten_kernel(node: fx.Node) -> bool:
    """An op overload call (becomes a kernel unless it is a view)."""
    return is_call(node) and isinstance(node.target, OpOverload)


# ------------------------------------------------------------------ collectives

#: Communicating functional collectives and what they do.
_COLLECTIVE_KINDS = {
    ALL_GATHER: "all_gather",
    ALL_GATHER_OUT: "all_gather",
    REDUCE_SCATTER: "reduce_scatter",
    ALL_REDUCE: "all_reduce",
}


def is_collective_issue(node: fx.Node) -> bool:
    """Any functional collective that communicates (ours or not); not ``wait_tensor``."""
    target = node.target
    return is_aten_kernel(node) and target.namespace == "_c10d_functional" and target is not WAIT


def collective_kind(node: fx.Node) -> str | None:
    """``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``, another collective's op
    name, or ``None`` for a node that does not communicate."""
    if not is_collective_issue(node):
        return None
    return _COLLECTIVE_KINDS.get(node.target, node.target._opname)


def _schema_args(node: fx.Node) -> dict:
    """The node's arguments by schema name (``group_name``, ``group_size``, ``reduce_op``...)."""
    names = [a.name for a in node.target._schema.arguments]
    return {**dict(zip(names, node.args, strict=False)), **node.kwargs}  # trailing defaults: fewer args


def group_of(node: fx.Node) -> str | None:
    """The process group name a collective runs over."""
    return _schema_args(node).get("group_name")


def world_size_of(node: fx.Node) -> int | None:
    """The group size a collective names (``all_reduce``'s schema names none)."""
    return _schema_args(node).get("group_size")


def reduce_op_of(node: fx.Node) -> str | None:
    return _schema_args(node).get("reduce_op")


def val(node: fx.Node) -> torch.Tensor:
    """The (fake) tensor a node produces, recorded by tracing in ``meta["val"]``."""
    return node.meta["val"]


@dataclass
class Collective:
    """One of our all-gathers or reduce-scatters in a graph: issue, wait, tag."""

    issue: fx.Node
    wait: fx.Node
    tag: CollectiveTag

    @property
    def input(self) -> fx.Node:
        return self.issue.args[0]

    @property
    def kind(self) -> str:
        """What the collective does for us: an all-to-all that
        ``fsdp_compile.passes.transport`` lowered one to says which by its role."""
        if self.issue.target is ALL_TO_ALL:
            return "all_gather" if self.tag.role is Role.UNSHARD else "reduce_scatter"
        return collective_kind(self.issue)

    @property
    def group_name(self) -> str:
        return group_of(self.issue)

    @property
    def world_size(self) -> int:
        if self.issue.target is ALL_TO_ALL:
            return len(_schema_args(self.issue)["output_split_sizes"])
        return world_size_of(self.issue)

    @property
    def reduce_op(self) -> str | None:
        return reduce_op_of(self.issue)

    @property
    def dtype(self) -> torch.dtype:
        return val(self.input).dtype

    @property
    def input_numel(self) -> int:
        return val(self.input).numel()

    @property
    def input_bytes(self) -> int:
        return self.input_numel * val(self.input).element_size()


#: Our collectives that the passes bucket and move, by target and role.
_SCHEDULED = {
    ALL_GATHER: (Role.UNSHARD,),
    REDUCE_SCATTER: (Role.REDUCE_GRAD,),
    ALL_REDUCE: (Role.REDUCE_GRAD, Role.REPLICATE_GRAD),
    ALL_TO_ALL: (Role.UNSHARD, Role.REDUCE_GRAD),  # lowered (gloo), after bucketing and reordering
}


def our_collectives(graph: fx.Graph, kind: str | None = None) -> list[Collective]:
    """Our all-gathers (``UNSHARD``), reduce-scatters and all-reduces of gradients
    (``REDUCE_GRAD``, HSDP's ``REPLICATE_GRAD``), in graph order.

    Collectives without our tag (a user's all-reduce, tensor parallelism) and
    ones whose result is not consumed by exactly one ``wait_tensor`` are left out.
    """
    found = []
    for node in graph.nodes:
        if not is_call(node) or node.target not in _SCHEDULED:
            continue
        tag = tag_of(node)
        if tag is None or tag.role not in _SCHEDULED[node.target]:
            continue
        users = list(node.users)
        if len(users) != 1 or users[0].target is not WAIT:
            continue
        collective = Collective(node, users[0], tag)
        if kind is None or collective.kind == kind:
            found.append(collective)
    return found


def is_tangent(node: fx.Node) -> bool:
    """An incoming gradient of a joint or backward graph: AOTAutograd names them ``tangents_*``."""
    return node.op == "placeholder" and node.name.startswith("tangents")


def is_backward_graph(graph: fx.Graph) -> bool:
    return any(is_tangent(n) for n in graph.find_nodes(op="placeholder"))


def graph_name(graph: fx.Graph) -> str:
    return "backward graph" if is_backward_graph(graph) else "forward graph"


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's index in the graph's current order (valid until a node moves)."""
    return {n: i for i, n in enumerate(graph.nodes)}


def unit_names_in(graph: fx.Graph) -> list[str]:
    """The units whose collectives ``graph`` holds, sorted."""
    return sorted({tag.unit_fqn for tag in map(tag_of, graph.nodes) if tag is not None})
