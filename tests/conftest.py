"""Shared fixtures: one persistent pool of 2 gloo ranks for the whole session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def pool2():
    from fsdp_compile.testing import RankPool

    pool = RankPool(2, backend="gloo")
    pool.start()
    yield pool
    pool.close()


@pytest.fixture()
def fake_pg():
    """A world of 8 ranks in this process on the ``fake`` backend (graph-structure tests)."""
    import torch.distributed as dist

    from fsdp_compile._compat import register_fake_process_group

    register_fake_process_group()
    dist.init_process_group("fake", rank=0, world_size=8)
    try:
        yield 8
    finally:
        dist.destroy_process_group()
