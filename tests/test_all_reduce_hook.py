"""FSDP2's ``set_all_reduce_hook``: a function called on a unit's reduced gradients, in place,
after the reduce-scatter (native HSDP: after the all-reduce over the replicas) and before the
division by the group size (``foreach_reduce`` in torch's ``_fsdp_collectives.py``).

Its main user is torchft's pattern: FSDP within a group of ranks, and the hook all-reducing
the reduced shards over the replicas of that group. Upstream tests it as
``TestHSDPWithCustomHook`` (``test_fully_shard_init.py``, 2 x 2 ranks); here on 2 gloo ranks:
each rank a shard group of its own (what the hook all-reduces over is the other rank), FSDP
over both ranks with a hook that scales, and native HSDP (replicate=2, shard=1). Each is
trained against torch's FSDP2 with the same hook: eager bitwise, with the same calls (one
per unit and backward, on the same flat buffer: dtype and element count); compiled (one
opaque call per parameter inside the graph) to float32 rounding, in one graph per step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.models import compile_counting_graphs, fully_shard_of
from tests.test_fsdp2_training_more import _mp_policy

STEPS = 3


def _replica_groups():
    """This rank alone (the shard group) and both ranks (the replicas): every rank makes both."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._init_utils import _init_inter_node_process_group, _init_intra_node_process_group

    alone = _init_intra_node_process_group(1)
    replicas = _init_inter_node_process_group(dist.distributed_c10d._get_default_group(), 1)
    mesh = DeviceMesh.from_group(alone, "cpu", dist.get_process_group_ranks(alone), mesh_dim_names=("shard",))
    return mesh, replicas


def train_with_hook(kind: str, layout: str, backend: str | None, mixed: bool, accumulate: bool = False) -> dict:
    """Two linear layers and the root, each a unit with the same hook; ``STEPS`` Adam steps on
    inputs that differ by rank. ``layout``: ``"replicas"`` (a one-rank shard group per rank,
    the hook averages over both ranks by hand: gloo has no average), ``"fsdp"`` (2 ranks, the
    hook scales by 0.5 and adds 1e-3), ``"hsdp"`` ((replicate=2, shard=1), the same hook).
    ``mixed``: bf16 parameters, fp32 reduction. ``accumulate``: each step two micro-batches, the
    first with gradient sync off (the hook runs once per unit, on the synced one's reduction)."""
    from fsdp_compile.testing import full_parameters
    from tests.test_fsdp2_contract_more import _mesh

    fully_shard = fully_shard_of(kind)
    replicas = None
    if layout == "replicas":
        mesh, replicas = _replica_groups()
    elif layout == "hsdp":
        mesh = _mesh((2, 1), ("replicate", "shard"))
    else:
        mesh = _mesh((2,), ("shard",))
    calls = []

    def hook(reduced: torch.Tensor) -> None:
        calls.append((str(reduced.dtype), reduced.numel(), reduced.is_contiguous()))
        if replicas is not None:
            dist.all_reduce(reduced, group=replicas)
            reduced.div_(2)
        else:
            reduced.mul_(0.5).add_(1e-3)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))  # 5 rows: padded over 2 ranks
    options = {"mesh": mesh}
    if mixed:
        options["mp_policy"] = _mp_policy(kind)(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2]):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    for unit in (model[0], model[2], model):
        unit.set_all_reduce_hook(hook)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step_model, counter = compile_counting_graphs(model, backend)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses, calls_per_step = [], []
    for _ in range(STEPS):
        calls.clear()
        if accumulate:
            model.set_requires_gradient_sync(False)
            step_model(torch.randn(4, 8, generator=g)).float().square().mean().backward()
            model.set_requires_gradient_sync(True)
        loss = step_model(torch.randn(4, 8, generator=g)).float().square().mean()
        loss.backward()
        calls_per_step.append(list(calls))
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    out = {"losses": torch.stack(losses), "params": full_parameters(model), "calls": calls_per_step}
    if counter is not None:
        out["graphs"] = counter.frame_count
    return out


