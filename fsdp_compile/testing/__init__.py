"""Test utilities for sharded models: the parity harness, a persistent multi-rank
worker pool, graph capture, and small reference models."""

from fsdp_compile.testing._graphs import GraphCapture, collective_nodes, saved_all_gathers
from fsdp_compile.testing._parity import ParityError, ParityReport, assert_parity
from fsdp_compile.testing._rank_pool import RankFailure, RankPool
from fsdp_compile.testing._tensors import full_parameters, full_tensor, global_mean

__all__ = [
    "full_parameters",
    "full_tensor",
    "global_mean",
    "assert_parity",
    "ParityError",
    "ParityReport",
    "RankPool",
    "RankFailure",
    "GraphCapture",
    "collective_nodes",
    "saved_all_gathers",
]
