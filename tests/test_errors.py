"""Bad input fails with a clear error, before any collective, on every rank alike."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_compile import fully_shard, replicate
from fsdp_compile.testing import RankFailure
from tests.models import MLPStack

# ---------------------------------------------------------------- on every rank

def shard_rank_dependent_model() -> str:
    rank = dist.get_rank()
    model = nn.Sequential()
    model.layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8 + rank))
    try:
        fully_shard(model)
    except ValueError as e:
        return str(e)
    return "no error"


def fail_on_rank(bad_rank: int):
    if dist.get_rank() == bad_rank:
        return 1 / 0
    dist.barrier()  # the healthy rank blocks in a collective, as it would in a real job


def crash_on_rank(bad_rank: int):
    """A native crash (SIGABRT, as glibc raises on heap corruption) on ``bad_rank``."""
    if dist.get_rank() == bad_rank:
        os.abort()
    dist.barrier()


def rank_and_world():
    return dist.get_rank(), dist.get_world_size()


# ---------------------------------------------------------------- tests

def test_not_a_module(fake_pg):
    with pytest.raises(TypeError, match="expects an nn.Module"):
        fully_shard(torch.randn(3))
    with pytest.raises(TypeError, match="got Tensor"):
        fully_shard([nn.Linear(2, 2), torch.randn(3)])


def test_twice_on_the_same_module(fake_pg):
    """A ``ValueError`` naming the module, that is also FSDP2's ``AssertionError`` with its words
    (upstream's ``test_fully_shard_reapply`` matches them)."""
    lin = nn.Linear(4, 4)
    fully_shard(lin)
    with pytest.raises(ValueError, match="already applied to this FSDPLinear"):
        fully_shard(lin)
    with pytest.raises(AssertionError, match="Each distinct composable distributed API can only be applied to a module once."):
        fully_shard(lin)


def test_parent_before_child(fake_pg):
    model = MLPStack(dim=8, n_layers=2)
    fully_shard(model)
    with pytest.raises(ValueError, match=r"'weight' is already sharded by fully_shard\(MLPStack\).*bottom-up"):
        fully_shard(model.layers[0])


def test_torchs_fully_shard_inside_is_refused(fake_pg):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = MLPStack(dim=8, n_layers=2)
    torch_fully_shard(model.layers[1])
    with pytest.raises(ValueError, match=r"fully_shard\(MLPStack\): FSDPLinear 'layers.1' is sharded by torch's own fully_shard"):
        fully_shard(model)
    with pytest.raises(ValueError, match=r"FSDPLinear '\(this module\)' is sharded by torch's own fully_shard.*cannot be mixed"):
        fully_shard(model.layers[1])


def test_two_dimensional_mesh_needs_dim_names(fake_pg):
    """Also FSDP2's error (an ``AssertionError`` with its words: upstream's
    ``test_2d_mesh_without_mesh_dim_names`` expects it)."""
    mesh = init_device_mesh("cpu", (2, 4))
    with pytest.raises(ValueError, match="2-D mesh without mesh_dim_names.*HSDP") as raised:
        fully_shard(nn.Linear(4, 4), mesh=mesh)
    assert isinstance(raised.value, AssertionError)
    assert "Please init the 2D mesh for HSDP with mesh_dim_names specified" in str(raised.value)


def test_three_dimensional_mesh(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
    with pytest.raises(ValueError, match=r"Linear\) got a 3-D mesh"):
        fully_shard(nn.Linear(4, 4), mesh=mesh)
    with pytest.raises(ValueError, match=r"fully\_shard expects a 1D or 2D DeviceMesh but got DeviceMesh"):  # upstream's
        fully_shard(nn.Linear(4, 4), mesh=mesh)


def test_shard_placement_outside_the_parameters_dims(fake_pg):
    """Named, with the parameter's shape; also FSDP2's ``AssertionError`` and words
    (upstream's ``test_invalid_shard_dim``)."""
    from torch.distributed.tensor import Shard

    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
    with pytest.raises(ValueError, match=r"parameter '0.bias' of shape \[16\]; the dimension must be in \[-1, 1\)") as raised:
        fully_shard(model, shard_placement_fn=lambda p: Shard(1))
    assert isinstance(raised.value, AssertionError) and "Shard dim 1 is invalid for 1D tensor" in str(raised.value)
    assert type(model) is nn.Sequential


def test_replicate_needs_one_dimensional_mesh(fake_pg):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError, match=r"replicate\(Linear\) got a 2-D mesh"):
        replicate(nn.Linear(4, 4), mesh=mesh)


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


@pytest.mark.parametrize("size", [0, 3, 16])
def test_reshard_size_must_divide_the_shard_group(fake_pg, size):
    with pytest.raises(ValueError, match=rf"fully_shard\(Linear\): reshard_after_forward={size} must divide the shard group's size \(8\)"):
        fully_shard(nn.Linear(4, 4), reshard_after_forward=size)


def test_reshard_size_of_wrong_type(fake_pg):
    with pytest.raises(TypeError, match=r"reshard_after_forward=2.0: use True .* or an int"):
        fully_shard(nn.Linear(4, 4), reshard_after_forward=2.0)


def test_reshard_sizes_one_and_the_whole_group_are_the_bools(fake_pg):
    """As FSDP2: 1 keeps everything (False, with a warning), the group's size is True."""
    with pytest.warns(UserWarning, match="reshard_after_forward=1 .* as reshard_after_forward=False"):
        one = fully_shard(nn.Linear(4, 4), reshard_after_forward=1)
    whole = fully_shard(nn.Linear(4, 4), reshard_after_forward=8)
    assert one._fsdp_unit.reshard_after_forward is False and one._fsdp_unit.reshard_to is None
    assert whole._fsdp_unit.reshard_after_forward is True and whole._fsdp_unit.reshard_to is None


def test_prefetch_hints_need_sharded_modules(fake_pg):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0])
    with pytest.raises(ValueError, match="set_modules_to_forward_prefetch: Linear is not a sharded module"):
        model[0].set_modules_to_forward_prefetch([model[1]])
    with pytest.raises(ValueError, match="set_modules_to_backward_prefetch: a unit cannot prefetch itself"):
        model[0].set_modules_to_backward_prefetch([model[0]])


