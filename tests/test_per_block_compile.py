"""Blocks compiled one by one instead of the whole model: ``torch.compile(block)`` before
``fully_shard`` (torchtitan's order), ``torch.compile(block)`` after it, and
``block.compile()`` after it.

As with the unsharded model (and FSDP2), every block of a class runs one graph, compiled
once: with the unit's name in its tags, each block compiled again, and past Dynamo's
recompile limit (8) the remaining blocks silently ran eagerly. Blocks compiled after
``fully_shard`` trace their collectives, named relative to the block
(``FRAME_UNIT``); blocks compiled before it are gathered around their compiled call, as
FSDP2's hooks do, and their graph reads gathered tensors.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.nn.functional as F

from fsdp_compile import fully_shard
from fsdp_compile.base.compat import c10d_functional
from fsdp_compile.runtime import Role, tag_of
from fsdp_compile.runtime.vocabulary import FRAME_UNIT
from fsdp_compile.testing import GraphCapture, collective_nodes, full_tensor
from fsdp_compile.testing.models import DecoderLayer, Llama, LlamaConfig, MLPStack
from tests.models import fully_shard_of

PATTERNS = ["compile_then_shard", "shard_then_compile", "shard_then_module_compile"]
STEPS = 3


class CallingDecoderLayer(DecoderLayer):
    """A block whose class overrides ``__call__``, as ``transformers``' decoder layers do
    (``GradientCheckpointingLayer``): Dynamo's frame for the compiled block then starts
    above our ``forward`` and traces the unit's collectives. For a plain block it starts
    below it (at the block's own ``forward``), and the unit is gathered around it."""

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs)


def build_llama(n_layers: int, blocks: str) -> Llama:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=n_layers))
    if blocks == "calling":
        for layer in model.layers:
            layer.__class__ = CallingDecoderLayer
    return model


def apply_per_block(model, pattern: str, shard_fn, backend, *, nested: bool = False, **block_kwargs):
    """``shard_fn`` per block and on the root (``None``: unsharded), each block compiled
    on its own with ``backend`` in the order ``pattern`` names; returns what to call.
    ``"blocks_only_whole_model"``: the blocks sharded, not the root, and the whole model
    compiled (every block is then a root unit of its own, named ""). ``nested``: each
    block's feed-forward is a unit of its own too."""
    layers = model.layers
    if pattern == "compile_then_shard":
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer, backend=backend)
    elif pattern == "module_compile_then_shard":  # torchtitan's apply_compile, then apply_fsdp
        for layer in layers:
            layer.compile(backend=backend, fullgraph=True)
    if shard_fn is not None:
        for layer in layers:
            if nested:  # a unit inside each block, as torchtitan shards MoE experts
                shard_fn(layer.feed_forward, **block_kwargs)
            shard_fn(layer, **block_kwargs)
        if pattern != "blocks_only_whole_model":
            shard_fn(model)
    if pattern == "blocks_only_whole_model":
        return torch.compile(model, backend=backend)
    if pattern == "shard_then_compile":
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer, backend=backend)
    elif pattern == "shard_then_module_compile":
        for layer in layers:
            layer.compile(backend=backend)
    return model


def _step(model, step: int, shard_batch=lambda t: t) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    tokens = shard_batch(torch.randint(0, 64, (4, 17), generator=g))
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss


