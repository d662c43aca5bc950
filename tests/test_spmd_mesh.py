"""FSDP2's SPMD mesh (``fully_shard(..., mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))``):
parameters are ``DTensor``s of the full mesh with ``Replicate()`` on the data-parallel
dims, modules compute on ``DTensor``s of the full mesh, and FSDP shards (and reduces
gradients over) the named dims; 4 gloo ranks, against torch's FSDP2 on the same layout."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.models import max_gap

STEPS = 3
DIM = 16


@pytest.fixture(scope="module")
def pool4(rank_pools):
    return rank_pools(4)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, 4)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _build() -> Model:
    torch.manual_seed(0)
    return Model()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


# Mesh layouts on 4 ranks: (mesh shape, dim names, DataParallelMeshDims kwargs). The batch is
# split over every data-parallel dim; a dim that is not data-parallel is "tp".
LAYOUTS = {
    # FSDP over "dp", tensor parallelism on "tp" (colwise up, rowwise down), the rest replicated.
    "dp+tp": ((2, 2), ("dp", "tp"), {"shard": "dp"}),
    # The same with the data-parallel dim last (FSDP splits within TP's pieces as Shard, not _StridedShard).
    "tp+dp": ((2, 2), ("tp", "dp"), {"shard": "dp"}),
    # HSDP: replicate over "dp_replicate", shard over "dp_shard"; no other dim.
    "hsdp": ((2, 2), ("dp_replicate", "dp_shard"), {"shard": "dp_shard", "replicate": "dp_replicate"}),
    # FSDP over two dims flattened into one (torchtitan's dp_shard * cp).
    "dp_shard*cp": ((2, 2), ("dp_shard", "cp"), {"shard": ("dp_shard", "cp")}),
    # FSDP over all 4 ranks, a 1-D mesh.
    "dp": ((4,), ("dp",), {"shard": "dp"}),
}


def _tensor_parallel_placement(name: str):
    from torch.distributed.tensor import Replicate, Shard

    if ".up." in name:
        return Shard(0)  # colwise: weight rows and bias
    if name.endswith("down.weight"):
        return Shard(1)  # rowwise
    return Replicate()


def _distribute(model: nn.Module, mesh, data_parallel: set[str]) -> None:
    """Every parameter a ``DTensor`` of the full mesh: ``Replicate()`` on the data-parallel
    dims, the tensor-parallel placement on the others."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            fqn = f"{module_name}.{name}"
            placements = [Replicate() if d in data_parallel else _tensor_parallel_placement(fqn) for d in mesh.mesh_dim_names]
            module.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), mesh, placements)))


_MESHES: dict = {}


