"""API shape and graph structure, on the ``fake`` process group at world size 8 (one process)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp_compile
from fsdp_compile import FSDPModule, fully_shard
from fsdp_compile.base.compat import c10d_functional
from fsdp_compile.testing import GraphCapture, collective_nodes, saved_all_gathers
from tests.models import Llama, LlamaConfig, MLPStack, build, shard_blocks

ALL_GATHER = c10d_functional.all_gather_into_tensor
REDUCE_SCATTER = c10d_functional.reduce_scatter_tensor


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_exports():
    for name in ["fully_shard", "FSDPModule", "FSDPParam", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]:
        assert hasattr(fsdp_compile, name)
    import importlib

    for sub in ["passes", "runtime"]:
        assert importlib.import_module(f"fsdp_compile.{sub}").__name__ == f"fsdp_compile.{sub}"


def test_class_swap_and_return_value(fake_pg):
    model = MLPStack(dim=16, n_layers=2)
    for layer in model.layers:
        assert fully_shard(layer) is layer
    assert fully_shard(model) is model
    assert type(model).__name__ == "FSDPMLPStack"
    mro = type(model).__mro__
    assert mro[1] is FSDPModule and mro.index(FSDPModule) < mro.index(MLPStack) < mro.index(nn.Module)
    assert isinstance(model.layers[0], FSDPModule) and isinstance(model.layers[0], nn.Linear)
    assert type(model.layers[0]).__name__ == "FSDPLinear"


def test_gathers_read_a_plain_alias_of_the_shard(fake_pg):
    """What traced gathers read (``FSDPParam.local_view``): a plain tensor, no autograd view
    (torch 2.11 refuses to run backward through a custom Function's view once its base was
    written in place), over the shard's storage (optimizer steps show through), whose
    gradient lands in the sharded parameter's ``DTensor`` ``.grad`` step after step;
    ``to_empty`` gives it the new storage."""
    with torch.device("meta"):
        model = MLPStack(dim=16, n_layers=2)
    fully_shard(model)
    model.to_empty(device="cpu")
    fsdp_param = model._fsdp_unit.params[0]
    param = fsdp_param.sharded_param
    with torch.no_grad():
        param.fill_(1.0)
    opt = torch.optim.AdamW([param], lr=0.1)
    for step in range(3):
        view = fsdp_param.local_view
        assert type(view) is torch.Tensor and not view._is_view() and view.requires_grad
        assert view.data_ptr() == param.to_local().data_ptr() and torch.equal(view, param.to_local())
        (view * (step + 1)).sum().backward()
        assert isinstance(param.grad, DTensor) and torch.equal(param.grad.to_local(), torch.full_like(view, step + 1.0))
        opt.step()  # in place, through the DTensor
        opt.zero_grad()


def test_list_of_modules_is_one_unit(fake_pg):
    model = MLPStack(dim=16, n_layers=3)
    fully_shard([model.layers[0], model.layers[1]])
    unit0, unit1 = model.layers[0]._fsdp_unit, model.layers[1]._fsdp_unit
    assert unit0 is unit1 and len(unit0.params) == 2
    assert isinstance(model.layers[0], FSDPModule) and isinstance(model.layers[1], FSDPModule)


@pytest.mark.parametrize("dim0", [1, 5, 8, 13, 17])
def test_sharded_layout_matches_torch_chunk(fake_pg, dim0):
    """Uneven dim 0 (smaller than the world size, odd) splits like DTensor's Shard(0)."""
    linear = nn.Linear(3, dim0)
    full = {k: v.detach().clone() for k, v in linear.named_parameters()}
    fully_shard(linear)
    rank = torch.distributed.get_rank()
    for name, param in linear.named_parameters():
        assert isinstance(param, DTensor) and isinstance(param, nn.Parameter)
        assert param.placements == (Shard(0),)
        assert param.shape == full[name].shape
        chunks = torch.chunk(full[name], 8, dim=0)
        expected = chunks[rank] if rank < len(chunks) else full[name][:0]
        torch.testing.assert_close(param.to_local(), expected, rtol=0, atol=0)


