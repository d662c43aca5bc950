"""Data-parallel layouts beyond 1-D FSDP: HSDP on a 2x2 mesh (4 gloo ranks),
replicate (DDP) and CPU offload (2 ranks). Parity against a single-process
reference and against torch's own implementation of the same layout, over
3 SGD steps; eager vs aot_eager bitwise."""

from __future__ import annotations

import pytest
import torch

from tests import layout_jobs, parity_jobs
from tests.test_parity import _assert_records_equal

OURS = ["ours-eager", "ours-aot_eager", "ours-inductor"]


def _check_parity(per_rank: list, variants: list) -> None:
    for other in per_rank[1:]:  # every rank reports the same full parameters and losses
        for v in variants:
            _assert_records_equal(per_rank[0][v], other[v], exact=True, what=v)
    result = per_rank[0]
    _assert_records_equal(result["ours-eager"], result["ours-aot_eager"], exact=True, what="eager vs aot_eager")
    for v in variants:
        if v != "reference":
            _assert_records_equal(result[v], result["reference"], exact=False, what=f"{v} vs reference")
    if "fsdp2" in variants:
        for v in OURS:
            _assert_records_equal(result[v], result["fsdp2"], exact=False, what=f"{v} vs torch")
    assert result["ours-aot_eager"]["frames"] == result["ours-inductor"]["frames"] == 1


@pytest.fixture(scope="module")
def pool4(rank_pools):
    return rank_pools(4)


def test_hsdp_2x2_matches_reference_and_torch_hsdp(pool4):
    variants = ["reference", *OURS, "fsdp2"]
    _check_parity(pool4.run(parity_jobs.train_all, "llama", variants, 3, False, None, "hsdp"), variants)


def test_hsdp_shards_over_dim_1_and_all_reduces_over_dim_0(pool4):
    for rank, info in enumerate(pool4.run(layout_jobs.placements_and_graph, "hsdp")):
        assert set(map(tuple, info["placements"].values())) == {("R", "S(0)")}
        shard, replicate = info["groups"]["shard"], info["groups"]["replicate"]
        assert {(op, g, n) for op, g, n in info["forward"]} == {("all_gather_into_tensor", shard, 2)}, rank
        backward_ops = {(op, g) for op, g, _ in info["backward"]}
        # Re-gathers (reshard after forward), reduce-scatters over the shard dim,
        # then all-reduces of the reduced shards over the replicate dim.
        assert backward_ops == {("all_gather_into_tensor", shard), ("reduce_scatter_tensor", shard), ("all_reduce", replicate)}
        first_reduce = next(i for i, c in enumerate(info["backward"]) if c[0] == "reduce_scatter_tensor")
        assert all(c[0] != "all_reduce" for c in info["backward"][:first_reduce])


def test_replicate_matches_reference_and_torch_replicate(pool2):
    variants = ["reference", *OURS, "fsdp2"]
    _check_parity(pool2.run(parity_jobs.train_all, "llama", variants, 3, False, None, "ddp"), variants)
    info = pool2.run(layout_jobs.placements_and_graph, "ddp")[0]
    assert set(map(tuple, info["placements"].values())) == {("R",)}
    assert info["forward"] == []  # nothing to gather
    assert {op for op, _, _ in info["backward"]} == {"all_reduce"}


def test_cpu_offload_placement_and_parity(pool2):
    """On a CPU-only machine the compute device is the CPU too: shards, gradients and
    optimizer state stay on the CPU, and the graph holds no device copy."""
    variants = ["reference", *OURS, "fsdp2"]
    _check_parity(pool2.run(parity_jobs.train_all, "llama", variants, 3, False, None, "offload"), variants)
    info = pool2.run(layout_jobs.placements_and_graph, "offload")[0]
    assert info["param_devices"] == info["grad_devices"] == info["state_devices"] == {"cpu"}
    assert info["device_copies"] == []


def test_shard_placement_copies_only_across_devices():
    """The offload path with a compute device other than the CPU (``meta`` stands in for
    an accelerator here): shards are stored on the CPU and copied for compute."""
    from fsdp_compile._fsdp_state import ShardDevices

    offload = ShardDevices(torch.device("meta"), offload_to_cpu=True)
    stored = offload.to_storage(torch.ones(3))
    assert stored.device.type == "cpu"
    assert offload.to_compute(stored).device.type == "meta"
    same = ShardDevices(torch.device("cpu"), offload_to_cpu=True)
    assert same.to_compute(stored) is stored
    kept = ShardDevices(torch.device("cpu"), offload_to_cpu=False)
    t = torch.ones(2)
    assert kept.to_storage(t) is t and kept.to_compute(t) is t
