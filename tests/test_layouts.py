"""Data-parallel layouts beyond 1-D FSDP: HSDP on a 2x2 mesh (4 gloo ranks),
replicate (DDP) and CPU offload (2 ranks). Parity against a single-process
reference and against torch's own implementation of the same layout, over
3 SGD steps; compiled (aot_eager with our passes) bitwise eager on 2 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.models import batch, build, loss_fn
from tests.test_parity import _assert_records_equal, _shard_model, train_all

#: Layouts are about groups, placements and collectives, which our passes handle: the
#: compiled variant is ``aot_eager`` with our joint and post-grad passes
#: (``aot_eager_passes``, fsdp_compile/testing/_backends.py): eager's ops, bucketed,
#: reordered and re-gathered, so bitwise eager on 2 ranks (a reduce-scatter sums two
#: slices, in either order the same). On 4 ranks a bucketed reduce-scatter sums in
#: another order than eager's, so plain ``aot_eager`` keeps the bitwise check there.
OURS = ["ours-eager", "ours-aot_eager_passes"]
OURS_4 = ["ours-eager", "ours-aot_eager", "ours-aot_eager_passes"]

# ---------------------------------------------------------------- on every rank

def _capturing_backend(graphs: list):
    """aot_eager that also keeps the forward and backward graphs it compiles."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=min_cut_rematerialization_partition)


def _collectives(gm) -> list[tuple[str, str, int]]:
    """(op, group name, world size or -1) of every functional collective, in graph order."""
    out = []
    for node in gm.graph.nodes:
        target = getattr(node.target, "_opname", "")
        if node.op == "call_function" and str(node.target).startswith("_c10d_functional.") and target != "wait_tensor":
            size = node.args[-2] if isinstance(node.args[-2], int) else -1
            out.append((target, node.args[-1], size))
    return out


