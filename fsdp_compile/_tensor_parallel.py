"""Parameters that are already DTensors: tensor parallelism (FSDP + TP, 2-D) and
FSDP2's SPMD mesh (``dp_mesh_dims``).

The 2-D recipe is FSDP2's: ``parallelize_module(model, mesh["tp"], plan)`` first, then
``fully_shard(block, mesh=mesh["dp"])``. A TP parameter's *local* tensor is what
FSDP shards along dim 0 over the data-parallel mesh and all-gathers back; the
gathered local tensor is wrapped again as the TP ``DTensor`` the module's forward
expects. The registered parameter is one DTensor over both meshes, with FSDP2's
placements (``_StridedShard`` where TP already splits dim 0), so state dicts,
optimizers and DCP see what they see with FSDP2 + TP.

With an SPMD mesh (``fully_shard(block, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))``)
a parameter is a ``DTensor`` of the *full* mesh with ``Replicate()`` on the data-parallel
dims, and so is what the module reads: the gathered local tensor wrapped on the full
mesh. Its gradient comes back ``Partial()`` on those dims (each data-parallel rank's
batch); FSDP reduces that local gradient itself, so the wrap hands it back ``Partial()``
there and redistributes only the other dims (FSDP2's ``_get_grad_inner_tensor`` does the
same). A gradient ``Replicate()`` on a data-parallel dim (every rank of it ran the same
batch) is divided by the dim's size on the way (``Replicate()`` to ``Partial()``), where
FSDP2 takes it as it is: ``DTensor.from_local``'s own backward, which Dynamo and
AOTAutograd trace with the gradient's real placements (an ``autograd.Function`` of ours
would be traced by Dynamo for the forward's placements only). We take the data-parallel dims
as the mesh's leading ones, (replicate, shard), as ``init_device_mesh`` lays out
torchtitan's ``(dp_replicate, dp_shard, ..., tp)``; the registered parameter is then
laid out as in the 2-D case, on the full mesh itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fsdp_compile.base.compat import concatenate_meshes, is_strided_shard
from fsdp_compile.runtime.process_groups import label_mesh_groups


@dataclass(frozen=True)
class TensorParallelSpec:
    """How a parameter is laid out by tensor parallelism before FSDP shards it."""

    mesh: DeviceMesh  # the TP mesh; with dp_mesh_dims, the full SPMD mesh
    placements: tuple  # on ``mesh``
    shape: torch.Size  # global
    stride: tuple[int, ...]
    # With dp_mesh_dims: how many leading dims of ``mesh`` are data-parallel (``Replicate()``
    # in ``placements``; FSDP's to shard and reduce over); 0 for a TP mesh.
    data_parallel_dims: int = 0

    @classmethod
    def of(cls, param: DTensor, data_parallel_dims: int = 0) -> TensorParallelSpec:
        # (labels for reports and the cross-rank check)
        label_mesh_groups(param.device_mesh, tensor_parallel=True, data_parallel_dims=data_parallel_dims)
        return cls(param.device_mesh, tuple(param.placements), param.shape, param.stride(), data_parallel_dims)

    @property
    def tensor_parallel_placements(self) -> tuple:
        """The placements on the dims that are not data-parallel."""
        return self.placements[self.data_parallel_dims :]

    def shards_on(self, dim: int) -> int:
        """Into how many pieces TP splits dimension ``dim``."""
        n = 1
        for size, placement in zip(self.mesh.shape, self.placements, strict=True):
            if _splits_a_dim(placement) and placement.dim % len(self.shape) == dim:
                n *= size
        return n

    def wrap(self, local_full: torch.Tensor) -> DTensor:
        """The TP ``DTensor`` whose local tensor is ``local_full`` (the gathered TP shard).
        With ``dp_mesh_dims``, its gradient is handed back ``Partial()`` on the data-parallel
        dims (unreduced: FSDP reduces it) and in the forward's placements on the others."""
        grad_placements = None
        if self.data_parallel_dims:
            grad_placements = (Partial(),) * self.data_parallel_dims + self.tensor_parallel_placements
        return DTensor.from_local(
            local_full,
            self.mesh,
            self.placements,
            run_check=False,
            shape=self.shape,
            stride=self.stride,
            grad_placements=grad_placements,
        )


def check_tensor_parallel_param(param: DTensor, fqn: str, dp_mesh: DeviceMesh, unit_name: str) -> None:
    """Raise (before any collective) if FSDP cannot shard this TP parameter over ``dp_mesh``."""
    tp_mesh = param.device_mesh
    if tp_mesh.ndim > 2:
        raise NotImplementedError(
            f"fully_shard({unit_name}): parameter {fqn!r} is a DTensor on a {tp_mesh.ndim}-D mesh "
            f"{tp_mesh.mesh_dim_names}; FSDP + model parallelism supports a 1-D (TP or EP) or 2-D (EP + TP) "
            "mesh, as FSDP2"
        )
    if not all(_splits_a_dim(p) or isinstance(p, Replicate) for p in param.placements):
        raise NotImplementedError(
            f"fully_shard({unit_name}): parameter {fqn!r} has placements {tuple(param.placements)}; "
            "FSDP can shard further only Shard(d), _StridedShard(d) or Replicate() tensor-parallel "
            "parameters (a Partial() parameter must be reduced first)"
        )
    if dp_mesh.mesh_dim_names is not None and tp_mesh.mesh_dim_names is not None:
        shared = set(dp_mesh.mesh_dim_names) & set(tp_mesh.mesh_dim_names)
        if shared:
            raise ValueError(
                f"fully_shard({unit_name}): parameter {fqn!r} is already a DTensor on mesh dimension(s) "
                f"{sorted(shared)}, which fully_shard was asked to shard over. If tensor parallelism was "
                "applied after fully_shard, apply it first; otherwise pass the data-parallel dimension, "
                'e.g. fully_shard(module, mesh=mesh["dp"]) with parameters on mesh["tp"]'
            )
    try:
        concatenate_meshes([dp_mesh, tp_mesh])
    except Exception as e:
        raise ValueError(
            f"fully_shard({unit_name}): parameter {fqn!r} is a DTensor on mesh {_describe(tp_mesh)}, and the "
            f"data-parallel mesh {_describe(dp_mesh)} is not another dimension of the same DeviceMesh. "
            'Build one mesh, e.g. init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp")), apply '
            'parallelize_module on mesh["tp"], then fully_shard(module, mesh=mesh["dp"])'
        ) from e


