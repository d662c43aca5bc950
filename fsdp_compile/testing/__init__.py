"""Test utilities for sharded models: a persistent multi-rank worker pool."""

from fsdp_compile.testing._rank_pool import RankFailure, RankPool

__all__ = ["RankPool", "RankFailure"]