def placements_and_graph(layout: str) -> dict:
    """Shard the small Llama with ``layout``, run one compiled step; report the
    parameters' placements and devices, the gradients' and optimizer state's
    devices, the mesh groups and the compiled graphs' collectives and copies."""
    from fsdp_compile.base.compat import group_name_of

    model, units = build("llama")
    _shard_model("ours", units, None, layout)
    graphs: list = []
    run = torch.compile(model, backend=_capturing_backend(graphs), fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batch("llama", 0)
    rank, world = dist.get_rank(), dist.get_world_size()
    loss_fn("llama", run(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    opt.step()
    dp = model._fsdp_unit.dp_mesh
    groups = {"shard": dp.shard_group_name, "replicate": dp.replicate_group_name}
    mesh = dp.mesh
    assert all(group_name_of(mesh.get_group(n)) == groups[n] for n in mesh.mesh_dim_names or [])
    device_copies = [
        str(n.target)
        for gm in graphs
        for n in gm.graph.nodes
        if n.op == "call_function"
        and (n.target is torch.ops.prims.device_put.default or (n.target is torch.ops.aten._to_copy.default and "device" in n.kwargs))
    ]
    return {
        "placements": {fqn: [str(pl) for pl in p.placements] for fqn, p in model.named_parameters()},
        "param_devices": {p.to_local().device.type for p in model.parameters()},
        "grad_devices": {p.grad.to_local().device.type for p in model.parameters()},
        "state_devices": {t.device.type for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.ndim > 0},
        "groups": groups,
        "forward": _collectives(graphs[0]),
        "backward": _collectives(graphs[1]),
        "device_copies": device_copies,
        "reshard_to": model.layers[0]._fsdp_unit.reshard_to,
    }


# ---------------------------------------------------------------- tests

def _check_parity(per_rank: list, variants: list) -> None:
    for other in per_rank[1:]:  # every rank reports the same full parameters and losses
        for v in variants:
            _assert_records_equal(per_rank[0][v], other[v], exact=True, what=v)
    result = per_rank[0]
    # Eager's arithmetic exactly: through our passes on 2 ranks, plain aot_eager over more (see OURS).
    exact = "ours-aot_eager_passes" if len(per_rank) == 2 else "ours-aot_eager"
    _assert_records_equal(result["ours-eager"], result[exact], exact=True, what=f"eager vs {exact}")
    for v in variants:
        if v != "reference":
            _assert_records_equal(result[v], result["reference"], exact=False, what=f"{v} vs reference")
    if "fsdp2" in variants:
        for v in variants:
            if v.startswith("ours"):
                _assert_records_equal(result[v], result["fsdp2"], exact=False, what=f"{v} vs torch")
    compiled = [v for v in variants if v.startswith("ours-aot")]
    assert compiled and all(result[v]["frames"] == 1 for v in compiled), {v: result[v]["frames"] for v in compiled}


@pytest.fixture(scope="module")
def pool4(rank_pools):
    return rank_pools(4)


def _assert_all_to_alls_only(collectives: dict) -> None:
    """The graphs' all-gathers and reduce-scatters all went out as all-to-alls (``config.gloo_all_to_all``)."""
    gathers, reduce_scatters = collectives["all_gather_into_tensor"], collectives["reduce_scatter_tensor"]
    assert gathers == reduce_scatters == 0 < collectives["all_to_all_single"], collectives


def test_hsdp_2x2_matches_reference_and_torch_hsdp(pool4):
    """HSDP 2x2 against the reference and torch's HSDP; the run through our passes is the
    default configuration's (``config.gloo_all_to_all``), counting its collectives: the
    mesh groups' all-gathers and reduce-scatters are all-to-alls, the replicate
    dimension's all-reduces stay."""
    through_passes = "ours-aot_eager_passes-a2a"
    variants = ["reference", "ours-eager", "ours-aot_eager", through_passes, "fsdp2"]
    per_rank = pool4.run(train_all, "llama", variants, 3, False, None, "hsdp")
    _check_parity(per_rank, variants)
    collectives = per_rank[0][through_passes]["collectives"]
    _assert_all_to_alls_only(collectives)


def test_hsdp_shards_over_dim_1_and_all_reduces_over_dim_0(pool4):
    for rank, info in enumerate(pool4.run(placements_and_graph, "hsdp")):
        assert set(map(tuple, info["placements"].values())) == {("R", "S(0)")}
        shard, replicate = info["groups"]["shard"], info["groups"]["replicate"]
        assert {(op, g, n) for op, g, n in info["forward"]} == {("all_gather_into_tensor", shard, 2)}, rank
        backward_ops = {(op, g) for op, g, _ in info["backward"]}
        # Re-gathers (reshard after forward), reduce-scatters over the shard dim,
        # then all-reduces of the reduced shards over the replicate dim.
        assert backward_ops == {("all_gather_into_tensor", shard), ("reduce_scatter_tensor", shard), ("all_reduce", replicate)}
        first_reduce = next(i for i, c in enumerate(info["backward"]) if c[0] == "reduce_scatter_tensor")
        assert all(c[0] != "all_reduce" for c in info["backward"][:first_reduce])


def train_on_own_group(variant: str, mp: str | None, steps: int = 3) -> dict:
    """Each rank shards the model over a group of its own (one rank: nothing to gather
    or reduce) and trains on its half of the batch with ``mp``: a plain step, a step of
    two micro-batches accumulated without sync (fp32 only), a plain step. The losses and
    the parameters after each step (this rank's)."""
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp_compile.base import config
    from fsdp_compile.testing import full_parameters
    from tests.models import compile_counting_graphs
    from tests.test_parity import COMPILE_BACKENDS, MIXED_PRECISION

    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    mesh = DeviceMesh.from_group(groups[rank], "cpu")
    if variant == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from fsdp_compile import fully_shard
    model, units = build("llama")
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=MixedPrecisionPolicy(**(MIXED_PRECISION[mp] or {})))
    run, _ = compile_counting_graphs(model, COMPILE_BACKENDS.get(variant))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    record: dict = {"loss": [], "params": [], "buffers": [], "eval_out": None}
    # The first-run check compares collective sequences over the default group; these
    # groups differ per rank by design.
    with config.patch(check_collective_consistency=False):
        for step in range(steps):
            # Accumulation in fp32 only: with a bf16 reduce dtype, ours and FSDP2 accumulate
            # no-sync gradients with different rounding (an open difference, not this path's).
            micro_batches = 2 if step == 1 and mp is None else 1
            for micro in range(micro_batches):
                x, y = batch("llama", 10 * step + micro)
                model.set_requires_gradient_sync(micro == micro_batches - 1)
                loss = loss_fn("llama", run(x.chunk(world)[rank]), y.chunk(world)[rank])
                loss.backward()
            opt.step()
            opt.zero_grad()
            record["loss"].append(loss.item())
            record["params"].append(full_parameters(model))
    return record


def train_variants_on_own_group(variants: list[str], mp: str | None) -> dict:
    return {v: train_on_own_group(v, mp) for v in variants}


# bf16 parameters, gradients reduced in bf16: the one-rank gather is the cast (with an fp32
# reduce dtype it is the autograd function).
@pytest.mark.parametrize("mp", [None, "bf16-reduce-bf16"])
def test_a_group_of_one_rank_trains_as_torch_fsdp2_does(pool2, mp):
    """Sharded over a group of one rank (no collective at all, the gather a cast or an
    alias), with and without a bf16 policy, with accumulation in fp32: ours eager is bitwise
    torch's FSDP2 on the same group, compiled with our passes (aot_eager_passes) bitwise ours eager."""
    variants = ["fsdp2", *OURS]
    for records in pool2.run(train_variants_on_own_group, variants, mp):
        _assert_records_equal(records["ours-eager"], records["fsdp2"], exact=True)
        _assert_records_equal(records["ours-aot_eager_passes"], records["ours-eager"], exact=True)


def test_shard_groups_of_one_rank_gather_nothing(pool2):
    """HSDP on a (2, 1) mesh: each shard group is one rank, so the shard is the whole
    tensor. Same numbers as the reference and FSDP2 and the same placements, with no
    all-gather or reduce-scatter (they would be copies): the backward all-reduces only."""
    variants = ["reference", *OURS, "fsdp2"]
    _check_parity(pool2.run(train_all, "llama", variants, 3, False, None, "hsdp-1"), variants)
    for rank, info in enumerate(pool2.run(placements_and_graph, "hsdp-1")):
        assert set(map(tuple, info["placements"].values())) == {("R", "S(0)")}
        assert info["forward"] == [], rank
        assert {(op, g) for op, g, _ in info["backward"]} == {("all_reduce", info["groups"]["replicate"])}, rank


def test_reshard_to_a_smaller_group_matches_reference_and_torch(pool4):
    """reshard_after_forward=2 on 4 ranks (FSDP2's int): same numbers as the reference
    and FSDP2's (the MLP's uneven shapes pad the kept blocks); forward gathers over all
    4 ranks, backward over pairs (0, 1) / (2, 3)."""
    variants = ["reference", *OURS_4, "fsdp2"]
    _check_parity(pool4.run(train_all, "mlp", variants, 3, False, None, "reshard-half"), variants)
    for rank, info in enumerate(pool4.run(placements_and_graph, "reshard-half")):
        shard = info["groups"]["shard"]
        assert {(op, g, n) for op, g, n in info["forward"]} == {("all_gather_into_tensor", shard, 4)}, rank
        pair = info["reshard_to"]
        assert tuple(pair[1:]) == (2, rank % 2) and pair[0] != shard
        assert {(op, g, n) for op, g, n in info["backward"]} == {
            ("all_gather_into_tensor", pair[0], 2),
            ("reduce_scatter_tensor", shard, 4),
        }, rank


def test_replicate_matches_reference_and_torch_replicate(pool2):
    variants = ["reference", *OURS, "fsdp2"]
    _check_parity(pool2.run(train_all, "llama", variants, 3, False, None, "ddp"), variants)
    info = pool2.run(placements_and_graph, "ddp")[0]
    assert set(map(tuple, info["placements"].values())) == {("R",)}
    assert info["forward"] == []  # nothing to gather
    assert {op for op, _, _ in info["backward"]} == {"all_reduce"}


def test_cpu_offload_placement_and_parity(pool2):
    """On a CPU-only machine the compute device is the CPU too: shards, gradients and
    optimizer state stay on the CPU, and the graph holds no device copy."""
    variants = ["reference", *OURS, "fsdp2"]
    _check_parity(pool2.run(train_all, "llama", variants, 3, False, None, "offload"), variants)
    info = pool2.run(placements_and_graph, "offload")[0]
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


def test_gloo_all_to_all_on_4_ranks_matches_the_reference(pool4):
    """``config.gloo_all_to_all`` over 4 ranks (1-D: a reduce-scatter sums 4 slices, in
    torch's order rather than gloo's): every rank the same, within fp32 rounding of the
    single-process reference; the compiled code's all-gathers and reduce-scatters are
    all-to-alls, in the graphs after our passes (``aot_eager_passes``; in Inductor's code,
    and bitwise against gloo's own collectives on 2 ranks: test_parity; HSDP 2x2's mesh
    groups: test_hsdp_2x2_matches_reference_and_torch_hsdp)."""
    variants = ["reference", "ours-aot_eager_passes-a2a"]
    per_rank = pool4.run(train_all, "llama", variants, 3, False, None, "fsdp")
    for other in per_rank[1:]:
        for v in variants:
            _assert_records_equal(per_rank[0][v], other[v], exact=True, what=v)
    result = per_rank[0]
    _assert_records_equal(result["ours-aot_eager_passes-a2a"], result["reference"], exact=False, what="all-to-all vs reference")
    collectives = result["ours-aot_eager_passes-a2a"]["collectives"]
    _assert_all_to_alls_only(collectives)


# ------------------------------------------------- parameters of non-contiguous layout


class NonContiguousParams(torch.nn.Module):
    """Convolutions in channels-last memory format and a linear weight stored transposed:
    parameters whose strides are not contiguous (FSDP2 refuses them: "FSDP does not
    support non-contiguous parameters yet")."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.convs = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3, padding=1))
        self.convs.to(memory_format=torch.channels_last)
        self.head_t = torch.nn.Parameter(torch.randn(5, 4).t())  # (4, 5), strides (1, 4)

    def forward(self, x):
        return self.convs(x).mean((2, 3)) @ self.head_t


def _images(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, 6, 6, generator=g), torch.randn(4, 5, generator=g)


def _shard_convs_and_root(model, fully_shard) -> None:
    fully_shard(model.convs)
    fully_shard(model)


def _mse(out, target):
    return torch.nn.functional.mse_loss(out, target)


def test_non_contiguous_parameters_train_like_the_reference(pool2):
    """Each shard is cut from the contiguous tensor the parameter equals; eager and
    compiled (``aot_eager_passes``) match the unsharded model in one graph."""
    from fsdp_compile.testing import assert_parity

    model = NonContiguousParams()
    assert not model.head_t.is_contiguous() and not model.convs[0].weight.is_contiguous()
    report = assert_parity(
        NonContiguousParams, _images, _mse, shard_fn=_shard_convs_and_root, backends=("eager", "aot_eager_passes"),
        check_graph_count=True, pool=pool2,
    )
    assert report.graphs["ours:aot_eager_passes"] == 1


# ------------------------------------------------------------------ complex parameters


class _SpectralWeights(torch.nn.Module):
    """Per-frequency complex weights and a complex channel mix (FSDP2 wants one dtype per
    unit: these are a unit of their own)."""

    def __init__(self) -> None:
        super().__init__()
        self.spectral = torch.nn.Parameter(torch.randn(4, 6, dtype=torch.complex64) / 4)  # 4 frequencies, 6 channels
        self.mix = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.complex64) / 4)  # sharded on dim 1

    def forward(self, h):
        return (h * self.spectral) @ self.mix


class SpectralMixer(torch.nn.Module):
    """A Fourier layer (FNO-style) with real layers around it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(6, 6)
        self.weights = _SpectralWeights()
        self.out = torch.nn.Linear(4, 3)

    def forward(self, x):  # x: (batch, 6 positions, 6 channels)
        h = torch.fft.rfft(self.inp(x), dim=1)  # (batch, 4 frequencies, 6)
        return self.out(torch.fft.irfft(self.weights(h), n=6, dim=1))


def train_spectral_mixer(kind: str, backend: str | None, steps: int = 2) -> dict:
    """``SpectralMixer`` sharded by ``kind`` (ours or FSDP2), ``mix`` on dim 1; two
    micro-batches per AdamW step, gradient sync off on the first."""
    import torch.distributed as dist

    from fsdp_compile.testing import full_parameters
    from tests.models import fully_shard_of

    model = SpectralMixer()
    _shard_spectral_mixer(model, fully_shard_of(kind))
    run = torch.compile(model, backend=backend) if backend else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, params = [], []
    for step in range(steps):
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            g = torch.Generator().manual_seed(10 * step + micro)
            x, y = torch.randn(4, 6, 6, generator=g), torch.randn(4, 6, 3, generator=g)
            x, y = x.chunk(dist.get_world_size())[dist.get_rank()], y.chunk(dist.get_world_size())[dist.get_rank()]
            loss = torch.nn.functional.mse_loss(run(x), y) / 2
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        params.append(full_parameters(model))
    return {"losses": losses, "params": params, "dtypes": {n: str(p.dtype) for n, p in model.named_parameters()}}


def test_complex_parameters_train_like_the_reference_and_fsdp2(pool2):
    """Complex parameters (FSDP2 moves them as real views, so do we: see
    ``_fsdp_param``'s [Note: complex parameters]), one sharded on dim 1, with gradient
    accumulation: ours eager matches FSDP2, compiled (``aot_eager_passes``) bitwise eager;
    and the unsharded model to fp32 rounding, in one graph (``assert_parity``; under
    Inductor too when tried by hand, left out here for the suite's time)."""
    from fsdp_compile.testing import assert_parity

    fsdp2 = pool2.run(train_spectral_mixer, "fsdp2", None)[0]
    eager = pool2.run(train_spectral_mixer, "ours", None)[0]
    compiled = pool2.run(train_spectral_mixer, "ours", "aot_eager_passes")[0]
    assert eager["dtypes"]["weights.spectral"] == eager["dtypes"]["weights.mix"] == "torch.complex64"
    assert compiled["losses"] == eager["losses"]
    for got, fsdp2_params in zip(eager["params"], fsdp2["params"], strict=True):
        for name in fsdp2_params:
            torch.testing.assert_close(got[name], fsdp2_params[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    for got, eager_params in zip(compiled["params"], eager["params"], strict=True):
        for name in eager_params:
            torch.testing.assert_close(got[name], eager_params[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    report = assert_parity(
        SpectralMixer, _spectral_batch, _mse, shard_fn=_shard_spectral_mixer, backends=("aot_eager_passes",),
        check_graph_count=True, pool=pool2,
    )
    assert report.graphs["ours:aot_eager_passes"] == 1


def _spectral_batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 6, 6, generator=g), torch.randn(4, 6, 3, generator=g)


def _shard_spectral_mixer(model, fully_shard) -> None:
    from torch.distributed.tensor import Shard

    fully_shard(model.weights, shard_placement_fn=lambda p: Shard(1) if p.shape == (6, 4) else None)
    fully_shard(model)
