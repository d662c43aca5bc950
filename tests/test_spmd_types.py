"""Parameters typed by ``spmd_types`` (torchtitan's default ``spmd_backend="spmd_types"``):
plain local tensors annotated with their layout over the mesh axes, sharded with
``dp_mesh_dims`` as FSDP2 (torch 2.15) shards them; 4 gloo ranks, a (dp=2, tp=2) mesh and a
1-D one, against a single-process reference and, where torch's FSDP2 reads spmd_types,
against it bitwise. The model computes on plain local tensors with its own collectives, as
torchtitan's spmd_types models do: a column-parallel ``up`` (``S(0)`` on tp), a row-parallel
``down`` (``S(1)``) followed by a sum over tp (Megatron's pair of operators), replicated
norms (``I``), and a head on a sequence split over tp whose weights are ``R`` on tp: their
gradients are partial over tp and must be all-reduced there (spmd_types' ``R`` -> ``P``
backward typing)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.models import max_gap
from tests.test_spmd_mesh import Block as SpmdMeshBlock
from tests.test_spmd_mesh import Model as SpmdMeshModel

spmd = pytest.importorskip("spmd_types")

STEPS = 3
DIM, SEQ, BATCH = 16, 4, 8

# (mesh shape, dim names) on 4 ranks; FSDP shards over "dp", "tp" is tensor parallel.
LAYOUTS = {"dp+tp": ((2, 2), ("dp", "tp")), "dp": ((4,), ("dp",))}
# Each parameter's type on tp (R on dp, where FSDP shards it).
TP_TYPES = {"up.weight": "S0", "up.bias": "S0", "down.weight": "S1", "head.weight": "R", "head.bias": "R"}


def _torch_fsdp2_reads_spmd_types() -> bool:
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    return hasattr(_fsdp_param.FSDPParam, "_resolve_spmd_types_for_storage")


class _SumOverTP(torch.autograd.Function):
    """A row-parallel layer's partial sums added over tp; the gradient is each rank's (I)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _EnterTP(torch.autograd.Function):
    """A column-parallel layer's input: the same on each tp rank; its gradient, partial
    over tp (each rank's columns), summed there."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(grad, "sum", ctx.group), None


class _SplitSequenceOverTP(torch.autograd.Function):
    """This tp rank's part of the sequence; the gradient of the whole (I) is gathered back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.shape = group, x.shape
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(size, dim=1)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed._functional_collectives as funcol

        rank = dist.get_rank(ctx.group)
        full = grad.new_zeros(ctx.shape)
        full.narrow(1, rank * grad.shape[1], grad.shape[1]).copy_(grad)
        return funcol.all_reduce(full, "sum", ctx.group), None


class Block(SpmdMeshBlock):
    """``test_spmd_mesh``'s block (norm, up, down), computing on local tensors with tp's
    collectives where ``tp_group`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.tp_group = None

    def forward(self, x):
        h = self.norm(x)
        if self.tp_group is not None:
            h = _EnterTP.apply(h, self.tp_group)
        h = torch.relu(self.up(h)) @ self.down.weight.t()
        if self.tp_group is not None:
            h = _SumOverTP.apply(h, self.tp_group)
        return x + h + self.down.bias


class Model(SpmdMeshModel):
    """``test_spmd_mesh``'s model with this file's blocks, its head on a sequence split over tp."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.tp_group = None

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        if self.tp_group is not None:
            h = _SplitSequenceOverTP.apply(h, self.tp_group)
        return self.head(h)


def _mesh_of(layout: str):
    """``test_spmd_mesh``'s mesh of the same layout, one per rank process (torch 2.13's FSDP2
    refuses an equal mesh created after another in the same process)."""
    from tests.test_spmd_mesh import LAYOUTS as SPMD_MESH_LAYOUTS
    from tests.test_spmd_mesh import _mesh_of as spmd_mesh_of

    assert SPMD_MESH_LAYOUTS[layout][:2] == LAYOUTS[layout]
    return spmd_mesh_of(layout)


def _type_of(fqn: str, mesh):
    """The annotation torchtitan's spmd_types backend gives ``fqn``: R on dp, its tp type."""
    types = {spmd.MeshAxis.of(mesh.get_group("dp")): spmd.R}
    if "tp" in mesh.mesh_dim_names:
        kind = next((t for suffix, t in TP_TYPES.items() if fqn.endswith(suffix)), "I")
        tp_type = {"S0": spmd.S(0), "S1": spmd.S(1), "R": spmd.R, "I": spmd.I}[kind]
        types[spmd.MeshAxis.of(mesh.get_group("tp"))] = tp_type
    return types


