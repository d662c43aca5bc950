"""Several forwards before one backward, eager: one reduce-scatter per unit, as FSDP2.

A loss summed over two calls of the model (two micro-batches in one backward, a
contrastive pair), or a block called twice in one forward, gathers a unit once per
call. FSDP2's unsharded parameters accumulate every call's gradient before its one
post-backward reduce-scatter. Ours reduce-scattered once per call: the same sums, but
twice the reduction traffic and upstream's collective order broken.

Each case trains 3 Adam steps on 2 gloo ranks, ours beside torch's FSDP2 on the same
layout, and compares losses and gradients every step, and the reduce-scatters of every
backward, in order (all of the backward's collectives where the units reshard after
forward; where they do not, FSDP2 reshards each unit after the first pass through it and
gathers it again for the second, ours reads what the forwards kept and gathers nothing).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.models import fully_shard_of, padded_gather_numel
from tests.test_eager_checkpointing import Stack, assert_trains_as_fsdp2
from tests.test_fsdp2_contract_more import AG, CollectiveLog

STEPS = 3
SCENARIOS = ["two-forwards", "block-called-twice", "a-forward-left-unused", "backward-twice", "accumulate", "one-parameter-unit"]


class StackWithTwiceCalledBlock(Stack):
    """The stack, its middle block called twice in a row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        x = self.layers[0](x)
        x = self.layers[1](self.layers[1](x))
        return self.head(self.layers[2](x))


def _model(scenario: str, checkpointed: bool) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = StackWithTwiceCalledBlock() if scenario == "block-called-twice" else Stack()
    if scenario == "one-parameter-unit":  # a unit of one parameter (an embedding's), gathered alone
        model.proj = nn.Linear(8, 8, bias=False)
    if checkpointed:
        model.layers = nn.ModuleList(checkpoint_wrapper(layer) for layer in model.layers)
    return model


def train_multi_forward(kind: str, scenario: str, reshard: bool, checkpointed: bool) -> dict:
    """3 Adam steps of ``scenario``: losses, full gradients per step, the collectives of
    each backward (``AG``/``RS`` and the unit, told apart by size)."""
    fully_shard = fully_shard_of(kind)
    model = _model(scenario, checkpointed)
    units = [("root", model), *[(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]]
    if scenario == "one-parameter-unit":
        units.append(("proj", model.proj))
        fully_shard(model.proj, reshard_after_forward=reshard)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    sizes = {}
    for name, unit in units:
        others = [f"{other}." for other, _ in units if other != "root"]
        own = [p for n, p in unit.named_parameters() if unit is not model or not n.startswith(tuple(others))]
        sizes[padded_gather_numel(own)] = name
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses, grads, backwards = [], [], []

    def loss_of(n_forwards: int) -> torch.Tensor:
        return sum(F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 3)) for _ in range(n_forwards))

    def backward(loss: torch.Tensor, **kwargs) -> None:
        log = CollectiveLog()
        with log:
            loss.backward(**kwargs)
        backwards.append([f"{'AG' if op == AG else 'RS'} {sizes.get(n, n)}" for op, _, n in log.events])
        losses.append(loss.detach())

    for _ in range(STEPS):
        if scenario in ("two-forwards", "block-called-twice", "one-parameter-unit"):
            backward(loss_of(1 if scenario == "block-called-twice" else 2))
        elif scenario == "a-forward-left-unused":
            loss_of(1)  # with autograd, never run backward
            backward(loss_of(1))
        elif scenario == "backward-twice":
            loss = loss_of(2)
            backward(loss, retain_graph=True)
            backward(loss)
        else:  # two micro-batches of two forwards each, gradient sync on the last only
            for i in range(2):
                model.set_requires_gradient_sync(i == 1)
                backward(loss_of(2))
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"losses": torch.stack(losses), "grads": grads, "backwards": backwards}


def both(scenario: str, reshard: bool, checkpointed: bool) -> dict:
    return {kind: train_multi_forward(kind, scenario, reshard, checkpointed) for kind in ("fsdp2", "ours")}


CASES = [
    (scenario, reshard, checkpointed)
    for scenario in SCENARIOS
    for reshard in (True, False)
    for checkpointed in (False, True)
    if not (checkpointed and scenario in ("backward-twice", "one-parameter-unit"))  # (a checkpoint's recompute runs once)
]


def _case_id(scenario: str, reshard: bool, checkpointed: bool) -> str:
    return "-".join([scenario, "reshard" if reshard else "no-reshard", *(["checkpointed"] if checkpointed else [])])