def test_names_and_state_dict_keys_unchanged(fake_pg):
    model, units = build("zoo")
    ref = copy.deepcopy(model)
    for unit in units:
        fully_shard(unit)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(model.state_dict()) == list(ref.state_dict())
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert model.scale.placements == (Replicate(),)  # 0-dim: kept whole on every rank
    assert not model.frozen.weight.requires_grad
    # Outside forward, reading the attribute gives the sharded parameter itself.
    assert model.head.weight is model.head._parameters["weight"]


def test_tied_weights_stay_tied(fake_pg):
    model = Llama(LlamaConfig())
    fully_shard(model)
    assert model.output.weight is model.tok_embeddings.weight
    assert [n for n, _ in model.named_parameters()].count("output.weight") == 0  # deduplicated, as unsharded


def test_root_resolution(fake_pg):
    model = MLPStack(dim=16, n_layers=2)
    for layer in model.layers:
        fully_shard(layer)
    assert model.layers[0]._fsdp_unit.is_root  # until a parent is sharded
    fully_shard(model)
    assert model._fsdp_unit.is_root and not model.layers[0]._fsdp_unit.is_root
    assert model._fsdp_unit.resolved_reshard_after_forward() is False
    assert model.layers[0]._fsdp_unit.resolved_reshard_after_forward() is True


def _compiled_step_graphs(model, x, partitioner):
    capture = GraphCapture(partitioner)
    out = torch.compile(model, backend=capture, fullgraph=True)(x)
    out.sum().backward()
    assert capture.frame_count == 1
    (fw,), (bw,) = capture.forward_graphs, capture.backward_graphs
    return fw, bw


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
@pytest.mark.parametrize("reshard", [True, False])
def test_reshard_after_forward_in_graphs(fake_pg, partitioner, reshard):
    """True: no gathered parameter is a forward output; the backward re-gathers
    each weight it needs. False: gathered weights are saved; no re-gather."""
    n_layers = 4
    model = shard_blocks(MLPStack(dim=16, n_layers=n_layers), reshard_after_forward=reshard)
    fw, bw = _compiled_step_graphs(model, torch.randn(2, 16, requires_grad=True), partitioner)
    assert len(collective_nodes(fw, ALL_GATHER)) == n_layers
    assert len(collective_nodes(bw, REDUCE_SCATTER)) == n_layers
    if reshard:
        assert saved_all_gathers(fw) == []
        assert len(collective_nodes(bw, ALL_GATHER)) == n_layers
    else:
        assert len(saved_all_gathers(fw)) == n_layers
        assert collective_nodes(bw, ALL_GATHER) == []


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_reshard_to_a_smaller_group_in_graphs(fake_pg, partitioner):
    """reshard_after_forward=4 on 8 ranks: the forward keeps a quarter of each gathered
    weight (rows 4-7 of 16 on rank 5, in ranks 4-7's group); the backward all-gathers
    those blocks over the group of 4 instead of gathering the shards over all 8."""
    model = shard_blocks(MLPStack(dim=16, n_layers=4), reshard_after_forward=4)
    unit = model.layers[0]._fsdp_unit
    group, size, index = unit.reshard_to
    assert (size, index) == (4, 0) and model._fsdp_unit.reshard_to is None  # rank 0 of the fake world
    fw, bw = _compiled_step_graphs(model, torch.randn(2, 16, requires_grad=True), partitioner)
    assert [(n.args[1], n.args[2]) for n in collective_nodes(fw, ALL_GATHER)] == [(8, unit.dp_mesh.shard_group_name)] * 4
    assert [(n.args[1], n.args[2]) for n in collective_nodes(bw, ALL_GATHER)] == [(4, group)] * 4
    assert [tuple(n.args[0].meta["val"].shape) for n in collective_nodes(bw, ALL_GATHER)] == [(4, 16)] * 4
    assert saved_all_gathers(fw) == []
    saved_shapes = [tuple(a.meta["val"].shape) for a in fw.graph.output_node().args[0] if isinstance(a, torch.fx.Node)]
    assert saved_shapes.count((4, 16)) == 4 and (16, 16) not in saved_shapes


