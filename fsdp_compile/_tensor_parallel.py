"""Parameters that tensor parallelism already made DTensors (FSDP + TP, 2-D).

The recipe is FSDP2's: ``parallelize_module(model, mesh["tp"], plan)`` first, then
``fully_shard(block, mesh=mesh["dp"])``. A TP parameter's *local* tensor is what
FSDP shards along dim 0 over the data-parallel mesh and all-gathers back; the
gathered local tensor is wrapped again as the TP ``DTensor`` the module's forward
expects. The registered parameter is one DTensor over both meshes, with FSDP2's
placements (``_StridedShard`` where TP already splits dim 0), so state dicts,
optimizers and DCP see what they see with FSDP2 + TP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_compile.base.compat import concatenate_meshes, is_strided_shard
from fsdp_compile.runtime.process_groups import label_mesh_groups


@dataclass(frozen=True)
class TensorParallelSpec:
    """How a parameter is laid out by tensor parallelism before FSDP shards it."""

    mesh: DeviceMesh  # the TP mesh
    placements: tuple  # on ``mesh``
    shape: torch.Size  # global
    stride: tuple[int, ...]

    @classmethod
    def of(cls, param: DTensor) -> TensorParallelSpec:
        label_mesh_groups(param.device_mesh, tensor_parallel=True)  # for reports and the cross-rank check
        return cls(param.device_mesh, tuple(param.placements), param.shape, param.stride())

    def shards_on(self, dim: int) -> int:
        """Into how many pieces TP splits dimension ``dim``."""
        n = 1
        for size, placement in zip(self.mesh.shape, self.placements, strict=True):
            if _splits_a_dim(placement) and placement.dim % len(self.shape) == dim:
                n *= size
        return n

    def wrap(self, local_full: torch.Tensor) -> DTensor:
        """The TP ``DTensor`` whose local tensor is ``local_full`` (the gathered TP shard)."""
        return DTensor.from_local(local_full, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride)


def check_tensor_parallel_param(param: DTensor, fqn: str, dp_mesh: DeviceMesh, unit_name: str) -> None:
    """Raise (before any collective) if FSDP cannot shard this TP parameter over ``dp_mesh``."""
    tp_mesh = param.device_mesh
    if tp_mesh.ndim != 1:
        raise NotImplementedError(
            f"fully_shard({unit_name}): parameter {fqn!r} is a DTensor on a {tp_mesh.ndim}-D mesh "
            f"{tp_mesh.mesh_dim_names}; FSDP + tensor parallelism supports a 1-D TP mesh"
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
    """The mesh of the registered parameter: the data-parallel dimensions, then TP's."""
    return concatenate_meshes([dp_mesh, tp.mesh])


def _describe(mesh: DeviceMesh) -> str:
    return f"{tuple(mesh.shape)} {mesh.mesh_dim_names or ''}".strip()
