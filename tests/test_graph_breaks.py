"""Sharding costs the compiler nothing: with the same ``torch.compile`` call, a model
that graph-breaks by itself (inside a sharded unit's forward, or outside every unit)
or checkpoints around sharded blocks compiles to no more graphs sharded than
unsharded, and still trains like the single-process reference (aot_eager: the same
ops as our eager run; Inductor: to fp32 rounding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from fsdp_compile.testing import assert_parity
from tests.models import shard_blocks

# ---------------------------------------------------------------- models (module-level: they run on the ranks)

DIM = 8


class Block(nn.Module):
    def __init__(self, break_inside: bool = False, views_across_break: bool = False):
        super().__init__()
        self.break_inside = break_inside
        self.views_across_break = views_across_break
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.views_across_break:
            # Two views of one intermediate that is itself dead at the break: the graph before
            # the break returns both views and not their base.
            up = torch.relu(self.up(x))
            halves = up[..., :DIM], up[..., DIM:]
            del up
            torch._dynamo.graph_break()
            return x + self.down(torch.cat([halves[1], halves[0]], dim=-1))
        h = torch.relu(self.up(x))
        if self.break_inside:
            torch._dynamo.graph_break()
        return x + self.down(h)


class Stack(nn.Module):
    """``kind``: ``"break_in_block"`` (a break inside each sharded block's forward),
    ``"checkpoint_around_blocks"`` (``torch.utils.checkpoint.checkpoint(block, ...)``
    around each sharded block), ``"views_across_break"`` (several views of one
    intermediate live across a break, in the root's and in each block's forward, as
    LLaVA's per-image features are across its image-token check), or plain."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.embed = nn.Linear(4, DIM)
        views = kind == "views_across_break"
        self.blocks = nn.ModuleList(Block(break_inside=kind == "break_in_block", views_across_break=views) for _ in range(3))
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "views_across_break":
            rows = list(self.embed(x))  # one view per sample (LLaVA: per image), their base dead
            if bool((rows[0].abs().sum() > 0).item()):  # a data-dependent check: Dynamo breaks here
                h = torch.stack([row.flip(0) for row in rows])
            else:
                h = torch.stack(rows)
        else:
            h = self.embed(x)
        for block in self.blocks:
            if self.kind == "checkpoint_around_blocks":
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        return self.head(h)


class BreakOutsideUnits(nn.Module):
    """A sharded model called by compiled code that breaks the graph outside every unit
    (a parameter-free caller: logging between the model and the loss)."""

    def __init__(self):
        super().__init__()
        self.model = Stack("plain")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        torch._dynamo.graph_break()
        return torch.tanh(out)


def _build(kind: str) -> Stack:
    torch.manual_seed(0)
    return Stack(kind)


def break_in_block() -> Stack:
    return _build("break_in_block")


def views_across_break() -> Stack:
    return _build("views_across_break")


def break_outside_units() -> BreakOutsideUnits:
    torch.manual_seed(0)
    return BreakOutsideUnits()


def checkpoint_around_blocks() -> Stack:
    return _build("checkpoint_around_blocks")


def shard(model: nn.Module, fully_shard) -> None:
    """Per block, then the stack (the caller of :class:`BreakOutsideUnits` holds no
    parameters and stays unsharded)."""
    stack = model.model if isinstance(model, BreakOutsideUnits) else model
    shard_blocks(stack, fully_shard, blocks=stack.blocks)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)


def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


# ---------------------------------------------------------------- tests

CASES = {
    "break_in_block": break_in_block,
    "break_outside_units": break_outside_units,
    "checkpoint_around_blocks": checkpoint_around_blocks,
    "views_across_break": views_across_break,
}


@pytest.mark.parametrize("name", list(CASES))
def test_no_more_graphs_than_unsharded(pool2, name):
    report = assert_parity(
        CASES[name],
        batch,
        loss,
        shard_fn=shard,
        backends=("eager", "aot_eager_passes"),
        check_graph_count=True,
        pool=pool2,
    )
    assert report.graphs["ours:aot_eager_passes"] <= report.graphs["unsharded"]
    if name == "checkpoint_around_blocks":
        assert report.graphs["unsharded"] == 1