def test_no_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        fully_shard(nn.Linear(4, 4))


def test_ranks_with_different_shapes_fail_together(pool2):
    """Both ranks raise (nobody hangs), naming the first mismatching parameter."""
    results = pool2.run(shard_rank_dependent_model)
    for rank, message in enumerate(results):
        assert "ranks hold different parameters" in message
        assert "'layers.1.weight'" in message
        assert "shape [8, 8]" in message and "shape [9, 8]" in message


@pytest.fixture(scope="module")
def throwaway_pool():
    """2 ranks of their own for the tests that kill them: the session's pool keeps its
    warm processes (imports, compiled kernels); a short grace once a rank failed."""
    from fsdp_compile.testing import RankPool
    from fsdp_compile.testing._rank_pool import fastest_start_method

    with RankPool(2, failure_grace_s=3.0, start_method=fastest_start_method()) as pool:
        yield pool


def test_pool_reports_failing_rank_and_recovers(throwaway_pool):
    # The hung rank's report carries its Python stack: where it waited.
    with pytest.raises(
        RankFailure,
        match=r"(?s)rank 0 ---\ndid not answer.*where it was:\n.*line \d+ in fail_on_rank.*rank 1 ---\n.*ZeroDivisionError",
    ):
        throwaway_pool.run(fail_on_rank, 1, timeout_s=60)
    assert throwaway_pool.run(rank_and_world) == [(0, 2), (1, 2)]


def test_pool_reports_a_native_crash_with_signal_and_stack(throwaway_pool):
    """A rank killed by a signal is reported as such, with the Python stack it died in
    (faulthandler): a heap corruption in CI otherwise said only "process died"."""
    with pytest.raises(
        RankFailure,
        match=r"(?s)rank 1 ---\nprocess died \(killed by SIGABRT\); its Python stacks when it died:\n.*line \d+ in crash_on_rank",
    ):
        throwaway_pool.run(crash_on_rank, 1, timeout_s=60)
    assert throwaway_pool.run(rank_and_world) == [(0, 2), (1, 2)]