def _mesh_of(layout: str):
    """``layout``'s mesh, one per rank process: torch's FSDP2 refuses an equal mesh created
    after one whose dims were flattened (its parameters' mesh is then "not the same mesh
    passed to fully_shard"; two FSDP2 models on two such meshes fail alike)."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout not in _MESHES:
        shape, names, _ = LAYOUTS[layout]
        _MESHES[layout] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[layout]


def _sharded(kind: str, layout: str):
    """The model on ``layout``'s mesh, ``kind``'s ``fully_shard`` per block and on the root;
    returns it, the mesh and the data-parallel dim names."""
    from torch.distributed.fsdp import DataParallelMeshDims

    from tests.models import fully_shard_of

    dims = LAYOUTS[layout][2]
    dp_mesh_dims = DataParallelMeshDims(**dims)
    data_parallel = {*dp_mesh_dims.shard_names, *dp_mesh_dims.replicate_names}
    model = _build()
    mesh = _mesh_of(layout)
    _distribute(model, mesh, data_parallel)
    shard = fully_shard_of(kind)
    for layer in model.layers:
        shard(layer, mesh=mesh, dp_mesh_dims=dp_mesh_dims)
    shard(model, mesh=mesh, dp_mesh_dims=dp_mesh_dims)
    return model, mesh, data_parallel


def checkpoint_interchange(path: str, layout: str, writer: str, reader: str) -> float:
    """``writer`` (``"ours"`` or ``"fsdp2"``) takes one SGD step and saves with DCP;
    ``reader`` loads into a fresh model. The largest gap between their full parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fsdp_compile.testing import full_parameters

    model, mesh, data_parallel = _sharded(writer, layout)
    x, target = (
        distribute_tensor(t, mesh, [Shard(0) if n in data_parallel else Replicate() for n in mesh.mesh_dim_names])
        for t in _batch(0)
    )
    ((model(x) - target) ** 2).mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    loaded = _sharded(reader, layout)[0]
    state = {"model": get_model_state_dict(loaded)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(loaded, state["model"])
    saved, restored = full_parameters(model), full_parameters(loaded)
    assert saved.keys() == restored.keys()
    return max((saved[k] - restored[k]).abs().max().item() for k in saved)


def train(variant: str, layout: str = "dp+tp", steps: int = STEPS, declared_replicated: bool = False) -> dict:
    """Losses and full parameters after each SGD step. ``variant``: ``"reference"`` (one
    process, the global batch, its loss scaled as FSDP's averaging over the data-parallel
    ranks scales it), ``"fsdp2"`` (torch's ``fully_shard``, eager), ``"ours"`` or
    ``"ours:<backend>"`` (compiled with ``fullgraph=True``). ``declared_replicated``: each
    data-parallel rank's own batch, declared ``Replicate()`` on every dim (upstream's
    ``test_fully_shard_dtensor.py`` trains so, DDP-like): gradients then come back
    ``Replicate()`` on the data-parallel dims, which FSDP takes as they are."""
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from fsdp_compile.testing import full_parameters
    from fsdp_compile.testing._torch_internals import reset_dynamo
    from tests.models import compile_counting_graphs

    reset_dynamo()
    shape, names, dims = LAYOUTS[layout]
    dp_mesh_dims = DataParallelMeshDims(**dims)
    data_parallel = {*dp_mesh_dims.shard_names, *dp_mesh_dims.replicate_names}
    dp_degree = 1
    for size, name in zip(shape, names, strict=True):
        dp_degree *= size if name in data_parallel else 1
    kind, _, backend = variant.partition(":")
    model, mesh = _build(), None
    if kind != "reference":
        model, mesh, _ = _sharded(kind, layout)
        batch_placements = [Shard(0) if n in data_parallel else Replicate() for n in names]
    run, counter = compile_counting_graphs(model, backend or None, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, params = [], []
    for step in range(steps):
        x, target = _batch(step)
        if mesh is not None and declared_replicated:
            rank = mesh.get_coordinate()[names.index(dp_mesh_dims.shard_names[0])]
            x, target = (t.chunk(dp_degree)[rank] for t in (x, target))
            x, target = (DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False) for t in (x, target))
        elif mesh is not None:
            x, target = (distribute_tensor(t, mesh, batch_placements) for t in (x, target))
        loss = ((run(x) - target) ** 2).mean()
        (loss if kind != "reference" else loss / dp_degree).backward()
        opt.step()
        opt.zero_grad()
        losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
        params.append(full_parameters(model))
    placements = {n: tuple(map(repr, p.placements)) for n, p in model.named_parameters() if hasattr(p, "placements")}
    meshes = {
        n: (tuple(p.device_mesh.mesh_dim_names), tuple(p.device_mesh.shape))
        for n, p in model.named_parameters()
        if hasattr(p, "device_mesh")
    }
    return {
        "losses": losses,
        "params": params,
        "graphs": counter.frame_count if counter else None,
        "placements": placements,
        "meshes": meshes,
    }


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_spmd_mesh_matches_fsdp2_and_reference(pool4, layout):
    """Ours eager is bitwise torch's FSDP2 on the same SPMD layout (same placements on the
    full mesh, so checkpoints interchange) and matches the single-process reference; ``aot_eager``
    (one graph, ``fullgraph=True``) matches ours eager to fp32 rounding: not bitwise, as
    ``DTensor``'s own ops are not (the unsharded ``DTensor`` model compiled with
    ``aot_eager`` differs from its eager run by ~6e-8 on this layout)."""
    reference = pool4.run(train, "reference", layout)[0]
    fsdp2 = pool4.run(train, "fsdp2", layout)[0]
    ours = pool4.run(train, "ours", layout)[0]
    ours_aot = pool4.run(train, "ours:aot_eager", layout)[0]
    assert ours["placements"] == fsdp2["placements"]
    assert ours["meshes"] == fsdp2["meshes"]
    assert max_gap(fsdp2, reference) < 1e-5
    assert max_gap(ours, fsdp2) == 0.0  # the same arithmetic: bitwise
    assert max_gap(ours_aot, ours) < 1e-6
    assert ours_aot["graphs"] == 1


@pytest.mark.parametrize("writer,reader", [("ours", "fsdp2"), ("fsdp2", "ours")])
def test_spmd_checkpoints_interchange_with_fsdp2(pool4, tmp_path, writer, reader):
    """DCP checkpoints of the flattened (dp_shard * cp) layout load bit for bit across
    FSDP2 and ours, both ways."""
    assert pool4.run(checkpoint_interchange, str(tmp_path / "ckpt"), "dp_shard*cp", writer, reader) == [0.0] * 4


def test_spmd_mesh_takes_replicated_gradients_as_fsdp2(pool4):
    """Each rank's own batch declared ``Replicate()`` (upstream's DDP-like parity test): the
    gradients' local tensors are reduced as they come, as FSDP2 reduces them, bitwise."""
    fsdp2 = pool4.run(train, "fsdp2", "dp+tp", 2, True)[0]
    ours = pool4.run(train, "ours", "dp+tp", 2, True)[0]
    ours_aot = pool4.run(train, "ours:aot_eager", "dp+tp", 2, True)[0]
    assert max_gap(ours, fsdp2) == 0.0
    assert max_gap(ours_aot, ours) < 1e-6 and ours_aot["graphs"] == 1


def _fake_mesh(shape=(2, 4), names=("dp", "tp")):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def test_spmd_mesh_bad_input_is_named_before_any_collective(fake_pg):
    """Each misuse raises naming the parameter or dim and what to do (FSDP2's checks, and
    the layouts we do not support yet), and leaves the module as it was."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fsdp_compile import DataParallelMeshDims, fully_shard

    mesh = _fake_mesh()
    with pytest.raises(ValueError, match=r"'weight'.*plain tensor.*DTensor"):
        fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))

    def linear(placements):
        m = nn.Linear(4, 4, bias=False)
        m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), mesh, placements))
        return m

    module = linear([Shard(0), Replicate()])
    weight = module.weight
    with pytest.raises(ValueError, match=r"'weight'.*Shard\(dim=0\).*'dp'.*Replicate"):
        fully_shard(module, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    assert type(module) is nn.Linear and module.weight is weight
    with pytest.raises(ValueError, match=r"'cp'.*not a dimension.*\('dp', 'tp'\)"):
        fully_shard(linear([Replicate(), Replicate()]), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="cp"))
    with pytest.raises(NotImplementedError, match=r"replicate dims must come before the shard dims"):
        fully_shard(linear([Replicate(), Replicate()]), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp", replicate="tp"))
    with pytest.raises(NotImplementedError, match=r"replicate-only"):
        fully_shard(linear([Replicate(), Replicate()]), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp"))
    with pytest.raises(ValueError, match=r"mesh="):
        fully_shard(linear([Replicate(), Replicate()]), dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    other = _fake_mesh()  # equal, another object: FSDP2 wants the very mesh the parameters are on
    assert other == mesh and other is not mesh
    with pytest.raises(ValueError, match=r"'weight' is another DeviceMesh equal to the one passed.*same mesh"):
        fully_shard(linear([Replicate(), Replicate()]), mesh=other, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    for size in (1, 2, 4):  # any int, as FSDP2 (even the shard group's size, which 1-D meshes take as True)
        with pytest.raises(NotImplementedError, match=r"Linear.*reshard_after_forward as int is not yet supported with SPMD mesh"):
            fully_shard(linear([Replicate(), Replicate()]), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"), reshard_after_forward=size)