def _typed_local_model(layout: str) -> Model:
    """The reference model's parameters as this rank's plain local pieces, typed."""
    torch.manual_seed(0)
    model = Model()
    mesh = _mesh_of(layout)
    tp = mesh["tp"] if "tp" in mesh.mesh_dim_names else None
    for module_name, module in model.named_modules():
        if tp is not None and hasattr(module, "tp_group"):
            module.tp_group = tp.get_group()
        for name, param in list(module.named_parameters(recurse=False)):
            fqn = f"{module_name}.{name}"
            types = _type_of(fqn, mesh)
            local = param.detach()
            for t in types.values():
                if isinstance(t, spmd.S):
                    local = local.chunk(tp.size(), dim=t.dim)[tp.get_local_rank()]
            typed = nn.Parameter(local.clone())
            spmd.assert_type(typed, types)
            module.register_parameter(name, typed)
    return model


def _batch(step: int, layout: str | None):
    """The global batch, or this rank's part of it (split over dp, whole over tp)."""
    g = torch.Generator().manual_seed(100 + step)
    x, target = torch.randn(BATCH, SEQ, 8, generator=g), torch.randn(BATCH, SEQ, 4, generator=g)
    if layout is None:
        return x, target
    mesh = _mesh_of(layout)
    dp = mesh["dp"]
    x, target = (t.chunk(dp.size())[dp.get_local_rank()] for t in (x, target))
    if "tp" in mesh.mesh_dim_names:
        target = target.chunk(mesh["tp"].size(), dim=1)[mesh["tp"].get_local_rank()]
    return x, target


def _type_checked(mesh, type_checked: bool):
    """spmd_types' type checker over ``mesh`` (strict, local types), or nothing."""
    import contextlib

    if not type_checked:
        return contextlib.nullcontext()
    from spmd_types.checker import typecheck

    stack = contextlib.ExitStack()
    stack.enter_context(spmd.set_current_mesh(mesh))
    stack.enter_context(typecheck())
    return stack


def _step(loss, opt, model, sharded: bool, loss_divisor: int, losses: list, params: list) -> None:
    """Backward and an optimizer step; records the loss (summed over the ranks of a sharded
    run, divided by ``loss_divisor``) and the whole parameters."""
    from fsdp_compile.testing import full_parameters

    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    if sharded:
        dist.all_reduce(total)
        total /= loss_divisor
    losses.append(total.item())
    params.append(full_parameters(model) if sharded else {n: p.detach().clone() for n, p in model.named_parameters()})


