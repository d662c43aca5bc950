"""Shared fixtures: one persistent pool of 2 gloo ranks for the whole session
(from our own pytest plugin, the one users get), and a fake world of 8."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor's CPU kernels built without SIMD (torch/_inductor/config.py ``cpp.vec_isa_ok``;
# read when torch is imported, so set here, before any rank starts): on an empty Inductor
# cache, as on a fresh CI machine, their C++ builds take about half as long, and no ISA
# probe is compiled. The graphs, their fusions and the collectives' order in Inductor's
# code are the same; only each kernel's inner loop is scalar (CONTRIBUTING.md, suite time).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

pytest_plugins = ["fsdp_compile.testing.pytest_plugin"]


@pytest.fixture(scope="session")
def pool2(rank_pool):
    return rank_pool


@pytest.fixture()
def fake_pg():
    """A world of 8 ranks in this process on the ``fake`` backend (graph-structure tests)."""
    import torch.distributed as dist

    from fsdp_compile.testing._torch_internals import register_fake_process_group

    register_fake_process_group()
    dist.init_process_group("fake", rank=0, world_size=8)
    try:
        yield 8
    finally:
        dist.destroy_process_group()
