"""A DeepSeek-V3 / Qwen3-MoE-style decoder trained with torchtitan's expert-parallel layout.

Each block is RMSNorm + causal attention + RMSNorm + a mixture of experts: a router picks the
top 2 of 4 routed experts per token from softmax scores (the selected scores weight the
experts' outputs), a dense shared expert (DeepSeek-V3's) runs on every token, and the routed
experts are grouped 3-D weights (``w1, w3: [E, dim, hidden]``, ``w2: [E, hidden, dim]``), each a
``Shard(0)`` ``DTensor`` on the ``ep`` mesh (torchtitan's ``ExpertParallel``: an ep rank holds
E / ep experts, the forward computes on the local tensor). Tokens go to their experts' ranks by
an all-to-all over the ``ep`` group and come back by another, with static shapes: every
(source rank, expert) pair has a fixed-capacity slot in a dense send buffer, so the whole step
compiles into one graph.

The layout is torchtitan's on 4 gloo ranks: the experts of each block under ``fully_shard`` over
``efsdp`` of a (efsdp=2, ep=2) mesh, with the gradient divide factor of the whole data-parallel
world (4; torchtitan's ``fsdp_gradient_divide_factor``: an expert's gradient is summed over its
ep group by the all-to-all's backward, then over ``efsdp`` by FSDP), every block and the root
under ``fully_shard`` over the default 4-rank mesh. Ours (``fsdp_compile.fully_shard``) against
torch's FSDP2 on that layout, eager and compiled, against an unsharded single-process model, and
DCP checkpoints interchanged between the two.

Simplified relative to DeepSeek-V3 / Qwen3-MoE: tiny sizes (dim 16, 2 blocks, 4 experts, top 2);
no load-balancing loss or bias, no node-limited routing, no top-k renormalization; a fixed
capacity per (source rank, expert) slot equal to the rank's token count, so no token is ever
dropped (the arithmetic stays deterministic); plain scaled-dot-product attention without RoPE
(no MLA, no grouped-query attention). Shimmed for gloo: the experts' units also reduce with
``set_force_sum_reduction_for_comms(True)`` (a sum, divided before and after), since FSDP2 with
a divide factor reduces float32 with ``ReduceOp.PREMUL_SUM``, which gloo refuses ("Cannot use
ReduceOp.PREMUL_SUM with Gloo"; NCCL runs it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.models import max_gap

STEPS = 3
DIM, HEADS, VOCAB, SEQ, BATCH = 16, 2, 32, 8, 2  # BATCH: sequences per rank
EXPERTS, TOP_K, EXPERT_HIDDEN, SHARED_HIDDEN = 4, 2, 16, 32
WORLD, EFSDP, EP = 4, 2, 2


@pytest.fixture(scope="module")
def pool4(rank_pools):
    return rank_pools(4)


# ---------------------------------------------------------------------- the model


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, HEADS, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, DIM))


class FeedForward(nn.Module):
    """A SwiGLU MLP: the shared expert."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, hidden, bias=False)
        self.w3 = nn.Linear(DIM, hidden, bias=False)
        self.w2 = nn.Linear(hidden, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _local(weight: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return weight.to_local() if isinstance(weight, DTensor) else weight


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU weights, grouped: ``Shard(0)`` DTensors on ``ep_mesh`` (each
    ep rank holds ``EXPERTS / ep`` experts), or whole plain tensors for ``ep_mesh=None`` (the
    unsharded reference: one rank holds every expert, no all-to-all)."""

    def __init__(self, ep_mesh) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        self.ep_group = ep_mesh.get_group() if ep_mesh is not None else None
        self.ep_size = ep_mesh.size() if ep_mesh is not None else 1

        def weight(*shape):
            whole = torch.randn(*shape) * shape[1] ** -0.5
            return nn.Parameter(whole if ep_mesh is None else distribute_tensor(whole, ep_mesh, [Shard(0)]))

        self.w1 = weight(EXPERTS, DIM, EXPERT_HIDDEN)
        self.w3 = weight(EXPERTS, DIM, EXPERT_HIDDEN)
        self.w2 = weight(EXPERTS, EXPERT_HIDDEN, DIM)

    def _exchange(self, rows: torch.Tensor) -> torch.Tensor:
        """Row block ``r`` of ``rows`` to ep rank ``r``; block ``r`` of the result came from ep rank ``r``."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        if self.ep_group is None:
            return rows
        return all_to_all_single_autograd(rows, None, None, self.ep_group)

    def forward(self, tokens, expert_index, expert_weight):
        """``tokens``: ``[T, dim]``; ``expert_index``, ``expert_weight``: ``[T, TOP_K]`` (the router's
        choices and their scores). Returns ``[T, dim]``: each token's experts' outputs, weighted."""
        n_tokens, top_k = expert_index.shape
        capacity = n_tokens  # a token picks an expert at most once: nothing is ever dropped
        per_rank = EXPERTS // self.ep_size
        # Each (token, choice) gets a position within its expert's slot, in token order.
        chosen = expert_index.flatten()  # [T * TOP_K], token-major
        one_hot = F.one_hot(chosen, EXPERTS)
        position = ((one_hot.cumsum(0) - 1) * one_hot).sum(1)
        kept = position < capacity
        dropped_row = EXPERTS * capacity  # one row past the buffer: where dropped choices go
        row = torch.where(kept, chosen * capacity + position, dropped_row)
        # The send buffer [ep, experts per rank, capacity, dim] (expert e = r * per_rank + l), flat.
        copies = tokens[:, None].expand(n_tokens, top_k, DIM).reshape(n_tokens * top_k, DIM)
        send = tokens.new_zeros(EXPERTS * capacity + 1, DIM).index_copy(0, row, copies)[:-1]
        received = self._exchange(send)  # [ep (source), per_rank, capacity, dim], flat
        batched = received.view(self.ep_size, per_rank, capacity, DIM).transpose(0, 1).reshape(per_rank, -1, DIM)
        w1, w3, w2 = _local(self.w1), _local(self.w3), _local(self.w2)
        out = torch.bmm(F.silu(torch.bmm(batched, w1)) * torch.bmm(batched, w3), w2)
        out = out.view(per_rank, self.ep_size, capacity, DIM).transpose(0, 1).reshape(-1, DIM)
        returned = torch.cat([self._exchange(out), out.new_zeros(1, DIM)])  # + a zero row for dropped choices
        routed = returned.index_select(0, row).view(n_tokens, top_k, DIM)
        return (routed * expert_weight[..., None]).sum(1)


class MoE(nn.Module):
    def __init__(self, ep_mesh) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = GroupedExperts(ep_mesh)
        self.shared_expert = FeedForward(SHARED_HIDDEN)

    def forward(self, x):
        tokens = x.flatten(0, 1)
        scores = F.softmax(self.router(tokens), dim=-1)
        expert_weight, expert_index = scores.topk(TOP_K, dim=-1)
        out = self.experts(tokens, expert_index, expert_weight) + self.shared_expert(tokens)
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self, ep_mesh) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.moe_norm = nn.RMSNorm(DIM)
        self.moe = MoE(ep_mesh)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.moe_norm(x))


