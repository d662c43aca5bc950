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


def train_with_optimizer_in_backward(variant: str, in_backward: bool = True, steps: int = 3) -> dict:
    """FSDP2's optimizer-in-backward pattern: an ``AdamW`` per parameter, stepped and
    zeroed by a post-accumulate-grad hook registered outside the forward (or, without
    ``in_backward``, one ``AdamW`` stepped after the backward). ``variant``: ``"<kind>"`` or
    ``"<kind>:<backend>"``. Returns losses and full parameters per step, whether every
    gradient was None after each step, the graph count, and (eager) the order in which the
    first optimizer step and the first layer's backward ran."""
    from fsdp_compile.testing import full_parameters
    from fsdp_compile.testing._torch_internals import reset_dynamo

    reset_dynamo()
    kind, _, backend = variant.partition(":")
    model, units = build("llama")
    for unit in units:
        fully_shard_of(kind)(unit)
    run, counter = compile_counting_graphs(model, backend or None)
    events: list[str] = []
    if not backend:  # (a module backward hook is a graph break of its own under torch.compile)
        model.layers[0].register_full_backward_hook(lambda *_: events.append("layers.0 backward"))
    if in_backward:
        optimizers = {p: torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}

        def step_and_zero(param: torch.Tensor) -> None:
            events.append("optimizer step")
            optimizers[param].step()
            optimizers[param].zero_grad()

        for param in model.parameters():
            param.register_post_accumulate_grad_hook(step_and_zero)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {"loss": [], "params": [], "grads_none": []}
    for step in range(steps):
        x, y = batch("llama", step)
        loss = loss_fn("llama", run(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        if not in_backward:
            opt.step()
            opt.zero_grad()
        out["loss"].append(loss.item())
        out["params"].append(full_parameters(model))
        out["grads_none"].append(all(p.grad is None for p in model.parameters()))
    out["graphs"] = counter.frame_count if counter else None
    out["first_events"] = list(dict.fromkeys(events))[:2]
    return out


def test_optimizer_in_backward_trains_as_fsdp2_and_steps_inside_the_backward(pool2):
    """FSDP2's optimizer-in-backward pattern on our units: eager bitwise FSDP2's and bitwise
    the same model stepped after its backward; eagerly the last layer's parameters step
    while the backward still runs (before the first layer's backward), as with FSDP2;
    aot_eager bitwise eager in one graph."""
    fsdp2 = pool2.run(train_with_optimizer_in_backward, "fsdp2")[0]
    ours = pool2.run(train_with_optimizer_in_backward, "ours")[0]
    after = pool2.run(train_with_optimizer_in_backward, "ours", False)[0]
    ours_aot = pool2.run(train_with_optimizer_in_backward, "ours:aot_eager")[0]
    assert ours["loss"] == fsdp2["loss"] == after["loss"] == ours_aot["loss"]
    assert _max_gap(ours, fsdp2) == _max_gap(ours, after) == _max_gap(ours_aot, ours) == 0.0
    assert all(ours["grads_none"]) and all(ours_aot["grads_none"]) and all(fsdp2["grads_none"])
    assert ours["first_events"] == fsdp2["first_events"] == ["optimizer step", "layers.0 backward"]
    assert ours_aot["graphs"] == 1
