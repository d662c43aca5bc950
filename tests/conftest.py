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

#: The files that take longest, longest first (CONTRIBUTING.md, suite time): they run
#: first, so that the two pytest-xdist workers (``-n 2 --dist loadfile`` in pyproject's
#: addopts, one file per worker at a time) are not left with one long file at the end,
#: one worker busy and the other idle. The rest keep their order.
HEAVIEST_FILES_FIRST = (
    "test_tensor_parallel.py",
    "test_layouts.py",
    "test_real_models.py",
    "test_dynamic.py",
    "test_parity.py",
    "test_features.py",
    "test_spmd_mesh.py",
    "test_low_precision.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(HEAVIEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a file is kept


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
