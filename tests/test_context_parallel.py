"""Context parallelism (CP) composed with FSDP, as torchtitan composes them, through a shim.

torch's ``torch.distributed.tensor.experimental.context_parallel`` does not run on CPU (its
ring attention has no sharding strategy for ``_scaled_dot_product_flash_attention_for_cpu``),
so the attention here is a hand-written CP attention of the "all-gather K/V" kind: each cp rank
holds a contiguous chunk of the sequence, all-gathers K and V over the cp group with a
differentiable functional collective, and attends causally from its local queries to the whole
K/V (the mask offset by its chunk's start). FSDP shards the parameters over the flattened
``dp_shard * cp`` mesh, as torchtitan does; 4 gloo ranks on a (dp_shard=2, cp=2) mesh.

What it checks: ours eager is bitwise torch's FSDP2 on the same layout; both match an unsharded
reference fed the global batch (fp32 rounding); ours compiled with ``aot_eager`` is one graph,
as the same model unsharded is, holds the CP all-gathers (and their reduce-scatters in backward)
as collectives that are not ours alongside our tagged ones, and matches ours eager. What it
does not check: torch's ``context_parallel`` itself (its ring attention, its buffer sharding
and load balancing).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.models import max_gap

STEPS = 3
DIM, HEADS, VOCAB, SEQ, BATCH = 16, 2, 32, 8, 2  # BATCH per dp_shard rank; SEQ is the whole sequence
DP, CP = 2, 2


@pytest.fixture(scope="module")
def pool4(rank_pools):
    return rank_pools(4)


# ---------------------------------------------------------------------- the model


class Attention(nn.Module):
    """Causal self-attention; with ``cp=(mesh, rank)`` the input is the ``rank``-th chunk of
    the sequence and K/V are all-gathered over ``mesh`` (the cp dim). ``cp=None``: the whole
    sequence, no collective."""

    def __init__(self, cp) -> None:
        super().__init__()
        self.cp_mesh, self.cp_rank = cp if cp is not None else (None, 0)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        from torch.distributed._functional_collectives import all_gather_single_autograd

        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM // HEADS).unbind(2)  # (b, s, heads, head_dim)
        if self.cp_mesh is not None:  # all_gather_tensor_autograd, without its deprecation warning
            k, v = (all_gather_single_autograd(t.contiguous(), 1, self.cp_mesh) for t in (k, v))
        start = s * self.cp_rank
        mask = torch.arange(start, start + s)[:, None] >= torch.arange(k.shape[1])[None, :]
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, s, DIM))


class Block(nn.Module):
    def __init__(self, cp) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention(cp)
        self.mlp_norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w3 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Decoder(nn.Module):
    def __init__(self, cp) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(cp) for _ in range(2))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: (DP * BATCH, SEQ) input tokens and their next-token labels."""
    tokens = torch.randint(VOCAB, (DP * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


_MESHES: dict = {}


def _meshes():
    """``(world_mesh, dp_shard_cp_mesh)``, once per rank process: torch's FSDP2 refuses an
    equal flattened mesh created again (see ``tests/test_spmd_mesh.py::_mesh_of``)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compile.base.compat import flatten_mesh

    if not _MESHES:
        world = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp_shard", "cp"))
        _MESHES["world"], _MESHES["dp_shard_cp"] = world, flatten_mesh(world["dp_shard", "cp"], "dp_shard_cp")
    return _MESHES["world"], _MESHES["dp_shard_cp"]


# ---------------------------------------------------------------------- one run on every rank


def _recording_aot_eager(graphs: list):
    """torch's ``aot_eager`` whose (nop) forward and backward compilers keep the graphs."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    def record(gm, example_inputs):
        graphs.append(gm)
        return boxed_nop(gm, example_inputs)

    return functools.partial(aot_eager, fw_compiler=record, bw_compiler=record)


def _collectives(graphs: list) -> list[tuple[str, str, bool]]:
    """``(kind, process group, ours)`` of every collective in the forward then backward graph."""
    from fsdp_compile.runtime.vocabulary import collective_kind, group_of, tag_of

    return [(collective_kind(n), group_of(n), tag_of(n) is not None) for g in graphs for n in g.graph.nodes if collective_kind(n)]


def train(variant: str) -> dict:
    """Losses (the global mean over every token) and full parameters after each SGD step
    (lr 0.5: updates large enough that a gradient off by 1e-4 of itself fails the tolerance).
    ``variant``: ``"reference"`` (unsharded, no CP, the global batch on every rank),
    ``"cp"`` (CP attention, no FSDP: the graph-count baseline; its gradients are not
    averaged), ``"fsdp2"`` or ``"ours"`` (``fully_shard`` per block and on the root over
    ``dp_shard_cp``), each with ``":aot_eager"`` to compile the model."""
    from fsdp_compile.testing import full_parameters, global_mean
    from tests.models import compile_counting_graphs, fully_shard_of

    kind, _, backend = variant.partition(":")
    world, dp_shard_cp = _meshes()
    dp, cp = world.get_coordinate()
    torch.manual_seed(0)
    model = Decoder(None if kind == "reference" else (world["cp"], cp))
    if kind in ("ours", "fsdp2"):
        shard = fully_shard_of(kind)
        for layer in model.layers:
            shard(layer, mesh=dp_shard_cp)
        shard(model, mesh=dp_shard_cp)
    graphs: list = []
    run, counter = compile_counting_graphs(model, backend and _recording_aot_eager(graphs), fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses, params = [], []
    for step in range(STEPS):
        tokens, labels = _batch(step)
        if kind != "reference":  # this dp_shard rank's rows, this cp rank's chunk of the sequence
            rows, cols = slice(dp * BATCH, (dp + 1) * BATCH), slice(cp * SEQ // CP, (cp + 1) * SEQ // CP)
            tokens, labels = tokens[rows, cols], labels[rows, cols]
        loss = F.cross_entropy(run(tokens).flatten(0, 1), labels.flatten())  # mean over local tokens
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item() if kind == "reference" else global_mean(loss))
        params.append(full_parameters(model))
    return {
        "losses": losses,
        "params": params,
        "graphs": counter.frame_count if counter else None,
        "collectives": _collectives(graphs[:2]),  # the step's forward and backward
        "groups": {"cp": world["cp"].get_group().group_name, "fsdp": dp_shard_cp.get_group().group_name},
    }


def _assert_close(got: dict, expected: dict) -> None:
    torch.testing.assert_close(got["losses"], expected["losses"], rtol=1e-5, atol=1e-6)
    for g, e in zip(got["params"], expected["params"], strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- tests


def test_cp_with_fsdp_over_dp_shard_cp_matches_fsdp2_and_reference(pool4):
    """Ours eager is bitwise torch's FSDP2 on the (dp_shard * cp) layout, on every rank; both
    match the unsharded reference to fp32 rounding (other matmul shapes, other sums)."""
    reference = pool4.run(train, "reference")[0]
    fsdp2 = pool4.run(train, "fsdp2")
    ours = pool4.run(train, "ours")
    for rank in range(4):
        gap = max_gap(ours[rank], fsdp2[rank])
        assert gap == 0.0, (rank, gap)
        _assert_close(ours[rank], reference)


def test_compiled_cp_with_fsdp_is_one_graph_holding_the_cp_all_gathers(pool4):
    """``aot_eager`` (``fullgraph=True``: a graph break raises): one graph, compiled once for
    the three steps, as for the same CP model unsharded (FSDP adds none). Its forward holds
    the 4 CP all-gathers (K and V of 2 blocks, over the cp group, untagged: not ours) beside
    our tagged all-gathers over dp_shard_cp, its backward their reduce-scatters beside ours;
    training matches ours eager bitwise."""
    baseline = pool4.run(train, "cp:aot_eager")[0]
    ours = pool4.run(train, "ours")[0]
    compiled = pool4.run(train, "ours:aot_eager")[0]
    assert baseline["graphs"] == 1
    assert compiled["graphs"] == baseline["graphs"]
    cp, fsdp = compiled["groups"]["cp"], compiled["groups"]["fsdp"]
    foreign = [(kind, group) for kind, group, is_ours in compiled["collectives"] if not is_ours]
    assert foreign == [("all_gather", cp)] * 4 + [("reduce_scatter", cp)] * 4, compiled["collectives"]
    assert foreign == [(k, g) for k, g, _ in baseline["collectives"]]
    ours_kinds = {(kind, group) for kind, group, is_ours in compiled["collectives"] if is_ours}
    assert ours_kinds == {("all_gather", fsdp), ("reduce_scatter", fsdp)}, compiled["collectives"]
    gap = max_gap(compiled, ours)
    assert gap == 0.0, gap
