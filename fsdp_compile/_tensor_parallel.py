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
mesh. Its gradient's local tensor is what FSDP reduces over those dims, as it comes
(``Partial()``: each data-parallel rank's batch; or ``Replicate()``, as for inputs
declared replicated): the wrap's backward redistributes only the other dims, as FSDP2's
``_get_grad_inner_tensor`` does. That backward branches on the gradient's placements, so
Dynamo must not trace it (it would, for the forward output's placements, and skip a TP
all-reduce the real gradient needs): the wrap is one ``allow_in_graph`` node, which
AOTAutograd traces with the gradient's real placements. The registered parameter
is FSDP2's: on the full mesh, or, where several dims are sharded over as one (e.g.
``shard=("dp_shard", "cp")``), on that flattened dim and the others (:func:`spmd_param_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_compile.base.compat import concatenate_meshes, flatten_mesh, is_strided_shard, strided_shard
from fsdp_compile.runtime.process_groups import label_mesh_groups


@dataclass(frozen=True)
class TensorParallelSpec:
    """How a parameter is laid out by tensor parallelism before FSDP shards it."""

    mesh: DeviceMesh  # the TP mesh; with dp_mesh_dims, the full SPMD mesh
    placements: tuple  # on ``mesh``
    shape: torch.Size  # global
    stride: tuple[int, ...]
    # With dp_mesh_dims: which dims of ``mesh`` are data-parallel (``Replicate()`` in
    # ``placements``; FSDP's to shard and reduce over); none for a TP mesh.
    data_parallel_dims: tuple[int, ...] = ()
    # With dp_mesh_dims: ``_FromLocalLeavingDataParallelGrad`` for this layout as one
    # ``allow_in_graph`` node (whose arguments are tensors only).
    _wrap_leaving_data_parallel_grad: object = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.data_parallel_dims:

            def wrap(local: torch.Tensor) -> DTensor:
                return _FromLocalLeavingDataParallelGrad.apply(local, self)

            object.__setattr__(self, "_wrap_leaving_data_parallel_grad", torch.compiler.allow_in_graph(wrap))

    @classmethod
    def of(cls, param: DTensor, data_parallel_dims: tuple[int, ...] = ()) -> TensorParallelSpec:
        # (labels for reports and the cross-rank check)
        label_mesh_groups(param.device_mesh, tensor_parallel=True, data_parallel_dims=data_parallel_dims)
        return cls(param.device_mesh, tuple(param.placements), param.shape, param.stride(), data_parallel_dims)

    def shards_after(self, mesh_dim: int, dim: int) -> int:
        """Into how many pieces the mesh dims after ``mesh_dim`` split tensor dim ``dim``."""
        n = 1
        for i in range(mesh_dim + 1, self.mesh.ndim):
            placement = self.placements[i]
            if _splits_a_dim(placement) and placement.dim % len(self.shape) == dim:
                n *= self.mesh.size(i)
        return n

    def shards_on(self, dim: int) -> int:
        """Into how many pieces TP splits dimension ``dim``."""
        return self.shards_after(-1, dim)

    def wrap(self, local_full: torch.Tensor) -> DTensor:
        """The TP ``DTensor`` whose local tensor is ``local_full`` (the gathered TP shard).
        With ``dp_mesh_dims``, its gradient's local tensor comes back as it is on the
        data-parallel dims (FSDP reduces it) and in the forward's placements on the others."""
        if self.data_parallel_dims:
            return self._wrap_leaving_data_parallel_grad(local_full)
        return DTensor.from_local(local_full, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride)


class _FromLocalLeavingDataParallelGrad(torch.autograd.Function):
    """``DTensor.from_local`` whose backward leaves the gradient as it comes on the
    data-parallel dims and redistributes the others to the forward's placements."""

    @staticmethod
    def forward(ctx, local, spec: TensorParallelSpec):
        ctx.spec = spec
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        if isinstance(grad, DTensor):
            target = tuple(grad.placements[i] if i in spec.data_parallel_dims else p for i, p in enumerate(spec.placements))
            if tuple(grad.placements) != target:
                grad = grad.redistribute(spec.mesh, target)
            grad = grad.to_local()
        return grad, None


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
    """The mesh of the registered parameter of FSDP + TP: the data-parallel dimensions, then
    TP's (with ``dp_mesh_dims``: :func:`spmd_param_layout`)."""
    return concatenate_meshes([dp_mesh, tp.mesh])


@dataclass(frozen=True)
class SpmdMesh:
    """FSDP2's ``dp_mesh_dims`` resolved on the full mesh: which of its dims FSDP shards
    over (several are flattened into one group) and which it replicates over (HSDP)."""

    mesh: DeviceMesh  # the full mesh the parameters and the modules' DTensors are on
    shard_dims: tuple[int, ...]
    replicate_dims: tuple[int, ...]
    dims: object = field(default=None, compare=False)  # the DataParallelMeshDims passed (for messages)

    @property
    def data_parallel_dims(self) -> tuple[int, ...]:
        return tuple(sorted(self.shard_dims + self.replicate_dims))


def spmd_param_layout(spmd: SpmdMesh, dp_mesh: DeviceMesh, tp: TensorParallelSpec, shard_dim: int, sharded: bool):
    """The registered parameter's mesh and placements with ``dp_mesh_dims``, FSDP2's: the
    full mesh, with ``Shard(shard_dim)`` on the shard dim (``_StridedShard`` where later
    dims split the same tensor dim: FSDP splits the pieces they leave) and ``Replicate()``
    on the other dims it owns. Several shard dims are one flattened dim of ``dp_mesh``
    there (with HSDP's replicate dim before it), the other dims as they are."""
    placements = list(tp.placements)
    first = spmd.shard_dims[0]
    if sharded:
        split = tp.shards_after(first, shard_dim)
        placements[first] = strided_shard(shard_dim, split) if split > 1 else Shard(shard_dim)
    if len(spmd.shard_dims) == 1:
        return spmd.mesh, tuple(placements)
    submeshes, out = [], []
    for i, name in enumerate(spmd.mesh.mesh_dim_names):
        if i == first:
            submeshes.append(dp_mesh)
            out += [Replicate()] * (dp_mesh.ndim - 1) + [placements[i]]
        elif i not in spmd.shard_dims and not (i in spmd.replicate_dims and dp_mesh.ndim == 2):
            submeshes.append(spmd.mesh[name])
            out.append(placements[i])
    return concatenate_meshes(submeshes), tuple(out)


def data_parallel_sub_mesh(
    mesh: DeviceMesh | None, dp_mesh_dims, unit_name: str, flatten: bool = True
) -> tuple[DeviceMesh | None, SpmdMesh]:
    """FSDP2's ``dp_mesh_dims`` resolved on the full SPMD ``mesh``: the mesh FSDP runs on,
    1-D (shard) or 2-D (replicate, shard) as for HSDP, several dims of either flattened
    into one (``None`` without ``flatten``), and the :class:`SpmdMesh`. Raises, before any
    collective, for what FSDP2 rejects and for the layouts we do not take."""
    call = f"fully_shard({unit_name}, dp_mesh_dims={dp_mesh_dims})"
    if mesh is None or mesh.mesh_dim_names is None:
        raise ValueError(
            f"{call}: dp_mesh_dims names dimensions of the full mesh; pass that mesh, with mesh_dim_names, as mesh= "
            '(e.g. init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp")))'
        )
    names = tuple(mesh.mesh_dim_names)
    shard, replicate = tuple(dp_mesh_dims.shard_names), tuple(dp_mesh_dims.replicate_names)
    for name in (*replicate, *shard):
        if name not in names:
            raise ValueError(f"{call}: {name!r} is not a dimension of the mesh {names} (FSDP2: not found in mesh.mesh_dim_names)")
    if not shard:
        raise NotImplementedError(f"{call}: replicate-only (DDP) dp_mesh_dims is not supported; name a shard dim")
    shard_dims, replicate_dims = tuple(map(names.index, shard)), tuple(map(names.index, replicate))
    for what, dims in (("shard", shard_dims), ("replicate", replicate_dims)):
        if dims and list(dims) != list(range(dims[0], dims[0] + len(dims))):
            raise NotImplementedError(f"{call}: the {what} dims must be neighbours in the mesh {names}, in its order")
    if replicate_dims and max(replicate_dims) > min(shard_dims):
        raise NotImplementedError(f"{call}: the replicate dims must come before the shard dims in the mesh {names}")
    if not flatten:
        dp_mesh = None
    elif not replicate:
        dp_mesh = _flattened(mesh, shard)
    elif len(shard) == len(replicate) == 1:
        dp_mesh = mesh[(replicate[0], shard[0])]
    else:
        dp_mesh = concatenate_meshes([_flattened(mesh, replicate), _flattened(mesh, shard)])
    return dp_mesh, SpmdMesh(mesh, shard_dims, replicate_dims, dp_mesh_dims)


def _flattened(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """``mesh[names]`` as one dimension (named as FSDP2 names it: the names joined by "_")."""
    return mesh[names[0]] if len(names) == 1 else flatten_mesh(mesh[names], "_".join(names))


def check_spmd_param(param: nn.Parameter, fqn: str, spmd: SpmdMesh, unit_name: str) -> None:
    """Raise (before any collective) unless ``param`` is what ``dp_mesh_dims`` requires: a
    ``DTensor`` of the full mesh, ``Replicate()`` on its data-parallel dims."""
    mesh, data_parallel_dims = spmd.mesh, spmd.data_parallel_dims
    call = f"fully_shard({unit_name}, dp_mesh_dims=...)"
    if not isinstance(param, DTensor):
        raise ValueError(
            f"{call}: parameter {fqn!r} is a plain tensor; with dp_mesh_dims every parameter must be a DTensor on "
            f"the full mesh {tuple(mesh.mesh_dim_names)}, Replicate() on the data-parallel dims (e.g. "
            "distribute_module(module, mesh) or distribute_tensor(p, mesh, placements)), as in FSDP2 (FSDP2: parameters "
            "must be DTensors)"
        )
    if param.device_mesh is not mesh:  # the very object, as FSDP2 (an equal mesh is another mesh there)
        what = "another DeviceMesh equal to" if param.device_mesh == mesh else "a DTensor on a mesh other than"
        raise ValueError(
            f"{call}: parameter {fqn!r} is {what} the one passed to fully_shard ({_describe(param.device_mesh)} vs "
            f"{_describe(mesh)}); distribute it on that very mesh object (FSDP2: parameters must be on the same mesh)"
        )
    for dim, placement in enumerate(param.placements):
        if dim in data_parallel_dims and not isinstance(placement, Replicate):
            raise ValueError(
                f"{call}: parameter {fqn!r} has {placement!r} on the data-parallel dim {mesh.mesh_dim_names[dim]!r}; "
                "FSDP shards it there itself: give it Replicate() on every data-parallel dim (FSDP2: Expected Replicate)"
            )
        if dim not in data_parallel_dims and not (_splits_a_dim(placement) or isinstance(placement, Replicate)):
            raise NotImplementedError(
                f"{call}: parameter {fqn!r} has {placement!r} on dim {mesh.mesh_dim_names[dim]!r}; FSDP can shard "
                "further only Shard(d), _StridedShard(d) or Replicate() parameters (reduce a Partial() one first)"
            )


def _describe(mesh: DeviceMesh) -> str:
    return f"{tuple(mesh.shape)} {mesh.mesh_dim_names or ''}".strip()
