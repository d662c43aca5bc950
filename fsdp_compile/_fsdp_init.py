"""What ``fully_shard`` checks and collects before it shards anything (FSDP2's
``_fsdp_init.py``): the modules, the options, the mesh, the parameters each unit owns
(shared and tied ones included), and that every rank passed the same. Everything here
runs before the first collective of a ``fully_shard`` call, so bad input raises an
error naming the module or parameter on every rank, never a hang."""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor, Shard

from fsdp_compile._fsdp_param import FSDPParam
from fsdp_compile._fsdp_state import FSDPUnit, compute_device
from fsdp_compile._low_precision import check_param_type
from fsdp_compile._spmd_types import spmd_typing_of
from fsdp_compile._tensor_parallel import SpmdMesh, check_spmd_param, check_tensor_parallel_param, data_parallel_sub_mesh
from fsdp_compile.base.compat import composable_apis_applied, flat_group_of
from fsdp_compile.runtime.process_groups import DataParallelMesh, all_gather_json

# Set on an original (unsharded) nn.Parameter once it is sharded, so that a
# module still holding the original object (a tied weight in another unit)
# finds the FSDPParam that replaced it.
_SHARDED_AS = "_fsdp_compile_sharded_as"


def _is_sharded_module(module: nn.Module) -> bool:
    from fsdp_compile._fully_shard import FSDPModule  # (it imports this module)

    return isinstance(module, FSDPModule)


def _as_module_list(module, api: str = "fully_shard") -> list[nn.Module]:
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
        raise ValueError(
            f"{api} does not support containers that do not implement forward: {type(module).__name__} (as FSDP2). "
            f"Apply it to each module in it (for block in model.layers: {api}(block)), or pass them as a list "
            f"({api}(list(model.layers)): one unit)"
        )
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module (or a list of them), got {type(m).__name__}")
    return modules


def _reject_unsupported_options(mesh, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy):
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f'mesh must be a DeviceMesh (e.g. init_device_mesh("cuda", (world_size,))) or None, got {type(mesh).__name__}'
        )
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise TypeError(
            f"reshard_after_forward={reshard_after_forward!r}: use True (free after forward, gather again "
            "in backward), False (keep gathered until backward), None (True except for the root) or an "
            "int (keep a shard over groups of that many ranks, gather over them in backward)"
        )
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(f"shard_placement_fn must be a callable (parameter -> Shard | None), got {shard_placement_fn!r}")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(mp_policy, name)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"mp_policy.{name}={dtype!r}: use a floating-point dtype (e.g. torch.bfloat16) or None")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be an OffloadPolicy (e.g. CPUOffloadPolicy()), got {type(offload_policy).__name__}")


def _resolve_reshard_size(reshard_after_forward, dp_mesh: DataParallelMesh, owned: list[OwnedParam], unit_name: str):
    """``reshard_after_forward`` as the unit keeps it: an int is checked and, as in FSDP2,
    1 means ``False`` and the shard group's size means ``True``."""
    if type(reshard_after_forward) is not int:
        return reshard_after_forward
    size = dp_mesh.shard_world_size
    if not 1 <= reshard_after_forward <= size or size % reshard_after_forward:
        raise ValueError(
            f"fully_shard({unit_name}): reshard_after_forward={reshard_after_forward} must divide the shard "
            f"group's size ({size}): the ranks are split into groups of that many to keep a shard over "
            "after forward (e.g. the ranks of one node)"
        )
    if reshard_after_forward == 1:
        warnings.warn(
            f"fully_shard({unit_name}): reshard_after_forward=1 (int) keeps the whole parameter after "
            "forward, as reshard_after_forward=False does",
            stacklevel=3,
        )
        return False
    if reshard_after_forward == size:
        return True
    tensor_parallel = [o.fqn for o in owned if isinstance(o.param, DTensor)]
    if tensor_parallel:
        raise NotImplementedError(
            f"fully_shard({unit_name}): reshard_after_forward={reshard_after_forward} (resharding to a smaller "
            f"group) is not supported for tensor-parallel parameters (e.g. {tensor_parallel[0]!r}), as in "
            "FSDP2; use True or False for this unit"
        )
    return reshard_after_forward


