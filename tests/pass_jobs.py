"""Rank-side: run a hand-built graph before and after each pass on real data."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist


def outputs_before_and_after_passes(bias_dtype: torch.dtype = torch.float32) -> dict:
    from fsdp_compile.passes.bucketing import bucket_collectives
    from fsdp_compile.passes.pinning import pin_schedule
    from fsdp_compile.passes.reordering import reorder_for_overlap
    from tests.pass_graphs import build_unit_graph

    rank, world_size = dist.get_rank(), dist.get_world_size()
    group_name = dist.group.WORLD.group_name
    gm, shapes = build_unit_graph(world_size, rank, group_name, bias_dtype=bias_dtype)
    gen = torch.Generator().manual_seed(rank)
    dtypes = [n.meta["val"].dtype for n in gm.graph.find_nodes(op="placeholder")]
    inputs = [torch.randn(s, generator=gen).to(d) for s, d in zip(shapes, dtypes)]

    results = {"original": gm(*inputs)}
    bucketed = copy.deepcopy(gm)
    bucket_collectives(bucketed.graph)
    bucketed.recompile()
    results["bucketed"] = bucketed(*inputs)
    reordered = copy.deepcopy(bucketed)
    reorder_for_overlap(reordered.graph)
    reordered.recompile()
    results["reordered"] = reordered(*inputs)
    pin_schedule(reordered.graph)
    reordered.recompile()
    results["pinned"] = reordered(*inputs)
    return results
