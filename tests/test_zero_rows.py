"""Parameters with fewer dim-0 rows than ranks (zero-row shards on high ranks).

A rank whose shard has zero rows pads an empty tensor; before the fix, Inductor folded
that padding into a constant, common-subexpression elimination merged two such
all-gathers into one on that rank only, and ranks compiled different buckets (a hang,
caught by the consistency check). Tested for the class: zero-row shards first, in the
middle and last in a bucket, frozen and trainable, two dtypes, in a block unit and in
the root unit; for real on 2 and 4 ranks, and as graph structure at 8 and 16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_compile.testing import assert_parity
from tests.models import shard_blocks

# ---------------------------------------------------------------- models (module-level: they run on the
# pool's ranks or in a fake world)

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
    shard_blocks(model, fully_shard, blocks=model.blocks)


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
    from fsdp_compile.passes import registration
    from fsdp_compile.passes.consistency import collective_fingerprint
    from fsdp_compile.testing._torch_internals import compile_fx_up_to_post_grad, register_fake_process_group

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


def ranks_by_shard_rows(world_size: int) -> list[int]:
    """One rank per distinct combination of shard sizes (the rows each of the model's
    dim-0 sizes leaves that rank): every kind of rank, each compiled once."""
    from fsdp_compile.runtime.collectives import ShardLayout

    dims = sorted({p.shape[0] for p in build().parameters() if p.ndim})
    first_of: dict[tuple[int, ...], int] = {}
    for rank in range(world_size):
        rows = tuple(ShardLayout((d,), world_size, rank, "").local_rows for d in dims)
        first_of.setdefault(rows, rank)
    return sorted(first_of.values())


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_row_shards_train_like_the_reference(rank_pools, world_size):
    """Eager and compiled through our post-grad passes (where the zero-row bug was) on 2
    and 4 ranks, without Inductor's code generation: on eager's ops (``aot_eager_passes``)
    on 2 ranks, on Inductor's decomposed graphs (``inductor_passes``) on 4; under real
    Inductor: ``test_zero_row_shards_match_fsdp2``."""
    compiled = ("aot_eager_passes",) if world_size == 2 else ("inductor_passes",)
    report = assert_parity(
        build,
        batch,
        loss,
        shard_fn=shard,
        world_size=world_size,
        backends=("eager", *compiled),
        compile_kwargs={"fullgraph": True},
        pool=rank_pools(world_size),
    )
    assert report.graphs == {f"ours:{backend}": 1 for backend in compiled}


def test_zero_row_shards_match_fsdp2(pool2):
    assert_parity(
        build_one_dtype,
        batch,
        loss,
        shard_fn=shard,
        reference="fsdp2",
        backends=("inductor",),
        pool=pool2,
    )


@pytest.mark.parametrize("world_size", [8, 16])
def test_every_rank_schedules_the_same_collectives(world_size):
    """Ranks with full, partial and zero-row shards compile one sequence: per unit one
    all-gather per dtype forward, one re-gather per dtype backward (blocks reshard
    after forward), one reduce-scatter per dtype of trainable parameters."""
    ranks = ranks_by_shard_rows(world_size)
    assert len(ranks) >= 3  # full, partial or zero-row shards on different ranks
    sequences = {rank: scheduled_collectives(rank, world_size) for rank in ranks}
    forward, backward = sequences[0]
    for rank in ranks[1:]:
        assert sequences[rank] == sequences[0], f"rank {rank} of {world_size} schedules other collectives than rank 0"
    kinds = lambda seq: [entry[0] for entry in seq]  # noqa: E731
    # root (fp32), then each block: fp32 and fp64 buckets
    assert kinds(forward) == ["all_gather_into_tensor"] * 5
    gathers = [k for k in kinds(backward) if k == "all_gather_into_tensor"]
    scatters = [k for k in kinds(backward) if k == "reduce_scatter_tensor"]
    assert len(gathers) == 4  # each block's two buckets again; the root keeps its parameters
    assert len(scatters) == 5