def train(variant: str, layout: str, type_checked: bool = False) -> dict:
    """Losses (the global mean) and full parameters after each AdamW step. ``variant``:
    ``"reference"`` (one process, the global batch), ``"fsdp2"``, ``"ours"`` or
    ``"ours:<backend>"`` (compiled, ``fullgraph=True``). ``type_checked``: the forward under
    spmd_types' type checker, the batch typed Varying on dp (what the first block's ``up``
    reads of its weight is recorded: its type)."""
    from torch.distributed.fsdp import DataParallelMeshDims

    from fsdp_compile.testing._torch_internals import reset_dynamo
    from tests.models import compile_counting_graphs, fully_shard_of

    reset_dynamo()
    kind, _, backend = variant.partition(":")
    mesh = _mesh_of(layout)
    if kind == "reference":
        torch.manual_seed(0)
        model = Model()
    else:
        model = _typed_local_model(layout)
        shard, dims = fully_shard_of(kind), DataParallelMeshDims(shard="dp")
        for layer in model.layers:
            shard(layer, mesh=mesh, dp_mesh_dims=dims)
        shard(model, mesh=mesh, dp_mesh_dims=dims)
    run, counter = compile_counting_graphs(model, backend or None, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, params, read_types = [], [], []
    if type_checked:
        up = model.layers[0].up
        up.register_forward_hook(lambda m, i, o: read_types.append(dict(spmd.get_local_type(m.weight))))
    for step in range(STEPS):
        x, target = _batch(step, None if kind == "reference" else layout)
        # Each rank's loss is its share of the global mean: summed over tp (gradients partial
        # there), averaged over dp by FSDP's reduce-scatter.
        share = target.numel() * (mesh.size() // mesh["dp"].size() if kind != "reference" else 1)
        if type_checked:
            dp = {spmd.MeshAxis.of(mesh.get_group("dp")): spmd.V}
            x, target = spmd.assert_type(x, dp), spmd.assert_type(target, dp)
        with _type_checked(mesh, type_checked):
            loss = ((run(x) - target) ** 2).sum() / share
        _step(loss, opt, model, kind != "reference", mesh["dp"].size(), losses, params)
    placements = {n: tuple(map(repr, p.placements)) for n, p in model.named_parameters() if hasattr(p, "placements")}
    graphs = counter.frame_count if counter else None
    return {"losses": losses, "params": params, "graphs": graphs, "placements": placements, "read_types": read_types}


@pytest.fixture(scope="module")
def pool4(rank_pools):
    return rank_pools(4)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_spmd_typed_parameters_train_as_the_reference_and_fsdp2(pool4, layout):
    """Ours, eager and ``aot_eager`` (one graph), trains the typed local model as the
    single-process reference trains the whole one (to fp32 rounding: the sums over tp are
    another order); its sharded parameters are the ``DTensor``s FSDP2 makes of them
    (``Shard(0)`` on dp, the type's placement on tp), and where torch's FSDP2 reads
    spmd_types (torch 2.15), ours eager is bitwise FSDP2's. Without the gradients' typing
    (``to_local()`` with the forward's placements, ``Replicate()`` on tp) the head's weights
    miss the other tp rank's part of their gradient, silently: 4.9e-2 off the reference
    after 3 steps, and this test fails."""
    reference = pool4.run(train, "reference", layout)[0]
    ours = pool4.run(train, "ours", layout)[0]
    ours_aot = pool4.run(train, "ours:aot_eager", layout)[0]
    assert max_gap(ours, reference) < 1e-5
    assert max_gap(ours_aot, ours) < 1e-6
    assert ours_aot["graphs"] == 1
    shard_dp = "Shard(dim=0)"
    if layout == "dp+tp":
        assert ours["placements"]["head.weight"] == (shard_dp, "Replicate()")
        assert ours["placements"]["layers.0.down.weight"] == (shard_dp, "Shard(dim=1)")
    else:
        assert set(ours["placements"].values()) == {(shard_dp,)}
    if _torch_fsdp2_reads_spmd_types():
        fsdp2 = pool4.run(train, "fsdp2", layout)[0]
        assert ours["placements"] == fsdp2["placements"]
        assert max_gap(ours, fsdp2) == 0.0


def _typed(param, types):
    spmd.assert_type(param, types)
    return param


def test_spmd_typed_parameters_bad_layouts_are_named_before_any_collective(fake_pg):
    """What FSDP cannot shard raises before any collective (the module is left as it was),
    FSDP2's ``ValueError`` in its words (torch's own tests compare them) with a note naming
    the unit, the parameter and what FSDP needs: a typed parameter without ``dp_mesh_dims``
    (torchtitan passes it), a type other than R on a data-parallel axis, no type on a dim
    that is not data-parallel (and no current mesh to complete it from); and a Partial parameter (our ``NotImplementedError``, naming it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims

    from fsdp_compile import fully_shard

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    dp, tp = spmd.MeshAxis.of(mesh.get_group("dp")), spmd.MeshAxis.of(mesh.get_group("tp"))
    dims = {"mesh": mesh, "dp_mesh_dims": DataParallelMeshDims(shard="dp")}
    cases = [
        ({tp: spmd.S(0)}, {"mesh": mesh["dp"]}, ValueError, r"^spmd_types parameters require fully_shard\(\) to be called with both"),
        ({dp: spmd.S(0), tp: spmd.R}, dims, ValueError, r"^Expected spmd.R on FSDP DP axis .* for parameter 'weight' but got"),
        ({dp: spmd.R}, dims, ValueError, r"^Parameter 'weight' has partial spmd_types annotations that cannot be restored"),
        ({dp: spmd.R, tp: spmd.P}, dims, NotImplementedError, r"'0.weight' has Partial\(.*\) on dim 'tp'"),
    ]
    for types, kwargs, error, match in cases:
        module = nn.Sequential(nn.Linear(8, 8))
        _typed(module[0].weight, types)
        with pytest.raises(error, match=match) as raised:
            fully_shard(module, **kwargs)
        if error is ValueError and hasattr(raised.value, "add_note"):
            assert "fully_shard(Sequential): parameter '0.weight', typed by spmd_types" in raised.value.__notes__[0]
        assert type(module) is nn.Sequential and not isinstance(module[0].weight, torch.distributed.tensor.DTensor)


def test_spmd_typed_parameters_completed_from_the_current_mesh(fake_pg):
    """Typed on tp only, under spmd_types' current mesh at ``fully_shard``: the annotation
    is completed with R on the data-parallel axis (FSDP2's rule), and a read is typed so."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims

    from fsdp_compile import fully_shard

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    dp, tp = spmd.MeshAxis.of(mesh.get_group("dp")), spmd.MeshAxis.of(mesh.get_group("tp"))
    module = nn.Sequential(nn.Linear(8, 8, bias=False))
    _typed(module[0].weight, {tp: spmd.I})
    with spmd.set_current_mesh(mesh):
        fully_shard(module, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    assert module[0].weight.placements == (torch.distributed.tensor.Shard(0), torch.distributed.tensor.Replicate())
    typing = module[0]._fsdp_params["weight"].spmd_typing
    assert typing.restore_type == {dp: spmd.R, tp: spmd.I}


def test_spmd_typed_parameters_under_the_type_checker(pool4):
    """With spmd_types' type checker on (torchtitan's ``spmd_typechecking``), an eager
    forward reads each parameter as a plain tensor typed as it was before sharding (R on
    dp), and trains bitwise as without the checker. Our gathers read untyped tensors: run
    under the checker, the first one raised ``SpmdTypeError`` (they run outside it, as
    FSDP2's do)."""
    checked = pool4.run(train, "ours", "dp", True)[0]
    plain = pool4.run(train, "ours", "dp")[0]
    assert max_gap(checked, plain) == 0.0
    dp_axis = spmd.MeshAxis.of(4, 1)  # all 4 ranks, stride 1: the 1-D mesh's dp axis
    assert checked["read_types"] == [{dp_axis: spmd.R}] * STEPS


# ---------------------------------------------------------------- experts on a mesh of their own

EXPERTS = 2  # one per "ep" rank; each "efsdp" pair shards its expert with FSDP


class ExpertModel(nn.Module):
    """A dense layer and a stack of experts; a rank's tokens go through the expert it holds
    (its "ep" coordinate): the expert-parallel layout without the token dispatch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, DIM)
        self.experts = nn.Parameter(0.1 * torch.randn(EXPERTS, DIM, DIM))
        self.head = nn.Linear(DIM, 4)

    def forward(self, x, expert: int = 0):
        h = self.embed(x)
        return self.head(h + torch.relu(h @ self.experts[expert]))


_EXPERT_MESHES: dict = {}


def _expert_meshes():
    """The dense mesh (``test_spmd_mesh``'s 1-D "dp", 4 ranks) and the experts' (efsdp=2, ep=2)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not _EXPERT_MESHES:
        _EXPERT_MESHES["sparse"] = init_device_mesh("cpu", (2, EXPERTS), mesh_dim_names=("efsdp", "ep"))
    return _mesh_of("dp"), _EXPERT_MESHES["sparse"]


def _sharded_experts(kind: str) -> ExpertModel:
    """The model as torchtitan's spmd_types backend lays it out (plain local tensors typed:
    R on dp; the experts R on efsdp, S(0) on ep), one unit whose ``shard_placement_fn`` puts
    the experts on their mesh (torch's ``_get_mesh_info`` with its ``dp_mesh_dims``), every
    gradient summed (divide factor 1.0: the loss is divided by the global token count)."""
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    from tests.models import fully_shard_of

    dense, sparse = _expert_meshes()
    torch.manual_seed(0)
    model = ExpertModel()
    ep = sparse["ep"]
    local = model.experts.detach().chunk(EXPERTS)[ep.get_local_rank()].clone()
    model.experts = nn.Parameter(local)
    spmd.assert_type(model.experts, {spmd.MeshAxis.of(sparse.get_group("efsdp")): spmd.R, spmd.MeshAxis.of(ep.get_group()): spmd.S(0)})
    for name, param in model.named_parameters():
        if name != "experts":
            spmd.assert_type(param, {spmd.MeshAxis.of(dense.get_group("dp")): spmd.R})
    expert_mesh_info = _get_mesh_info(sparse, DataParallelMeshDims(shard="efsdp"))
    experts = model.experts

    def placement(param):
        return ShardPlacementResult(placement=Shard(0), mesh_info=expert_mesh_info) if param is experts else None

    fully_shard_of(kind)(model, mesh=dense, dp_mesh_dims=DataParallelMeshDims(shard="dp"), shard_placement_fn=placement)
    model.set_gradient_divide_factor(1.0)
    model.set_force_sum_reduction_for_comms(True)  # (FSDP2's factor-1.0 reduce-scatter is a PREMUL_SUM: not on gloo)
    return model


def train_experts(variant: str) -> dict:
    """Losses (global) and full parameters after each AdamW step: ``"reference"`` (one
    process; rank r's batch through expert r % 2), ``"fsdp2"``, ``"ours"``, ``"ours:<backend>"``."""
    from fsdp_compile.testing._torch_internals import reset_dynamo
    from tests.models import compile_counting_graphs

    reset_dynamo()
    kind, _, backend = variant.partition(":")
    if kind == "reference":
        torch.manual_seed(0)
        model = ExpertModel()
    else:
        model = _sharded_experts(kind)
    run, counter = compile_counting_graphs(model, backend or None, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, params, world = [], [], 4
    for step in range(STEPS):
        x, target = _batch(step, None)
        chunks = list(zip(x.chunk(world), target.chunk(world), strict=True))
        if kind == "reference":
            loss = sum(((run(xr, r % EXPERTS) - tr) ** 2).sum() for r, (xr, tr) in enumerate(chunks)) / target.numel()
        else:
            xr, tr = chunks[dist.get_rank()]
            loss = ((run(xr) - tr) ** 2).sum() / target.numel()
        _step(loss, opt, model, kind != "reference", 1, losses, params)
    placements = {n: tuple(map(repr, p.placements)) for n, p in model.named_parameters() if hasattr(p, "placements")}
    graphs = counter.frame_count if counter else None
    return {"losses": losses, "params": params, "graphs": graphs, "placements": placements}


def test_spmd_typed_experts_on_their_own_mesh_train_as_the_reference(pool4):
    """torchtitan's MoE layout under spmd_types: in one unit, dense parameters sharded over
    "dp" (4 ranks) and the experts, typed on (efsdp, ep), over "efsdp" (2 ranks) by a
    ``ShardPlacementResult`` whose mesh info carries the expert mesh's ``dp_mesh_dims``
    (``fully_shard`` refused it before). Ours, eager and ``aot_eager`` (one graph), trains
    as the single-process reference; bitwise FSDP2 eager where torch's FSDP2 reads
    spmd_types; the experts' ``DTensor`` is on their mesh, FSDP's split of dim 0 strided
    within ep's (``_StridedShard``, as FSDP2 lays it out)."""
    reference = pool4.run(train_experts, "reference")[0]
    ours = pool4.run(train_experts, "ours")[0]
    ours_aot = pool4.run(train_experts, "ours:aot_eager")[0]
    assert max_gap(ours, reference) < 1e-5
    assert max_gap(ours_aot, ours) < 1e-6 and ours_aot["graphs"] == 1
    assert ours["placements"]["experts"] == ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)")
    assert ours["placements"]["embed.weight"] == ("Shard(dim=0)",)
    if _torch_fsdp2_reads_spmd_types():
        fsdp2 = pool4.run(train_experts, "fsdp2")[0]
        assert ours["placements"] == fsdp2["placements"]
        assert max_gap(ours, fsdp2) == 0.0


def test_a_parameter_mesh_with_dp_mesh_dims_needs_a_unit_with_them(fake_pg):
    """A ``ShardPlacementResult`` whose mesh info carries ``dp_mesh_dims`` in a unit sharded
    without them (or the reverse) is refused by name before any collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    from fsdp_compile import fully_shard

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("efsdp", "ep"))
    info = _get_mesh_info(mesh, DataParallelMeshDims(shard="efsdp"))
    module = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(NotImplementedError, match=r"parameter '0.weight' has a shard mesh of its own .*with dp_mesh_dims"):
        fully_shard(module, mesh=mesh["efsdp"], shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), info))
    assert type(module) is nn.Sequential
