"""Passes on hand-built FX graphs: what they tag, and that they change nothing else."""

from __future__ import annotations

import itertools

import torch
import torch.fx as fx

from fsdp_compile.base.compat import CheckpointPolicy, c10d_functional, get_joint_custom_pass, set_joint_custom_pass
from fsdp_compile.passes import install_passes, tag_reshard_after_forward
from fsdp_compile.passes.registration import _ChainedJointPass
from fsdp_compile.runtime import CollectiveTag, Role
from fsdp_compile.runtime.vocabulary import set_tag

aten = torch.ops.aten


def _unshard_then_matmul(reshard: bool, annotate: bool = True, backward: bool = False) -> tuple[fx.GraphModule, dict]:
    """shard -> all_gather -> wait -> t -> mm(x, .), as the runtime traces it."""
    g = fx.Graph()
    shard, x = g.placeholder("shard"), g.placeholder("x")
    ag = g.call_function(c10d_functional.all_gather_into_tensor.default, (shard, 2, "0"))
    wait = g.call_function(c10d_functional.wait_tensor.default, (ag,))
    t = g.call_function(aten.t.default, (wait,))
    mm = g.call_function(aten.mm.default, (x, t))
    g.output(mm)
    tag = CollectiveTag(Role.UNSHARD, "w", "layers.0", reshard)
    for node in (ag, wait):
        if annotate:
            set_tag(node, tag)
        if backward:
            node.meta["partitioner_tag"] = "is_backward"
    return fx.GraphModule(torch.nn.Module(), g), dict(ag=ag, wait=wait, t=t, mm=mm)


def _recompute_tags(nodes):
    return {name: node.meta.get("recompute") for name, node in nodes.items()}


def test_resharded_chain_and_its_views_are_recomputed():
    gm, nodes = _unshard_then_matmul(reshard=True)
    code_before = gm.code
    tag_reshard_after_forward(gm)
    must = CheckpointPolicy.MUST_RECOMPUTE
    assert _recompute_tags(nodes) == {"ag": must, "wait": must, "t": must, "mm": None}
    assert gm.code == code_before  # only metadata changed


def test_kept_chain_is_left_to_the_partitioner():
    gm, nodes = _unshard_then_matmul(reshard=False)
    tag_reshard_after_forward(gm)
    assert set(_recompute_tags(nodes).values()) == {None}


def test_unannotated_and_backward_collectives_untouched():
    for kwargs in (dict(annotate=False), dict(backward=True)):
        gm, nodes = _unshard_then_matmul(reshard=True, **kwargs)
        tag_reshard_after_forward(gm)
        assert set(_recompute_tags(nodes).values()) == {None}, kwargs


def test_pass_keeps_results():
    gm, _ = _unshard_then_matmul(reshard=True)
    fake_gather = lambda shard, n, group: torch.cat([shard] * n)  # noqa: E731
    for node in gm.graph.nodes:
        if node.target is c10d_functional.all_gather_into_tensor.default:
            node.target = fake_gather
        elif node.target is c10d_functional.wait_tensor.default:
            node.target = torch.clone
    gm.recompile()
    shard, x = torch.randn(3, 4), torch.randn(5, 4)
    before = gm(shard, x)
    tag_reshard_after_forward(gm)
    gm.recompile()
    torch.testing.assert_close(gm(shard, x), before, rtol=0, atol=0)


def test_registration_chains_with_a_user_pass_and_is_idempotent():
    saved = get_joint_custom_pass()
    calls = []

    def user_pass(gm, inputs):
        calls.append("user")
        return gm

    try:
        set_joint_custom_pass(user_pass)
        install_passes()
        install_passes()
        chained = get_joint_custom_pass()
        assert isinstance(chained, _ChainedJointPass) and chained.previous is user_pass
        gm, nodes = _unshard_then_matmul(reshard=True)
        chained(gm, [])
        assert calls == ["user"]
        assert nodes["ag"].meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
    finally:
        set_joint_custom_pass(saved)


