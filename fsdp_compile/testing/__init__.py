"""Test utilities for sharded models: a persistent multi-rank worker pool and graph capture."""

from fsdp_compile.testing._graphs import GraphCapture, collective_nodes, saved_all_gathers
from fsdp_compile.testing._rank_pool import RankFailure, RankPool

__all__ = ["RankPool", "RankFailure", "GraphCapture", "collective_nodes", "saved_all_gathers"]
