"""Comparing sharded runs: full tensors of DTensors, and losses averaged over ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_compile.runtime.collectives import as_movable


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole tensor (gathered if it is a DTensor; a collective then).

    Over gloo, a tensor sharded on dim 0 over one mesh dimension is gathered with
    ``dist.all_gather_into_tensor`` (gloo's ``_allgather_base``) rather than
    ``DTensor.full_tensor()``, whose functional all-gather takes gloo's coalesced
    all-gather: back-to-back calls of that one can corrupt the heap (README,
    Limitations), which killed a rank of this suite now and then. Other layouts of
    a plain tensor over a gloo mesh of every rank (FSDP + TP: ``Shard`` and
    ``_StridedShard`` on several mesh dims) are gathered the same way, with the
    global positions of each rank's elements."""
    if not isinstance(t, DTensor):
        return t.detach().clone()
    with torch.no_grad():
        gathered = _all_gathered_over_gloo(t)
        if gathered is None:
            gathered = _scattered_over_a_gloo_world(t)
        return (gathered if gathered is not None else t.full_tensor()).detach().clone()


def _all_gathered_over_gloo(t: DTensor) -> torch.Tensor | None:
    """``t``'s whole tensor where it is replicated, or sharded on dim 0 (``torch.chunk``
    rows) over one dimension of a gloo mesh; ``None`` for any other layout."""
    from torch.distributed.tensor import Shard

    local = t.to_local()
    sharded = [(i, p) for i, p in enumerate(t.placements) if not p.is_replicate()]
    if len(sharded) > 1:
        return None
    if not sharded:
        return local
    mesh_dim, placement = sharded[0]
    group = t.device_mesh.get_group(mesh_dim)
    if type(placement) is not Shard or placement.dim != 0 or dist.get_backend(group) != "gloo":
        return None
    if type(local) is not torch.Tensor:
        return _wrapper_gathered(local, t.shape, group, t.device_mesh.size(mesh_dim))
    return _rows_gathered(local, t.shape[0], group, t.device_mesh.size(mesh_dim))


def _scattered_over_a_gloo_world(t: DTensor) -> torch.Tensor | None:
    """``t``'s whole tensor, for any placements but ``Partial`` over a gloo mesh that holds
    every rank, with a plain local tensor; ``None`` otherwise. Each rank's local
    elements are gathered with the global positions they hold, which ``distribute_tensor``
    of the positions themselves gives, splitting locally as ``t`` was split (so
    ``_StridedShard``'s order is DTensor's own); replicated copies write equal values."""
    from torch.distributed.tensor import distribute_tensor

    local, mesh = t.to_local(), t.device_mesh
    if (
        type(local) is not torch.Tensor
        or any(p.is_partial() for p in t.placements)
        or mesh.size() != dist.get_world_size()
        or dist.get_backend() != "gloo"
    ):
        return None
    positions = torch.arange(t.numel()).view(t.shape)
    mine = distribute_tensor(positions, mesh, t.placements, src_data_rank=None).to_local().reshape(-1)
    sizes = torch.empty(dist.get_world_size(), dtype=torch.int64)
    dist.all_gather_into_tensor(sizes, torch.tensor([mine.numel()]))
    width = int(sizes.max())

    def gathered(x: torch.Tensor) -> torch.Tensor:  # every rank's x, zero-padded to ``width``
        sent = x.new_zeros(width)
        sent[: x.numel()] = x
        out = x.new_empty(width * sizes.numel())
        dist.all_gather_into_tensor(out, sent)
        return out

    values = as_movable(local.detach().contiguous().reshape(-1))
    all_values, all_positions = gathered(values), gathered(mine)
    whole, covered = values.new_empty(t.numel()), torch.zeros(t.numel(), dtype=torch.bool)
    for rank, size in enumerate(sizes.tolist()):
        start = rank * width
        whole[all_positions[start : start + size]] = all_values[start : start + size]
        covered[all_positions[start : start + size]] = True
    assert bool(covered.all()), f"full_tensor: the ranks' shards of a {tuple(t.shape)} tensor leave elements out"
    return whole.view(local.dtype).view(t.shape)  # (float8 moved as its bytes)


def _wrapper_gathered(local, shape, group, size) -> torch.Tensor | None:
    """A wrapper subclass's whole tensor (``TwoTensor``-like: ``__tensor_flatten__``
    with inner tensors of the outer shape), each inner tensor gathered by rows;
    ``None`` for a subclass whose inner tensors are laid out otherwise (NF4, float8)."""
    flatten = getattr(local, "__tensor_flatten__", None)
    if flatten is None:
        return None
    names, ctx = flatten()
    inner = {name: getattr(local, name) for name in names}
    if any(type(x) is not torch.Tensor or x.shape != local.shape for x in inner.values()):
        return None
    import inspect

    unflatten = type(local).__tensor_unflatten__
    if len(inspect.signature(unflatten).parameters) != 4:  # (inner, ctx, outer_size, outer_stride)
        return None
    whole = {name: _rows_gathered(x, shape[0], group, size) for name, x in inner.items()}
    return unflatten(whole, ctx, shape, torch.empty(shape).stride())


def _rows_gathered(local: torch.Tensor, rows_whole: int, group, size: int) -> torch.Tensor:
    """The whole tensor of ``torch.chunk`` rows ``local`` over ``group`` (padded all-gather)."""
    rows = -(-rows_whole // size)
    padded = local.new_zeros((rows, *local.shape[1:]))
    padded[: local.shape[0]] = local
    out = local.new_empty((rows * size, *local.shape[1:]))
    dist.all_gather_into_tensor(as_movable(out), as_movable(padded), group=group)  # (float8 as its bytes)
    return out[:rows_whole]


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a whole tensor, by name (every rank must call it); frozen
    parameters of a tensor subclass (NF4 base weights) are left out: nothing updates
    them, and their subclass may not gather as a ``DTensor``."""
    return {name: full_tensor(p) for name, p in model.named_parameters() if p.requires_grad or not _is_subclass(p)}


def _is_subclass(p: torch.Tensor) -> bool:
    local = p._local_tensor if isinstance(p, DTensor) else p
    return type(local) not in (torch.Tensor, nn.Parameter)


def global_mean(value: torch.Tensor) -> float:
    """The mean of a per-rank scalar (e.g. a local-batch loss) over all ranks."""
    total = value.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()