def _joint_with_backward_read(reshard_to, checkpointed: bool = False) -> tuple[fx.GraphModule, dict]:
    """A joint graph: shard -> all_gather(4 ranks) -> wait -> t -> mm(x, .) in forward; the
    backward reads ``t`` (``mm(tangent, t(t))``), as ``F.linear``'s backward does. With
    ``checkpointed``, a forward node recomputed by an activation checkpoint reads it too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_compile.passes.graph_utils import emit

    g, mode = fx.Graph(), FakeTensorMode()
    shard, x, tangent = g.placeholder("shard"), g.placeholder("x"), g.placeholder("tangents_1")
    for node, shape in ((shard, (2, 4)), (x, (5, 4)), (tangent, (5, 8))):
        with mode:
            node.meta["val"] = torch.empty(shape)
    tag = CollectiveTag(Role.UNSHARD, "w", "layers.0", True, reshard_to=reshard_to)
    ag = emit(g, c10d_functional.all_gather_into_tensor.default, (shard, 4, "0"), tag=tag)
    wait = emit(g, c10d_functional.wait_tensor.default, (ag,), tag=tag)
    t = emit(g, aten.t.default, (wait,))
    mm = emit(g, aten.mm.default, (x, t))
    outputs = [mm]
    if checkpointed:
        relu = emit(g, aten.relu.default, (t,))
        relu.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
        outputs.append(relu)
    t_t = emit(g, aten.t.default, (t,))
    grad_x = emit(g, aten.mm.default, (tangent, t_t))
    for node in (t_t, grad_x):
        node.meta["partitioner_tag"] = "is_backward"
    g.output((*outputs, grad_x))
    return fx.GraphModule(torch.nn.Module(), g), dict(ag=ag, wait=wait, t=t, t_t=t_t)


def _run_with_stand_in_collectives(gm: fx.GraphModule, *inputs):
    """``gm`` on real tensors, an all-gather of n ranks standing in as n copies of the input."""
    gm = copy.deepcopy(gm)
    for node in gm.graph.nodes:
        if node.target is c10d_functional.all_gather_into_tensor.default:
            node.target = lambda shard, n, group: torch.cat([shard] * n)
        elif node.target is c10d_functional.wait_tensor.default:
            node.target = torch.clone
    gm.recompile()
    return gm(*inputs)


def test_backward_regathers_over_the_smaller_group_from_a_kept_block():
    from fsdp_compile.passes import regather_from_post_forward_shards

    gm, nodes = _joint_with_backward_read(("1", 2, 1))
    inputs = (torch.randn(2, 4), torch.randn(5, 4), torch.randn(5, 8))
    before = _run_with_stand_in_collectives(gm, *inputs)
    tag_reshard_after_forward(gm)
    regather_from_post_forward_shards(gm)
    gm.graph.lint()
    # The backward's t(t) now reads a copy of t over an all-gather of rows 4-8 (rank 1's
    # half of the 8 gathered rows) over group "1" of 2 ranks, placed in the backward.
    copy_of_t = nodes["t_t"].args[0]
    new_wait = copy_of_t.args[0]
    regather = new_wait.args[0]
    kept = regather.args[0]
    assert copy_of_t is not nodes["t"] and copy_of_t.target is aten.t.default
    assert regather.target is c10d_functional.all_gather_into_tensor.default and regather.args[1:] == (2, "1")
    assert kept.target is aten.clone.default and kept.args[0].args == (nodes["wait"], 0, 4, 8)
    assert all(n.meta["partitioner_tag"] == "must_be_in_backward" for n in (regather, new_wait, copy_of_t))
    assert "partitioner_tag" not in kept.meta
    # The forward chain is no longer recomputed (the partitioner saves the block instead).
    assert all("recompute" not in nodes[k].meta for k in ("ag", "wait", "t"))
    for got, want in zip(_run_with_stand_in_collectives(gm, *inputs), before, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_regather_pass_leaves_other_chains_to_the_reshard_tags():
    """No smaller group, or a checkpointed region that recomputes the weight's reader in
    backward: the chain stays as tag_reshard_after_forward left it (re-gathered whole)."""
    from fsdp_compile.passes import regather_from_post_forward_shards

    for reshard_to, checkpointed in ((None, False), (("1", 2, 1), True)):
        gm, nodes = _joint_with_backward_read(reshard_to, checkpointed)
        tag_reshard_after_forward(gm)
        code_before = gm.code
        regather_from_post_forward_shards(gm)
        assert gm.code == code_before
        assert nodes["ag"].meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE


# ---------------------------------------------------------------- post-grad passes

import copy  # noqa: E402

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsdp_compile.passes.bucketing import bucket_collectives, plan_buckets, split_by_use  # noqa: E402
from fsdp_compile.passes.pinning import schedule_constraints  # noqa: E402
from fsdp_compile.passes.reordering import reorder_for_overlap, tail_of  # noqa: E402
from fsdp_compile.runtime.vocabulary import our_collectives, positions  # noqa: E402
from tests.pass_graphs import build_root_used_apart_graph, build_unit_graph, fake_placeholder, node_signature  # noqa: E402

N_UNITS = 3


def outputs_before_and_after_passes(bias_dtype: torch.dtype = torch.float32) -> dict:
    """On every rank: run a hand-built graph before and after each pass on real data."""
    from fsdp_compile.passes.pinning import pin_schedule

    rank, world_size = dist.get_rank(), dist.get_world_size()
    group_name = dist.group.WORLD.group_name
    gm, shapes = build_unit_graph(world_size, rank, group_name, bias_dtype=bias_dtype)
    gen = torch.Generator().manual_seed(rank)
    dtypes = [n.meta["val"].dtype for n in gm.graph.find_nodes(op="placeholder")]
    inputs = [torch.randn(s, generator=gen).to(d) for s, d in zip(shapes, dtypes, strict=True)]

    results = {"original": gm(*inputs)}
    bucketed = copy.deepcopy(gm)
    bucket_collectives(bucketed.graph)
    bucketed.recompile()
    results["bucketed"] = bucketed(*inputs)
    reordered = copy.deepcopy(bucketed)
    reorder_for_overlap(reordered.graph)
    reordered.recompile()
    results["reordered"] = reordered(*inputs)
    pin_schedule(reordered.graph)
    reordered.recompile()
    results["pinned"] = reordered(*inputs)
    return results


def _sequence(graph):
    return [(c.kind, c.input_numel) for c in our_collectives(graph)]


@pytest.mark.parametrize("rank", [0, 1])
def test_bucketing_one_collective_per_unit_and_kind(rank):
    gm, _ = build_unit_graph(2, rank, "0", N_UNITS)
    assert len(our_collectives(gm.graph)) == 4 * N_UNITS
    buckets = bucket_collectives(gm.graph)
    assert [len(b.members) for b in buckets] == [2] * (2 * N_UNITS)
    gm.graph.lint()
    collectives = our_collectives(gm.graph)
    assert [c.kind for c in collectives] == ["all_gather"] * N_UNITS + ["reduce_scatter"] * N_UNITS
    assert [c.tag.unit_fqn for c in collectives] == [f"layers.{u}" for u in range(N_UNITS)] + [
        f"layers.{u}" for u in reversed(range(N_UNITS))
    ]


def test_padding_is_folded_into_the_copy_in():
    """Rank 1's uneven shards are padded by the runtime (``pad_dim0``); after bucketing
    the copy-in pads in its single pass and the padding nodes are gone."""
    gm, _ = build_unit_graph(2, 1, "0", N_UNITS)
    cats = lambda: [n for n in gm.graph.nodes if n.target is torch.ops.fsdp_compile.pad_dim0.default]  # noqa: E731
    assert cats()
    bucket_collectives(gm.graph)
    assert cats() == []
    for c in our_collectives(gm.graph):
        assert all(src.op == "placeholder" or c.kind == "reduce_scatter" for src in c.input.args[0])


def test_all_gather_copy_out_takes_each_members_column_block():
    """The bucket copy-out op: member ``i`` of ``[world_size, sum(numels)]`` is its column
    block, contiguous, each rank's rows in rank order (its padded full tensor)."""
    numels, world_size = [6, 2, 4], 3
    gathered = torch.arange(world_size * sum(numels), dtype=torch.float32)
    outs = torch.ops.fsdp_compile.all_gather_copy_out(gathered, numels, world_size)
    grid, offset = gathered.view(world_size, -1), 0
    for out, numel in zip(outs, numels, strict=True):
        assert out.is_contiguous() and out.shape == (world_size * numel,)
        torch.testing.assert_close(out, grid[:, offset : offset + numel].reshape(-1), rtol=0, atol=0)
        offset += numel
    # With this rank's block apart (the gloo transport's): the same members, for every rank.
    for own_rank in range(world_size):
        peers = torch.cat([row for k, row in enumerate(grid) if k != own_rank])
        own = torch.cat([grid[own_rank], torch.full((5,), float("nan"))])  # read up to sum(numels) only
        with_own = torch.ops.fsdp_compile.all_gather_copy_out(peers, numels, world_size, own, own_rank)
        for got, want in zip(with_own, outs, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_copy_ins_lay_out_each_ranks_padded_shards(world_size):
    """The copy-in ops against the layout built by hand from ``ShardLayout``: rank ``r``'s
    block of the reduce-scatter input holds every member's ``torch.chunk`` shard ``r``,
    zero-padded (fewer rows than ranks, uneven rows, 1-D and 3-D members); the
    all-gather input is the local shards, each zero-padded, back to back."""
    from fsdp_compile.runtime.collectives import ShardLayout

    shapes = [(5, 3), (7,), (1, 4), (16, 2, 3), (world_size, 2)]
    grads = [torch.randn(shape) for shape in shapes]
    layouts = [[ShardLayout(shape, world_size, r, "g") for shape in shapes] for r in range(world_size)]
    widths = [layout.padded_numel for layout in layouts[0]]

    def padded_shard(grad, layout):
        block = torch.zeros(layout.padded_local_shape)
        start = layout.rank * layout.rows_per_rank
        block[: layout.local_rows] = grad[start : start + layout.local_rows]
        return block.reshape(-1)

    expected = torch.cat(
        [padded_shard(g, layout) for r in range(world_size) for g, layout in zip(grads, layouts[r], strict=True)]
    )
    flat = torch.ops.fsdp_compile.reduce_scatter_copy_in(grads, [w * world_size for w in widths], world_size)
    torch.testing.assert_close(flat, expected, rtol=0, atol=0)
    # A member without elements contributes nothing.
    empty = torch.ops.fsdp_compile.reduce_scatter_copy_in([grads[0], torch.zeros(0, 3)], [widths[0] * world_size, 0], world_size)
    torch.testing.assert_close(empty, flat.view(world_size, -1)[:, : widths[0]].reshape(-1), rtol=0, atol=0)

    for r in range(world_size):
        shards = [
            g[layout.rank * layout.rows_per_rank :][: layout.local_rows] for g, layout in zip(grads, layouts[r], strict=True)
        ]
        copied = torch.ops.fsdp_compile.all_gather_copy_in(shards, widths)
        torch.testing.assert_close(
            copied, torch.cat([padded_shard(g, layout) for g, layout in zip(grads, layouts[r], strict=True)]), rtol=0, atol=0
        )


def test_bucketed_all_gather_copies_out_with_one_op():
    """A merged all-gather's members come from one copy-out op (not a traced slice and
    clone each: those compiled to one C++ kernel per member)."""
    gm, _ = build_unit_graph(2, 1, "0", N_UNITS)
    bucket_collectives(gm.graph)
    copy_outs = [n for n in gm.graph.nodes if n.target is torch.ops.fsdp_compile.all_gather_copy_out.default]
    assert len(copy_outs) == N_UNITS
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]