def test_offload_policy_of_wrong_type(fake_pg):
    with pytest.raises(TypeError, match="offload_policy must be an OffloadPolicy"):
        fully_shard(nn.Linear(4, 4), offload_policy="cpu")


def test_mesh_of_wrong_type(fake_pg):
    with pytest.raises(TypeError, match="mesh must be a DeviceMesh.*got str"):
        fully_shard(nn.Linear(4, 4), mesh="cpu")


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
def test_mixed_precision_dtype_must_be_floating_point(fake_pg, field):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    with pytest.raises(ValueError, match=rf"mp_policy.{field}=torch.int32: use a floating-point dtype"):
        fully_shard(nn.Linear(4, 4), mp_policy=MixedPrecisionPolicy(**{field: torch.int32}))


def test_complex_tensor_parallel_parameter_is_refused_by_name(fake_pg):
    """Complex parameters are sharded (``test_layouts.py``), but not complex tensor-parallel
    ``DTensor``s: refused by name before any collective."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    module = nn.Linear(4, 4)
    module.spectrum = nn.Parameter(DTensor.from_local(torch.zeros(1, 4, dtype=torch.complex64), mesh["tp"], [Shard(0)]))
    with pytest.raises(NotImplementedError, match=r"parameter 'spectrum' is a complex tensor-parallel DTensor"):
        fully_shard(module, mesh=mesh["dp"])
    assert type(module) is nn.Linear  # untouched


def test_a_shard_mesh_of_its_own_from_shard_placement_fn_is_refused_where_unsupported(fake_pg):
    """``shard_placement_fn`` may return torch's ``ShardPlacementResult`` (a placement with a
    shard mesh of its own: torchtitan's routed experts; trained in ``test_moe_expert_parallel``).
    What this library cannot shard that way is refused by name before any collective: a mesh
    info without a shard dim, a 3-D mesh, an int ``reshard_after_forward``; and anything
    else returned is a ``TypeError``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    world = init_device_mesh("cpu", (8,))
    other = init_device_mesh("cpu", (2, 4), mesh_dim_names=("efsdp", "ep"))
    cube = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))

    def own(mesh_info, placement=None):
        return lambda p: ShardPlacementResult(placement=placement, mesh_info=mesh_info)

    with pytest.raises(NotImplementedError, match=r"'0.weight'.*DDPMeshInfo without a shard dimension"):
        fully_shard(nn.Sequential(nn.Linear(4, 4)), mesh=world, shard_placement_fn=own(DDPMeshInfo(world, replicate_mesh_dim=0)))
    with pytest.raises(NotImplementedError, match=r"'0.weight'.*3-D mesh"):
        fully_shard(nn.Sequential(nn.Linear(4, 4)), mesh=world, shard_placement_fn=own(FSDPMeshInfo(cube, shard_mesh_dim=2)))
    with pytest.raises(NotImplementedError, match=r"reshard_after_forward=2.*'0.weight'"):
        fully_shard(
            nn.Sequential(nn.Linear(4, 4)),
            mesh=world,
            reshard_after_forward=2,
            shard_placement_fn=own(FSDPMeshInfo(other["efsdp"], shard_mesh_dim=0), Shard(1)),
        )
    with pytest.raises(TypeError, match=r"returned 'dim0' for parameter '0.weight'"):
        fully_shard(nn.Sequential(nn.Linear(4, 4)), mesh=world, shard_placement_fn=lambda p: "dim0")
    # The unit's own mesh given back is the default.
    model = fully_shard(nn.Sequential(nn.Linear(4, 4)), mesh=world, shard_placement_fn=own(FSDPMeshInfo(world, shard_mesh_dim=0)))
    assert model[0].weight.device_mesh == world
