"""Process-group helpers: small object exchanges without pickling, a side group for checks."""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist

_SIDE_GROUP = None


def all_gather_json(value, group=None, device: torch.device | None = None) -> list:
    """Every rank's ``value`` (JSON-able), with two small all-gathers.

    ``all_gather_object`` would pickle and needs numpy; JSON keeps it to
    plain data and to the bytes that travel.
    """
    device = device or torch.device("cpu")
    payload = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=device)
    world_size = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], device=device), group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded, group=group)
    return [json.loads(bytes(g[: int(n.item())].tolist()).decode()) for g, n in zip(gathered, sizes)]


def side_group(timeout_s: float):
    """A gloo group over all ranks for our own checks, apart from the training traffic.

    Created on first use, which every rank must reach (it is a collective call).
    """
    global _SIDE_GROUP
    if _SIDE_GROUP is None:
        _SIDE_GROUP = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return _SIDE_GROUP


def is_real_multi_rank() -> bool:
    """True when there are several real ranks to talk to (not the ``fake`` backend)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"