class FSDP2AssertionError(ValueError, AssertionError):
    """Bad input that FSDP2 refuses with an ``AssertionError``: a ``ValueError``, as every
    bad-input error here, that is also FSDP2's ``AssertionError``, so that code written
    against FSDP2 (its own tests included) catches it where it caught FSDP2's. Its message
    holds FSDP2's words too."""


class ParamPlacement(NamedTuple):
    """Where ``shard_placement_fn`` puts one parameter: the dimension it is sharded on, and
    the data-parallel mesh it is sharded over (``None``: the unit's)."""

    shard_dim: int
    dp_mesh: DataParallelMesh | None = None


def _placement(
    param: nn.Parameter, fqn: str, shard_placement_fn, unit: FSDPUnit, unit_name: str, own_meshes: dict
) -> ParamPlacement:
    """The dimension and mesh ``shard_placement_fn`` (FSDP2's) gives ``param``: ``None`` is
    ``Shard(0)`` on the unit's mesh; ``Shard(d)``, dim ``d`` there; a ``ShardPlacementResult``
    (torch's, ``torch.distributed.fsdp._fully_shard._fsdp_common``) its placement (``None``:
    ``Shard(0)``) over its ``mesh_info``'s mesh (torchtitan's routed experts over ``efsdp``
    in the block sharded over ``fsdp``), 1-D FSDP or 2-D (replicate, shard) HSDP. ``own_meshes``:
    the unit's meshes of that kind so far, by ``DeviceMesh`` (its parameters share one each)."""
    result = None if shard_placement_fn is None or param.ndim == 0 else shard_placement_fn(param)
    dp_mesh = None
    if type(result).__name__ == "ShardPlacementResult" and hasattr(result, "mesh_info"):
        dp_mesh = _own_data_parallel_mesh(result.mesh_info, fqn, unit, unit_name, own_meshes)
        result = result.placement
    if result is None:
        return ParamPlacement(0, dp_mesh)
    if type(result) is not Shard:
        raise TypeError(
            f"fully_shard({unit_name}): shard_placement_fn returned {result!r} for parameter {fqn!r}; "
            "return Shard(dim), None (Shard(0)) or a ShardPlacementResult(placement, mesh_info)"
        )
    dim = result.dim + param.ndim if result.dim < 0 else result.dim
    if not 0 <= dim < param.ndim:
        raise FSDP2AssertionError(
            f"fully_shard({unit_name}): shard_placement_fn returned {result!r} for parameter {fqn!r} "
            f"of shape {list(param.shape)}; the dimension must be in [-{param.ndim}, {param.ndim}) (FSDP2: Shard dim "
            f"{result.dim} is invalid for {param.ndim}D tensor)"
        )
    return ParamPlacement(dim, dp_mesh)


def check_one_mesh_per_group(placements: list[ParamPlacement], unit: FSDPUnit, unit_name: str) -> None:
    """Refuse, as FSDP2, two different meshes over one shard group in a unit (the unit's and a
    ``ShardPlacementResult``'s, or two of those): their parameters' collectives would be one
    group's, their ``DTensor``s laid out on different meshes."""
    meshes = {unit.dp_mesh.shard_group_name: unit.dp_mesh.mesh}
    for placement in placements:
        own = placement.dp_mesh
        if own is None:
            continue
        seen = meshes.setdefault(own.shard_group_name, own.mesh)
        if seen != own.mesh:
            raise ValueError(
                f"fully_shard({unit_name}): two meshes over one shard group, {seen} and {own.mesh}; give the "
                "parameters on that group one mesh (FSDP2: Params sharing the same process group must use the same "
                "FSDPMeshInfo object)"
            )


