"""Eager activation checkpointing of sharded blocks, in each way the stacks apply it.

torchtitan wraps each block in ``checkpoint_wrapper`` (selective: saving matmul outputs)
and shards the wrapper; composable
``checkpoint(block)`` shards the block itself; a model may checkpoint a sub-module inside
its sharded block (``torch.utils.checkpoint`` around an inner call); each reentrant or not.
The backward re-runs the block's forward, so it must read the block's parameters
gathered again, and (reentrant) send their gradients back through that re-run.

Each case trains 3 Adam steps on 2 gloo ranks, ours beside torch's FSDP2 on the same
layout (``reshard_after_forward`` True and False; with and without gradient accumulation),
and compares losses and gradients every step, and the collectives each backward issues,
in order (read off a dispatch mode, as ``CommDebugMode`` reads them). (Ours re-gathered
each parameter of a ``checkpoint_wrapper``'d block alone, unseen by dispatch modes and
never prefetched, and, reentrant, sent no gradient back to any of them: the blocks never
trained, silently.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.models import fully_shard_of, padded_gather_numel
from tests.test_fsdp2_compose_more import Stack3
from tests.test_fsdp2_contract_more import AG, CollectiveLog

STEPS = 3
STYLES = ["composable", "wrapper", "wrapper-reentrant", "wrapper-selective", "inner", "inner-reentrant"]


class Block(nn.Module):
    """A residual MLP block; ``inner``: checkpoints its MLP inside its own forward."""

    def __init__(self, dim: int, hidden: int, inner: str | None = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner is None:
            return x + self.mlp(self.norm(x))
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.mlp, self.norm(x), use_reentrant=self.inner == "reentrant")
        return x + h


class Stack(Stack3):
    """Upstream's 3-block stack (an in-projection, blocks of distinct widths, a head) with
    the blocks above."""

    def __init__(self, inner: str | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(8, h, inner) for h in (4, 8, 12))


def _save_matmuls():
    """Selective checkpointing as torchtitan's: matmul outputs saved, the rest recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, func, *args, **kwargs):
        saved = func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpointed(style: str) -> nn.Module:
    from torch.distributed._composable import checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    inner = {"inner": "non-reentrant", "inner-reentrant": "reentrant"}.get(style)
    torch.manual_seed(0)
    model = Stack(inner)
    if style.startswith("wrapper"):
        impl = CheckpointImpl.REENTRANT if style == "wrapper-reentrant" else CheckpointImpl.NO_REENTRANT
        options = {"context_fn": _save_matmuls} if style == "wrapper-selective" else {}
        model.layers = nn.ModuleList(checkpoint_wrapper(layer, checkpoint_impl=impl, **options) for layer in model.layers)
    elif style == "composable":
        for layer in model.layers:
            checkpoint(layer)
    return model


