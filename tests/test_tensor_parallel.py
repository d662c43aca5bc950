"""FSDP + tensor parallelism (2-D): parameters TP made DTensors on ``mesh["tp"]`` are
sharded over ``mesh["dp"]``; 4 gloo ranks as (dp=2, tp=2)."""

from __future__ import annotations

import pytest
import torch

from tests import tp_models

STEPS = 3


@pytest.fixture(scope="module")
def pool4(rank_pools):
    return rank_pools(4)


# ------------------------------------------------------------------ rank jobs


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def parallelize(model, mesh, sequence_parallel: bool, shard) -> None:
    """TP on ``mesh["tp"]`` first, then ``shard`` (ours or torch's ``fully_shard``) on
    ``mesh["dp"]`` per block and on the root."""
    from torch.distributed.tensor.parallel import parallelize_module

    root_plan, block_plan = tp_models.tp_plan(sequence_parallel)
    if root_plan:
        parallelize_module(model, mesh["tp"], root_plan)
    for block in model.layers:
        parallelize_module(block, mesh["tp"], block_plan)
    for block in model.layers:
        shard(block, mesh=mesh["dp"])
    shard(model, mesh=mesh["dp"])


def train(variant: str, sequence_parallel: bool = False, steps: int = STEPS) -> dict:
    """Losses and full parameters after each step. ``variant``: ``"reference"`` (one
    process, the global batch), ``"fsdp2"`` (torch's fully_shard + TP, eager), or
    ``"ours"`` / ``"ours:<backend>"`` (compiled with ``fullgraph=True``)."""
    import torch.distributed as dist

    from fsdp_compile._compat import compile_counter, reset_dynamo
    from fsdp_compile.testing import full_parameters

    reset_dynamo()
    model = tp_models.build()
    dp_rank, dp_size = 0, 1
    if variant != "reference":
        mesh = _mesh()
        dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
        if variant == "fsdp2":
            from torch.distributed.fsdp import fully_shard
        else:
            from fsdp_compile import fully_shard
        parallelize(model, mesh, sequence_parallel, fully_shard)
    backend = variant.split(":", 1)[1] if ":" in variant else None
    counter = compile_counter(backend) if backend else None
    run = model if counter is None else torch.compile(model, backend=counter, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, params = [], []
    for step in range(steps):
        tokens, targets = tp_models.batch(step)
        tokens, targets = tokens.chunk(dp_size)[dp_rank], targets.chunk(dp_size)[dp_rank]
        loss = tp_models.loss(run(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        global_loss = loss.detach().clone()
        if variant != "reference":
            dist.all_reduce(global_loss)
            global_loss /= dist.get_world_size()
        losses.append(global_loss.item())
        params.append(full_parameters(model))
    placements = {n: tuple(map(repr, p.placements)) for n, p in model.named_parameters() if hasattr(p, "placements")}
    return {"losses": losses, "params": params, "graphs": counter.frame_count if counter else None, "placements": placements}


def _sharded_model(layout: str):
    """``"ours"`` / ``"fsdp2"``: (dp=2, tp=2) with TP; ``"ours_dp4"``: our FSDP over all
    4 ranks, no TP (a checkpoint resharded to another data-parallel size)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compile import fully_shard

    model = tp_models.build()
    if layout == "ours_dp4":
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    parallelize(model, _mesh(), False, fully_shard)
    return model


def checkpoint_interchange(path: str, writer: str, reader: str) -> float:
    """``writer`` trains one step and saves with DCP; ``reader`` loads into a fresh model.
    Returns the largest gap between the two models' full parameters (0: exact)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from fsdp_compile.testing import full_parameters

    model = _sharded_model(writer)
    tokens, targets = tp_models.batch(0)
    tp_models.loss(model(tokens), targets).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    loaded = _sharded_model(reader)
    state = {"model": get_model_state_dict(loaded)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(loaded, state["model"])
    saved, restored = full_parameters(model), full_parameters(loaded)
    assert saved.keys() == restored.keys()
    return max((saved[k] - restored[k]).abs().max().item() for k in saved)


def _max_gap(a: dict, b: dict) -> float:
    gaps = [abs(x - y) for x, y in zip(a["losses"], b["losses"])]
    for pa, pb in zip(a["params"], b["params"]):
        assert pa.keys() == pb.keys()
        gaps += [(pa[k] - pb[k]).abs().max().item() for k in pa]
    return max(gaps)


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_fsdp_tp_matches_reference_and_fsdp2(pool4, sequence_parallel):
    reference = pool4.run(train, "reference")[0]
    fsdp2 = pool4.run(train, "fsdp2", sequence_parallel)[0]
    ours_eager = pool4.run(train, "ours", sequence_parallel)[0]
    ours_aot = pool4.run(train, "ours:aot_eager", sequence_parallel)[0]
    # Same names and placements as FSDP2 + TP (so DCP checkpoints interchange).
    assert ours_eager["placements"] == fsdp2["placements"]
    assert _max_gap(fsdp2, reference) < 1e-5
    assert _max_gap(ours_eager, reference) < 1e-5
    # Eager and aot_eager run the same ops: bitwise equal.
    assert _max_gap(ours_aot, ours_eager) == 0.0
    assert ours_aot["graphs"] == 1  # fullgraph=True, no recompiles


def test_fsdp_tp_sp_under_inductor_matches_reference(pool4):
    """Inductor (our post-grad passes, the cross-rank check) on the sequence-parallel plan,
    the one with the most TP collectives; to fp32 rounding."""
    reference = pool4.run(train, "reference")[0]
    ours_inductor = pool4.run(train, "ours:inductor", True)[0]
    assert ours_inductor["graphs"] == 1
    assert _max_gap(ours_inductor, reference) < 1e-5


def test_fsdp_tp_placements_are_fsdp2s(pool4):
    placements = pool4.run(train, "ours", False, 1)[0]["placements"]
    assert placements["layers.0.attention.wq.weight"] == ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)")
    assert placements["layers.0.attention.wo.weight"] == ("Shard(dim=0)", "Shard(dim=1)")
    assert placements["layers.0.attention_norm.weight"] == ("Shard(dim=0)",)  # not TP'd: dp only


@pytest.mark.parametrize("writer,reader", [("ours", "fsdp2"), ("fsdp2", "ours"), ("ours", "ours_dp4")])
def test_dcp_checkpoints_interchange_with_fsdp2_tp_and_reshard(pool4, tmp_path, writer, reader):
    gaps = pool4.run(checkpoint_interchange, str(tmp_path / "ckpt"), writer, reader)
    assert gaps == [0.0] * 4


# ------------------------------------------------- graph structure (fake ranks)


def _fake_tp_model(sequence_parallel: bool = False):
    """The model under TP on a (dp=2, tp=4) mesh of the 8 fake ranks, then ours."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compile import fully_shard
    from fsdp_compile._compat import reset_dynamo

    reset_dynamo()
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model = tp_models.build()
    parallelize(model, mesh, sequence_parallel, fully_shard)
    return model, mesh


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_compiled_tp_step_keeps_no_resharded_weight(fake_pg, sequence_parallel):
    """One graph per step; the blocks (reshard_after_forward=True) save no gathered
    weight for backward, only the root unit's (reshard_after_forward=False) are kept;
    DTensor's TP collectives are in the graph and none of them carries our tag."""
    from fsdp_compile.runtime import tag_of
    from fsdp_compile.testing import GraphCapture, saved_all_gathers
    from fsdp_compile.runtime.vocabulary import collective_kind

    model, mesh = _fake_tp_model(sequence_parallel)
    capture = GraphCapture("min_cut")
    tokens, targets = tp_models.batch(0)
    tp_models.loss(torch.compile(model, backend=capture, fullgraph=True)(tokens), targets).backward()
    assert capture.frame_count == 1
    (fw,), (bw,) = capture.forward_graphs, capture.backward_graphs
    assert {tag_of(n).unit_fqn for n in saved_all_gathers(fw)} == {""}
    ours = [n for g in (fw, bw) for n in g.graph.nodes if collective_kind(n) and tag_of(n) is not None]
    tp = [n for g in (fw, bw) for n in g.graph.nodes if collective_kind(n) and tag_of(n) is None]
    assert len([n for n in ours if collective_kind(n) == "all_gather"]) >= len(list(model.parameters()))
    assert tp, "the TP plan's own collectives should be in the graph"
    tp_group = mesh["tp"].get_group().group_name
    from fsdp_compile.runtime.vocabulary import group_of

    assert {group_of(n) for n in tp} == {tp_group}
    assert tp_group not in {group_of(n) for n in ours}


def test_dp_mesh_must_be_a_sibling_dimension_of_the_tp_mesh(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compile import fully_shard

    model, mesh = tp_models.build(), init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model.layers[0], mesh["tp"], tp_models.tp_plan(False)[1])
    other = init_device_mesh("cpu", (8,), mesh_dim_names=("world",))
    with pytest.raises(ValueError, match=r"'attention\.wq\.weight'.*not another dimension of the same DeviceMesh"):
        fully_shard(model.layers[0], mesh=other)
    with pytest.raises(ValueError, match=r"already a DTensor on mesh dimension\(s\) \['tp'\].*apply it first"):
        fully_shard(model.layers[0], mesh=mesh["tp"])


def test_tp_placements_fsdp_cannot_shard_are_rejected(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from fsdp_compile import fully_shard

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    module = torch.nn.Linear(4, 4)
    module.weight = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, 4), mesh["tp"], [Partial()]))
    with pytest.raises(NotImplementedError, match=r"'weight'.*Partial"):
        fully_shard(module, mesh=mesh["dp"])
