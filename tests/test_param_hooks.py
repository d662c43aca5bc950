"""Gradient hooks a module's forward registers on its own parameters (FSDP2 hands such
code the unsharded parameter, a plain tensor; ``transformers``' TP norms all-reduce its
gradient there): they see a plain tensor, the local shard, and change the sharded
gradient in place; eager and compiled alike. Hooks registered outside any forward see
the sharded ``DTensor`` parameter. 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from tests.models import batch, build, compile_counting_graphs, fully_shard_of, loss_fn

STEPS = 2


def _register_in_forward(module: torch.nn.Module, hook) -> None:
    """Wrap ``module.forward`` so that its first call with grad enabled registers
    ``hook`` on each of its own parameters (``transformers``' ``replicated_with_grad_allreduce``
    does this: the parameters only exist once weights are loaded)."""
    original, hooked = module.forward, {}

    def forward(*args, **kwargs):
        if torch.is_grad_enabled():
            for name, param in module.named_parameters(recurse=False):
                if hooked.get(name) is not param:
                    param.register_post_accumulate_grad_hook(hook)
                    hooked[name] = param
        return original(*args, **kwargs)

    module.forward = forward


def train_with_forward_hooks(variant: str, replace_grad: bool = False) -> dict:
    """``variant``: ``"<kind>"`` or ``"<kind>:<backend>"``, kind ``ours``, ``fsdp2`` or
    ``plain`` (unsharded, each rank the global batch). Each layer's forward registers a
    hook that doubles its parameters' gradients in place (or, with ``replace_grad``,
    assigns a new one). Returns the full parameters after each step, the types the hooks
    saw, the graph count, and what a hook registered outside the forward saw."""
    from fsdp_compile.testing import full_parameters
    from fsdp_compile.testing._torch_internals import reset_dynamo

    reset_dynamo()
    kind, _, backend = variant.partition(":")
    model, _ = build("mlp")
    seen: list[str] = []

    def double_grad(param: torch.Tensor) -> None:
        seen.append(type(param).__name__)
        if replace_grad:
            param.grad = param.grad * 2
        else:
            param.grad.mul_(2.0)

    for layer in model.layers:
        if layer is not model.layers[0]:
            _register_in_forward(layer, double_grad)
    if kind != "plain":
        # Two units; the hooked layers are modules inside them (as transformers' norms are).
        fully_shard_of(kind)(model.layers[0])
        fully_shard_of(kind)(model)
    outside: list = []
    if kind == "ours":
        head = model.layers[-1].weight
        head.register_post_accumulate_grad_hook(lambda p: outside.append(p is head and type(p.grad).__name__))
    run, counter = compile_counting_graphs(model, backend or None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rank, world = (0, 1) if kind == "plain" else (torch.distributed.get_rank(), torch.distributed.get_world_size())
    params = []
    for step in range(STEPS):
        x, y = batch("mlp", step)
        loss_fn("mlp", run(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
        params.append(full_parameters(model))
    return {"params": params, "seen": sorted(set(seen)), "graphs": counter.frame_count if counter else None, "outside": outside}


def _max_gap(a: dict, b: dict) -> float:
    return max((x - y).abs().max().item() for pa, pb in zip(a["params"], b["params"], strict=True) for x, y in zip(pa.values(), pb.values(), strict=True))


def test_hooks_registered_in_forward_see_a_plain_tensor_and_match_fsdp2(pool2):
    """FSDP2's hook doubles the unsharded gradient before the reduce-scatter, ours the
    reduced shard after it: the same update (doubling is exact). aot_eager is bitwise
    eager and compiles no more graphs than the unsharded model with the same hooks."""
    fsdp2 = pool2.run(train_with_forward_hooks, "fsdp2")[0]
    ours = pool2.run(train_with_forward_hooks, "ours")[0]
    ours_aot = pool2.run(train_with_forward_hooks, "ours:aot_eager")[0]
    plain_aot = pool2.run(train_with_forward_hooks, "plain:aot_eager")[0]
    assert fsdp2["seen"] == ours["seen"] == ours_aot["seen"] == ["Parameter"]
    assert _max_gap(ours, fsdp2) < 1e-6
    assert _max_gap(ours_aot, ours) == 0.0
    assert ours_aot["graphs"] == plain_aot["graphs"]
    # Registered outside the forward: the sharded parameter itself, its DTensor gradient.
    assert ours["outside"] == ours_aot["outside"] == ["DTensor"] * STEPS


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_a_forward_hook_that_replaces_the_gradient_is_refused_by_name(pool2, backend):
    variant = "ours" if backend is None else f"ours:{backend}"
    with pytest.raises(Exception, match=r"sharded parameter 'layers\.[12]\.(weight|bias)' during its forward replaced the gradient.*in place"):
        pool2.run(train_with_forward_hooks, variant, True)