def test_mixed_dtypes_get_separate_buckets():
    gm, _ = build_unit_graph(2, 0, "0", N_UNITS, bias_dtype=torch.float64)
    buckets = bucket_collectives(gm.graph)
    assert len(buckets) == 4 * N_UNITS  # per unit: {fp32, fp64} x {all-gather, reduce-scatter}
    for b in buckets:
        assert len({m.dtype for m in b.members}) == 1
    gm.graph.lint()


def test_bucket_cap():
    gm, _ = build_unit_graph(2, 0, "0", N_UNITS)
    collectives = our_collectives(gm.graph)
    assert len(plan_buckets(collectives, cap_bytes=1)) == len(collectives)  # each alone
    assert len(plan_buckets(collectives, cap_bytes=None)) == 2 * N_UNITS


def _unit_buckets(graph) -> list[tuple[str, str, list[str]]]:
    return [(c.kind, c.tag.unit_fqn, c.tag.param_fqn.split(",")) for c in our_collectives(graph)]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("with_norm", [True, False], ids=["norm_and_head", "head_alone"])
def test_a_unit_used_apart_gets_a_bucket_per_run_used_together(rank, with_norm):
    """The root's embedding is used first, its norm and head after every layer: with
    ``split_min_bytes`` the root's all-gather and reduce-scatter each become one bucket
    per run (embedding apart from norm + head), in the order the graph needs them; layers
    keep one bucket each; the same sequence on a rank that pads (rank 1) as on one that
    does not. A run of one parameter (a head without a norm) has nothing to merge and is
    moved to its use all the same. Without ``split_min_bytes``, one bucket per unit."""
    late = ["norm", "head"] if with_norm else ["head"]
    split = build_root_used_apart_graph(2, rank, "0", with_norm=with_norm)
    bucket_collectives(split.graph, split_min_bytes=0)
    split.graph.lint()
    assert _unit_buckets(split.graph) == [
        ("all_gather", "", ["embed"]),
        ("all_gather", "layers.0", ["layers.0.weight"]),
        ("all_gather", "layers.1", ["layers.1.weight"]),
        ("all_gather", "", late),
        ("reduce_scatter", "", late[::-1]),
        ("reduce_scatter", "layers.1", ["layers.1.weight"]),
        ("reduce_scatter", "layers.0", ["layers.0.weight"]),
        ("reduce_scatter", "", ["embed"]),
    ]
    # Issued where they are needed, norm + head are then prefetched as any bucket: before
    # the wait of the bucket issued before them (the last layer's), not at the step's start.
    reorder_for_overlap(split.graph)
    order = positions(split.graph)
    gathers = {c.tag.param_fqn: c for c in our_collectives(split.graph, "all_gather")}
    assert order[gathers["layers.0.weight"].wait] < order[gathers[",".join(late)].issue] < order[gathers["layers.1.weight"].wait]

    whole = build_root_used_apart_graph(2, rank, "0", with_norm=with_norm)
    bucket_collectives(whole.graph)
    assert [b for b in _unit_buckets(whole.graph) if b[1] == ""] == [
        ("all_gather", "", ["embed", *late]),
        ("reduce_scatter", "", [*late[::-1], "embed"]),
    ]


def test_a_split_keeps_no_run_smaller_than_the_threshold():
    """Runs below ``split_min_bytes`` (gathered bytes) join their neighbour: norm (DIM
    floats) alone never splits off, and a threshold above every run keeps one bucket."""
    sizes = {}
    gm = build_root_used_apart_graph(2, 0, "0")
    for c in our_collectives(gm.graph, "all_gather"):
        sizes[c.tag.param_fqn] = c.input_bytes * c.world_size
    between = min(sizes["embed"], sizes["head"] + sizes["norm"])  # the smaller run's bytes
    for threshold, root_gathers in (
        (0, [["embed"], ["norm", "head"]]),
        (between, [["embed"], ["norm", "head"]]),
        (between + 1, [["embed", "norm", "head"]]),
    ):
        gm = build_root_used_apart_graph(2, 0, "0")
        buckets = plan_buckets(our_collectives(gm.graph), split_min_bytes=threshold)
        got = [[m.tag.param_fqn for m in b.members] for b in buckets if b.kind == "all_gather" and b.members[0].tag.unit_fqn == ""]
        assert got == root_gathers, threshold


