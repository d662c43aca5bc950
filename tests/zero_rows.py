"""Models whose units hold parameters with fewer dim-0 rows than ranks: on high ranks
the shard has zero rows (an MoE's shared-expert gate, a ``Linear(n, 1)``, a ``(1,)``
scale). Module-level functions: they run on the pool's ranks or in a fake world.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM = 8


class FewRows(nn.Module):
    """A block whose parameters, in registration (= bucket) order, put zero-row shards
    first, in the middle and last, frozen and trainable, in two dtypes."""

    def __init__(self, second_dtype: torch.dtype = torch.float64):
        super().__init__()
        self.gate = nn.Linear(DIM, 1, bias=False)  # (1, DIM): first in the bucket
        self.proj = nn.Linear(DIM, DIM)
        self.frozen_gate = nn.Parameter(torch.randn(1, DIM) * 0.1, requires_grad=False)  # frozen, middle
        self.scale = nn.Parameter(torch.ones(1))  # (1,): middle
        self.scale64 = nn.Parameter(torch.full((1,), 0.5, dtype=second_dtype))  # fp64: a bucket of its own
        self.out = nn.Linear(DIM, DIM)
        self.last_gate = nn.Linear(DIM, 1)  # weight (1, DIM), bias (1,): last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.sigmoid(self.gate(x) + F.linear(x, self.frozen_gate))
        h = torch.tanh(self.proj(x)) * g * self.scale * self.scale64.to(x.dtype)
        h = self.out(h)
        return x + h * torch.sigmoid(self.last_gate(h))


class FewRowsModel(nn.Module):
    """A frozen 11-row embedding at the root, two :class:`FewRows` blocks, and a root
    head ``Linear(DIM, 1)``: the root unit itself mixes frozen and zero-row shards."""

    def __init__(self, second_dtype: torch.dtype = torch.float64):
        super().__init__()
        self.embed = nn.Embedding(11, DIM)
        self.embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(FewRows(second_dtype) for _ in range(2))
        self.head = nn.Linear(DIM, 1)
        self.head_scale = nn.Parameter(torch.ones(1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).mean(1)
        for block in self.blocks:
            h = block(h)
        return self.head(h).squeeze(-1) * self.head_scale


def build() -> FewRowsModel:
    torch.manual_seed(0)
    return FewRowsModel()


def build_one_dtype() -> FewRowsModel:
    """The same in fp32 only: torch's FSDP2 requires one dtype per unit."""
    torch.manual_seed(0)
    return FewRowsModel(torch.float32)


def shard(model: FewRowsModel, fully_shard) -> None:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def batch(step: int, global_batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 11, (global_batch, 5), generator=g), torch.randn(global_batch, generator=g)


def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def scheduled_collectives(rank: int, world_size: int) -> list[list[list[str]]]:
    """In a ``fake`` world of ``world_size`` ranks, as ``rank``: compile one step through
    Inductor's passes (ours included, no code generation) and return each graph's
    collective sequence after our passes (op, group, reduce op, input shapes)."""
    import torch.distributed as dist

    from fsdp_compile import fully_shard
    from fsdp_compile._compat import compile_fx_up_to_post_grad, register_fake_process_group
    from fsdp_compile.passes import registration
    from fsdp_compile.passes.consistency import collective_fingerprint

    register_fake_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    sequences = []

    def record_instead_of_checking(graph):
        sequences.append(collective_fingerprint(graph))
        return None

    original = registration.insert_consistency_check
    registration.insert_consistency_check = record_instead_of_checking
    try:
        torch._dynamo.reset()
        model = build()
        shard(model, fully_shard)
        x, y = batch(0, global_batch=2)
        loss(torch.compile(model, backend=compile_fx_up_to_post_grad(), fullgraph=True)(x), y).backward()
    finally:
        registration.insert_consistency_check = original
        dist.destroy_process_group()
    return sequences