def _splits_a_dim(placement) -> bool:
    """``Shard(d)``, or ``_StridedShard(d)`` (a packed weight's interleaved split of ``d``)."""
    return isinstance(placement, Shard) or is_strided_shard(placement)


def spmd_mesh(dp_mesh: DeviceMesh, tp: TensorParallelSpec) -> DeviceMesh:
    """The mesh of the registered parameter: the data-parallel dimensions, then TP's (with
    ``dp_mesh_dims``, the full mesh the parameter already is on)."""
    return tp.mesh if tp.data_parallel_dims else concatenate_meshes([dp_mesh, tp.mesh])


def data_parallel_sub_mesh(mesh: DeviceMesh | None, dp_mesh_dims, unit_name: str) -> DeviceMesh:
    """FSDP2's ``dp_mesh_dims`` resolved on the full SPMD ``mesh``: the sub-mesh of its
    data-parallel dims, 1-D (shard) or 2-D (replicate, shard) as for HSDP. Raises, before
    any collective, for what FSDP2 rejects and for the layouts we do not take yet."""
    call = f"fully_shard({unit_name}, dp_mesh_dims={dp_mesh_dims})"
    if mesh is None or mesh.mesh_dim_names is None:
        raise ValueError(
            f"{call}: dp_mesh_dims names dimensions of the full mesh; pass that mesh, with mesh_dim_names, as mesh= "
            '(e.g. init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp")))'
        )
    shard, replicate = tuple(dp_mesh_dims.shard_names), tuple(dp_mesh_dims.replicate_names)
    for name in (*replicate, *shard):
        if name not in mesh.mesh_dim_names:
            raise ValueError(f"{call}: {name!r} is not a dimension of the mesh {tuple(mesh.mesh_dim_names)}")
    if len(shard) != 1 or len(replicate) > 1:
        raise NotImplementedError(
            f"{call}: one shard dimension and at most one replicate dimension are supported, not several flattened "
            "into one (e.g. dp_shard and cp); pass one of each"
        )
    names = (*replicate, *shard)
    if tuple(mesh.mesh_dim_names[: len(names)]) != names:
        raise NotImplementedError(
            f"{call}: the data-parallel dims {names} must lead the mesh {tuple(mesh.mesh_dim_names)}, in the order "
            "(replicate, shard), as torchtitan's (dp_replicate, dp_shard, ..., tp) mesh has them"
        )
    return mesh[names[0]] if len(names) == 1 else mesh[names]


def check_spmd_param(param: nn.Parameter, fqn: str, mesh: DeviceMesh, data_parallel_dims: int, unit_name: str) -> None:
    """Raise (before any collective) unless ``param`` is what ``dp_mesh_dims`` requires: a
    ``DTensor`` of the full ``mesh``, ``Replicate()`` on its leading data-parallel dims."""
    call = f"fully_shard({unit_name}, dp_mesh_dims=...)"
    if not isinstance(param, DTensor):
        raise ValueError(
            f"{call}: parameter {fqn!r} is a plain tensor; with dp_mesh_dims every parameter must be a DTensor on "
            f"the full mesh {tuple(mesh.mesh_dim_names)}, Replicate() on the data-parallel dims (e.g. "
            "distribute_module(module, mesh) or distribute_tensor(p, mesh, placements)), as in FSDP2"
        )
    if param.device_mesh != mesh:
        raise ValueError(
            f"{call}: parameter {fqn!r} is a DTensor on mesh {_describe(param.device_mesh)}, not on the mesh "
            f"passed to fully_shard ({_describe(mesh)}); distribute it on that mesh"
        )
    for dim, placement in enumerate(param.placements):
        if dim < data_parallel_dims and not isinstance(placement, Replicate):
            raise ValueError(
                f"{call}: parameter {fqn!r} has {placement!r} on the data-parallel dim {mesh.mesh_dim_names[dim]!r}; "
                "FSDP shards it there itself: give it Replicate() on every data-parallel dim"
            )
        if dim >= data_parallel_dims and not (_splits_a_dim(placement) or isinstance(placement, Replicate)):
            raise NotImplementedError(
                f"{call}: parameter {fqn!r} has {placement!r} on dim {mesh.mesh_dim_names[dim]!r}; FSDP can shard "
                "further only Shard(d), _StridedShard(d) or Replicate() parameters (reduce a Partial() one first)"
            )


def _describe(mesh: DeviceMesh) -> str:
    return f"{tuple(mesh.shape)} {mesh.mesh_dim_names or ''}".strip()
