"""Bad input fails with a clear error, before any collective, on every rank alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_compile import CPUOffloadPolicy, fully_shard
from fsdp_compile.testing import RankFailure
from tests import error_jobs
from tests.models import MLPStack


def test_not_a_module(fake_pg):
    with pytest.raises(TypeError, match="expects an nn.Module"):
        fully_shard(torch.randn(3))
    with pytest.raises(TypeError, match="got Tensor"):
        fully_shard([nn.Linear(2, 2), torch.randn(3)])


def test_twice_on_the_same_module(fake_pg):
    lin = nn.Linear(4, 4)
    fully_shard(lin)
    with pytest.raises(ValueError, match="already applied"):
        fully_shard(lin)


def test_parent_before_child(fake_pg):
    model = MLPStack(dim=8, n_layers=2)
    fully_shard(model)
    with pytest.raises(ValueError, match=r"'weight' is already sharded by fully_shard\(MLPStack\).*bottom-up"):
        fully_shard(model.layers[0])


def test_two_dimensional_mesh(fake_pg):
    mesh = init_device_mesh("cpu", (2, 4))
    with pytest.raises(NotImplementedError, match="2-D mesh.*HSDP"):
        fully_shard(nn.Linear(4, 4), mesh=mesh)


def test_mesh_on_another_device_type(fake_pg):
    mesh = DeviceMesh("cuda", torch.arange(8), _init_backend=False)
    with pytest.raises(ValueError, match="parameters are on 'cpu' but the mesh is on 'cuda'"):
        fully_shard(nn.Linear(4, 4), mesh=mesh)


def test_shared_parameter_with_conflicting_mesh(fake_pg):
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    fully_shard(a)
    other = init_device_mesh("cpu", (8,), mesh_dim_names=("other",))
    with pytest.raises(ValueError, match="'weight' is shared with the unit of Linear.*different mesh"):
        fully_shard(b, mesh=other)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(reshard_after_forward=2), "reshard_after_forward=2.*issue 4"),
        (dict(shard_placement_fn=lambda p: None), "shard_placement_fn"),
        (dict(offload_policy=CPUOffloadPolicy()), "CPU offload"),
    ],
)
def test_unsupported_options_are_not_ignored(fake_pg, kwargs, match):
    with pytest.raises(NotImplementedError, match=match):
        fully_shard(nn.Linear(4, 4), **kwargs)


def test_unsupported_methods_say_so(fake_pg):
    lin = fully_shard(nn.Linear(4, 4))
    with pytest.raises(NotImplementedError, match="set_modules_to_forward_prefetch"):
        lin.set_modules_to_forward_prefetch([])


def test_no_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        fully_shard(nn.Linear(4, 4))


def test_ranks_with_different_shapes_fail_together(pool2):
    """Both ranks raise (nobody hangs), naming the first mismatching parameter."""
    results = pool2.run(error_jobs.shard_rank_dependent_model)
    for rank, message in enumerate(results):
        assert "ranks hold different parameters" in message
        assert "'layers.1.weight'" in message
        assert "shape [8, 8]" in message and "shape [9, 8]" in message


def test_pool_reports_failing_rank_and_recovers(pool2):
    with pytest.raises(RankFailure, match=r"(?s)rank 0 ---\ndid not answer.*rank 1 ---\n.*ZeroDivisionError"):
        pool2.run(error_jobs.fail_on_rank, 1, timeout_s=60)
    assert pool2.run(error_jobs.rank_and_world) == [(0, 2), (1, 2)]