def _own_data_parallel_mesh(mesh_info, fqn: str, unit: FSDPUnit, unit_name: str, own_meshes: dict) -> DataParallelMesh | None:
    """The mesh a ``ShardPlacementResult``'s ``mesh_info`` shards one parameter over (``None``
    where it is the unit's own), refused by name where this library cannot shard over it."""
    mesh = getattr(mesh_info, "mesh", None)
    shard_dim, replicate_dim = getattr(mesh_info, "shard_mesh_dim", None), getattr(mesh_info, "replicate_mesh_dim", None)
    if not isinstance(mesh, DeviceMesh) or shard_dim is None:
        raise NotImplementedError(
            f"fully_shard({unit_name}): shard_placement_fn gave parameter {fqn!r} a {type(mesh_info).__name__} without a "
            "shard dimension; give it an FSDPMeshInfo (FSDP) or HSDPMeshInfo over its own mesh"
        )
    if (getattr(mesh_info, "dp_mesh_dims", None) is not None) != (unit.dp_mesh.spmd is not None):
        raise NotImplementedError(
            f"fully_shard({unit_name}): parameter {fqn!r} has a shard mesh of its own (ShardPlacementResult) "
            f"{'with' if unit.dp_mesh.spmd is None else 'without'} dp_mesh_dims (FSDP2's SPMD mesh), and the unit "
            f"{'without' if unit.dp_mesh.spmd is None else 'with'}; give both or neither (with dp_mesh_dims: "
            "torch's _get_mesh_info(full_mesh, dp_mesh_dims))"
        )
    if (mesh.ndim, shard_dim, replicate_dim) not in ((1, 0, None), (2, 1, 0)):
        raise NotImplementedError(
            f"fully_shard({unit_name}): parameter {fqn!r}'s ShardPlacementResult shards over dim {shard_dim} "
            f"(replicating over {replicate_dim}) of a {mesh.ndim}-D mesh; a parameter's own mesh must be 1-D (FSDP) or "
            "2-D (replicate, shard) (HSDP), as fully_shard's mesh"
        )
    if mesh.device_type != unit.mesh.device_type:
        raise ValueError(
            f"fully_shard({unit_name}): parameter {fqn!r}'s own mesh is on {mesh.device_type!r}, the unit's on "
            f"{unit.mesh.device_type!r}; build both on one device type"
        )
    spmd = _spmd_mesh_of(mesh_info, unit_name) if unit.dp_mesh.spmd is not None else None
    if mesh == unit.mesh or (spmd is not None and spmd == unit.dp_mesh.spmd):
        return None
    if type(unit.reshard_after_forward) is int:
        raise NotImplementedError(
            f"fully_shard({unit_name}): reshard_after_forward={unit.reshard_after_forward} with a shard mesh of its own "
            f"for parameter {fqn!r} (ShardPlacementResult) is not supported; pass True or False"
        )
    if mesh not in own_meshes:
        own_meshes[mesh] = DataParallelMesh(mesh, shard=True, spmd=spmd)
    return own_meshes[mesh]


def _spmd_mesh_of(mesh_info, unit_name: str) -> SpmdMesh:
    """The SPMD layout of a ``mesh_info`` made by torch's ``_get_mesh_info(full_mesh,
    dp_mesh_dims)`` (torchtitan's experts over ``(dp_replicate, efsdp, ep)``); its ``mesh`` is
    the data-parallel mesh already flattened there."""
    return data_parallel_sub_mesh(mesh_info.spmd_mesh, mesh_info.dp_mesh_dims, unit_name, flatten=False)[1]


def _default_mesh(modules: list[nn.Module]) -> DeviceMesh:
    """All ranks, on the parameters' device type (for meta or CPU-offloaded
    parameters, as FSDP2: the accelerator if there is one, else CPU)."""
    device_type = _params_device_type(modules)
    if device_type in (None, "meta") or (device_type == "cpu" and torch.cuda.is_available()):
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))  # unnamed, as FSDP2's


def _params_device_type(modules: list[nn.Module]) -> str | None:
    for m in modules:
        for p in m.parameters():
            return p.device.type
    return None