class MoEDecoder(nn.Module):
    def __init__(self, ep_mesh) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(ep_mesh) for _ in range(2))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# ---------------------------------------------------------------------- one run on every rank


def _rank_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(BATCH, SEQ)`` input tokens at ``step`` and their next-token labels."""
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 * rank + step))
    return tokens[:, :-1], tokens[:, 1:]


_MESHES: dict = {}


def _experts_mesh():
    """The (efsdp, ep) mesh, once per rank process (both kinds of run share it)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not _MESHES:
        _MESHES["experts"] = init_device_mesh("cpu", (EFSDP, EP), mesh_dim_names=("efsdp", "ep"))
    return _MESHES["experts"]


def build(kind: str, layout: str = "units") -> MoEDecoder:
    """The model under seed 0: ``"reference"`` unsharded with every expert local; ``"ours"`` or
    ``"fsdp2"``: experts on ``ep``, sharded as torchtitan shards them with that kind's ``fully_shard``.
    ``layout``: ``"units"``, the experts a unit of their own over ``efsdp`` inside each block's
    (torchtitan until its EP > 1 path moved to per-parameter meshes); ``"placement"``, each block
    one unit whose ``shard_placement_fn`` gives the experts' weights a ``ShardPlacementResult``
    over ``efsdp`` and the rest ``Shard(0)`` over the 4-rank mesh (torchtitan 0.3's
    ``apply_fsdp`` with EP > 1); the block then reduces with the divide factor and sums."""
    from tests.models import fully_shard_of

    torch.manual_seed(0)
    if kind == "reference":
        return MoEDecoder(None)
    experts_mesh = _experts_mesh()
    model = MoEDecoder(experts_mesh["ep"])
    shard = fully_shard_of(kind)
    for block in model.layers:
        if layout == "placement":
            from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
            from torch.distributed.tensor import Shard

            experts = set(block.moe.experts.parameters())
            efsdp = FSDPMeshInfo(experts_mesh["efsdp"], shard_mesh_dim=0)
            dense = FSDPMeshInfo(_world_mesh(), shard_mesh_dim=0)

            def placement(param, experts=experts, efsdp=efsdp, dense=dense):
                return ShardPlacementResult(placement=Shard(0), mesh_info=efsdp if param in experts else dense)

            shard(block, mesh=_world_mesh(), shard_placement_fn=placement)
            block.set_gradient_divide_factor(float(WORLD))
            block.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
            continue
        shard(block.moe.experts, mesh=experts_mesh["efsdp"])
        block.moe.experts.set_gradient_divide_factor(float(WORLD))
        block.moe.experts.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        shard(block)
    shard(model, mesh=_world_mesh())
    return model


