"""fsdp_compile.testing.assert_parity: passes on a correct setup, names the gap otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fsdp_compile.testing import ParityError, assert_parity
from tests.models import MLPStack, shard_blocks

# ---------------------------------------------------------------- on every rank (model, data, loss)

def build_mlp():
    torch.manual_seed(0)
    return MLPStack(dim=6, n_layers=3, bias=True)


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)


def mse(output, target):
    return F.mse_loss(output, target)


def build_llama():
    from tests.models import build

    return build("llama")[0]


def llama_batch(step: int):
    from tests.models import batch as llama_batches

    return llama_batches("llama", step)


def token_loss(output, target):
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def inductor_compile_setup() -> tuple:
    import torch._inductor.async_compile as async_compile
    import torch._inductor.config as inductor_config

    return inductor_config.compile_threads, async_compile._process_pool_allowed()


def full_tensors_of_2d_layouts() -> list:
    """On a 2 x 2 gloo mesh: ``fsdp_compile.testing.full_tensor`` of DTensors laid out as
    FSDP + TP lays them out (``_StridedShard`` and ``Shard`` on both dims, uneven rows,
    replicated dims), with ``full_tensor()`` made to fail, and ``DTensor.full_tensor()`` of
    the same, with the tensor itself."""
    from unittest import mock

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from fsdp_compile.base.compat import strided_shard
    from fsdp_compile.testing import full_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    out = []
    for shape, placements in [
        ((7, 6), [Shard(0), Shard(1)]),
        ((9, 5), [strided_shard(0, 2), Shard(0)]),
        ((5, 3), [Shard(0), Shard(0)]),
        ((4, 6), [Replicate(), Shard(1)]),
        ((3,), [Shard(0), Replicate()]),
    ]:
        whole = torch.randn(shape)
        t = distribute_tensor(whole, mesh, placements, src_data_rank=None)
        with mock.patch.object(DTensor, "full_tensor", side_effect=AssertionError("full_tensor() called")):
            ours = full_tensor(t)
        out.append((whole, ours, t.full_tensor()))
    return out


# ---------------------------------------------------------------- tests


def test_full_tensor_gathers_fsdp_tp_layouts_without_full_tensor(rank_pools):
    """The test helper's gather of 2-D layouts (gloo's plain all-gather, not
    ``full_tensor()``'s coalesced one) is the tensor, as ``full_tensor()`` is."""
    for rank_result in rank_pools(4).run(full_tensors_of_2d_layouts):
        for whole, ours, dtensors in rank_result:
            assert torch.equal(ours, whole) and torch.equal(dtensors, whole), (whole.shape, ours, whole)

def test_ranks_build_kernels_on_two_threads_without_worker_subprocesses(pool2):
    """A rank builds Inductor's C++ kernels on two threads of its own process (the ranks of
    one machine build the same kernels, each behind a file lock: on one thread each they
    would build one at a time between them), and never starts Inductor's pool of compile
    worker subprocesses (several hundred MB each)."""
    assert pool2.run(inductor_compile_setup) == [(2, False), (2, False)]


def test_parity_against_reference_and_fsdp2(pool2):
    for reference in ("single_process", "fsdp2"):
        report = assert_parity(
            build_mlp,
            batch,
            mse,
            shard_fn=shard_blocks,
            backends=("eager", "aot_eager"),
            reference=reference,
            pool=pool2,
        )
        assert set(report.max_param_gap) == {"ours:eager", "ours:aot_eager"}


def test_a_gap_is_reported_with_step_and_parameter(pool2):
    """Zero tolerance against the reference: rounding differences must be caught and named."""
    pattern = r"ours:eager: (parameter 'layers\.\d\.(weight|bias)' after step \d differs .* by up to|loss at step \d is .* \(gap )"
    with pytest.raises(ParityError, match=pattern):
        assert_parity(
            build_mlp,
            batch,
            mse,
            shard_fn=shard_blocks,
            backends=("eager",),
            rtol=0,
            atol=0,
            pool=pool2,
        )


def test_pytest_plugin_pools_by_world_size(rank_pools):
    from tests.test_errors import rank_and_world

    assert rank_pools(2).run(rank_and_world) == [(0, 2), (1, 2)]
    assert rank_pools(2) is rank_pools(2)


def test_graph_count_under_dynamic_shapes_counts_no_restarted_analysis(pool2):
    """``dynamic=True``: AOTAutograd makes Dynamo restart its analysis of the frame once
    (scalar tensorification); that is not a second graph, for the sharded model as for the
    unsharded one (the check compiled the unsharded model with ``eager``, which never
    restarts, and failed every sharded variant compiled through AOTAutograd)."""
    report = assert_parity(
        build_llama,
        llama_batch,
        token_loss,
        shard_fn=shard_blocks,
        backends=("aot_eager",),
        compile_kwargs={"dynamic": True},
        check_graph_count=True,
        steps=2,
        pool=pool2,
    )
    assert report.graphs == {"ours:aot_eager": 1, "unsharded": 1}
