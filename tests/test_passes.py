"""Passes on hand-built FX graphs: what they tag, and that they change nothing else."""

from __future__ import annotations

import torch
import torch.fx as fx

from fsdp_compile._compat import CheckpointPolicy, c10d_functional, get_joint_custom_pass, set_joint_custom_pass
from fsdp_compile.passes import install_passes, tag_reshard_after_forward
from fsdp_compile.passes.registration import _ChainedJointPass
from fsdp_compile.runtime import collective_annotation

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
    meta = collective_annotation("unshard", "w", "layers.0", reshard)
    for node in (ag, wait):
        if annotate:
            node.meta["custom"] = meta
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