def test_split_by_use_is_a_partition_in_member_order():
    """Pure function: every member in exactly one run, runs in use order, members in a
    run in their original order; a boundary wherever another unit's position falls
    between two members' positions."""

    class Member:
        def __init__(self, name, nbytes):
            self.name, self.input_bytes, self.world_size = name, nbytes, 2

    members = [Member(n, b) for n, b in (("a", 8), ("b", 8), ("c", 1), ("d", 8))]
    where = {"a": 0, "b": 5, "c": 6, "d": 20}
    runs = split_by_use(members, others=[3, 10], position=lambda m: where[m.name], min_gathered_bytes=0)
    assert [[m.name for m in r] for r in runs] == [["a"], ["b", "c"], ["d"]]
    # c's run alone would be 2 bytes: with a 16-byte threshold it joins b's run anyway;
    # at 20 bytes "a" (16) is small and takes b and c in; "d" (16) then joins them.
    runs = split_by_use(members, others=[3, 10], position=lambda m: where[m.name], min_gathered_bytes=20)
    assert [[m.name for m in r] for r in runs] == [["a", "b", "c", "d"]]
    runs = split_by_use(members, others=[], position=lambda m: where[m.name], min_gathered_bytes=0)
    assert [[m.name for m in r] for r in runs] == [["a", "b", "c", "d"]]
    # All-reduces (HSDP's replicate dimension) have no world size: their input bytes count.
    for m in members:
        m.world_size = None
    runs = split_by_use(members, others=[3, 10], position=lambda m: where[m.name], min_gathered_bytes=8)
    assert [[m.name for m in r] for r in runs] == [["a"], ["b", "c"], ["d"]]
    runs = split_by_use(members, others=[3, 10], position=lambda m: where[m.name], min_gathered_bytes=9)
    assert [[m.name for m in r] for r in runs] == [["a", "b", "c", "d"]]


def test_ranks_with_and_without_padding_issue_the_same_sequence():
    """Rank 1 pads its shards (extra nodes); the collectives it issues must not differ."""
    sequences = []
    for rank in (0, 1):
        gm, _ = build_unit_graph(2, rank, "0", N_UNITS)
        bucket_collectives(gm.graph)
        reorder_for_overlap(gm.graph)
        sequences.append(_sequence(gm.graph))
    assert sequences[0] == sequences[1]


def test_reordering_moves_nodes_only_and_overlaps():
    gm, _ = build_unit_graph(2, 1, "0", N_UNITS)
    bucket_collectives(gm.graph)
    before = node_signature(gm.graph)
    sequence_before = _sequence(gm.graph)
    reorder_for_overlap(gm.graph, prefetch_depth=1, reduce_scatter_depth=1)
    gm.graph.lint()
    assert node_signature(gm.graph) == before
    assert _sequence(gm.graph) == sequence_before
    pos = positions(gm.graph)
    gathers = our_collectives(gm.graph, "all_gather")
    for k in range(1, len(gathers)):
        assert pos[gathers[k].issue] < pos[gathers[k - 1].wait], f"all-gather {k} is not prefetched"
    scatters = our_collectives(gm.graph, "reduce_scatter")
    for c in our_collectives(gm.graph):
        tail = tail_of(c)
        outside = [u for n in tail for u in n.users if u not in tail]
        latest = min(pos[u] for u in outside)
        if c.kind == "reduce_scatter" and c.issue is not scatters[-1].issue:
            # ...or earlier: before the next reduce-scatter is issued (one in flight).
            latest = min(latest, pos[scatters[scatters.index(c) + 1].issue])
        assert pos[tail[-1]] == latest - 1, f"{c.kind} wait is not as late as allowed"


def test_memory_bound_disables_prefetch():
    gm, _ = build_unit_graph(2, 0, "0", N_UNITS)
    bucket_collectives(gm.graph)
    reorder_for_overlap(gm.graph, prefetch_depth=1, max_inflight_bytes=1)
    pos = positions(gm.graph)
    gathers = our_collectives(gm.graph, "all_gather")
    for k in range(1, len(gathers)):
        assert pos[gathers[k].issue] > pos[gathers[k - 1].wait]


def test_prefetch_hint_overrides_depth():
    """layers.0 asks to prefetch layers.2 (set_modules_to_forward_prefetch): its all-gather,
    and layers.1's (needed first; issue order is kept), are issued before layers.0's
    wait, although depth 0 and a 1-byte in-flight bound prefetch nothing otherwise."""
    gm, _ = build_unit_graph(2, 0, "0", N_UNITS, forward_prefetched_by={"layers.2": "layers.0"})
    bucket_collectives(gm.graph)
    before = node_signature(gm.graph)
    sequence_before = _sequence(gm.graph)
    reorder_for_overlap(gm.graph, prefetch_depth=0, max_inflight_bytes=1)
    gm.graph.lint()
    assert node_signature(gm.graph) == before and _sequence(gm.graph) == sequence_before
    pos = positions(gm.graph)
    g0, g1, g2 = our_collectives(gm.graph, "all_gather")[:3]
    assert pos[g0.issue] < pos[g1.issue] < pos[g2.issue] < pos[g0.wait]
    assert pos[g1.wait] > pos[g0.wait]


def test_prefetch_hint_from_a_later_unit_is_ignored():
    gm, _ = build_unit_graph(2, 0, "0", N_UNITS, forward_prefetched_by={"layers.0": "layers.2"})
    bucket_collectives(gm.graph)
    reorder_for_overlap(gm.graph, prefetch_depth=0)
    pos = positions(gm.graph)
    gathers = our_collectives(gm.graph, "all_gather")
    for k in range(1, len(gathers)):
        assert pos[gathers[k].issue] > pos[gathers[k - 1].wait]


def test_pinning_constraints_follow_the_schedule():
    gm, _ = build_unit_graph(2, 0, "0", N_UNITS)
    bucket_collectives(gm.graph)
    reorder_for_overlap(gm.graph)
    deps = schedule_constraints(gm.graph)
    pos = positions(gm.graph)
    assert deps
    for dependent, before in deps.items():
        assert all(pos[b] < pos[dependent] for b in before)  # forward edges only: no cycle
    for c in our_collectives(gm.graph):
        if c.wait in deps:
            assert all(pos[c.issue] < pos[b] for b in deps[c.wait])
    issues = [c.issue for c in sorted(our_collectives(gm.graph), key=lambda c: pos[c.issue])]
    for earlier, later in itertools.pairwise(issues):
        assert earlier in deps[later], "collective issue order is not pinned"