@pytest.mark.parametrize(("scenario", "reshard", "checkpointed"), [pytest.param(*c, id=_case_id(*c)) for c in CASES])
def test_several_forwards_reduce_once_per_unit_as_fsdp2(pool2, scenario, reshard, checkpointed):
    for r in pool2.run(both, scenario, reshard, checkpointed):
        o, f = r["ours"], r["fsdp2"]
        assert_trains_as_fsdp2(o, f)
        reductions = [[e for e in b if e.startswith("RS")] for b in o["backwards"]]
        fsdp2_reductions = [[e for e in b if e.startswith("RS")] for b in f["backwards"]]
        if scenario == "one-parameter-unit":
            # (FSDP2 reduces the first unit, whose input needs no gradient, in its final
            # callback, after the root; ours when its gradient is ready.)
            reductions, fsdp2_reductions = [sorted(b) for b in reductions], [sorted(b) for b in fsdp2_reductions]
        if scenario == "accumulate":
            # FSDP2's synced backward reduce-scatters each block twice: its first pass through
            # a block reduces the gradient the micro-batch without sync accumulated, the
            # second the rest. Ours reduces their sum once, in FSDP2's order.
            fsdp2_reductions = [[e for i, e in enumerate(b) if e not in b[:i]] for b in fsdp2_reductions]
        assert reductions == fsdp2_reductions
        # One reduce-scatter per unit in every synced backward, none without sync.
        units = 5 if scenario == "one-parameter-unit" else 4
        synced = [len(b) for i, b in enumerate(reductions) if scenario != "accumulate" or i % 2 == 1]
        assert synced == [units] * len(synced), reductions
        gathers = [[e for e in b if e.startswith("AG")] for b in o["backwards"]]
        if scenario == "one-parameter-unit":
            # (Ours gathers the first unit in backward only where its gradient needs it.)
            fsdp2_gathers = [[e for e in b if e.startswith("AG")] for b in f["backwards"]]
            assert all(len(a) <= len(b) for a, b in zip(gathers, fsdp2_gathers, strict=True)), gathers
            continue
        if not reshard:  # ours gathers nothing in backward: the forwards kept the units gathered
            assert gathers == [[]] * len(gathers), gathers
            continue
        fsdp2_gathers = [[e for e in b if e.startswith("AG")] for b in f["backwards"]]
        if scenario == "backward-twice":
            # The second backward over the retained graph re-gathers the root once per forward
            # (the first forward's root slots were drained by the first backward); FSDP2's root
            # stays unsharded through each backward.
            fsdp2_gathers = [b if i % 2 == 0 else [*b[:4], "AG root", *b[4:]] for i, b in enumerate(fsdp2_gathers)]
        if scenario == "block-called-twice" and checkpointed:
            # The twice-called block's re-runs share one gather (it stays gathered through its
            # backward); FSDP2 reshards it after the second call's backward and gathers it again.
            fsdp2_gathers = [[e for i, e in enumerate(b) if not (e == "AG layers.1" and b[i - 1] == e)] for b in fsdp2_gathers]
        assert gathers == fsdp2_gathers
        if scenario in ("two-forwards", "a-forward-left-unused") or (scenario == "block-called-twice" and not checkpointed):
            assert o["backwards"] == f["backwards"]  # and in FSDP2's order


# ----------------------------------------------------------- compiled, for comparison


def compiled_block_called_twice() -> dict:
    """The stack whose middle block runs twice, eager and compiled (our passes on
    ``aot_eager``, bitwise eager's on 2 ranks): 3 Adam steps' losses and gradients, and
    the compiled backward's reduce-scatters after bucketing, as (how many, parameters
    reduced in all)."""
    from fsdp_compile import fully_shard
    from fsdp_compile.passes import registration
    from fsdp_compile.runtime.vocabulary import our_collectives

    reduce_scatters = []
    lower = registration.lower_to_all_to_all

    def counting(graph, *args, **kwargs):
        found = our_collectives(graph, "reduce_scatter")
        if found:
            reduce_scatters.append((len(found), sum(c.tag.bucket_size for c in found)))
        return lower(graph, *args, **kwargs)

    def train(backend: str | None) -> dict:
        torch._dynamo.reset()
        model = _model("block-called-twice", False)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        run = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(dist.get_rank())
        losses, grads = [], []
        for _ in range(STEPS):
            loss = F.mse_loss(run(torch.randn(4, 8, generator=g)), torch.zeros(4, 3))
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
        return {"losses": torch.stack(losses), "grads": grads, "params": len(list(model.parameters()))}

    registration.lower_to_all_to_all = counting
    try:
        compiled = train("aot_eager_passes")
    finally:
        registration.lower_to_all_to_all = lower
    return {"eager": train(None), "compiled": compiled, "reduce_scatters": reduce_scatters}


def test_a_block_called_twice_is_reduce_scattered_once_compiled(pool2):
    """Compiled, each read of the twice-called block's parameters traced its own
    reduce-scatter (bucketed together: twice the block's bytes); their gradients are now
    summed before one, as eager sums them: 4 units, 4 reduce-scatters, eager's numbers
    bit for bit."""
    for r in pool2.run(compiled_block_called_twice):
        assert r["reduce_scatters"] == [(4, r["compiled"]["params"])]  # was 4 holding 6 more
        torch.testing.assert_close(r["compiled"]["losses"], r["eager"]["losses"], rtol=0, atol=0)
        for c, e in zip(r["compiled"]["grads"], r["eager"]["grads"], strict=True):
            for name in e:
                torch.testing.assert_close(c[name], e[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
