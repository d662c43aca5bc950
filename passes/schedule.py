"""The collective schedule of a post-grad graph: bucketing, then reordering, as
``fsdp_compile.config`` says, and the cost model's choice of bucket size.

Invariant: the graph computes the same values; only our collectives are merged
and moved (see each pass's own invariant).
"""

from __future__ import annotations

from typing import Callable

import torch.fx as fx

from fsdp_compile.base import config
from fsdp_compile.passes.bucketing import bucket_collectives
from fsdp_compile.passes.cost_model import simulate
from fsdp_compile.passes.reordering import reorder_for_overlap
from fsdp_compile.passes.repeated_reads import sum_gradients_before_reducing


def bucket_cap_bytes(graph: fx.Graph) -> int | None:
    """The bucket cap ``config.bucket_mode`` asks for (``None``: one bucket per unit)."""
    if config.bucket_mode == "cap":
        return int(config.bucket_cap_mb * 2**20)
    if config.bucket_mode == "auto":
        return choose_bucket_cap(graph, config.hardware_profile)
    return None


def schedule_collectives(graph: fx.Graph, cap_bytes: int | None, after_each: Callable[[str], None] = lambda stage: None) -> None:
    """Bucketing (a parameter read more than once reduced once, then buckets of at most
    ``cap_bytes``, ``None``: one per unit) then reordering, each if enabled in the config;
    ``after_each`` is called with ``"1_bucketing"`` / ``"2_reordering"`` after each pass
    that ran."""
    if config.bucketing:
        sum_gradients_before_reducing(graph)
        split = config.split_unit_min_mb
        bucket_collectives(graph, cap_bytes, None if split is None else int(split * 2**20))
        after_each("1_bucketing")
    if config.reorder:
        reorder_for_overlap(
            graph,
            prefetch_depth=config.prefetch_depth,
            reduce_scatter_depth=config.reduce_scatter_depth,
            max_inflight_bytes=config.max_inflight_bytes,
            profile=config.hardware_profile,
        )
        after_each("2_reordering")


def choose_bucket_cap(graph: fx.Graph, profile: str, candidates_mb=(None, 64, 16, 4, 1)) -> int | None:
    """``bucket_mode="auto"``: the cap (bytes, ``None`` = one bucket per unit) whose
    scheduled copy of ``graph`` simulates fastest; ties go to fewer, larger buckets.
    Rank-independent: our own copies are left out of the costs."""
    best: tuple[float, int | None] | None = None
    for cap_mb in candidates_mb:
        cap = None if cap_mb is None else int(cap_mb * 2**20)
        trial = copy_graph(graph)
        schedule_collectives(trial, cap)
        step = simulate(trial, profile, ignore_own_copies=True).step_s
        if best is None or step < best[0] * (1 - 1e-9):
            best = (step, cap)
    return best[1] if best else None


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` with the same node names and metadata."""
    new = fx.Graph()
    new.output(new.graph_copy(graph, {}))
    return new
