"""pytest plugin: persistent rank pools as fixtures.

Enable with ``pytest_plugins = ["fsdp_compile.testing.pytest_plugin"]`` in a
``conftest.py``, then::

    def test_something(rank_pool):                 # 2 gloo ranks for the session
        results = rank_pool.run(my_module.check)   # check() runs on every rank

    def test_four(rank_pools):
        rank_pools(4).run(my_module.check)         # a 4-rank pool, started once

Functions sent to the ranks must be importable module-level callables.
"""

from __future__ import annotations

import pytest

from fsdp_compile.testing._rank_pool import RankPool, fastest_start_method


def pytest_configure(config) -> None:
    """``torch.compile(..., backend="inductor_passes")`` in the test process too (see
    ``fsdp_compile.testing._backends``), and Dynamo's side-effect messages off there, as
    in every rank (``_torch_internals.skip_side_effect_messages``)."""
    from fsdp_compile.testing._backends import register_test_backends
    from fsdp_compile.testing._torch_internals import skip_side_effect_messages

    register_test_backends()
    skip_side_effect_messages()


@pytest.fixture(scope="session")
def rank_pools():
    """``rank_pools(world_size, backend="gloo")``: a pool per size, kept for the session.

    The 2-rank pool stays up, and so does a 1-rank one; asking for a size above 2 stops
    the other pools above 2 (their processes, not the objects: a stopped pool starts
    again on its next ``run``), so at most 3 + N ranks hold memory at once and a 4-rank
    pool is not restarted for a 1-rank test between its users. Ranks are forked from a
    server that has imported torch and fsdp_compile (``RankPool``'s ``forkserver``)."""
    pools: dict[tuple[int, str], RankPool] = {}

    def get(world_size: int = 2, backend: str = "gloo") -> RankPool:
        key = (world_size, backend)
        for other_key, other in pools.items():
            if world_size > 2 and other_key != key and other_key[0] > 2:
                other.close()
        if key not in pools:
            pools[key] = RankPool(world_size, backend=backend, start_method=fastest_start_method())
        pools[key].start()
        return pools[key]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="session")
def rank_pool(rank_pools) -> RankPool:
    """2 gloo ranks for the whole session."""
    return rank_pools(2)
