"""Parameters typed by ``spmd_types`` (torchtitan's default ``spmd_backend="spmd_types"``).

Such a parameter is a plain tensor, the local piece of a tensor laid out over the mesh
axes its annotation names: ``S(d)`` split on dim ``d``, ``R`` or ``I`` whole on each rank
(``spmd_types.get_local_type`` and its ``PartitionSpec``). With ``dp_mesh_dims``, FSDP2
(torch 2.15) shards it, and so does this library, as the ``DTensor`` on the full mesh that
annotation describes: ``Replicate()`` on the data-parallel dims (an annotation there must be
``R``: FSDP reduces that gradient), the annotation's placement on each other dim (which must
be annotated; an annotation of some axes only is completed from spmd_types' current mesh at
``fully_shard`` time, ``R`` on the axes it leaves out, as FSDP2 completes it). The module
computes, as before sharding, on a plain tensor: the gathered ``DTensor``'s local tensor,
typed again with the completed annotation where spmd_types is type checking (eagerly; the
gathers run outside the checker). Its gradient is read as the annotation's backward type says
(spmd_types' tied forward/backward typing: ``R`` -> ``P``, ``S(d)`` -> ``S(d)``, ``I`` ->
``I``): partial over the data-parallel dims, which FSDP reduce-scatters, and, on a
tensor-parallel dim where the parameter is ``R``, partial too, so it is all-reduced over
that dim (a sequence-parallel norm weight's gradient).

What cannot be sharded raises FSDP2's ``ValueError``, in its words (torch's own tests compare
them), with a note naming the unit and the parameter. spmd_types is never imported by this
library: a tensor can only carry an annotation where the user's code imported it, so it is
looked up in ``sys.modules``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

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
    grad_placements: tuple  # the types' backward: Partial() on the data-parallel dims
    restore_type: dict  # what a read is typed as: the annotation, completed with R
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
        """``local`` typed for the type checker."""
        _spmd_types().assert_type(local, self.restore_type, partition_spec=self.partition_spec)
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


def spmd_typing_of(param: torch.Tensor, name: str, fqn: str, spmd_mesh: SpmdMesh | None, unit_name: str) -> SpmdTyping | None:
    """The layout of a parameter typed by spmd_types (``None`` for an untyped one), or
    FSDP2's error where FSDP cannot shard it (before any collective), with a note naming
    the unit and the parameter (``name``: its name in its module, as FSDP2 names it)."""
    local_type = local_type_of(param)
    if not local_type:
        return None
    try:
        return _resolve(param, name, local_type, spmd_mesh)
    except ValueError as e:
        if hasattr(e, "add_note"):  # (Python 3.11)
            e.add_note(
                f"fully_shard({unit_name}): parameter {fqn!r}, typed by spmd_types ({describe(local_type)}). FSDP shards a "
                "typed parameter as the DTensor its type describes on the full mesh passed with dp_mesh_dims: R (or no "
                "type) on the data-parallel dims, a type on each other dim"
            )
        raise


def typed_as_dtensor(param: nn.Parameter, fqn: str, spmd_mesh: SpmdMesh | None) -> tuple[SpmdTyping | None, nn.Parameter]:
    """A parameter typed by spmd_types (``fully_shard`` checked it): its typing and the
    ``DTensor`` parameter FSDP shards in its place; ``(None, param)`` for any other."""
    typing = spmd_typing_of(param, fqn, fqn, spmd_mesh, "")
    return (None, param) if typing is None else (typing, typing.as_dtensor(param, spmd_mesh.mesh))


def _resolve(param: torch.Tensor, name: str, local_type: dict, spmd_mesh: SpmdMesh | None) -> SpmdTyping:
    if spmd_mesh is None or spmd_mesh.mesh.mesh_dim_names is None:
        raise ValueError(
            "spmd_types parameters require fully_shard() to be called with both a named full DeviceMesh for FSDP "
            "storage and dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...), where shard names the mesh axis "
            "or axes FSDP shards parameters across and replicate names the HSDP/DDP mesh axis or axes FSDP replicates "
            "across."
        )
    spmd = _spmd_types()
    from spmd_types.runtime import get_partition_spec  # (imported by the user's code already)
    from spmd_types.types import partition_spec_to_shard_types

    partition_spec = get_partition_spec(param)
    types = dict(local_type)
    if partition_spec is not None:
        types.update(partition_spec_to_shard_types(partition_spec))
    mesh = spmd_mesh.mesh
    storage = tuple(spmd.MeshAxis.of(mesh.get_group(dim_name)) for dim_name in mesh.mesh_dim_names)
    restore_mesh = _restore_mesh(name, tuple(types), storage, local_type)
    storage_types = _types_on_storage_dims(name, types, storage, spmd_mesh)
    placements = tuple(spmd.spmd_type_to_dtensor_placement(t) for t in storage_types)
    grad_placements = tuple(spmd.spmd_type_to_dtensor_placement(t.backward_type()) for t in storage_types)
    restore_type = {axis: local_type.get(axis, spmd.R) for axis in restore_mesh}
    return SpmdTyping(placements, grad_placements, restore_type, partition_spec)


def _spans_same_ranks(lhs: tuple, rhs: tuple) -> bool:
    """Whether two sets of mesh axes span the same ranks (spmd_types' normal form)."""
    from spmd_types._mesh_axis import flatten_axes

    spmd = _spmd_types()
    lhs, rhs = spmd.normalize_mesh(frozenset(lhs)), spmd.normalize_mesh(frozenset(rhs))
    if not lhs or not rhs:
        return lhs == rhs
    return flatten_axes(tuple(lhs)) == flatten_axes(tuple(rhs))


def _restore_mesh(name: str, annotated: tuple, storage: tuple, local_type: dict) -> tuple:
    """The axes a read is typed on: the annotation's where they span the storage mesh's
    ranks, else spmd_types' current mesh (at ``fully_shard`` time)."""
    if _spans_same_ranks(annotated, storage):
        restore = annotated
    elif (current := _spmd_types().current_mesh()) is not None:
        restore = tuple(current)
    else:
        raise ValueError(
            f"Parameter '{name}' has partial spmd_types annotations that cannot be restored from its FSDP storage mesh. "
            "Fully annotate the parameter on its storage mesh, or wrap fully_shard() in spmd.set_current_mesh(...) when "
            "all parameters in the FSDP unit share one typechecking mesh. Mixed per-parameter typechecking meshes with "
            f"partial annotations are not supported. Annotated axes: {annotated}. Storage mesh axes: {storage}."
        )
    unknown = tuple(axis for axis in local_type if axis not in restore)
    if unknown:
        raise ValueError(
            f"FSDP found spmd_types annotations on parameter '{name}' and will restore runtime annotations on compute "
            f"mesh axes {restore}, but the parameter is annotated on axes {unknown} that are not in that mesh. Annotate "
            "only axes in the compute mesh."
        )
    if not _spans_same_ranks(restore, storage):
        raise ValueError(
            f"Parameter '{name}' uses spmd_types annotations on a typechecking mesh that does not span the same ranks as "
            "its FSDP storage mesh. FSDP can fill omitted FSDP-managed axes only when these meshes span the same rank set. "
            f"Typechecking mesh axes: {restore}. Storage mesh axes: {storage}."
        )
    return restore


def _types_on_storage_dims(name: str, types: dict, storage: tuple, spmd_mesh: SpmdMesh) -> list:
    """The type on each dim of the full mesh: R on the data-parallel dims (an annotation on
    one of them, or on a part of their flattened group, must be R), the annotation's on
    each other dim (which must have one)."""
    from spmd_types._mesh_axis import flatten_axes

    spmd = _spmd_types()
    dp_dims = spmd_mesh.data_parallel_dims
    data_parallel = flatten_axes(tuple(storage[i] for i in dp_dims))
    by_dim = dict.fromkeys(dp_dims, spmd.R)
    for axis, axis_type in types.items():
        if axis <= data_parallel:
            if axis_type is not spmd.R:
                raise ValueError(
                    f"Expected spmd.R on FSDP DP axis {axis} for parameter '{name}' but got {axis_type}. FSDP requires DP "
                    "parameters to be R since it handles the DP gradient reduction."
                )
        elif axis in storage and storage.index(axis) not in dp_dims:
            by_dim[storage.index(axis)] = axis_type
        else:
            raise ValueError(
                f"Parameter '{name}' has spmd_types annotation on axis {axis}, which is neither a non-FSDP storage-mesh "
                "axis nor contained in the FSDP DP mesh."
            )
    missing = tuple(axis for i, axis in enumerate(storage) if i not in by_dim)
    if missing:
        raise ValueError(
            f"Parameter '{name}' has incomplete spmd_types annotations for FSDP storage. Annotated axes: {tuple(types)}. "
            f"Storage mesh axes: {storage}. FSDP mesh dims: {spmd_mesh.dims}. Missing non-FSDP storage axes: {missing}."
        )
    return [by_dim[i] for i in range(len(storage))]