def _validate_mesh(mesh: DeviceMesh, modules: list[nn.Module], offload_policy, shard: bool) -> None:
    name = _unit_name(modules)
    if shard and mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard({name}) got a {mesh.ndim}-D mesh {tuple(mesh.shape)}; use a 1-D mesh (FSDP) "
            f"or a 2-D (replicate, shard) mesh (HSDP) (FSDP2: fully_shard expects a 1D or 2D DeviceMesh but got {mesh})"
        )
    if shard and mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise FSDP2AssertionError(
            f"fully_shard({name}) got a 2-D mesh without mesh_dim_names; for HSDP build it as "
            'init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard")) '
            "(FSDP2: Please init the 2D mesh for HSDP with mesh_dim_names specified)"
        )
    if not shard and mesh.ndim != 1:
        raise ValueError(f"replicate({name}) got a {mesh.ndim}-D mesh {tuple(mesh.shape)}; it needs a 1-D mesh")
    device_type = _params_device_type(modules)
    offloaded = isinstance(offload_policy, CPUOffloadPolicy)
    if device_type not in (None, "meta") and device_type != mesh.device_type and not (offloaded and device_type == "cpu"):
        raise ValueError(
            f"fully_shard({name}): the parameters are on {device_type!r} but the mesh is on "
            f"{mesh.device_type!r}; move the model to the mesh's device type first"
        )


def _unit_name(modules: list[nn.Module]) -> str:
    """The modules' original class names, for messages."""
    names = [getattr(type(m), "_fsdp_orig_class", type(m)).__name__ for m in modules]
    return names[0] if len(names) == 1 else "[" + ", ".join(names) + "]"


class OwnedParam(NamedTuple):
    """A parameter a unit manages, where it is registered."""

    module: nn.Module  # the module registering it
    name: str  # its name there
    param: nn.Parameter
    fqn: str  # its path from the module passed to fully_shard
    module_index: int  # which of the unit's modules that is


def _collect_owned_params(
    modules: list[nn.Module], ignored: set, unit: FSDPUnit, shard_placement_fn=None
) -> tuple[list[OwnedParam], list[ParamPlacement]]:
    """Every parameter this unit manages, and where ``shard_placement_fn`` places each
    (:func:`_placement`; a parameter another unit shards already keeps its own).

    Skips subtrees already sharded by an earlier (nested) call, or given to torch's
    ``replicate()``; parameters owned by those units but also held here (tied
    weights) are included with their existing FSDPParam, which then serves both units.
    """
    owned, placements, own_meshes = [], [], {}
    unit_name = _unit_name(modules)
    for module_index, root in enumerate(modules):
        stack = [("", root)]
        while stack:
            prefix, mod = stack.pop()
            if isinstance(mod, TorchFSDPModule) and not _is_sharded_module(mod):
                raise ValueError(
                    f"fully_shard({_unit_name(modules)}): {type(mod).__name__} {prefix.rstrip('.') or '(this module)'!r} "
                    "is sharded by torch's own fully_shard (torch.distributed.fsdp); the two cannot be mixed in one "
                    "model. Shard every unit with fsdp_compile.fully_shard (the same arguments)."
                )
            if mod is not root and _is_sharded_module(mod):
                continue  # a nested unit owns this subtree
            if mod is not root and "replicate" in composable_apis_applied(mod):
                continue  # torch's replicate() (DDP) owns this subtree, as FSDP2 leaves it
            for name, param in mod._parameters.items():
                if param is None or param in ignored:
                    continue
                fqn = prefix + name
                existing = _existing_fsdp_param(mod, name, param)
                placement = (
                    ParamPlacement(0)
                    if existing is not None
                    else _placement(param, fqn, shard_placement_fn, unit, unit_name, own_meshes)
                )
                if existing is not None:
                    _check_shareable(existing, fqn, unit, modules)
                elif (typing := spmd_typing_of(param, name, fqn, (spmd := _spmd_of(placement, unit)), unit_name)) is not None:
                    check_spmd_param(typing.as_dtensor(param, spmd.mesh), fqn, spmd, unit_name)
                elif spmd is not None:
                    check_spmd_param(param, fqn, spmd, unit_name)
                elif isinstance(param, DTensor):
                    check_tensor_parallel_param(param, fqn, (placement.dp_mesh or unit.dp_mesh).mesh, unit_name)
                owned.append(OwnedParam(mod, name, param, fqn, module_index))
                placements.append(placement)
            for child_name, child in reversed(list(mod._modules.items())):
                if child is not None:
                    stack.append((f"{prefix}{child_name}.", child))
    return owned, placements