def train_checkpointed(kind: str, style: str, reshard: bool, accumulate: bool, policy: str | None = None) -> dict:
    """3 Adam steps (2 micro-batches each with ``accumulate``, gradient sync on the last
    only): losses, full gradients per step, the collectives of each backward. ``policy``:
    ``"bf16"``: parameters gathered and computed in bf16, gradients reduced in fp32;
    ``"nested"``: each block's MLP sharded as a unit of its own first."""
    from tests.test_fsdp2_training_more import _mp_policy

    fully_shard = fully_shard_of(kind)
    options = {"reshard_after_forward": reshard}
    if policy == "bf16":
        options["mp_policy"] = _mp_policy(kind)(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _checkpointed(style)
    for layer in model.layers:
        if policy == "nested":  # each block's MLP a unit of its own inside the block's
            fully_shard(layer.get_submodule("_checkpoint_wrapped_module.mlp" if style.startswith("wrapper") else "mlp"), **options)
        fully_shard(layer, **options)
    fully_shard(model, **options)
    sizes = {}
    for name, unit in [("root", model), *[(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]]:
        own = [p for n, p in unit.named_parameters() if unit is not model or not n.startswith("layers.")]
        sizes[padded_gather_numel(own)] = name
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses, grads, backwards = [], [], []
    for _ in range(STEPS):
        micro = 2 if accumulate else 1
        for i in range(micro):
            model.set_requires_gradient_sync(i == micro - 1)
            x = torch.randn(4, 8, generator=g)
            loss = F.mse_loss(model(x), torch.zeros(4, 3))
            log = CollectiveLog()
            with log:
                loss.backward()
            backwards.append([f"{'AG' if op == AG else 'RS'} {sizes.get(n, n)}" for op, _, n in log.events])
            losses.append(loss.detach())
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"losses": torch.stack(losses), "grads": grads, "backwards": backwards}


def both(style: str, reshard: bool, accumulate: bool, policy: str | None) -> dict:
    return {kind: train_checkpointed(kind, style, reshard, accumulate, policy) for kind in ("fsdp2", "ours")}


CASES = [(style, reshard, False, None) for style in STYLES for reshard in (True, False)]
CASES += [(style, True, True, None) for style in ("wrapper-reentrant", "inner")]
CASES += [("wrapper-reentrant", True, False, "bf16"), ("wrapper", False, False, "bf16")]
# Each block's MLP a unit of its own inside the block's (MoE experts on their own mesh are so).
CASES += [("wrapper", True, False, "nested"), ("wrapper-reentrant", True, False, "nested"), ("composable", False, False, "nested")]


def _case_id(style: str, reshard: bool, accumulate: bool, policy: str | None) -> str:
    return "-".join([style, "reshard" if reshard else "no-reshard", *(["accumulate"] if accumulate else []), *filter(None, [policy])])


def assert_trains_as_fsdp2(ours: dict, fsdp2: dict) -> None:
    """The same losses, and the same gradients every step, as FSDP2's run."""
    torch.testing.assert_close(ours["losses"], fsdp2["losses"])
    for step, (og, fg) in enumerate(zip(ours["grads"], fsdp2["grads"], strict=True)):
        assert og.keys() == fg.keys()
        for name in og:
            torch.testing.assert_close(og[name], fg[name], msg=lambda m, s=step, n=name: f"step {s} {n}: {m}")


@pytest.mark.parametrize(("style", "reshard", "accumulate", "policy"), [pytest.param(*c, id=_case_id(*c)) for c in CASES])
def test_checkpointed_blocks_train_and_communicate_as_fsdp2(pool2, style, reshard, accumulate, policy):
    for r in pool2.run(both, style, reshard, accumulate, policy):
        o, f = r["ours"], r["fsdp2"]
        assert_trains_as_fsdp2(o, f)
        if style != "inner-reentrant":
            assert o["backwards"] == f["backwards"]
            continue
        # Reentrant checkpointing inside a block: the region's gradients reach the shards
        # through its re-run, the rest of the block's through the forward's gather, so ours
        # reduce-scatters each block twice where FSDP2 reduces once; gathers as FSDP2's.
        ags = [[e for e in b if e.startswith("AG")] for b in o["backwards"]]
        assert ags == [[e for e in b if e.startswith("AG")] for b in f["backwards"]]
        blocks = len(_checkpointed(style).layers)
        assert [sum(e.startswith("RS") for e in b) for b in o["backwards"]] == [
            sum(e.startswith("RS") for e in b) + blocks for b in f["backwards"]
        ]


def forwards_around_an_edit() -> dict:
    """A model whose units do not reshard after forward: two forwards, ``reshard()`` of
    every unit and a third, an in-place edit of every parameter and a fourth, then
    ``load_state_dict(assign=True)`` of the reference's weights and a fifth; the
    all-gathers of each forward, and the outputs beside the unsharded reference's."""
    from fsdp_compile import FSDPModule, fully_shard
    from fsdp_compile.testing import full_parameters

    model = _checkpointed("composable")
    ref = _checkpointed("composable")
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    gathers, gaps = [], []

    def forward() -> None:
        log = CollectiveLog()
        with log:
            out = model(x)
        gathers.append(sum(op == AG for op, _, _ in log.events))
        gaps.append((out - ref(x)).abs().max().item())

    forward()
    forward()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    forward()
    with torch.no_grad():
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            p.mul_(2.0)
            r.mul_(2.0)
    forward()
    with torch.no_grad():
        for r in ref.parameters():
            r.add_(0.5)
    sharded = {k: v.redistribute(v.device_mesh, v.placements) for k, v in model.state_dict().items()}
    for k, v in ref.state_dict().items():
        sharded[k] = torch.distributed.tensor.distribute_tensor(v, sharded[k].device_mesh, sharded[k].placements)
    model.load_state_dict(sharded, assign=True)
    forward()
    assert all(torch.equal(a, b) for a, b in zip(full_parameters(model).values(), ref.state_dict().values(), strict=True))
    return {"gathers": gathers, "gaps": gaps}


def test_a_unit_kept_after_forward_is_gathered_again_only_when_its_shards_change(pool2):
    """FSDP2's ``reshard_after_forward=False``: a second forward before any backward reads
    what the first gathered; one after ``reshard()`` gathers again, and one after an
    in-place edit or an ``assign=True`` load gathers anew and computes with the new
    weights (the reference's, exactly)."""
    for r in pool2.run(forwards_around_an_edit):
        assert r["gathers"] == [4, 0, 4, 4, 4], r["gathers"]
        assert r["gaps"] == [0.0] * 5, r["gaps"]