def test_hsdp_reshards_to_consecutive_ranks_within_a_shard_group(fake_pg):
    """HSDP on a (replicate=2, shard=4) mesh, reshard_after_forward=2: rank 0 keeps its
    block over ranks (0, 1), inside its shard group (0, 1, 2, 3), as FSDP2's mesh rows."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compile.base.compat import group_ranks

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    model = shard_blocks(MLPStack(dim=16, n_layers=2), mesh=mesh, reshard_after_forward=2, root_too=True)
    group, size, index = model.layers[0]._fsdp_unit.reshard_to
    assert (group_ranks(group), size, index) == ([0, 1], 2, 0)
    fw, bw = _compiled_step_graphs(model, torch.randn(2, 16, requires_grad=True), "min_cut")
    assert {(n.args[1], n.args[2]) for n in collective_nodes(bw, ALL_GATHER)} == {(2, group)}
    assert saved_all_gathers(fw) == []


def test_eager_reshard_to_a_smaller_group(fake_pg):
    """Eager backward gathers the kept blocks over the smaller group, like compiled."""
    model = shard_blocks(MLPStack(dim=16, n_layers=4), reshard_after_forward=2)
    group, _, _ = model.layers[0]._fsdp_unit.reshard_to
    forward_log, backward_log = _CollectiveLog(), _CollectiveLog()
    with forward_log:
        loss = model(torch.randn(2, 16)).sum()
    with backward_log:
        loss.backward()
    assert forward_log.groups == [(8, model.layers[0]._fsdp_unit.dp_mesh.shard_group_name)] * 4
    assert backward_log.groups == [(2, group)] * 3  # layer 0's weight is not needed in backward
    assert all(p.grad is not None for p in model.parameters())


def test_first_layer_weight_not_regathered_without_input_grad(fake_pg):
    """Layer 0's weight is only needed in backward for the input's gradient."""
    model = shard_blocks(MLPStack(dim=16, n_layers=3))
    fw, bw = _compiled_step_graphs(model, torch.randn(2, 16), "min_cut")
    assert saved_all_gathers(fw) == []
    assert len(collective_nodes(bw, ALL_GATHER)) == 2


def test_llama_compiles_to_one_graph(fake_pg):
    model = shard_blocks(Llama(LlamaConfig(n_layers=4)))
    tokens = torch.randint(0, 64, (2, 16))
    fw, bw = _compiled_step_graphs(model, tokens, "min_cut")
    n_params = len(list(model.parameters()))
    # Each parameter is gathered exactly once in forward, tied weight included.
    assert len(collective_nodes(fw, ALL_GATHER)) == n_params
    assert len(collective_nodes(bw, REDUCE_SCATTER)) == n_params
    # Each reduce-scatter is tagged as the gradient reduction of its parameter (AOTAutograd
    # copies the gather's forward annotations onto its backward nodes: they must not win).
    from fsdp_compile.runtime import Role, tag_of

    rs_tags = [tag_of(node) for node in collective_nodes(bw, REDUCE_SCATTER)]
    assert {tag.role for tag in rs_tags} == {Role.REDUCE_GRAD}
    assert sorted(tag.param_fqn for tag in rs_tags) == sorted(name for name, _ in model.named_parameters())
    assert saved_all_gathers(fw) != []  # the root unit (embeddings, norm) is kept: reshard=False
    assert {tag_of(node).unit_fqn for node in saved_all_gathers(fw)} == {""}  # only the root's


def test_unit_and_param_names_follow_the_root(fake_pg):
    model = Llama(LlamaConfig(n_layers=2))
    for layer in model.layers:
        fully_shard(layer)
    assert model.layers[1]._fsdp_unit.fqn == ""  # a root until its parent is sharded
    fully_shard(model)
    assert [m._fsdp_unit.fqn for m in model.layers] == ["layers.0", "layers.1"]
    names = {p.fqn for m in [*model.layers, model] for p in m._fsdp_unit.params}
    assert names == {n for n, _ in model.named_parameters()}


def test_other_collectives_untouched(fake_pg):
    """A user's all-reduce in the same graph is not tagged for recomputation."""
    from fsdp_compile.runtime import tag_of

    class WithAllReduce(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            import torch.distributed._functional_collectives as funcol

            y = self.lin(x)
            return funcol.all_reduce(y, "sum", torch.distributed.group.WORLD)

    model = WithAllReduce()
    fully_shard(model.lin)
    fully_shard(model)
    seen = []
    prev = torch._functorch.config.joint_custom_pass

    def spy(gm, inputs):
        gm = prev(gm, inputs)
        for node in gm.graph.nodes:
            if node.target is c10d_functional.all_reduce.default:
                seen.append((tag_of(node), node.meta.get("recompute")))
        return gm

    with torch._functorch.config.patch(joint_custom_pass=spy):
        _compiled_step_graphs(model, torch.randn(2, 8, requires_grad=True), "min_cut")
    assert seen and all(tag is None and recompute is None for tag, recompute in seen)


def test_eager_forward_outside_compile(fake_pg):
    model, units = build("zoo")
    for unit in units:
        fully_shard(unit)
    out = model(torch.randn(3, 4))
    assert out.shape == (3, 3)
    # The per-forward cache of gathered tensors is empty again afterwards.
    from fsdp_compile._fsdp_state import forward_context

    assert forward_context.depth == 0 and list(forward_context.gathered_params()) == []
    assert all(p.gathered is None for u in units for p in u._fsdp_unit.params)


class _CollectiveLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts all-gathers (eager code's c10d op, or the functional one) and keeps weak
    references to their results' storages."""

    def __init__(self):
        super().__init__()
        self.gathers = 0
        self.groups = []  # (group size, group name) of each all-gather
        self.results = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is ALL_GATHER.default:
            self.gathers += 1
            self.groups.append((args[1], args[2]))
        elif func is torch.ops.c10d._allgather_base_.default:  # eager code issues FSDP2's op
            self.gathers += 1
            group = torch.distributed.ProcessGroup.unbox(args[2])
            self.groups.append((group.size(), group.group_name))
        if func is c10d_functional.wait_tensor.default:
            import weakref

            self.results.append(weakref.ref(out.untyped_storage()))  # alive while any view of it is
        return out


@pytest.mark.parametrize("reshard", [True, False])
def test_eager_reshard_after_forward(fake_pg, reshard):
    """Eager runs the same policy as compiled ones: gathered weights of a resharded
    unit are freed after forward and gathered again in backward."""
    import gc

    model = shard_blocks(MLPStack(dim=16, n_layers=4), reshard_after_forward=reshard)
    forward_log, backward_log = _CollectiveLog(), _CollectiveLog()
    with forward_log:
        loss = model(torch.randn(2, 16)).sum()
    gc.collect()
    alive = [ref for ref in forward_log.results if ref() is not None]
    assert forward_log.gathers == 4
    # A unit that does not reshard stays gathered until its backward, as FSDP2's (layer 0
    # too, though its backward reads no weight: its input needs no gradient).
    assert len(alive) == (0 if reshard else 4)
    with backward_log:
        loss.backward()
    assert backward_log.gathers == (3 if reshard else 0)
    assert all(p.grad is not None for p in model.parameters())


def test_set_reshard_after_forward_changes_the_backward_graph(fake_pg):
    model = shard_blocks(MLPStack(dim=16, n_layers=3))
    model.set_reshard_after_forward(False)
    fw, bw = _compiled_step_graphs(model, torch.randn(2, 16, requires_grad=True), "min_cut")
    assert collective_nodes(bw, ALL_GATHER) == [] and len(saved_all_gathers(fw)) == 3
    with pytest.raises(TypeError, match="set_reshard_after_backward"):
        model.set_reshard_after_backward(None)


def test_pass_time_is_recorded_per_graph(fake_pg):
    """Every graph our passes run on records what they took (benchmarks.step_time
    reports the sum per compile): the joint graph, then the forward and the backward.
    (Cold caches: a graph found in Inductor's cache skips the post-grad passes.
    ``inductor_passes``: Inductor's graph pipeline without its code generation.)"""
    from torch._inductor.utils import fresh_cache

    from fsdp_compile.passes.registration import pass_seconds

    before = len(pass_seconds)
    model = shard_blocks(MLPStack(dim=16, n_layers=2))
    with fresh_cache():
        torch.compile(model, backend="inductor_passes", fullgraph=True)(torch.randn(2, 16, requires_grad=True)).sum().backward()
    recorded = pass_seconds[before:]
    assert [stage for _, stage, _ in recorded] == ["joint", "post_grad", "post_grad"], recorded
    assert all(seconds > 0 for *_, seconds in recorded)



def _compile_a_sharded_mlp(prefetch_hint: bool = False) -> dict:
    """Compile one step of a small sharded model with Inductor (``fake`` world of 8, as
    rank 0), with or without a forward prefetch hint; Inductor's counters (FX-graph
    cache hits and misses) and AOTAutograd's (``autograd_cache_*``)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = shard_blocks(MLPStack(dim=16, n_layers=2))
    if prefetch_hint:
        model.layers[0].set_modules_to_forward_prefetch([model.layers[1]])
    torch.compile(model, backend="inductor", fullgraph=True)(torch.randn(2, 16, requires_grad=True)).sum().backward()
    return {**counters["inductor"], **counters["aot_autograd"]}


_IN_A_NEW_PROCESS = """
import json, torch.distributed as dist
from fsdp_compile.testing._torch_internals import register_fake_process_group
from tests.test_structure import _compile_a_sharded_mlp
register_fake_process_group()
dist.init_process_group("fake", rank=0, world_size=8)
print(json.dumps(_compile_a_sharded_mlp()))
"""


def test_a_restarted_job_compiles_from_inductors_cache(fake_pg):
    """The same sharded model compiled again in a new process (a restarted job) is found
    in Inductor's FX-graph cache and AOTAutograd's cache: their keys hold nothing that
    differs per process. (Before, each DeviceMesh input was pickled with its ``_hash``,
    which hashes an object id: no sharded graph was ever found in the cache after a
    restart; and AOTAutograd's cache refused the graph while it held our gather's
    ``autograd.Function``, so a restart traced it again.)"""
    import json
    import os
    import subprocess
    import sys

    if not torch._inductor.config.fx_graph_cache:
        pytest.skip("Inductor's FX-graph cache is turned off here (TORCHINDUCTOR_FX_GRAPH_CACHE=0)")
    _compile_a_sharded_mlp()  # stored in the cache (or found there, from an earlier run)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # for "tests.*"
    env["PYTHONPATH"] = os.pathsep.join([repo_root, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _IN_A_NEW_PROCESS], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    again = json.loads(done.stdout.strip().splitlines()[-1])
    assert again.get("fxgraph_cache_miss", 0) == 0 and again.get("fxgraph_cache_hit", 0) == 2, again
    if torch._functorch.config.enable_autograd_cache:
        assert again.get("autograd_cache_hit", 0) == 1 and again.get("autograd_cache_bypass", 0) == 0, again


def test_graphs_alike_but_for_their_tags_do_not_share_a_cache_entry(fake_pg):
    """A prefetch hint changes only our tags on the collectives (the graph's code is the
    same) and our passes schedule by them, so Inductor's and AOTAutograd's cache keys
    must tell the two graphs apart; the same graph again is found."""
    from torch._inductor.utils import fresh_cache

    if not torch._inductor.config.fx_graph_cache:
        pytest.skip("Inductor's FX-graph cache is turned off here (TORCHINDUCTOR_FX_GRAPH_CACHE=0)")
    with fresh_cache():
        assert _compile_a_sharded_mlp().get("fxgraph_cache_miss") == 2
        assert _compile_a_sharded_mlp().get("fxgraph_cache_hit") == 2
        hinted = _compile_a_sharded_mlp(prefetch_hint=True)
    assert hinted.get("fxgraph_cache_hit", 0) == 0 and hinted.get("fxgraph_cache_miss") == 2, hinted
    assert hinted.get("autograd_cache_hit", 0) == 0, hinted


def test_ranks_do_not_share_cache_entries_where_the_gloo_transport_makes_graphs_per_rank(fake_pg):
    """The gloo transport leaves a rank's own block out of its all-gathers, so a graph
    after our passes is that rank's: our pass's cache uuid holds the rank then, and
    only then (ranks sharing a cache directory would otherwise load each other's)."""
    from fsdp_compile.base import config
    from fsdp_compile.passes.registration import FSDPPostGradPass

    pass_ = FSDPPostGradPass()
    with config.patch(gloo_all_to_all=True):
        with_transport = pass_.uuid()
        dist.destroy_process_group()
        dist.init_process_group("fake", rank=1, world_size=8)
        assert pass_.uuid() != with_transport
    with config.patch(gloo_all_to_all=False):
        without = pass_.uuid()
        dist.destroy_process_group()
        dist.init_process_group("fake", rank=0, world_size=8)
        assert pass_.uuid() == without


def test_the_cache_key_is_the_loaded_codes_not_the_files():
    """Our pass's cache uuid hashes the passes' and runtime's sources as read when the
    process loaded them: a process whose first compile comes after its code was edited
    (a job running while its code changes) keys its graphs with the code it runs. It
    read the files at the first compile, and a test run's ranks, started before an
    edit, stored old graphs under the new code's key, which a later run then loaded as
    its own. In a fresh process: once the package is imported, computing the key reads
    no source file."""
    import subprocess
    import sys

    probe = """
import builtins
from fsdp_compile.passes.registration import FSDPPostGradPass
real_open = builtins.open
def edited_sources(path, *args, **kwargs):
    if str(path).endswith(".py"):
        raise AssertionError(f"the cache key read {path} after the code was loaded")
    return real_open(path, *args, **kwargs)
builtins.open = edited_sources
key = FSDPPostGradPass().uuid()
builtins.open = real_open
assert FSDPPostGradPass().uuid() == key
"""
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_a_later_prefetch_hint_replaces_the_earlier(fake_pg):
    """As in FSDP2, ``set_modules_to_forward_prefetch`` sets the list: a unit left out of a
    later call is no longer prefetched by this one (nor tagged so for the passes)."""
    model = shard_blocks(MLPStack(dim=16, n_layers=3))
    first, second, third = (layer._fsdp_unit for layer in model.layers)
    model.layers[0].set_modules_to_forward_prefetch([model.layers[1], model.layers[2]])
    model.layers[0].set_modules_to_forward_prefetch([model.layers[2]])
    assert first.forward_prefetches == [third]
    assert second.forward_prefetched_by is None and third.forward_prefetched_by is first
    assert all(p.spec.tag.forward_prefetched_by is None for p in second.params)
    assert all(p.spec.tag.forward_prefetched_by == first.fqn for p in third.params)
    model.layers[0].set_modules_to_forward_prefetch([])
    assert first.forward_prefetches == [] and third.forward_prefetched_by is None


def test_specs_follow_the_units_options(fake_pg):
    """A parameter's collective spec is derived from its unit's options: writing one
    (through FSDP2's setters or directly) rebuilds it, and sharding a parent renames the
    prefetch hints that name a nested unit."""
    blocks = MLPStack(dim=16, n_layers=3)
    for layer in blocks.layers:
        fully_shard(layer)
    blocks.layers[0].set_modules_to_forward_prefetch([blocks.layers[1]])
    first, second = blocks.layers[0]._fsdp_unit, blocks.layers[1]._fsdp_unit
    assert all(p.spec.tag.forward_prefetched_by == "" for p in second.params)  # both still roots
    fully_shard(blocks)
    assert first.fqn == "layers.0"
    assert all(p.spec.tag.forward_prefetched_by == "layers.0" for p in second.params)
    assert all(p.spec.tag.param_fqn.startswith("layers.1.") for p in second.params)
    with pytest.raises(AttributeError, match=r"unit.update\(gradient_divide_factor=...\)"):
        first.gradient_divide_factor = 4.0  # would leave the specs stale
    first.update(gradient_divide_factor=4.0)
    assert all(p.spec.reduce_op == "sum" and p.spec.grad_scale == 0.25 for p in first.params)
    blocks.set_reshard_after_forward(False)
    assert not any(p.spec.tag.reshard_after_forward for u in (first, second) for p in u.params)


def test_forward_context_records_each_forwards_execution_mode(fake_pg):
    """The mode a sharded forward started in is decided once and kept on its frame: code
    that a compiled step runs eagerly inside a traced forward (a graph break) sees traced
    frames around eager code, which is what marks its gathers as left outside the graph."""
    from fsdp_compile._fsdp_state import forward_context
    from fsdp_compile.base.execution_mode import ExecutionMode, execution_mode

    seen = []

    @torch.compiler.disable
    def probe(x):
        seen.append((list(forward_context.frame_modes), execution_mode(), forward_context.in_broken_graph()))
        return x

    model = MLPStack(dim=16, n_layers=2)
    model.layers[1].register_forward_pre_hook(lambda m, args: (probe(args[0]),))
    shard_blocks(model)
    assert execution_mode() is ExecutionMode.EAGER
    model(torch.randn(2, 16))
    eager, traced = ExecutionMode.EAGER, ExecutionMode.TRACED
    assert seen.pop() == ([eager], eager, False)
    torch.compile(model, backend="aot_eager")(torch.randn(2, 16))
    assert seen.pop() == ([traced], eager, True)
    assert forward_context.frame_modes == [] and forward_context.depth == 0


def test_shards_enter_the_graph_as_static_inputs(fake_pg):
    """What CUDA graphs (``mode="reduce-overhead"``) need to replay a step without copying
    the parameters into their memory pool: the plain aliases of the shards that the
    gathers read are static inputs of the compiled forward, as parameters are; the batch
    is not. (Dynamo counts them static here even without ``mark_as_parameter_input``,
    which also gives them static addresses: the test holds the property, not the call.)"""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import TracingContext

    from fsdp_compile._fully_shard import managed_params

    def static_and_dynamic_inputs(model, x):
        seen = {}

        def forward_compiler(gm, example_inputs):
            static = set(TracingContext.get().fw_metadata.static_input_indices)
            seen["static"] = [t for i, t in enumerate(example_inputs) if i in static]
            seen["dynamic"] = [t for i, t in enumerate(example_inputs) if i not in static]
            return make_boxed_func(gm)

        torch._dynamo.reset()
        backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm))
        torch.compile(model, backend=backend, fullgraph=True)(x).sum().backward()
        return seen

    model = shard_blocks(MLPStack(dim=16, n_layers=2))
    shards = [p.local_view for p in managed_params(model)]
    seen = static_and_dynamic_inputs(model, torch.randn(3, 16))
    # The compiler sees fake tensors: inputs are told apart by shape ((2, 16) shards, a (3, 16) batch).
    assert sorted(tuple(t.shape) for t in seen["static"]) == sorted(tuple(s.shape) for s in shards) == [(2, 16)] * 2
    assert [tuple(t.shape) for t in seen["dynamic"]] == [(3, 16)]
