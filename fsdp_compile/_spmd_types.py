"""Parameters typed by ``spmd_types`` (torchtitan's default ``spmd_backend="spmd_types"``).

Such a parameter is a plain tensor, the local piece of a tensor laid out over the mesh
axes its annotation names: ``S(d)`` split on dim ``d``, ``R`` or ``I`` whole on each rank
(``spmd_types.get_local_type`` and its ``PartitionSpec``). With ``dp_mesh_dims``, FSDP2
(torch 2.15) shards it, and so does this library, as the ``DTensor`` on the full mesh that
annotation describes: ``Replicate()`` on the data-parallel dims (an annotation there must be
``R``: FSDP reduces that gradient), the annotation's placement on each other dim (which must
be annotated). The module computes, as before sharding, on a plain tensor: the gathered
``DTensor``'s local tensor, annotated again as the parameter was where spmd_types is type
checking (eagerly). Its gradient is read as the annotation's backward type says
(spmd_types' tied forward/backward typing: ``R`` -> ``P``, ``S(d)`` -> ``S(d)``, ``I`` ->
``I``): partial over the data-parallel dims, which FSDP reduce-scatters, and, on a
tensor-parallel dim where the parameter is ``R``, partial too, so it is all-reduced over
that dim (a sequence-parallel norm weight's gradient).

spmd_types is never imported by this library: a tensor can only carry an annotation where
the user's code imported it, so it is looked up in ``sys.modules``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from fsdp_compile._tensor_parallel import SpmdMesh

# Where spmd_types keeps a tensor's annotation (its ``get_local_type`` and ``get_partition_spec``).
_ANNOTATION_ATTRIBUTES = ("_local_type", "_partition_spec")


def _spmd_types():
    return sys.modules.get("spmd_types")


def local_type_of(param: torch.Tensor) -> dict:
    """The ``spmd_types`` annotation of a plain tensor, ``{MeshAxis: type}`` (empty for
    none, and for a ``DTensor``, whose placements say what it is)."""
    spmd = _spmd_types()
    if spmd is None or isinstance(param, DTensor) or not hasattr(spmd, "get_local_type"):
        return {}
    return dict(spmd.get_local_type(param) or {})


def describe(local_type: dict) -> str:
    return ", ".join(f"{axis}: {t!r}" for axis, t in local_type.items())


@dataclasses.dataclass(frozen=True)
class SpmdTyping:
    """How a typed parameter is laid out on the full mesh, and how it is read back."""

    placements: tuple  # on the full mesh: Replicate() on the data-parallel dims
    grad_placements: tuple  # the annotation's backward types: Partial() on the data-parallel dims
    local_type: dict  # the annotation, restored on what the module reads
    partition_spec: object

    def as_dtensor(self, param: nn.Parameter, mesh) -> nn.Parameter:
        """The ``DTensor`` parameter the annotation describes (no communication), with the
        attributes users hang on parameters but not the annotation (its placements say it)."""
        dtensor = nn.Parameter(DTensor.from_local(param.detach(), mesh, self.placements, run_check=False), param.requires_grad)
        for key, value in vars(param).items():
            if key not in _ANNOTATION_ATTRIBUTES:
                setattr(dtensor, key, value)
        return dtensor

    def local(self, gathered: DTensor) -> torch.Tensor:
        """What the module reads: ``gathered``'s local tensor, its gradient read as the
        annotation's backward types."""
        return gathered.to_local(grad_placements=self.grad_placements)

    def annotate(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` typed as the parameter was before sharding (for the type checker)."""
        _spmd_types().assert_type(local, self.local_type, partition_spec=self.partition_spec)
        return local


def type_checker():
    """spmd_types, where it is type checking on this thread now (else ``None``): an eager
    read of a sharded parameter then gathers outside the checker (our collectives and
    bookkeeping read untyped tensors, as FSDP2's run under ``no_typecheck``) and types
    what the module reads (:meth:`SpmdTyping.annotate`)."""
    spmd = _spmd_types()
    return spmd if spmd is not None and spmd.is_type_checking() else None


def outside_type_checker():
    """A context in which spmd_types' type checker, if it is on, checks nothing (what an
    eager unit's gathers and reshards run in, as FSDP2's do)."""
    spmd = type_checker()
    return contextlib.nullcontext() if spmd is None else spmd.no_typecheck()


def spmd_typing_of(param: torch.Tensor, fqn: str, spmd_mesh: SpmdMesh | None, unit_name: str) -> SpmdTyping | None:
    """The layout of a parameter typed by spmd_types (``None`` for an untyped one), or an
    error naming it where FSDP cannot shard it (before any collective)."""
    local_type = local_type_of(param)
    if not local_type:
        return None
    call, what = f"fully_shard({unit_name})", f"parameter {fqn!r}, typed by spmd_types ({describe(local_type)})"
    if spmd_mesh is None or spmd_mesh.mesh.mesh_dim_names is None:
        raise ValueError(
            f"{call}: {what}, needs fully_shard called with the named full mesh and dp_mesh_dims="
            'DataParallelMeshDims(shard=..., replicate=...) naming its data-parallel dims (torchtitan\'s "spmd_types" '
            "backend passes both), as FSDP2 requires"
        )
    spmd = _spmd_types()
    from spmd_types.runtime import get_partition_spec  # (imported by the user's code already)
    from spmd_types.types import partition_spec_to_shard_types

    partition_spec = get_partition_spec(param)
    types = dict(local_type)
    if partition_spec is not None:
        types.update(partition_spec_to_shard_types(partition_spec))
    mesh = spmd_mesh.mesh
    axes = [spmd.MeshAxis.of(mesh.get_group(name)) for name in mesh.mesh_dim_names]
    data_parallel = [axes[i] for i in spmd_mesh.data_parallel_dims]
    by_dim = _types_by_mesh_dim(types, axes, data_parallel, f"{call}: {what}")
    placements, grad_placements = [], []
    for dim, name in enumerate(mesh.mesh_dim_names):
        if dim in spmd_mesh.data_parallel_dims:
            placements.append(Replicate())
            grad_placements.append(Partial())
            continue
        if dim not in by_dim:
            raise ValueError(
                f"{call}: {what}, is not annotated on mesh dim {name!r}, which is not data-parallel; annotate it "
                "on every dim of the mesh outside dp_mesh_dims, as FSDP2 requires"
            )
        try:
            placements.append(spmd.spmd_type_to_dtensor_placement(by_dim[dim]))
            grad_placements.append(spmd.spmd_type_to_dtensor_placement(by_dim[dim].backward_type()))
        except ValueError as e:
            raise ValueError(f"{call}: {what}, has no DTensor layout on mesh dim {name!r}: {e}") from e
    return SpmdTyping(tuple(placements), tuple(grad_placements), local_type, partition_spec)


def typed_as_dtensor(param: nn.Parameter, fqn: str, spmd_mesh: SpmdMesh | None) -> tuple[SpmdTyping | None, nn.Parameter]:
    """A parameter typed by spmd_types (``fully_shard`` checked it): its typing and the
    ``DTensor`` parameter FSDP shards in its place; ``(None, param)`` for any other."""
    typing = spmd_typing_of(param, fqn, spmd_mesh, "")
    return (None, param) if typing is None else (typing, typing.as_dtensor(param, spmd_mesh.mesh))


def _types_by_mesh_dim(types: dict, axes: list, data_parallel: list, prefix: str) -> dict:
    """The annotation's type per non-data-parallel mesh dim, after checking that every
    data-parallel axis it names (one of them or a part of their flattened group) is ``R``."""
    from spmd_types._mesh_axis import flatten_axes

    spmd = _spmd_types()
    data_parallel_group = flatten_axes(tuple(data_parallel))
    by_dim = {}
    for axis, axis_type in types.items():
        if axis <= data_parallel_group:
            if axis_type is not spmd.R:
                raise ValueError(
                    f"{prefix}, is {axis_type!r} on the data-parallel axis {axis}; it must be R there (FSDP shards it "
                    "and reduces its gradient over that axis), as FSDP2 requires"
                )
        elif axis in axes and axis not in data_parallel:
            by_dim[axes.index(axis)] = axis_type
        else:
            raise ValueError(
                f"{prefix}, is annotated on axis {axis}, which is neither a dim of the mesh passed to fully_shard nor "
                "inside its data-parallel dims; annotate it on that mesh's dims"
            )
    return by_dim