def _spmd_of(placement: ParamPlacement, unit: FSDPUnit) -> SpmdMesh | None:
    """The SPMD layout a parameter is sharded with: its own mesh's, or the unit's."""
    return (placement.dp_mesh or unit.dp_mesh).spmd


def _existing_fsdp_param(mod: nn.Module, name: str, param: nn.Parameter) -> FSDPParam | None:
    fsdp_param = getattr(param, _SHARDED_AS, None)
    if fsdp_param is None:
        fsdp_param = getattr(mod, "_fsdp_params", {}).get(name)
    return fsdp_param


def _check_shareable(existing: FSDPParam, fqn: str, unit: FSDPUnit, modules: list[nn.Module]) -> None:
    owner_unit = existing.unit
    for m in modules:
        if any(sub is m for owner in owner_unit.modules for sub in owner.modules()):
            raise ValueError(
                f"fully_shard({_unit_name(modules)}): parameter {fqn!r} is already sharded by "
                f"fully_shard({_unit_name(owner_unit.modules)}), which contains this module. Apply fully_shard "
                "to submodules before their parents (bottom-up), as with FSDP2."
            )
    if owner_unit.mesh != unit.mesh:
        raise ValueError(
            f"fully_shard({_unit_name(modules)}): parameter {fqn!r} is shared with the unit of "
            f"{_unit_name(owner_unit.modules)} ({owner_unit.fqn or 'root'!r}) "
            "which uses a different mesh; a parameter shared between units must use one mesh. "
            "Pass the same mesh to both fully_shard calls, or shard the common parent instead."
        )


def _check_param_types(owned: list[OwnedParam], placements: list[ParamPlacement], unit: FSDPUnit) -> None:
    """Refuse, by name, complex tensor-parallel parameters, and parameter subclasses this
    unit cannot shard as asked (see ``_low_precision.check_param_type``; parameters sharded
    already or by tensor parallelism are checked where they were)."""
    for (_, _, param, fqn, _), (shard_dim, own_mesh) in zip(owned, placements, strict=True):
        dp = own_mesh or unit.dp_mesh
        if param.is_complex() and isinstance(param, DTensor):
            raise NotImplementedError(
                f"fully_shard: parameter {fqn!r} is a complex tensor-parallel DTensor ({param.dtype}), which is not "
                "supported; keep complex parameters out of the tensor-parallel plan, or pass it in ignored_params"
            )
        if getattr(param, _SHARDED_AS, None) is None and not isinstance(param, DTensor):
            check_param_type(
                fqn,
                param,
                shard_dim=shard_dim,
                shard_world_size=dp.shard_world_size if dp.shards else None,
                reshards_to_int=type(unit.reshard_after_forward) is int,
            )


def _check_same_params_on_all_ranks(owned: list[OwnedParam], mesh: DeviceMesh, unit_fqn: str) -> None:
    """Every rank must shard the same names, shapes and dtypes (two small all-gathers)."""
    mine = [(o.fqn, tuple(o.param.shape), str(o.param.dtype)) for o in owned]
    group = mesh.get_group() if mesh.ndim == 1 else flat_group_of(mesh)
    everyone = [
        [(fqn, tuple(shape), dtype) for fqn, shape, dtype in theirs]
        for theirs in all_gather_json(mine, group, compute_device(mesh))
    ]
    rank = dist.get_rank(group)
    for other_rank, theirs in enumerate(everyone):
        if theirs == mine:
            continue
        for i in range(max(len(mine), len(theirs))):
            a = mine[i] if i < len(mine) else None
            b = theirs[i] if i < len(theirs) else None
            if a != b:
                raise ValueError(
                    f"fully_shard({unit_fqn}): ranks hold different parameters; first mismatch at "
                    f"{(a or b)[0]!r}: rank {rank} has {_describe(a)}, rank {other_rank} has "
                    f"{_describe(b)}. Build the same model on every rank before sharding."
                )


def _describe(entry) -> str:
    if entry is None:
        return "no such parameter"
    fqn, shape, dtype = entry
    return f"{fqn!r} shape {list(shape)} {dtype}"