def test_pinning_anchors_the_overlap_on_kernels_inductor_keeps():
    """A pointwise node right after an issue may be fused into a later kernel, and the
    lowering of ``control_deps`` then drops its edge: Inductor moved the backward's first
    re-gather of a transformers Llama below the LM head's matmuls that way (no compute
    between its issue and wait). The first and the last matmul between issue and wait
    are pinned too; compute outside that window is not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_compile.passes.graph_utils import emit
    from fsdp_compile.runtime.vocabulary import ALL_GATHER, WAIT, aten

    graph = fx.Graph()
    mode = FakeTensorMode()

    def placeholder(name, shape):
        return fake_placeholder(graph, mode, name, shape)

    shard, x, w = placeholder("shard", (3, 4)), placeholder("x", (2, 4)), placeholder("w", (4, 4))
    tag = CollectiveTag(Role.UNSHARD, "u.weight", "u", True)
    before = emit(graph, aten.mm.default, (x, w))
    issue = emit(graph, ALL_GATHER, (shard, 2, "0"), tag=tag)
    pointwise = emit(graph, aten.relu.default, (before,))
    first_mm = emit(graph, aten.mm.default, (pointwise, w))
    last_mm = emit(graph, aten.mm.default, (first_mm, w))
    tail = emit(graph, aten.add.Tensor, (last_mm, 1.0))
    wait = emit(graph, WAIT, (issue,), tag=tag)
    after = emit(graph, aten.mm.default, (tail, w))
    graph.output((wait, after))

    deps = schedule_constraints(graph)
    assert issue in deps[pointwise] and issue in deps[first_mm]
    assert issue not in deps.get(last_mm, []) and issue not in deps.get(after, [])
    assert set(deps[wait]) == {tail, last_mm}
    assert before not in deps and after not in deps


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float64])
def test_passes_keep_results_bitwise_on_two_ranks(pool2, bias_dtype):
    for rank, results in enumerate(pool2.run(outputs_before_and_after_passes, bias_dtype)):
        for stage in ("bucketed", "reordered", "pinned"):
            assert len(results[stage]) == len(results["original"])
            for i, (a, b) in enumerate(zip(results["original"], results[stage], strict=True)):
                torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"rank {rank} {stage} output {i}: {m}")


def test_gradient_all_reduces_are_bucketed_per_unit_and_group(fake_pg):
    """HSDP's replicate-dimension all-reduces (and replicated parameters') merge like
    reduce-scatters: one per unit, group and dtype, issued where the last member was,
    each member's consumers reading the same shape and values."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_compile.passes.bucketing import bucket_collectives
    from fsdp_compile.passes.graph_utils import emit
    from fsdp_compile.runtime import CollectiveTag, Role
    from fsdp_compile.runtime.vocabulary import ALL_REDUCE, WAIT, collective_kind

    group = dist.group.WORLD.group_name
    graph, mode = fx.Graph(), FakeTensorMode()
    grads = []
    for i, shape in enumerate([(3, 4), (5,), (2, 2)]):
        node = graph.placeholder(f"g{i}")
        with mode:
            node.meta["val"] = torch.empty(shape)
        grads.append(node)
    outs = []
    for i, g in enumerate(grads):
        tag = CollectiveTag(Role.REPLICATE_GRAD, f"w{i}", "layers.0", True)
        outs.append(emit(graph, WAIT, (emit(graph, ALL_REDUCE, (g, "avg", group), tag=tag),), tag=tag))
    graph.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    inputs = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2)]
    before = gm(*inputs)
    buckets = bucket_collectives(graph)
    gm.recompile()
    assert [len(b.members) for b in buckets] == [3]
    assert [collective_kind(n) for n in graph.nodes if collective_kind(n)] == ["all_reduce"]
    after = gm(*inputs)
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(before, after, strict=True))


def _graph_with_a_foreign_collective_between_two_units():
    """x -> [our all-gather of unit a] -> mm -> [a TP all-gather, not ours] -> mm ->
    [our all-gather of unit b] -> mm, as traced (each wait right after its issue)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_compile.passes.graph_utils import emit
    from fsdp_compile.runtime import CollectiveTag, Role
    from fsdp_compile.runtime.vocabulary import ALL_GATHER, WAIT

    graph, mode = fx.Graph(), FakeTensorMode()

    def placeholder(name, shape):
        return fake_placeholder(graph, mode, name, shape)

    x, wa, wb = placeholder("x", (64, 64)), placeholder("wa", (32, 64)), placeholder("wb", (32, 64))

    def gather(shard, tag):
        return emit(graph, WAIT, (emit(graph, ALL_GATHER, (shard, 2, "dp"), tag=tag),), tag=tag)

    h = emit(graph, aten.mm.default, (x, gather(wa, CollectiveTag(Role.UNSHARD, "a.w", "a", True))))
    tp_gathered = emit(graph, WAIT, (emit(graph, ALL_GATHER, (h, 2, "tp")),))  # untagged: not ours
    h = emit(graph, aten.mm.default, (tp_gathered, x))
    out = emit(graph, aten.mm.default, (h, gather(wb, CollectiveTag(Role.UNSHARD, "b.w", "b", True))))
    graph.output(out)
    return graph


@pytest.mark.parametrize("profile,after_foreign", [(None, False), ("cpu-gloo", True)])
def test_prefetch_does_not_delay_a_collective_that_is_not_ours(profile, after_foreign):
    """Unit b's all-gather is prefetched before unit a's wait, unless (with the cost model)
    it would still be on the link when the TP all-gather between them is issued."""
    from fsdp_compile.passes.reordering import reorder_for_overlap
    from fsdp_compile.runtime.vocabulary import our_collectives, tag_of

    graph = _graph_with_a_foreign_collective_between_two_units()
    reorder_for_overlap(graph, profile=profile)
    a, b = our_collectives(graph, "all_gather")
    (foreign,) = [n for n in graph.nodes if n.target is c10d_functional.all_gather_into_tensor.default and tag_of(n) is None]
    assert b.issue < a.wait if not after_foreign else foreign < b.issue < b.wait
    if after_foreign:
        assert next(u for u in foreign.users) < b.issue  # after the TP all-gather's wait


# ---------------------------------------------------------------- transport lowering (gloo)


def _gather_and_reduce_graph(reduce_op: str) -> fx.GraphModule:
    """A post-grad graph with one of our all-gathers (2 ranks, a [2, 4] shard, read by a
    matmul) and one of our reduce-scatters (2 ranks, a [4, 3] gradient, scaled after)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_compile.passes.graph_utils import emit

    g, mode = fx.Graph(), FakeTensorMode()
    shard, x, grad = g.placeholder("shard"), g.placeholder("x"), g.placeholder("grad")
    for node, shape in ((shard, (2, 4)), (x, (5, 4)), (grad, (4, 3))):
        with mode:
            node.meta["val"] = torch.empty(shape)
    gather_tag = CollectiveTag(Role.UNSHARD, "w", "layers.0", True)
    reduce_tag = CollectiveTag(Role.REDUCE_GRAD, "v", "layers.0", True)
    ag = emit(g, c10d_functional.all_gather_into_tensor.default, (shard, 2, "0"), tag=gather_tag)
    gathered = emit(g, c10d_functional.wait_tensor.default, (ag,), tag=gather_tag)
    mm = emit(g, aten.mm.default, (x, emit(g, aten.t.default, (gathered,))))
    rs = emit(g, c10d_functional.reduce_scatter_tensor.default, (grad, reduce_op, 2, "0"), tag=reduce_tag)
    reduced = emit(g, c10d_functional.wait_tensor.default, (rs,), tag=reduce_tag)
    scaled = emit(g, aten.mul.Tensor, (reduced, 3.0))
    g.output((mm, scaled))
    return fx.GraphModule(torch.nn.Module(), g)