def _world_mesh():
    """The 4-rank data-parallel mesh, once per rank process."""
    from torch.distributed.device_mesh import init_device_mesh

    if "world" not in _MESHES:
        _MESHES["world"] = init_device_mesh("cpu", (WORLD,))
    return _MESHES["world"]


def _train(model: MoEDecoder, kind: str, backend: str | None) -> dict:
    """``STEPS`` SGD steps; each rank its own tokens (the reference: all ranks' tokens, in rank
    order). Per-step losses (the mean over ranks of each rank's mean loss), full parameters after
    each step, and the graph count (compiled with ``fullgraph=True``)."""
    import torch.distributed as dist

    from fsdp_compile.testing import full_parameters, global_mean
    from tests.models import compile_counting_graphs

    run, counter = compile_counting_graphs(model, backend, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses, params = [], []
    for step in range(STEPS):
        if kind == "reference":
            tokens, labels = (torch.cat(parts) for parts in zip(*(_rank_batch(r, step) for r in range(WORLD)), strict=True))
        else:
            tokens, labels = _rank_batch(dist.get_rank(), step)
        loss = F.cross_entropy(run(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item() if kind == "reference" else global_mean(loss))
        params.append(full_parameters(model))
    return {"losses": losses, "params": params, "graphs": counter.frame_count if counter else None}


def train(variant: str) -> dict | None:
    """``variant``: ``"reference"`` (rank 0 only; None elsewhere), ``"fsdp2"``, ``"ours"`` or
    ``"ours:<backend>"`` (compiled), ``"ours:<backend>:gloo"``: compiled with gloo's own
    all-gathers and reduce-scatters instead of our all-to-all transport (and without
    prefetch: one gloo all-gather in flight at a time, README, Limitations); a fourth
    field names :func:`build`'s layout. Adds the parameters' DTensor placements."""
    import contextlib

    import torch.distributed as dist

    from fsdp_compile.base import config
    from fsdp_compile.testing._torch_internals import reset_dynamo

    reset_dynamo()
    kind, backend, transport, layout = (variant.split(":") + ["", "", ""])[:4]
    if kind == "reference" and dist.get_rank() != 0:
        return None
    with config.patch(gloo_all_to_all=False, prefetch_depth=0) if transport == "gloo" else contextlib.nullcontext():
        model = build(kind, layout or "units")
        result = _train(model, kind, backend or None)
    placements = {n: tuple(map(repr, p.placements)) for n, p in model.named_parameters() if hasattr(p, "placements")}
    return {**result, "placements": placements}


def checkpoint_interchange(path: str, writer: str, reader: str) -> dict:
    """``writer`` trains ``STEPS`` eager steps and saves ``model.state_dict()`` with DCP; a fresh
    ``reader`` model loads it. Full parameters of the trained model, of the fresh one before
    loading, and after."""
    import torch.distributed.checkpoint as dcp

    from fsdp_compile.testing import full_parameters
    from fsdp_compile.testing._torch_internals import reset_dynamo

    reset_dynamo()
    trained = build(writer)
    _train(trained, writer, None)
    dcp.save({"model": trained.state_dict()}, checkpoint_id=path)
    fresh = build(reader)
    before = full_parameters(fresh)
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["model"])
    return {"saved": full_parameters(trained), "before": before, "loaded": full_parameters(fresh)}


# ---------------------------------------------------------------------- tests

_RUNS: dict = {}


def _runs(pool, variant: str) -> list:
    """Every rank's :func:`train` result, each variant run once per test session."""
    if variant not in _RUNS:
        _RUNS[variant] = pool.run(train, variant)
    return _RUNS[variant]


def _gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_expert_parallel_moe_eager_is_bitwise_fsdp2(pool4):
    """Ours eager is bitwise torch's FSDP2 eager on torchtitan's EP layout, on every rank: the
    same losses and full parameters after each of 3 steps, and the same DTensor placements
    (the experts' on the (efsdp, ep) mesh, the rest on the 4-rank mesh)."""
    fsdp2, ours = _runs(pool4, "fsdp2"), _runs(pool4, "ours")
    assert ours[0]["placements"] == fsdp2[0]["placements"]
    assert ours[0]["placements"]["layers.0.moe.experts.w1"] == ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)")
    for rank in range(WORLD):
        gap = max_gap(ours[rank], fsdp2[rank])
        assert gap == 0.0, (rank, gap)


