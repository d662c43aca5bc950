"""Comparing sharded runs: full tensors of DTensors, and losses averaged over ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole tensor (gathered if it is a DTensor; a collective then)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


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