def _run_as_rank_0_of_identical_ranks(gm: fx.GraphModule, *inputs):
    """``gm`` on real tensors as rank 0 of ranks that all hold ``inputs``: each collective
    replaced by what it computes there."""
    gm = copy.deepcopy(gm)
    stand_ins = {
        c10d_functional.all_gather_into_tensor.default: lambda t, n, group: torch.cat([t] * n),
        c10d_functional.reduce_scatter_tensor.default: lambda t, op, n, group: t.chunk(n)[0] * (1 if op == "avg" else n),
        # Every peer sends this rank what this rank sends its first receiving peer.
        c10d_functional.all_to_all_single.default: lambda t, out, in_, group: torch.cat(
            [next(piece for piece in t.split(list(in_)) if piece.numel())] * sum(1 for rows in out if rows)
        ),
        c10d_functional.wait_tensor.default: torch.clone,
    }
    for node in gm.graph.nodes:
        node.target = stand_ins.get(node.target, node.target)
    gm.recompile()
    return gm(*inputs)


@pytest.mark.parametrize("reduce_op", ["avg", "sum"])
def test_gloo_transport_lowers_both_collectives_to_all_to_alls_with_the_same_values(reduce_op):
    from fsdp_compile.passes.bucketing import ALL_GATHER_COPY_IN, SUM_RECEIVED_SLICES
    from fsdp_compile.passes.transport import lower_to_all_to_all
    from fsdp_compile.runtime.vocabulary import ALL_TO_ALL, tag_of

    gm = _gather_and_reduce_graph(reduce_op)
    inputs = (torch.randn(2, 4), torch.randn(5, 4), torch.randn(4, 3))
    before = _run_as_rank_0_of_identical_ranks(gm, *inputs)
    tags = [c.tag for c in our_collectives(gm.graph)]
    assert lower_to_all_to_all(gm.graph, lambda group: group == "0") == 2
    gm.graph.lint()
    gm.recompile()
    gather, reduce = our_collectives(gm.graph)
    # Same tags, kinds and group sizes, each still waited on once; nothing else communicates.
    assert [c.tag for c in (gather, reduce)] == tags
    assert [(c.issue.target, c.kind, c.world_size, c.group_name) for c in (gather, reduce)] == [
        (ALL_TO_ALL, "all_gather", 2, "0"),
        (ALL_TO_ALL, "reduce_scatter", 2, "0"),
    ]
    assert {n.target for n in gm.graph.nodes if n.op == "call_function" and n.target._namespace == "_c10d_functional"} == {
        ALL_TO_ALL,
        c10d_functional.wait_tensor.default,
    }
    # The all-gather sends its shard to both ranks (written by the copy-in op, no traced
    # repeat); the reduce-scatter's slices are summed after the wait by one op (no traced
    # sum): each traced op was a C++ kernel of its own to compile.
    assert _is_repeated_by_copy_in(gather.input, 2) and gather.issue.args[1:3] == ([2, 2], [2, 2])
    assert reduce.issue.args[1:3] == ([2, 2], [2, 2])
    (summed,) = reduce.wait.users
    assert summed.target is SUM_RECEIVED_SLICES and summed.args == (reduce.wait, 2, reduce_op == "avg")
    assert tuple(summed.meta["val"].shape) == (2, 3)
    assert all(tag_of(n) is None for n in (gather.input, gather.input.args[0], summed))
    traced = {aten.repeat.default, aten.sum.dim_IntList, aten.div.Tensor}
    assert not any(n.target in traced for n in gm.graph.nodes), gm.code
    assert sum(n.target is ALL_GATHER_COPY_IN for n in gm.graph.nodes) == 1
    for got, want in zip(_run_as_rank_0_of_identical_ranks(gm, *inputs), before, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _is_repeated_by_copy_in(node: fx.Node, copies: int, source: fx.Node | None = None) -> bool:
    """``node`` is a view of the copy-in op writing ``copies`` copies of one tensor
    (``source``, where given): the gloo transport's repeat of an all-gather input."""
    from fsdp_compile.passes.bucketing import ALL_GATHER_COPY_IN

    copy_in = node.args[0] if node.target is aten.view.default else None
    return (
        copy_in is not None
        and copy_in.target is ALL_GATHER_COPY_IN
        and len(copy_in.args[0]) == 1
        and copy_in.args[2] == copies
        and (source is None or copy_in.args[0][0] is source)
    )


def _bucketed_gather_graph(extra_reader: bool, world_size: int = 2) -> fx.GraphModule:
    """A post-grad graph with one bucketed all-gather of ours (``world_size`` ranks): the
    copy-in of a [2, 4] shard and a 3-element shard padded to 4, the collective, the
    copy-out; with ``extra_reader`` the copy-in is also an output."""
    import operator

    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_compile.passes.bucketing import ALL_GATHER_COPY_IN, ALL_GATHER_COPY_OUT
    from fsdp_compile.passes.graph_utils import emit

    g, mode = fx.Graph(), FakeTensorMode()
    a, b = g.placeholder("a"), g.placeholder("b")
    for node, shape in ((a, (2, 4)), (b, (3,))):
        with mode:
            node.meta["val"] = torch.empty(shape)
    tag = CollectiveTag(Role.UNSHARD, "w", "layers.0", True)
    copy_in = emit(g, ALL_GATHER_COPY_IN, ([a, b], [8, 4]), tag=tag)
    ag = emit(g, c10d_functional.all_gather_into_tensor.default, (copy_in, world_size, "0"), tag=tag)
    gathered = emit(g, c10d_functional.wait_tensor.default, (ag,), tag=tag)
    out = emit(g, ALL_GATHER_COPY_OUT, (gathered, [8, 4], world_size), tag=tag)
    full_a = emit(g, operator.getitem, (out, 0))
    full_b = emit(g, operator.getitem, (out, 1))
    g.output((full_a, full_b, copy_in) if extra_reader else (full_a, full_b))
    return fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("extra_reader", [False, True])
def test_gloo_transport_has_a_bucket_copy_in_write_one_copy_per_rank(extra_reader):
    """A bucket's copy-in read by the all-gather alone writes the all-to-all's
    ``world_size`` copies itself, where it stood (no ``repeat`` of it); one with another
    reader stays and is repeated. Same values either way."""
    from fsdp_compile.passes.bucketing import ALL_GATHER_COPY_IN
    from fsdp_compile.passes.transport import lower_to_all_to_all
    from fsdp_compile.runtime.vocabulary import tag_of

    gm = _bucketed_gather_graph(extra_reader)
    inputs = (torch.randn(2, 4), torch.randn(3))
    before = _run_as_rank_0_of_identical_ranks(gm, *inputs)
    assert lower_to_all_to_all(gm.graph, lambda group: True) == 1
    gm.graph.lint()
    gm.recompile()
    (gather,) = our_collectives(gm.graph)
    copy_ins = [n for n in gm.graph.nodes if n.target is ALL_GATHER_COPY_IN]
    if extra_reader:  # the bucket's copy-in, then a copy-in op repeating it
        assert len(copy_ins) == 2 and copy_ins[0].args[2:] == ()
        assert _is_repeated_by_copy_in(gather.input, 2, source=copy_ins[0])
    else:
        assert len(copy_ins) == 1
        assert gather.input is copy_ins[0] and copy_ins[0].args[2] == 2
        assert tuple(gather.input.meta["val"].shape) == (24,) and gather.issue.args[1:3] == ([12, 12], [12, 12])
        assert tag_of(gather.input) == gather.tag
        assert list(gm.graph.nodes).index(gather.input) == 2  # where the copy-in stood
    for got, want in zip(_run_as_rank_0_of_identical_ranks(gm, *inputs), before, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("world_size, rank", [(2, 0), (2, 1), (4, 0), (4, 2), (4, 3)])
def test_gloo_transport_sends_a_rank_nothing_of_its_own(world_size, rank):
    """Knowing its rank, a bucket's all-gather sends this rank nothing: the copy-in writes
    ``world_size - 1`` copies, the all-to-all's split to and from this rank is empty, and
    the copy-out takes this rank's block from the copy-in; the values are the
    all-gather's. A copy-in with another reader is left as without the rank."""
    from fsdp_compile.passes.bucketing import ALL_GATHER_COPY_IN, ALL_GATHER_COPY_OUT
    from fsdp_compile.passes.transport import lower_to_all_to_all

    gm = _bucketed_gather_graph(False, world_size)
    inputs = (torch.randn(2, 4), torch.randn(3))
    before = _run_as_rank_0_of_identical_ranks(gm, *inputs)
    assert lower_to_all_to_all(gm.graph, lambda group: True, lambda group: rank) == 1
    gm.graph.lint()
    gm.recompile()
    (gather,) = our_collectives(gm.graph)
    (copy_in,) = [n for n in gm.graph.nodes if n.target is ALL_GATHER_COPY_IN]
    (copy_out,) = [n for n in gm.graph.nodes if n.target is ALL_GATHER_COPY_OUT]
    splits = [0 if k == rank else 12 for k in range(world_size)]
    assert gather.input is copy_in and gather.issue.args[1:3] == (splits, splits)
    assert copy_in.args[2:] == (() if world_size == 2 else (world_size - 1,))
    assert tuple(gather.wait.meta["val"].shape) == (12 * (world_size - 1),)
    assert copy_out.args == (gather.wait, [8, 4], world_size, copy_in, rank)
    for got, want in zip(_run_as_rank_0_of_identical_ranks(gm, *inputs), before, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    gm = _bucketed_gather_graph(True, world_size)
    assert lower_to_all_to_all(gm.graph, lambda group: True, lambda group: rank) == 1
    (gather,) = our_collectives(gm.graph)
    assert gather.issue.args[1] == [12] * world_size and _is_repeated_by_copy_in(gather.input, world_size)


def test_gloo_transport_leaves_other_groups_and_collectives_alone():
    from fsdp_compile.passes.transport import lower_to_all_to_all

    gm = _gather_and_reduce_graph("avg")
    code = gm.code
    assert lower_to_all_to_all(gm.graph, lambda group: False) == 0
    gm.recompile()
    assert gm.code == code
    # Untagged collectives (a user's, tensor parallelism's) are not ours to lower.
    for node in gm.graph.nodes:
        node.meta.pop("custom", None)
    assert lower_to_all_to_all(gm.graph, lambda group: True) == 0
    # A reduction the sum cannot stand in for stays gloo's; the all-gather is lowered.
    gm = _gather_and_reduce_graph("max")
    assert lower_to_all_to_all(gm.graph, lambda group: True) == 1
    assert [c.kind for c in our_collectives(gm.graph)] == ["all_gather", "reduce_scatter"]
    assert our_collectives(gm.graph)[1].issue.target is c10d_functional.reduce_scatter_tensor.default


def test_report_names_what_a_low_precision_gather_sends():
    """collectives.md's dtype of a low-precision parameter's all-gather: the uint8 buffer
    and the dtypes of the pre hook's inputs it is made of."""
    from fsdp_compile.passes.report import _payload_dtype

    graph = torch.fx.Graph()
    parts = []
    for dtype, n in [(torch.int8, 8), (torch.float32, 2), (torch.uint8, 16)]:
        inp = graph.placeholder(f"in_{dtype}".replace(".", "_"))
        inp.meta["val"] = torch.empty(n, dtype=dtype)
        flat = graph.call_function(torch.ops.aten.view.dtype, (inp, torch.uint8))
        flat.meta["val"] = inp.meta["val"].view(torch.uint8)
        parts.append(flat)
    sent = graph.call_function(torch.ops.aten.cat.default, (parts,))
    sent.meta["val"] = torch.cat([p.meta["val"] for p in parts])
    assert _payload_dtype(sent) == "uint8 (int8+float32+uint8)"
    assert _payload_dtype(parts[1]) == "uint8 (float32)"
    assert _payload_dtype(parts[0].args[0]) == "int8"


def test_what_is_computed_from_a_resharded_gather_alone_is_recomputed_too():
    """A low-precision weight's dequantization (from the gathered bytes and a small lookup
    table) is recomputed with its gather, not saved as a full-size copy; what also reads an
    activation (the matmul with ``x``), random and in-place ops are not, nor anything after
    a plain parameter's gather (float32 sent)."""
    g = fx.Graph()
    shard, x, lut = g.placeholder("shard"), g.placeholder("x"), g.placeholder("lut")
    shard.meta["val"], x.meta["val"] = torch.empty(32, dtype=torch.uint8), torch.empty(8, 16)
    lut.meta["val"] = torch.empty(16)
    ag = g.call_function(c10d_functional.all_gather_into_tensor.default, (shard, 2, "0"))
    wait = g.call_function(c10d_functional.wait_tensor.default, (ag,))
    codes = g.call_function(aten.bitwise_and.Scalar, (wait, 15))
    dequant = g.call_function(aten.index.Tensor, (lut, [codes]))
    weight = g.call_function(aten.view.default, (dequant, [8, 8]))
    noisy = g.call_function(aten.rand_like.default, (weight,))
    bumped = g.call_function(aten.add_.Tensor, (weight, 1.0))
    mm = g.call_function(aten.mm.default, (x, weight))
    g.output((mm, noisy, bumped))
    for node in (ag, wait):
        set_tag(node, CollectiveTag(Role.UNSHARD, "w", "layers.0", True))
    gm = fx.GraphModule(torch.nn.Module(), g)
    tag_reshard_after_forward(gm)
    must = CheckpointPolicy.MUST_RECOMPUTE
    tags = _recompute_tags(dict(ag=ag, codes=codes, dequant=dequant, weight=weight, noisy=noisy, bumped=bumped, mm=mm))
    assert tags == {"ag": must, "codes": must, "dequant": must, "weight": must, "noisy": None, "bumped": None, "mm": None}
    shard.meta["val"] = torch.empty(32)
    for node in gm.graph.nodes:
        node.meta.pop("recompute", None)
    tag_reshard_after_forward(gm)
    assert [n for n in gm.graph.nodes if "recompute" in n.meta] == [ag, wait]


# ---------------------------------------------------------------- backward tags (torch < 2.13)


def _backward_graph_with_forward_tags_only() -> tuple[fx.Graph, dict[str, fx.Node]]:
    """A backward graph as torch 2.11 leaves it: parameter ``w`` re-gathered (depends on
    its shard only), its gradient cast, reduce-scattered and all-reduced over a replicate
    group (HSDP), parameter ``b`` replicated (its gradient all-reduced only), parameter ``c``
    accumulated without sync (its gradient reduced nowhere); every node of those carries
    its gather's tag (role ``UNSHARD``), none a gradient tag."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_compile.passes.graph_utils import emit
    from fsdp_compile.runtime.vocabulary import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, WAIT, aten

    graph, mode, nodes = fx.Graph(), FakeTensorMode(), {}
    w_tag, b_tag, c_tag = (CollectiveTag(Role.UNSHARD, f"layers.0.{n}", "layers.0", True) for n in ("w", "b", "c"))

    def placeholder(name, shape):
        node = nodes[name] = graph.placeholder(name)
        with mode:
            node.meta["val"] = torch.empty(shape)
        return node

    w_shard, b, grad_out = placeholder("primals_1", (2, 4)), placeholder("primals_2", (4,)), placeholder("tangents_1", (3, 4))
    nodes["regather"] = emit(graph, ALL_GATHER, (w_shard, 2, "shard"), tag=w_tag)
    nodes["regather_wait"] = emit(graph, WAIT, (nodes["regather"],), tag=w_tag)
    grad_w = emit(graph, aten.mm.default, (emit(graph, aten.t.default, (grad_out,)), grad_out))
    nodes["cast"] = emit(graph, aten.mul.Tensor, (grad_w, 0.5), tag=w_tag)
    nodes["reduce_scatter"] = emit(graph, REDUCE_SCATTER, (nodes["cast"], "avg", 2, "shard"), tag=w_tag)
    nodes["reduce_scatter_wait"] = emit(graph, WAIT, (nodes["reduce_scatter"],), tag=w_tag)
    nodes["w_all_reduce"] = emit(graph, ALL_REDUCE, (nodes["reduce_scatter_wait"], "avg", "replicate"), tag=w_tag)
    nodes["w_all_reduce_wait"] = emit(graph, WAIT, (nodes["w_all_reduce"],), tag=w_tag)
    grad_b = emit(graph, aten.sum.dim_IntList, (grad_out, [0]))
    nodes["b_all_reduce"] = emit(graph, ALL_REDUCE, (grad_b, "avg", "replicate"), tag=b_tag)
    nodes["b_all_reduce_wait"] = emit(graph, WAIT, (nodes["b_all_reduce"],), tag=b_tag)
    nodes["c_accumulated"] = emit(graph, aten.mul.Tensor, (grad_out, 2.0), tag=c_tag)  # no sync: nothing reduced
    graph.output((nodes["regather_wait"], nodes["w_all_reduce_wait"], nodes["b_all_reduce_wait"], nodes["c_accumulated"], b))
    return graph, nodes


def test_restore_backward_tags_gives_gradient_reductions_their_roles():
    """The reduction nodes get the gradient role they were traced under (all-reduces:
    REPLICATE_GRAD after a reduce-scatter, REDUCE_GRAD instead of one); the re-gather,
    which depends on no tangent, and a gradient reduced nowhere keep their gather tag; nodes, edges and order stay;
    a graph that already has gradient tags is left alone."""
    from fsdp_compile.passes.backward_tags import restore_backward_tags
    from fsdp_compile.runtime.vocabulary import tag_of

    graph, nodes = _backward_graph_with_forward_tags_only()
    order = [n.name for n in graph.nodes]
    assert restore_backward_tags(graph) == 7
    roles = {name: tag_of(node).role for name, node in nodes.items() if tag_of(node) is not None}
    assert roles == {
        "regather": Role.UNSHARD, "regather_wait": Role.UNSHARD,
        "cast": Role.REDUCE_GRAD, "reduce_scatter": Role.REDUCE_GRAD, "reduce_scatter_wait": Role.REDUCE_GRAD,
        "w_all_reduce": Role.REPLICATE_GRAD, "w_all_reduce_wait": Role.REPLICATE_GRAD,
        "b_all_reduce": Role.REDUCE_GRAD, "b_all_reduce_wait": Role.REDUCE_GRAD,
        "c_accumulated": Role.UNSHARD,  # as torch 2.13 leaves it
    }
    assert tag_of(nodes["reduce_scatter"]).param_fqn == "layers.0.w"
    assert [n.name for n in graph.nodes] == order
    assert restore_backward_tags(graph) == 0  # gradient tags present: nothing to restore


def _graph_reading_a_parameter_three_times() -> fx.GraphModule:
    """A backward-like graph: ``w``'s gradient reduce-scattered three times (three reads of
    ``w`` in one step), the results added as autograd adds them; ``v`` (same shape, another
    parameter) reduced once and added to ``w``'s sum, which must not be merged."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_compile.passes.graph_utils import emit

    g, mode = fx.Graph(), FakeTensorMode()
    grads = [g.placeholder(f"g{i}") for i in range(4)]
    for node in grads:
        with mode:
            node.meta["val"] = torch.empty(4, 3)

    def reduced(grad, param):
        tag = CollectiveTag(Role.REDUCE_GRAD, param, "layers.0", True)
        rs = emit(g, c10d_functional.reduce_scatter_tensor.default, (grad, "avg", 2, "0"), tag=tag)
        return emit(g, c10d_functional.wait_tensor.default, (rs,), tag=tag)

    w = [reduced(grads[i], "w") for i in range(3)]
    w_sum = emit(g, aten.add.Tensor, (emit(g, aten.add.Tensor, (w[0], w[1])), w[2]))
    v = reduced(grads[3], "v")
    g.output((w_sum, emit(g, aten.add.Tensor, (w_sum, v))))
    return fx.GraphModule(torch.nn.Module(), g)


def test_a_parameter_read_three_times_is_reduce_scattered_once():
    from fsdp_compile.passes.repeated_reads import sum_gradients_before_reducing

    gm = _graph_reading_a_parameter_three_times()
    inputs = [torch.randn(4, 3) for _ in range(4)]
    before = _run_as_rank_0_of_identical_ranks(gm, *inputs)
    assert sum_gradients_before_reducing(gm.graph) == 2
    gm.graph.lint()
    gm.recompile()
    assert [(c.tag.param_fqn, c.kind) for c in our_collectives(gm.graph)] == [("w", "reduce_scatter"), ("v", "reduce_scatter")]
    for b, a in zip(before, _run_as_rank_0_of_identical_ranks(gm, *inputs), strict=True):
        torch.testing.assert_close(a, b)
    assert sum_gradients_before_reducing(gm.graph) == 0  # nothing left to merge