def test_compiled_expert_parallel_moe_is_one_graph_matching_eager_and_reference(pool4):
    """Ours compiled (``aot_eager_passes``: eager's ops through our joint and post-grad passes;
    ``fullgraph=True``: a graph break raises; the EP all-to-alls in the graph beside our
    collectives) is one graph for the 3 steps and bitwise ours eager on every rank; ours
    matches the unsharded single-process model (every expert local, no all-to-all) fed all 4
    ranks' tokens to fp32 rounding (other matmul shapes and sums).

    Compiled with gloo's own all-gathers and reduce-scatters (the collectives the graph keeps
    on NCCL), not our all-to-all transport for gloo (``config.gloo_all_to_all``, the default
    on gloo): over 4 ranks the transport sums a reduce-scatter's 4 slices in torch's order and
    gloo (an all-reduce) in its own (``passes/transport.py``), so gradients differ in their last
    bits (measured here: 1.2e-7 after 3 steps) and the bitwise check would not hold; the
    transport on 4 ranks is checked against a reference in ``tests/test_layouts.py``. Both
    compiles here would double this file's time."""
    ours = _runs(pool4, "ours")
    compiled = _runs(pool4, "ours:aot_eager_passes:gloo")
    reference = _runs(pool4, "reference")[0]
    for rank in range(WORLD):
        assert compiled[rank]["graphs"] == 1, (rank, compiled[rank]["graphs"])
        gap = max_gap(compiled[rank], ours[rank])
        assert gap == 0.0, (rank, gap)
    gap = max_gap(ours[0], reference)
    assert gap < 1e-5, gap


@pytest.mark.parametrize("writer, reader", [("ours", "fsdp2"), ("fsdp2", "ours")])
def test_expert_parallel_dcp_checkpoint_interchanges_with_fsdp2(pool4, tmp_path, writer, reader):
    """A DCP checkpoint of ``model.state_dict()`` saved after training by one (ours or FSDP2)
    loads into a freshly built model of the same layout sharded by the other: every full
    parameter then equals the trained model's bitwise (and differed before loading)."""
    results = pool4.run(checkpoint_interchange, str(tmp_path / f"{writer}-to-{reader}"), writer, reader)
    for rank, result in enumerate(results):
        assert _gap(result["before"], result["saved"]) > 0.0, rank
        gap = _gap(result["loaded"], result["saved"])
        assert gap == 0.0, (rank, gap)


def test_expert_parallel_with_per_parameter_meshes_trains_as_fsdp2_eager_and_compiled(pool4):
    """torchtitan 0.3's ``apply_fsdp`` with EP > 1: one ``fully_shard`` per block whose
    ``shard_placement_fn`` returns a ``ShardPlacementResult`` (the routed experts over
    ``efsdp``, the rest over the 4-rank mesh; refused by name before). Ours eager is bitwise
    FSDP2 on every rank, with the same placements; compiled, one graph for the 3 steps,
    bitwise ours eager; both match the unsharded model to fp32 rounding."""
    fsdp2, ours = _runs(pool4, "fsdp2:::placement"), _runs(pool4, "ours:::placement")
    compiled = _runs(pool4, "ours:aot_eager_passes:gloo:placement")
    reference = _runs(pool4, "reference")[0]
    assert ours[0]["placements"] == fsdp2[0]["placements"]
    assert ours[0]["placements"]["layers.0.moe.experts.w1"] == ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)")
    assert ours[0]["placements"]["layers.0.attention.wq.weight"] == ("Shard(dim=0)",)
    for rank in range(WORLD):
        assert max_gap(ours[rank], fsdp2[rank]) == 0.0, rank
        assert compiled[rank]["graphs"] == 1, (rank, compiled[rank]["graphs"])
        assert max_gap(compiled[rank], ours[rank]) == 0.0, rank
    assert max_gap(ours[0], reference) < 1e-5