@pytest.mark.parametrize("blocks", ["plain", "calling", "calling+nested"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_block_runs_one_graph_past_dynamos_recompile_limit(fake_pg, pattern, blocks):
    """10 blocks (Dynamo recompiles a frame at most 8 times): one graph for all of them,
    as unsharded, over two steps. Traced collectives are named relative to the block.
    Blocks gathered around their compiled calls are so by design (as FSDP2's hooks gather
    them): no warning of ours says a graph broke or recompiled."""
    import warnings

    from fsdp_compile.testing._torch_internals import reset_dynamo

    def graphs(shard_fn):
        reset_dynamo()
        capture = GraphCapture("default")
        model = build_llama(10, blocks.partition("+")[0])
        model = apply_per_block(model, pattern, shard_fn, capture, nested=blocks.endswith("+nested"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(2):
                _step(model, step)
        assert [str(w.message) for w in caught if str(w.message).startswith("fsdp_compile")] == []
        return capture

    unsharded, ours = graphs(None), graphs(fully_shard)
    assert unsharded.frame_count == 1
    assert ours.frame_count == unsharded.frame_count
    (fw,), (bw,) = ours.forward_graphs, ours.backward_graphs
    gathers = collective_nodes(fw, c10d_functional.all_gather_into_tensor)
    reductions = collective_nodes(bw, c10d_functional.reduce_scatter_tensor)
    # Where Dynamo's frame for a block starts decides where its unit is gathered: above
    # our forward (``torch.compile(block)`` of a block whose class overrides
    # ``__call__``), the collectives are traced, named relative to the block; below it,
    # the unit is gathered around the compiled call, as FSDP2 does, and a unit nested in
    # the block is the graph's own unit, named relative to itself.
    nested = blocks.endswith("+nested")
    block_names = sorted(name for name, _ in build_llama(1, "plain").layers[0].named_parameters())
    if pattern == "shard_then_compile" and blocks.startswith("calling"):
        expected = {n: f"{FRAME_UNIT}.feed_forward" if nested and n.startswith("feed_forward.") else FRAME_UNIT for n in block_names}
    elif nested:
        expected = {n.removeprefix("feed_forward."): FRAME_UNIT for n in block_names if n.startswith("feed_forward.")}
    else:
        expected = {}
    assert {tag_of(n).param_fqn: tag_of(n).unit_fqn for n in gathers} == expected
    assert len(gathers) == len(expected)
    assert sorted(tag_of(n).param_fqn for n in reductions) == sorted(expected)
    assert {tag_of(n).role for n in reductions} <= {Role.REDUCE_GRAD}


@pytest.mark.parametrize("pattern", ["compile_then_shard", "shard_then_module_compile"])
@pytest.mark.parametrize("reshard", [True, False])
def test_per_block_compile_reshards_after_forward(fake_pg, pattern, reshard):
    """``reshard_after_forward`` holds for blocks compiled on their own: with ``True`` no
    gathered weight outlives the forward and backward gathers again (the first block's
    weight is not needed in backward); with ``False`` backward gathers nothing."""
    from fsdp_compile.testing._torch_internals import reset_dynamo
    from tests.test_structure import _CollectiveLog

    reset_dynamo()
    model = apply_per_block(MLPStack(dim=16, n_layers=4), pattern, fully_shard, "aot_eager", reshard_after_forward=reshard)
    for _ in range(2):  # the second step runs what the first one compiled
        forward_log, backward_log = _CollectiveLog(), _CollectiveLog()
        with forward_log:
            loss = model(torch.randn(2, 16)).sum()
        gc.collect()
        alive = [ref for ref in forward_log.results if ref() is not None]
        with backward_log:
            loss.backward()
        if reshard:
            assert alive == []
        assert backward_log.gathers == (3 if reshard else 0)
        assert all(p.grad is not None for p in model.parameters())


def train_per_block(variant: str, pattern: str, backend: str, blocks: str) -> dict:
    """``STEPS`` SGD steps of a 3-block Llama: ``"reference"`` unsharded on the global
    batch in one process; ``"ours"`` / ``"fsdp2"`` sharded per block and at the root and
    compiled per block as ``pattern`` says (``"<pattern>+nested"``: each block's
    feed-forward a unit of its own too), each rank on its half of the batch."""
    import torch.distributed as dist

    from fsdp_compile.testing._torch_internals import reset_dynamo

    reset_dynamo()
    model = build_llama(3, blocks)
    shard_batch = lambda t: t  # noqa: E731
    run = model
    if variant != "reference":
        base, _, nested = pattern.partition("+")
        run = apply_per_block(model, base, fully_shard_of(variant), backend, nested=nested == "nested")
        rank, world = dist.get_rank(), dist.get_world_size()
        shard_batch = lambda t: t.chunk(world)[rank]  # noqa: E731
    # SGD: AdamW turns fp32 rounding in near-zero gradients into whole steps' differences.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, params = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = _step(run, 0, shard_batch)
    for step in range(STEPS):
        if step:
            loss = _step(run, step, shard_batch)
        if variant != "reference":
            dist.all_reduce(loss := loss.detach().clone())
            loss /= dist.get_world_size()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        params.append(
            {
                name.replace("._orig_mod", ""): full_tensor(p) for name, p in model.named_parameters()
            }
        )
    return {"losses": losses, "params": params, "warnings": [str(w.message) for w in caught if "fsdp_compile" in str(w.message)]}


def _max_gap(a: dict, b: dict) -> float:
    gaps = [abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)]
    for pa, pb in zip(a["params"], b["params"], strict=True):
        gaps += [(pa[name] - pb[name]).abs().max().item() for name in pb]
    return max(gaps)


@pytest.mark.parametrize(
    "pattern", [*PATTERNS, "module_compile_then_shard", "shard_then_compile+nested", "blocks_only_whole_model"]
)
def test_per_block_compile_matches_reference_and_fsdp2(pool2, pattern):
    """Blocks compiled on their own (traced collectives where the pattern allows) train
    as the unsharded model does, and as FSDP2 with the same per-block compile:
    ``aot_eager``; ours with our passes too (``aot_eager_passes``: eager's ops, bucketed
    and reordered, one compile per block; Inductor's code generation for each would
    dominate the suite's time). Blocks sharded without the
    root: as FSDP2 (the root's parameters are then not synchronized at all, so there is
    no single-process reference)."""
    # torchtitan's blocks are plain modules (no __call__ of their own): the compiled frame
    # starts at the block's forward, below ours, and the unit is gathered around it.
    blocks = "plain" if pattern == "module_compile_then_shard" else "calling"
    fsdp2 = pool2.run(train_per_block, "fsdp2", pattern, "aot_eager", blocks)[0]
    ours = pool2.run(train_per_block, "ours", pattern, "aot_eager_passes", blocks)[0]
    assert _max_gap(ours, fsdp2) < 1e-6
    assert ours["warnings"] == [], ours["warnings"]  # no graph broke, nothing recompiled
    if pattern == "blocks_only_whole_model":
        return
    reference = pool2.run(train_per_block, "reference", pattern, "aot_eager", blocks)[0]
    assert _max_gap(fsdp2, reference) < 1e-5
    assert _max_gap(ours, reference) < 1e-5


def test_blocks_sharded_without_their_parent_are_units_of_their_own(fake_pg):
    """Blocks sharded without the root are root units, all named "": in one compiled
    graph each is still a unit of its own (by its order in the graph), so each is
    bucketed, gathered and reduced on its own rather than all blocks at once."""
    from fsdp_compile.testing._torch_internals import reset_dynamo

    reset_dynamo()
    capture = GraphCapture("default")
    run = apply_per_block(build_llama(3, "plain"), "blocks_only_whole_model", fully_shard, capture)
    _step(run, 0)
    assert capture.frame_count == 1
    (fw,), (bw,) = capture.forward_graphs, capture.backward_graphs
    for graph, op in ((fw, c10d_functional.all_gather_into_tensor), (bw, c10d_functional.reduce_scatter_tensor)):
        units = [tag_of(n).unit_fqn for n in collective_nodes(graph, op)]
        assert {u: units.count(u) for u in units} == {"": 9, "(root 1)": 9, "(root 2)": 9}


class PartlyEagerBlock(torch.nn.Module):
    """A block Dynamo runs partly eagerly: a data-dependent branch inside a loop makes it
    skip ``_loop``'s frame (as the per-expert loops of ``transformers``' MoE layers do),
    so ``_loop`` runs eagerly inside the compiled call, saving gathered weights for
    backward there."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.inp, self.mid, self.out = (torch.nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self._loop(self.inp(x)))

    def _loop(self, h: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            if h.sum() > -1e9:
                h = torch.relu(self.mid(h))
        return h


def graphs_with_partly_eager_blocks(kind: str) -> dict:
    """On each rank: 3 ``PartlyEagerBlock``s compiled one by one (eager backend, counted),
    then sharded (torchtitan's order), and a head; 3 SGD steps. Graphs compiled and the
    full parameters after."""
    import torch.distributed as dist

    from fsdp_compile.testing import full_parameters
    from fsdp_compile.testing._torch_internals import compile_counter, reset_dynamo

    reset_dynamo()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(PartlyEagerBlock() for _ in range(3)), torch.nn.Linear(8, 2))
    counter = compile_counter("eager")
    for i in range(3):
        model[i] = torch.compile(model[i], backend=counter)
    if kind != "unsharded":
        shard = fully_shard_of(kind)
        for block in list(model)[:3]:
            shard(block)
        shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        local = x if kind == "unsharded" else x.chunk(world)[rank]
        model(local).square().sum().mul(1 / 4 if kind == "unsharded" else world / 4).backward()
        opt.step()
        opt.zero_grad()
    return {"graphs": counter.frame_count, "params": full_parameters(model)}


def test_eager_code_inside_a_compiled_block_compiles_no_graph_of_ours(pool2):
    """Autograd calls our saved-tensor hooks (resharding after forward) from the eager part
    of a compiled block: Dynamo compiled them as frames of their own, recompiling them per
    saved tensor's dtype, size and stride (found on ``transformers``' Qwen3-MoE with
    per-expert loops: 12 graphs where the unsharded model and FSDP2 compile 9). As many
    graphs as unsharded and FSDP2, and the same training."""
    results = {kind: pool2.run(graphs_with_partly_eager_blocks, kind)[0] for kind in ("unsharded", "fsdp2", "ours")}
    assert results["ours"]["graphs"] == results["unsharded"]["graphs"] == results["fsdp2"]["graphs"], {
        k: r["graphs"] for k, r in results.items()
    }
    for name, expected in results["unsharded"]["params"].items():
        torch.testing.assert_close(results["ours"]["params"][name], expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(results["ours"]["params"][name], results["fsdp2"]["params"][name], rtol=1e-6, atol=1e-7)

