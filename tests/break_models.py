"""Models that break Dynamo's graph by themselves, or checkpoint around sharded blocks:
sharding must not add graphs to them. Module-level functions: they run on the ranks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

DIM = 8


class Block(nn.Module):
    def __init__(self, break_inside: bool = False):
        super().__init__()
        self.break_inside = break_inside
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        if self.break_inside:
            torch._dynamo.graph_break()
        return x + self.down(h)


class Stack(nn.Module):
    """``kind``: ``"break_in_block"`` (a break inside each sharded block's forward),
    ``"break_outside_units"`` (a break in the root's forward between blocks; the root is
    not sharded, so it runs outside every unit), ``"checkpoint_around_blocks"``
    (``torch.utils.checkpoint.checkpoint(block, ...)`` around each sharded block)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.embed = nn.Linear(4, DIM)
        self.blocks = nn.ModuleList(Block(break_inside=kind == "break_in_block") for _ in range(3))
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            if self.kind == "checkpoint_around_blocks":
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
            if self.kind == "break_outside_units" and i == 0:
                torch._dynamo.graph_break()
        return self.head(h)


def _build(kind: str) -> Stack:
    torch.manual_seed(0)
    return Stack(kind)


def break_in_block() -> Stack:
    return _build("break_in_block")


def break_outside_units() -> Stack:
    return _build("break_outside_units")


def checkpoint_around_blocks() -> Stack:
    return _build("checkpoint_around_blocks")


def shard(model: Stack, fully_shard) -> None:
    """Per block, then the root; with the break outside every unit, the root's own
    layers are units of their own and the root is left unsharded."""
    for block in model.blocks:
        fully_shard(block)
    if model.kind == "break_outside_units":
        fully_shard(model.embed)
        fully_shard(model.head)
    else:
        fully_shard(model)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)


def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)
