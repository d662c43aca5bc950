"""``fsdp_compile.step_on_local_shards``: the optimizer's update on local shards gives
bitwise the update it makes on the ``DTensor``s, keeps its state as ``DTensor``s between
steps (state dicts, DCP), and refuses optimizers whose update is not elementwise."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from fsdp_compile import step_on_local_shards
from fsdp_compile.testing import global_mean
from tests.models import batch, build, compile_counting_graphs, fully_shard_of, loss_fn, shard_blocks

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adamw-foreach-amsgrad": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True, amsgrad=True),
    "sgd-nesterov": lambda params: torch.optim.SGD(params, lr=1e-1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3, momentum=0.5, centered=True),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-2),
}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.chunk(dist.get_world_size())[dist.get_rank()]


def _state_of(model, opt) -> dict:
    """Every state entry, by parameter name: local tensors of ``DTensor``s, with their kind."""
    names = {p: n for n, p in model.named_parameters()}
    out = {}
    for p, entries in opt.state.items():
        for key, value in entries.items():
            kind = "dtensor" if isinstance(value, DTensor) else type(value).__name__
            if isinstance(value, DTensor):
                assert value.placements == p.placements and value.device_mesh is p.device_mesh, (names[p], key)
                value = value._local_tensor
            out[f"{names[p]}.{key}"] = (kind, value.clone() if isinstance(value, torch.Tensor) else value)
    return out


def train_on_local_shards(optimizer: str, kind: str, backend: str | None, steps: int = 3) -> dict:
    """The Llama sharded by ``kind`` (ours or torch's FSDP2), its first attention frozen,
    trained ``steps`` steps with ``optimizer`` stepping on the ``DTensor``s and, from the
    same start, stepping on local shards; then one more step each after the local one's
    state went through ``state_dict()`` into a fresh optimizer. Per variant: losses,
    local parameter shards, optimizer state."""
    results = {}
    for variant in ("dtensor", "local"):
        model, units = build("llama")
        shard_blocks(model, fully_shard_of(kind), blocks=units[:-1])
        for p in model.layers[0].attention.parameters():
            p.requires_grad_(False)
        run, _ = compile_counting_graphs(model, backend)
        opt = OPTIMIZERS[optimizer](model.parameters())
        if variant == "local":
            assert step_on_local_shards(opt) is opt and step_on_local_shards(opt) is opt  # again: no-op
        losses = []
        for step in range(steps + 1):
            if step == steps and variant == "local":
                resumed = step_on_local_shards(OPTIMIZERS[optimizer](model.parameters()))
                resumed.load_state_dict(opt.state_dict())
                opt = resumed
            x, y = batch("llama", step)
            loss = loss_fn("llama", run(_local(x)), _local(y))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(global_mean(loss))
            assert all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
        if variant == "local":
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            dcp_state = get_optimizer_state_dict(model, opt)["state"]
            assert all(isinstance(v, DTensor) for entries in dcp_state.values() for k, v in entries.items() if k != "step")
        results[variant] = {
            "losses": losses,
            "params": {n: p._local_tensor.clone() for n, p in model.named_parameters()},
            "state": _state_of(model, opt),
        }
    return results


@pytest.mark.parametrize(
    "optimizer, kind, backend",
    [
        ("adamw", "ours", "aot_eager"),
        ("adamw-foreach-amsgrad", "ours", None),
        ("sgd-nesterov", "ours", None),
        ("rmsprop", "fsdp2", None),
        ("adagrad", "ours", None),
    ],
)
def test_the_local_step_is_bitwise_the_dtensor_step(pool2, optimizer, kind, backend):
    """Losses, parameter shards and every optimizer state entry (kind included: a
    ``DTensor`` with its parameter's placements where the ``DTensor`` step made one) are
    bitwise equal, across a state dict round trip, frozen parameters (no gradient) included."""
    for result in pool2.run(train_on_local_shards, optimizer, kind, backend):
        dtensor, local = result["dtensor"], result["local"]
        assert local["losses"] == dtensor["losses"]
        assert local["params"].keys() == dtensor["params"].keys()
        for name in dtensor["params"]:
            assert torch.equal(local["params"][name], dtensor["params"][name]), name
        assert local["state"].keys() == dtensor["state"].keys()
        for key, (kind_expected, value) in dtensor["state"].items():
            kind_got, got = local["state"][key]
            assert kind_got == kind_expected, key
            assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, key


def _dtensor_params(mesh, n: int = 3) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = []
    for i in range(n):
        p = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 3), mesh, [Shard(0)], run_check=False))
        p.grad = DTensor.from_local(torch.randn(4, 3) * (i + 1), mesh, [Shard(0)], run_check=False)
        params.append(p)
    return params


def test_an_optimizer_whose_update_is_not_elementwise_is_refused(fake_pg):
    mesh = init_device_mesh("cpu", (8,))
    params = _dtensor_params(mesh)

    class ClippedAdamW(torch.optim.AdamW):
        pass

    refused = [torch.optim.LBFGS(params), ClippedAdamW(params)]
    if hasattr(torch.optim, "Adafactor"):
        refused.append(torch.optim.Adafactor(params))
    for opt in refused:
        with pytest.raises(
            TypeError, match=rf"{type(opt).__qualname__} is not one of the optimizers whose update is elementwise"
        ):
            step_on_local_shards(opt)
        assert "step" not in vars(opt)  # unchanged
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer"):
        step_on_local_shards(params)


def test_a_step_that_raises_leaves_the_dtensors_in_place(fake_pg):
    mesh = init_device_mesh("cpu", (8,))
    params = _dtensor_params(mesh)
    opt = step_on_local_shards(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    opt.step()
    before = {k: dict(v) for k, v in opt.state.items()}

    init_group = opt._init_group

    def failing_update(group, *args):  # SGD's update, on the local tensors
        assert all(not isinstance(p, DTensor) for p in group["params"])
        init_group(group, *args)
        raise RuntimeError("update failed")

    opt._init_group = failing_update
    with pytest.raises(RuntimeError, match="update failed"):
        opt.step()
    del opt._init_group
    assert opt.param_groups[0]["params"] == params and all(p.grad is not None for p in params)
    assert list(opt.state) == params
    for p in params:
        assert opt.state[p]["momentum_buffer"] is before[p]["momentum_buffer"]
        assert isinstance(opt.state[p]["momentum_buffer"], DTensor)

    # A deep copy steps itself, not the original, on its own local tensors.
    copied = copy.deepcopy(opt)
    originals = [p._local_tensor.clone() for p in params]
    copied.step()
    for p, original, q in zip(params, originals, copied.param_groups[0]["params"], strict=True):
        assert torch.equal(p._local_tensor, original)
        assert q is not p and isinstance(q, DTensor) and not torch.equal(q._local_tensor, original)
        assert isinstance(copied.state[q]["momentum_buffer"], DTensor)


@pytest.mark.parametrize("scheduler_first", [True, False], ids=["scheduler-first", "local-step-first"])
def test_lr_schedulers_wrap_the_local_step_without_warnings(fake_pg, scheduler_first):
    """torch's LR schedulers check that ``optimizer.step`` is still their wrapper: the local
    step made every ``scheduler.step()`` warn that the step was overridden (the default
    path installs it at the first step, after the scheduler), and a scheduler made after it
    raised ``AttributeError`` (no ``__func__``). The schedule runs, the step stays local."""
    import warnings

    mesh = init_device_mesh("cpu", (8,))
    params = _dtensor_params(mesh)
    opt = torch.optim.AdamW(params, lr=1.0)
    if not scheduler_first:
        step_on_local_shards(opt)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    step_on_local_shards(opt)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        for _ in range(3):
            before = [p._local_tensor.clone() for p in params]
            opt.step()
            scheduler.step()
            lrs.append(opt.param_groups[0]["lr"])
            assert all(not torch.equal(p._local_tensor, b) for p, b in zip(params, before, strict=True))
    assert lrs == [0.5, 0.25, 0.125]
    assert all(isinstance(opt.state[p]["exp_avg"], DTensor) for p in params)


def test_groups_that_cannot_step_locally_step_on_the_dtensors(fake_pg):
    """A group holding a plain tensor besides ``DTensor``s steps as before, and a group of
    ``DTensor``s beside it steps locally; both give the ``DTensor`` step's numbers."""
    mesh = init_device_mesh("cpu", (8,))

    def groups():
        params = _dtensor_params(mesh, 4)
        plain = torch.nn.Parameter(torch.randn(5))
        plain.grad = torch.randn(5)
        return [{"params": params[:2] + [plain]}, {"params": params[2:], "lr": 0.5}]

    reference, local = groups(), groups()
    ref_opt = torch.optim.Adam(reference, lr=0.1)
    opt = step_on_local_shards(torch.optim.Adam(local, lr=0.1))
    seen = []
    init_group = opt._init_group

    def spy(group, *args):  # Adam's update of each group sees these parameters
        seen.append([type(p) for p in group["params"]])
        return init_group(group, *args)

    opt._init_group = spy
    for _ in range(2):
        ref_opt.step()
        opt.step()
    assert seen[0] + seen[1] == [DTensor, DTensor, torch.nn.Parameter, torch.Tensor, torch.Tensor]
    for ref_group, group in zip(reference, local, strict=True):
        for ref_p, p in zip(ref_group["params"], group["params"], strict=True):
            assert type(p) is type(ref_p)

            def local_of(t):
                return t._local_tensor if isinstance(t, DTensor) else t

            assert torch.equal(local_of(p.detach()), local_of(ref_p.detach()))
            for key, value in ref_opt.state[ref_p].items():
                assert type(opt.state[p][key]) is type(value)
                assert torch.equal(local_of(opt.state[p][key]), local_of(value))


def default_local_step(kind: str) -> dict:
    """A plain ``torch.optim.AdamW`` over the Llama sharded by ``kind``, 3 steps, with the
    default (``config.local_shard_optimizer_step``) and with it off: whether the steps after
    the first ran on local shards, and the parameter shards of each run."""
    from fsdp_compile._local_shard_optimizer import _StepOnLocalShards
    from fsdp_compile.base import config

    out = {}
    for default in (True, False):
        model, units = build("llama")
        shard_blocks(model, fully_shard_of(kind), blocks=units[:-1])
        with config.patch(local_shard_optimizer_step=default):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in range(3):
                x, y = batch("llama", step)
                loss_fn("llama", model(_local(x)), _local(y)).backward()
                opt.step()
                opt.zero_grad()
        out[default] = {
            "local": isinstance(opt.step, _StepOnLocalShards),
            "params": {n: p._local_tensor.clone() for n, p in model.named_parameters()},
            "state_is_dtensor": all(isinstance(v, DTensor) for s in opt.state.values() for k, v in s.items() if k != "step"),
        }
    return out


@pytest.mark.parametrize("kind", ["ours", "fsdp2"])
def test_a_plain_optimizer_of_our_parameters_steps_on_local_shards_by_default(pool2, kind):
    """The user's plain recipe gets the fast step: from its second step, an elementwise
    optimizer of our parameters runs on local tensors (bitwise the DTensor step, state
    kept as DTensors); with the option off, and for FSDP2's parameters, it is left alone."""
    for result in pool2.run(default_local_step, kind):
        assert result[True]["local"] is (kind == "ours") and result[False]["local"] is False
        assert result[True]["state_is_dtensor"] and result[False]["state_is_dtensor"]
        for name, value in result[False]["params"].items():
            assert torch.equal(result[True]["params"][name], value), name


def compiled_optimizer_steps(steps: int = 4, clip_in_pre_hook: bool = False) -> dict:
    """An MLP sharded per block and the same MLP unsharded, each trained ``steps`` steps
    with ``torch.compile(opt.step)`` of a plain AdamW, on the same batch on every rank
    (so the averaged gradient is the unsharded one, exactly): the full parameters after
    each step, and how many frames Dynamo compiled for each step function. With
    ``clip_in_pre_hook``, a step pre-hook clips ``optimizer.param_groups``' gradients."""
    from fsdp_compile import fully_shard
    from fsdp_compile.testing import full_tensor
    from fsdp_compile.testing._torch_internals import compile_counter

    torch.manual_seed(0)
    reference = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()) for _ in range(3)])
    sharded = copy.deepcopy(reference)
    for block in sharded:
        fully_shard(block)
    fully_shard(sharded)
    out = {}
    for label, model in (("reference", reference), ("sharded", sharded)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        if clip_in_pre_hook:

            def clip(optimizer, args, kwargs) -> None:
                torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 0.05)

            opt.register_step_pre_hook(clip)
        counter = compile_counter("inductor")
        step = torch.compile(opt.step, backend=counter)
        params = []
        for i in range(steps):
            torch.manual_seed(100 + i)
            loss = model(torch.randn(8, 16)).pow(2).mean()
            loss.backward()
            if label == "reference":
                for p in model.parameters():  # what the sharded model's average gives, exactly
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
            step()
            opt.zero_grad(set_to_none=True)
            params.append({n: full_tensor(p).detach().clone() for n, p in model.named_parameters()})
        assert all(isinstance(p, DTensor) == (label == "sharded") for p in model.parameters())
        out[label] = {"params": params, "frames": counter.frame_count}
    return out


