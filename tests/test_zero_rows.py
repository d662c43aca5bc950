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

from fsdp_compile.testing import assert_parity
from tests import zero_rows


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_row_shards_train_like_the_reference(rank_pools, world_size):
    report = assert_parity(
        zero_rows.build,
        zero_rows.batch,
        zero_rows.loss,
        shard_fn=zero_rows.shard,
        world_size=world_size,
        backends=("eager", "aot_eager", "inductor"),
        compile_kwargs={"fullgraph": True},
        pool=rank_pools(world_size),
    )
    assert report.graphs == {"ours:aot_eager": 1, "ours:inductor": 1}


def test_zero_row_shards_match_fsdp2(pool2):
    assert_parity(
        zero_rows.build_one_dtype,
        zero_rows.batch,
        zero_rows.loss,
        shard_fn=zero_rows.shard,
        reference="fsdp2",
        backends=("inductor",),
        pool=pool2,
    )


@pytest.mark.parametrize("world_size", [8, 16])
def test_every_rank_schedules_the_same_collectives(world_size):
    """Ranks with full, partial and zero-row shards compile one sequence: per unit one
    all-gather per dtype forward, one re-gather per dtype backward (blocks reshard
    after forward), one reduce-scatter per dtype of trainable parameters."""
    ranks = sorted({0, 1, world_size // 2, world_size - 2, world_size - 1})
    sequences = {rank: zero_rows.scheduled_collectives(rank, world_size) for rank in ranks}
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