LAYOUTS = ["replicas", "fsdp", "hsdp"]


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_reduce_hook_trains_as_fsdp2_eager(pool2, layout, mixed):
    expected = pool2.run(train_with_hook, "fsdp2", layout, None, mixed)
    got = pool2.run(train_with_hook, "ours", layout, None, mixed)
    for rank, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert len(e["calls"][0]) == 2, e["calls"]  # the two layers; the root has no parameters
        if layout == "fsdp":
            assert g["calls"] == e["calls"], (rank, g["calls"], e["calls"])
        else:  # a one-rank shard group: ours calls the hook per parameter, on the same elements
            assert all({(dtype, contiguous) for dtype, _, contiguous in c} == {("torch.float32", True)} for c in g["calls"])
            assert [sum(n for _, n, _ in c) for c in g["calls"]] == [sum(n for _, n, _ in c) for c in e["calls"]]
        assert torch.equal(g["losses"], e["losses"]), (rank, g["losses"], e["losses"])
        for name, value in e["params"].items():
            assert torch.equal(g["params"][name], value), (rank, name)
    if layout == "replicas":  # the hook made the two ranks' shards one model again
        assert torch.equal(got[0]["params"]["0.weight"], got[1]["params"]["0.weight"])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_reduce_hook_trains_as_fsdp2_compiled(pool2, layout, backend):
    """Compiled: the hook runs once per parameter inside the one graph of each step."""
    expected = pool2.run(train_with_hook, "fsdp2", layout, None, False)
    got = pool2.run(train_with_hook, "ours", layout, backend, False)
    for rank, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert [len(c) for c in g["calls"]] == [4] * STEPS, (rank, g["calls"])  # 2 weights and 2 biases
        torch.testing.assert_close(g["losses"], e["losses"], rtol=1e-5, atol=1e-6)
        for name, value in e["params"].items():
            torch.testing.assert_close(g["params"][name], value, rtol=1e-5, atol=1e-6)
        assert g["graphs"] == 1, g["graphs"]


def hook_errors() -> dict:
    from tests.test_fsdp2_contract_more import _mesh

    fully_shard = fully_shard_of("ours")
    out = {}
    for name, mesh, call in (
        ("hsdp_stream", _mesh((2, 1), ("replicate", "shard")), lambda m: m.set_all_reduce_hook(lambda t: None, stream=object())),
        ("not_callable", _mesh((2,), ("shard",)), lambda m: m.set_all_reduce_hook(42)),
    ):
        model = fully_shard(nn.Linear(4, 4), mesh=mesh)
        try:
            call(model)
            out[name] = None
        except Exception as e:  # noqa: BLE001
            out[name] = (type(e).__name__, str(e))
    # Removing the hook: the next step reduces as without one.
    torch.manual_seed(0)
    model = fully_shard(nn.Linear(4, 4), mesh=_mesh((2,), ("shard",)))
    torch.manual_seed(0)
    plain = fully_shard(nn.Linear(4, 4), mesh=_mesh((2,), ("shard",)))
    model.set_all_reduce_hook(lambda t: t.mul_(0))
    model.set_all_reduce_hook(None)
    for m in (model, plain):
        m(torch.ones(2, 4)).sum().backward()
    out["removed"] = torch.equal(model.weight.grad.full_tensor(), plain.weight.grad.full_tensor())
    return out


def test_all_reduce_hook_refuses_what_fsdp2_refuses(pool2):
    got = pool2.run(hook_errors)[0]
    assert got["hsdp_stream"] == ("ValueError", "stream cannot be set when using native HSDP")
    assert got["not_callable"][0] == "TypeError" and "Linear" in got["not_callable"][1]
    assert got["removed"] is True


@pytest.mark.parametrize("layout", ["fsdp", "replicas"])
def test_all_reduce_hook_with_gradient_accumulation_matches_fsdp2(pool2, layout):
    """Micro-batches without sync reduce nothing and call no hook; the synced one reduces the
    accumulated sum and calls the hook once per unit (eager, bitwise FSDP2; compiled, the
    same training to fp32 rounding, one graph per sync mode)."""
    expected = pool2.run(train_with_hook, "fsdp2", layout, None, False, True)
    got = pool2.run(train_with_hook, "ours", layout, None, False, True)
    compiled = pool2.run(train_with_hook, "ours", layout, "aot_eager", False, True)
    for rank, (g, c, e) in enumerate(zip(got, compiled, expected, strict=True)):
        assert len(e["calls"][0]) == 2, e["calls"]
        if layout == "fsdp":
            assert g["calls"] == e["calls"], (rank, g["calls"], e["calls"])
        assert [len(x) for x in c["calls"]] == [4] * STEPS, c["calls"]
        assert torch.equal(g["losses"], e["losses"]), rank
        for name, value in e["params"].items():
            assert torch.equal(g["params"][name], value), (rank, name)
            torch.testing.assert_close(c["params"][name], value, rtol=1e-5, atol=1e-6)
        assert c["graphs"] == 2, c["graphs"]