@pytest.mark.parametrize("clip_in_pre_hook", [False, True], ids=["plain", "clipping-pre-hook"])
def test_a_compiled_optimizer_step_trains_like_the_unsharded_models(pool2, clip_in_pre_hook):
    """``torch.compile(opt.step)`` over our parameters (``DTensor``s, stepping on local shards
    by default) gives bitwise the unsharded model's compiled step, step after step; also
    with a step pre-hook clipping the optimizer's gradients to their (whole) norm."""
    for result in pool2.run(compiled_optimizer_steps, 4, clip_in_pre_hook):
        ref, ours = result["reference"], result["sharded"]
        for step, (expected, got) in enumerate(zip(ref["params"], ours["params"], strict=True)):
            assert expected.keys() == got.keys()
            for name in expected:
                assert torch.equal(got[name], expected[name]), (step, name)
        assert ours["frames"] >= 1 and ref["frames"] >= 1


def test_the_optimizers_step_hooks_see_the_dtensors(fake_pg):
    """Step pre and post hooks (the optimizer's own and global ones) and the closure run where
    they would without the local step: on the ``DTensor`` parameters and gradients, before the
    swap to local tensors and after the swap back; the update between them is still local."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    mesh = init_device_mesh("cpu", (8,))
    params = _dtensor_params(mesh)
    opt = step_on_local_shards(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    seen = []

    def record(where):
        def hook(optimizer, args, kwargs):
            seen.append((where, all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in optimizer.param_groups[0]["params"])))

        return hook

    def closure():
        seen.append(("closure", all(isinstance(p, DTensor) for p in opt.param_groups[0]["params"])))

    init_group = opt._init_group

    def update(group, *args):  # SGD's update of the group
        seen.append(("update", any(isinstance(p, DTensor) for p in group["params"])))
        return init_group(group, *args)

    opt._init_group = update

    handles = [
        register_optimizer_step_pre_hook(record("global pre")),
        opt.register_step_pre_hook(record("pre")),
        opt.register_step_post_hook(record("post")),
        register_optimizer_step_post_hook(record("global post")),
    ]
    try:
        opt.step(closure)
    finally:
        for handle in handles:
            handle.remove()
    expected = [("global pre", True), ("pre", True), ("closure", True), ("update", False), ("post", True), ("global post", True)]
    assert seen == expected
    assert opt.param_groups[0]["params"] == params and all(isinstance(opt.state[p]["momentum_buffer"], DTensor) for p in params)


def clipping_in_a_pre_hook(kind: str, local_step: bool) -> dict:
    """An AdamW over the Llama sharded by ``kind``, whose step pre-hook clips the gradients
    of the optimizer's parameters to a global norm (``clip_grad_norm_`` over
    ``optimizer.param_groups``: the whole gradient's norm on ``DTensor``s), 3 steps: the
    norms the hook saw and the parameter shards."""
    from fsdp_compile.base import config

    model, units = build("llama")
    shard_blocks(model, fully_shard_of(kind), blocks=units[:-1])
    norms = []

    def clip(optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=0.05)
        norms.append(norm.full_tensor().item() if isinstance(norm, DTensor) else norm.item())

    with config.patch(local_shard_optimizer_step=local_step):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt.register_step_pre_hook(clip)
        for step in range(3):
            x, y = batch("llama", step)
            loss_fn("llama", model(_local(x)), _local(y)).backward()
            opt.step()
            opt.zero_grad()
    return {"norms": norms, "params": {n: p._local_tensor.clone() for n, p in model.named_parameters()}}


def test_a_step_hook_clipping_the_optimizers_gradients_clips_to_the_global_norm(pool2):
    """The silent difference this guards against: a hook over ``optimizer.param_groups``
    that saw local shards would clip each rank's shard by that shard's own norm. With the
    local step (ours' default) the norms and parameters are bitwise those without it, and
    FSDP2's."""
    ours = pool2.run(clipping_in_a_pre_hook, "ours", True)
    dtensor_step = pool2.run(clipping_in_a_pre_hook, "ours", False)
    fsdp2 = pool2.run(clipping_in_a_pre_hook, "fsdp2", False)
    for rank in range(2):
        assert ours[rank]["norms"] == dtensor_step[rank]["norms"] == fsdp2[rank]["norms"] == ours[0]["norms"]
        assert all(n > 0.05 for n in ours[rank]["norms"]), "the hook did not clip"
        for name, value in dtensor_step[rank]["params"].items():
            assert torch.equal(ours[rank]["params"][name], value), name
            assert torch.equal(fsdp2[rank]["params"][name], value), name


def closure_steps(kind: str, local_step: bool) -> dict:
    """An SGD (momentum) over the Llama sharded by ``kind``, stepped 3 times with a closure
    that zeroes the gradients, runs the forward and the backward (as ``opt.step(closure)``
    is written for optimizers that re-evaluate the loss): the losses and parameter shards."""
    from fsdp_compile.base import config

    model, units = build("llama")
    shard_blocks(model, fully_shard_of(kind), blocks=units[:-1])
    losses = []
    with config.patch(local_shard_optimizer_step=local_step):
        opt = torch.optim.SGD(model.parameters(), lr=1e-1, momentum=0.9)
        for step in range(3):
            x, y = batch("llama", step)

            def closure():
                opt.zero_grad()
                loss = loss_fn("llama", model(_local(x)), _local(y))
                loss.backward()
                return loss

            losses.append(opt.step(closure).item())
    return {"losses": losses, "params": {n: p._local_tensor.clone() for n, p in model.named_parameters()}}


def test_a_closure_passed_to_the_step_sees_the_dtensors(pool2):
    """``opt.step(closure)``: the closure runs inside the step; it zeroes the gradients and
    runs the backward on the model's (``DTensor``) parameters, so it must see them, not the
    local tensors the update runs on. Bitwise the ``DTensor`` step's and FSDP2's."""
    ours = pool2.run(closure_steps, "ours", True)
    dtensor_step = pool2.run(closure_steps, "ours", False)
    fsdp2 = pool2.run(closure_steps, "fsdp2", False)
    for rank in range(2):
        assert ours[rank]["losses"] == dtensor_step[rank]["losses"] == fsdp2[rank]["losses"]
        for name, value in dtensor_step[rank]["params"].items():
            assert torch.equal(ours[rank]["params"][name], value), name
            assert torch.equal(fsdp2[rank]["params"][name], value), name
