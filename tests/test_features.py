"""FSDP2 features on 2 gloo ranks: meta-device init, gradient clipping, state dicts and DCP."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from fsdp_compile.testing import full_parameters as _full_params
from fsdp_compile.testing import full_tensor, global_mean
from tests.models import batch, build, compile_counting_graphs, fully_shard_of, loss_fn, shard_blocks
from tests.test_parity import train

# ---------------------------------------------------------------- on every rank


def _shard(units, kind: str = "ours") -> None:
    fully_shard = fully_shard_of(kind)
    for unit in units:
        fully_shard(unit)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.chunk(dist.get_world_size())[dist.get_rank()]


def _step(model, run, opt, name: str, step: int, clip: float | None = None):
    x, y = batch(name, step)
    loss = loss_fn(name, run(_local(x)), _local(y))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip is not None else None
    opt.step()
    opt.zero_grad()
    return global_mean(loss), norm


def meta_init_matches_eager_init(name: str = "llama", steps: int = 3) -> dict:
    """Meta build -> fully_shard -> to_empty -> load full weights, vs building on CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    reference, _ = build(name)
    full = {k: v.clone() for k, v in reference.state_dict().items()}
    with torch.device("meta"):
        model, units = build(name)
    _shard(units)
    # A forward before materializing is refused, eager and compiled, naming the parameters.
    refusals = []
    for run in (model, torch.compile(model, backend="aot_eager")):
        try:
            run(_local(batch(name, 0)[0]))
        except RuntimeError as e:
            refusals.append(str(e))
    model.to_empty(device="cpu")
    model.rope_cos.copy_(reference.rope_cos)  # non-persistent buffers are not in a state dict
    model.rope_sin.copy_(reference.rope_sin)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
    eager, eager_units = build(name)
    _shard(eager_units)
    out = {}
    for label, m in (("meta", model), ("eager", eager)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        run = torch.compile(m, backend="aot_eager")
        losses = [_step(m, run, opt, name, s)[0] for s in range(steps)]
        out[label] = (losses, _full_params(m))
    out["refusals"] = refusals
    return out


def clip_grad_norm_matches_reference(name: str = "mlp", max_norm: float = 0.01) -> dict:
    """clip_grad_norm_ on sharded gradients vs the unsharded model on the global batch."""
    ref, _ = build(name)
    model, units = build(name)
    _shard(units)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(name, 0)
    loss_fn(name, ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    ref_opt.step()
    _, norm = _step(model, torch.compile(model, backend="inductor_passes"), opt, name, 0, clip=max_norm)
    norm = full_tensor(norm)
    return {
        "ref_norm": ref_norm,
        "norm": norm,
        "ref": {n: p.detach().clone() for n, p in ref.named_parameters()},
        "ours": _full_params(model),
    }


def dcp_round_trip(path: str, name: str = "llama", kind: str = "ours") -> dict:
    """Train 2 steps, save model + optimizer with DCP, train 1 more; then load into a fresh
    model and optimizer and train that step again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def fresh():
        model, units = build(name)
        _shard(units, kind)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, torch.compile(model, backend="aot_eager"), opt

    model, run, opt = fresh()
    for s in range(2):
        _step(model, run, opt, name, s)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    continued = _step(model, run, opt, name, 2)[0]
    continued_params = _full_params(model)

    model2, run2, opt2 = fresh()
    model_sd, optim_sd = get_state_dict(model2, opt2)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = _step(model2, run2, opt2, name, 2)[0]
    return {"continued": (continued, continued_params), "resumed": (resumed, _full_params(model2))}


def save_checkpoint(path: str, kind: str, name: str = "llama", steps: int = 2) -> dict:
    """Train ``steps`` steps sharded by ``kind`` and save the model with DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model, units = build(name)
    _shard(units, kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(steps):
        _step(model, model, opt, name, s)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    return _full_params(model)


def load_checkpoint(path: str, kind: str, name: str = "llama") -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model, units = build(name)
    _shard(units, kind)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    return _full_params(model)


def gradient_accumulation(
    kind: str, backend: str | None, name: str = "mlp", micro_batches: int = 4, steps: int = 2, keep_gathered: bool = False
) -> dict:
    """``steps`` optimizer steps of ``micro_batches`` micro-batches each; gradient sync only
    on the last micro-batch of a step (``set_requires_gradient_sync``); with
    ``keep_gathered``, parameters also stay gathered between the micro-batches
    (``set_reshard_after_backward``). Records the all-gathers each micro-batch of the
    last step issues; with ``keep_gathered``, whose test reads them, compiled with
    gloo's own collectives rather than the all-to-all transport, so that the profile
    tells all-gathers from reduce-scatters, and without prefetch: one all-gather in
    flight at a time (two of gloo's coalesced all-gathers in flight can corrupt the heap:
    README, Limitations)."""
    from fsdp_compile.base import config

    with config.patch(gloo_all_to_all=False, prefetch_depth=0) if keep_gathered else contextlib.nullcontext():
        return _gradient_accumulation(kind, backend, name, micro_batches, steps, keep_gathered)


def _gradient_accumulation(
    kind: str, backend: str | None, name: str, micro_batches: int, steps: int, keep_gathered: bool
) -> dict:
    model, units = build(name)
    _shard(units, kind)
    run, counter = compile_counting_graphs(model, backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, frames_after_first_step, gathers = [], None, []
    for step in range(steps):
        for micro in range(micro_batches):
            model.set_requires_gradient_sync(micro == micro_batches - 1)
            if keep_gathered:
                model.set_reshard_after_backward(micro == micro_batches - 1)
            x, y = batch(name, step * micro_batches + micro)
            with _count_all_gathers() as forward_gathers:
                loss = loss_fn(name, run(_local(x)), _local(y)) / micro_batches
            with _count_all_gathers() as backward_gathers:
                loss.backward()
            if step == steps - 1:
                gathers.append((forward_gathers(), backward_gathers()))
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        if step == 0 and counter:
            frames_after_first_step = counter.frame_count
    return {
        "losses": losses,
        "params": _full_params(model),
        "frames": (frames_after_first_step, counter.frame_count) if counter else None,
        "gathers": gathers,
    }


def accumulation_with_two_forwards(kind: str, backend: str | None, steps: int = 2, micro_batches: int = 3) -> dict:
    """Gradient accumulation whose every micro-batch runs the model twice before one
    backward (the sync one too); the unsharded reference does the same."""
    import copy

    from fsdp_compile.testing._torch_internals import reset_dynamo

    reset_dynamo()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    fully_shard = fully_shard_of(kind)
    for m in (model[0], model[2], model):
        fully_shard(m)
    run, counter = compile_counting_graphs(model, backend, fullgraph=True)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    frames = []
    for _ in range(steps):
        for micro in range(micro_batches):
            model.set_requires_gradient_sync(micro == micro_batches - 1)
            x1, x2 = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
            (run(x1).sum() + run(x2).sum()).backward()
            (ref(x1).sum() + ref(x2).sum()).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        frames.append(counter.frame_count if counter else None)
    return {"params": _full_params(model), "ref_params": {n: p.detach() for n, p in ref.named_parameters()}, "frames": frames}


@contextlib.contextmanager
def _count_all_gathers():
    """Yields a function that returns how many all-gathers ran inside (eager or compiled
    code)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        # Eager runs issue FSDP2's c10d op (``runtime.collectives.issue_all_gather``).
        ops = ("_c10d_functional::all_gather_into_tensor", "c10d::_allgather_base_")
        yield lambda: sum(e.count for e in prof.key_averages() if e.key in ops)


def module_methods() -> dict:
    """unshard/reshard, register_fsdp_forward_method and set_gradient_divide_factor."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from fsdp_compile import register_fsdp_forward_method
    from fsdp_compile.testing.models import MLPStack

    class WithMethod(MLPStack):
        def first_layer_only(self, x):
            return F.linear(x, self.layers[0].weight, self.layers[0].bias)

    torch.manual_seed(0)
    ref = WithMethod(dim=5, n_layers=2, bias=True)
    torch.manual_seed(0)
    model = shard_blocks(WithMethod(dim=5, n_layers=2, bias=True))
    x = torch.randn(3, 5)
    out: dict = {}
    try:
        model.first_layer_only(x)
        out["unregistered"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["unregistered"] = type(e).__name__
    register_fsdp_forward_method(model, "first_layer_only")
    out["registered_matches"] = torch.equal(model.first_layer_only(x), ref.first_layer_only(x))

    for layer in model.layers:
        layer.unshard()
    held = model.layers[0].weight
    out["held_is_full_plain"] = type(held) is torch.Tensor and torch.equal(held, ref.layers[0].weight)
    with torch.no_grad():
        out["held_forward_matches"] = torch.allclose(model(x), ref(x))
    for layer in model.layers:
        layer.reshard()
    out["resharded_is_dtensor"] = isinstance(model.layers[0].weight, DTensor)

    model(x).sum().backward()
    averaged = {n: full_tensor(p.grad) for n, p in model.named_parameters()}
    model.zero_grad()
    for layer in model.layers:
        layer.set_gradient_divide_factor(1.0)
    model(x).sum().backward()
    summed = {n: full_tensor(p.grad) for n, p in model.named_parameters()}
    out["divide_factor_1_sums"] = all(torch.equal(summed[n], 2 * averaged[n]) for n in summed)
    return out


def _adamw_llama(name: str = "llama"):
    model, units = build(name)
    _shard(units)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def save_then_continue(path: str, name: str = "llama", steps: int = 2) -> dict:
    """Train ``steps`` steps, save model + optimizer with DCP, then train one more step:
    that step's loss and the parameters after it are what a resumed run must reproduce."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _adamw_llama(name)
    run = torch.compile(model, backend="aot_eager")
    for s in range(steps):
        _step(model, run, opt, name, s)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = _full_params(model)
    loss = _step(model, run, opt, name, steps)[0]
    return {"saved": saved, "loss": loss, "params": _full_params(model)}


def resume(path: str, name: str = "llama", step: int = 2) -> dict:
    """Load model + optimizer from ``path`` (saved at any world size) and train step ``step``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _adamw_llama(name)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full_params(model)
    loss = _step(model, torch.compile(model, backend="aot_eager"), opt, name, step)[0]
    return {"loaded": loaded, "loss": loss, "params": _full_params(model), "world_size": dist.get_world_size()}


def saved_activation_bytes(name: str) -> int:
    """Bytes of distinct storages autograd saves outside checkpointed regions in one
    eager forward (checkpoint's own hooks take over inside its regions)."""
    model, units = build(name)
    _shard(units)
    x, _ = batch(name, 0)
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(_local(x)).sum()
    return sum(seen.values())


def _saved_bytes(forward: torch.fx.GraphModule) -> int:
    """Bytes a compiled forward graph hands to the backward (its outputs after the model's own)."""
    outputs = next(n for n in forward.graph.nodes if n.op == "output").args[0]
    saved = [n.meta.get("val") for n in outputs[1:]]
    return sum(t.numel() * t.element_size() for t in saved if isinstance(t, torch.Tensor))


def train_min_cut_counting_saved_bytes(name: str) -> dict:
    """:func:`~tests.test_parity.train` compiled with ``aot_eager``'s graphs partitioned by
    AOTAutograd's min-cut partitioner, as under Inductor (recomputing an op in the backward
    gives its bits again); with the :func:`_saved_bytes` of its forward."""
    import tests.test_parity as parity
    from tests.test_layouts import _capturing_backend

    graphs: list = []
    parity.COMPILE_BACKENDS["ours-aot_eager-min_cut"] = _capturing_backend(graphs)
    try:
        record = train(name, "ours-aot_eager-min_cut")
    finally:
        del parity.COMPILE_BACKENDS["ours-aot_eager-min_cut"]
    record["saved_bytes"] = _saved_bytes(graphs[0])
    return record


# ---------------------------------------------------------------- tests


def forward_without_backward_then_train(backend: str | None, name: str = "mlp", steps: int = 3) -> dict:
    """Two identical sharded models trained alike, one of them after a forward that no
    backward follows (an evaluation loss with gradients on, an abandoned step): their
    parameters after each step."""
    out = {}
    for label in ("plain", "after_dropped_forward"):
        model, units = build(name)
        _shard(units)
        run = torch.compile(model, backend=backend) if backend else model
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if label == "after_dropped_forward":
            x, y = batch(name, 99)
            loss_fn(name, run(_local(x)), _local(y))  # graph built, never backpropagated
        out[label] = []
        for step in range(steps):
            _step(model, run, opt, name, step)
            out[label].append(_full_params(model))
    return out


def evaluations_between_steps(backend: str | None, name: str = "llama", steps: int = 3) -> dict:
    """Identical sharded models trained alike, with an evaluation forward before each step
    under ``torch.no_grad()``, under ``torch.inference_mode()``, or under inference mode
    after ``unshard()`` and without ``reshard()``: each one's evaluation outputs and its
    parameters after each step."""
    evaluations = {
        "plain": None,
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
        "inference_mode_unshard": torch.inference_mode,
    }
    out = {}
    for label, evaluation in evaluations.items():
        model, units = build(name)
        _shard(units)
        run = torch.compile(model, backend=backend) if backend else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        out[label] = {"evals": [], "params": []}
        for step in range(steps):
            if evaluation is not None:
                model.eval()
                with evaluation():
                    if label == "inference_mode_unshard":
                        for unit in units:
                            unit.unshard()
                    evaluated = run(_local(batch(name, 50 + step)[0]))
                out[label]["evals"].append(evaluated.clone())
                model.train()
            _step(model, run, opt, name, step)
            out[label]["params"].append(_full_params(model))
    return out


def functional_call_with_stand_ins(name: str = "llama") -> dict:
    """``torch.func.functional_call`` on a sharded model (tied embeddings) with stand-ins
    derived from its parameters (``DTensor``s laid out as they are), against the unsharded
    model with the same stand-ins, one global batch on every rank: outputs, and gradients
    of stand-ins that require them; the model's own parameters untouched; then a stand-in
    of another layout in eager, and any stand-in while ``torch.compile`` traces."""
    from torch.func import functional_call

    model, units = build(name)
    _shard(units)
    ref, _ = build(name)
    x, y = batch(name, 0)
    before = model(x).detach()
    out: dict = {}
    stand_ins = {n: (p.detach() * 2).requires_grad_() for n, p in model.named_parameters()}
    ref_stand_ins = {n: (p.detach() * 2).requires_grad_() for n, p in ref.named_parameters()}
    got = functional_call(model, stand_ins, (x,))
    expected = functional_call(ref, ref_stand_ins, (x,))
    loss_fn(name, got, y).backward()
    loss_fn(name, expected, y).backward()
    out["output"] = (got.detach(), expected.detach())
    out["grads"] = {n: (full_tensor(stand_ins[n].grad), ref_stand_ins[n].grad) for n in stand_ins}
    out["own_grads_none"] = all(p.grad is None for p in model.parameters())
    out["after_unchanged"] = torch.equal(model(x).detach(), before)
    full = {n: full_tensor(p).detach() for n, p in model.named_parameters()}
    for label, run, params in (("plain tensor", model, full), ("compiled", torch.compile(model, backend="aot_eager"), stand_ins)):
        try:
            functional_call(run, params, (x,))
            out[label] = "no error"
        except Exception as e:  # noqa: BLE001
            out[label] = f"{type(e).__name__}: {e}"
    return out


def requires_grad_changes_follow_the_unsharded_model(kind: str, backend: str | None, steps: int = 6) -> dict:
    """Freezing and unfreezing parameters around compiled steps, as fine-tuning does: the
    first layer's attention and the embedding frozen after ``fully_shard`` and before
    the first step, one MLP weight of the second layer frozen before step 2, the
    attention and the embedding unfrozen again before step 4. Per step: the loss and
    which parameters got a gradient; then the full parameters and the graphs compiled.
    ``kind`` ``"reference"``: the unsharded model on the global batch, same compile."""
    model, units = build("llama")
    if kind != "reference":
        _shard(units, kind)
    run, counter = compile_counting_graphs(model, backend)
    first_frozen = [*model.layers[0].attention.parameters(), *model.tok_embeddings.parameters()]
    for p in first_frozen:
        p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    names = {p: n for n, p in model.named_parameters()}
    losses, with_grad = [], []
    for step in range(steps):
        if step == 2:
            model.layers[1].feed_forward.w1.weight.requires_grad = False
        if step == 4:
            for p in first_frozen:
                p.requires_grad_(True)
        x, y = batch("llama", step)
        if kind != "reference":
            x, y = _local(x), _local(y)
        loss = loss_fn("llama", run(x), y)
        loss.backward()
        with_grad.append(sorted(names[p] for p in model.parameters() if p.grad is not None))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item() if kind == "reference" else global_mean(loss))
    params = {n: p.detach().clone() for n, p in model.named_parameters()} if kind == "reference" else _full_params(model)
    return {"losses": losses, "with_grad": with_grad, "params": params, "graphs": counter.frame_count if counter else None}


def _equal(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"{k}: {m}", **(tol or {"rtol": 0, "atol": 0}))


def test_meta_device_init_matches_eager_init(pool2):
    for result in pool2.run(meta_init_matches_eager_init):
        assert len(result["refusals"]) == 2  # eager, then compiled
        for message in result["refusals"]:
            assert "on the meta device" in message and "'tok_embeddings.weight'" in message and "to_empty" in message
        meta_losses, meta_params = result["meta"]
        eager_losses, eager_params = result["eager"]
        assert meta_losses == eager_losses
        _equal(meta_params, eager_params)


def test_clip_grad_norm_matches_unsharded_reference(pool2):
    result = pool2.run(clip_grad_norm_matches_reference)[0]
    torch.testing.assert_close(result["norm"], result["ref_norm"], rtol=1e-5, atol=1e-7)
    assert result["ref_norm"] > 0.01  # clipping is active (max_norm=0.01)
    _equal(result["ours"], result["ref"], rtol=1e-5, atol=1e-6)


def test_dcp_round_trip_model_and_optimizer_is_bitwise(pool2, tmp_path):
    for result in pool2.run(dcp_round_trip, str(tmp_path / "ckpt")):
        continued_loss, continued = result["continued"]
        resumed_loss, resumed = result["resumed"]
        assert resumed_loss == continued_loss
        _equal(resumed, continued)


def test_checkpoints_cross_load_with_torch_fsdp2(pool2, tmp_path):
    for writer, reader in (("ours", "fsdp2"), ("fsdp2", "ours")):
        path = str(tmp_path / f"{writer}_to_{reader}")
        saved = pool2.run(save_checkpoint, path, writer)[0]
        loaded = pool2.run(load_checkpoint, path, reader)[0]
        _equal(loaded, saved)


def test_gradient_accumulation_matches_torch_fsdp2(pool2):
    """4 micro-batches per step (sync on the last), 2 steps: same parameters as FSDP2."""
    fsdp2 = pool2.run(gradient_accumulation, "fsdp2", None)[0]
    eager = pool2.run(gradient_accumulation, "ours", None)[0]
    # aot_eager with our passes: eager's ops, bucketed and reordered, so bitwise eager.
    compiled = pool2.run(gradient_accumulation, "ours", "aot_eager_passes")[0]
    _equal(compiled["params"], eager["params"])
    assert compiled["losses"] == eager["losses"]
    _equal(eager["params"], fsdp2["params"], rtol=1e-5, atol=1e-6)
    # One graph per mode (no sync; sync with accumulated gradients), compiled in the
    # first step only: no recompile in the second.
    first, total = compiled["frames"]
    assert first == total == 2


def test_accumulated_gradients_count_once_with_two_forwards_per_backward(pool2):
    """A parameter gathered twice before the synced backward (two forwards, one backward)
    adds what earlier micro-batches accumulated once: each forward's gather added it to
    its own reduction, a silent double count (eager and compiled; the parameters 16 off
    here). FSDP2 and the unsharded reference agree; compiled in one graph per mode, none
    recompiled in the second step."""
    fsdp2 = pool2.run(accumulation_with_two_forwards, "fsdp2", None)
    for backend in (None, "aot_eager"):
        for rank, (ours, theirs) in enumerate(
            zip(pool2.run(accumulation_with_two_forwards, "ours", backend), fsdp2, strict=True)
        ):
            _equal(ours["params"], ours["ref_params"], rtol=1e-5, atol=1e-6)
            _equal(ours["params"], theirs["params"], rtol=1e-5, atol=1e-6)
            if backend:  # no sync; sync with the accumulated sum; sync without it (the second forward)
                assert ours["frames"][0] == ours["frames"][1] <= 3, (rank, ours["frames"])


def test_keeping_parameters_gathered_between_micro_batches_matches_torch_fsdp2(pool2):
    """set_reshard_after_backward(False) on all but the last micro-batch, as FSDP2's docs
    suggest: same parameters as FSDP2 doing the same, and only the first micro-batch
    of a step gathers (the others read the kept parameters)."""
    fsdp2 = pool2.run(gradient_accumulation, "fsdp2", None, keep_gathered=True)[0]
    eager = pool2.run(gradient_accumulation, "ours", None, keep_gathered=True)[0]
    compiled = pool2.run(gradient_accumulation, "ours", "aot_eager_passes", keep_gathered=True)[0]
    _equal(compiled["params"], eager["params"])  # eager's ops through our passes: bitwise
    assert compiled["losses"] == eager["losses"]
    _equal(eager["params"], fsdp2["params"], rtol=1e-5, atol=1e-6)
    for result in (eager, compiled):
        first, *rest = result["gathers"]
        assert first[0] > 0 and [forward for forward, _ in rest] == [0, 0, 0], result["gathers"]
        # Kept parameters need no re-gather in backward, but in the last micro-batch's
        # eager backward: it frees them after forward and gathers again, as FSDP2 does.
        assert [backward for _, backward in (first, *rest[:2])] == [0, 0, 0], result["gathers"]
    # One graph per mode: gather and keep; read kept and keep; read kept and free (the
    # last micro-batch also syncs gradients). Compiled in the first step only.
    first, total = compiled["frames"]
    assert first == total == 3


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "aot_eager"])
def test_a_forward_without_backward_does_not_change_later_training(pool2, backend):
    """Eager re-gathers in the backward through per-parameter slots; a forward whose graph
    is dropped unused must not leave one behind that a later backward reads (it served
    the previous step's weight: parameters went wrong from the second step on)."""
    result = pool2.run(forward_without_backward_then_train, backend)[0]
    for plain, after in zip(result["plain"], result["after_dropped_forward"], strict=True):
        _equal(after, plain)


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "aot_eager"])
def test_evaluations_between_steps_under_no_grad_or_inference_mode_change_no_training(pool2, backend):
    """An evaluation before each step (``model.eval()``, then ``torch.no_grad()`` or
    ``torch.inference_mode()``) changes nothing in the training, bitwise. Under inference
    mode the root, which keeps what it gathered until its backward, kept inference tensors
    that the next training forward then saved for backward: a RuntimeError in eager (FSDP2
    fails there too, on 2.13 and 2.15); held by ``unshard()`` under inference mode likewise."""
    result = pool2.run(evaluations_between_steps, backend)[0]
    for label in ("no_grad", "inference_mode", "inference_mode_unshard"):
        for plain, other in zip(result["plain"]["params"], result[label]["params"], strict=True):
            _equal(other, plain)
        for a, b in zip(result["no_grad"]["evals"], result[label]["evals"], strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_functional_call_computes_with_the_stand_ins_as_unsharded(pool2):
    """``torch.func.functional_call`` (and ``torch.nn.utils.stateless``) put stand-ins in
    ``module._parameters``; the sharded forward gathered the sharded parameters instead, so
    the output ignored them, silently (FSDP2 2.13 takes them only in part: its output is off
    too). Eager forwards now gather each stand-in (laid out as the sharded parameter) and
    reduce its gradient into it: the unsharded model's output and gradients; anything
    else, and any stand-in while torch.compile traces, raises naming the parameter."""
    result = pool2.run(functional_call_with_stand_ins)[0]
    torch.testing.assert_close(*result["output"])
    for name, (got, expected) in result["grads"].items():
        torch.testing.assert_close(got, expected, msg=lambda m, n=name: f"{n}: {m}")
    assert result["own_grads_none"] and result["after_unchanged"]
    for label in ("plain tensor", "compiled"):
        assert "NotImplementedError" in result[label] and "tok_embeddings.weight" in result[label], (label, result[label])
    assert "laid out as the sharded parameter" in result["plain tensor"]
    assert "while torch.compile traces" in result["compiled"]


def test_freezing_and_unfreezing_parameters_follows_the_unsharded_model(pool2):
    """``requires_grad`` changed after ``fully_shard``, before the first compiled step and
    between steps: every step gives exactly the parameters the unsharded model gives a
    gradient, the same losses and parameters, in as many graphs (each change between
    steps recompiles the unsharded model too); eager and compiled (aot_eager with our
    passes) are bitwise equal."""
    backend = "aot_eager_passes"
    reference = pool2.run(requires_grad_changes_follow_the_unsharded_model, "reference", backend)[0]
    eager = pool2.run(requires_grad_changes_follow_the_unsharded_model, "ours", None)
    compiled = pool2.run(requires_grad_changes_follow_the_unsharded_model, "ours", backend)
    frozen_first = [n for n in reference["with_grad"][4] if n not in reference["with_grad"][0]]
    assert frozen_first and "layers.1.feed_forward.w1.weight" in reference["with_grad"][1]
    assert "layers.1.feed_forward.w1.weight" not in reference["with_grad"][2]
    for rank_eager, rank_compiled in zip(eager, compiled, strict=True):
        for result in (rank_eager, rank_compiled):
            assert result["with_grad"] == reference["with_grad"]
            torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-5)
            _equal(result["params"], reference["params"], rtol=1e-4, atol=1e-5)
        # Equal, not fewer: a parameter frozen between steps must recompile, as the unsharded
        # model does, or its gradient would still be computed and reduced every step.
        assert rank_compiled["graphs"] == reference["graphs"]
        assert rank_compiled["losses"] == rank_eager["losses"]
        _equal(rank_compiled["params"], rank_eager["params"])


def test_fsdp_module_methods(pool2):
    for result in pool2.run(module_methods):
        assert result["unregistered"] != "no error"  # a unit's weight read outside any forward: sharded
        assert result["registered_matches"]
        assert result["held_is_full_plain"] and result["held_forward_matches"]
        assert result["resharded_is_dtensor"]
        assert result["divide_factor_1_sums"]  # divide by 1 = sum over 2 ranks = 2 x average


def test_activation_checkpointing_eager_is_bitwise_equal_to_no_checkpointing(pool2):
    """torch.utils.checkpoint (full, and selective: matmul outputs saved) inside each
    sharded decoder layer, eager: recomputation re-gathers the layer's weights and gives
    exactly the same training, while saving fewer activations."""
    without = pool2.run(train, "llama", "ours-eager")[0]
    saved_without = pool2.run(saved_activation_bytes, "llama")[0]
    for name in ("llama_ac", "llama_sac"):
        with_ac = pool2.run(train, name, "ours-eager")[0]
        assert with_ac["loss"] == without["loss"], name
        _equal(with_ac["params"][-1], without["params"][-1])
        saved = pool2.run(saved_activation_bytes, name)[0]
        assert saved < saved_without, (name, saved, saved_without)


def test_activation_checkpointing_under_compile(pool2):
    """The same checkpointed model compiled: aot_eager with Inductor's (min-cut) partitioner
    trains bitwise like eager without checkpointing, in one graph, and selective
    checkpointing through Inductor's graph pipeline and our passes (``inductor_passes``) to
    fp32 rounding; and the compiled forward hands the backward fewer bytes (full <
    selective < none)."""
    without = pool2.run(train, "llama", "ours-eager")[0]
    saved = {}
    for name in ("llama", "llama_ac", "llama_sac"):
        compiled = pool2.run(train_min_cut_counting_saved_bytes, name)[0]
        assert compiled["loss"] == without["loss"], name
        _equal(compiled["params"][-1], without["params"][-1])
        assert compiled["frames"] == 1
        saved[name] = compiled["saved_bytes"]
    inductor = pool2.run(train, "llama_sac", "ours-inductor_passes")[0]
    _equal(inductor["params"][-1], without["params"][-1], rtol=1e-5, atol=1e-6)
    assert inductor["frames"] == 1
    assert saved["llama_ac"] < saved["llama_sac"] < saved["llama"], saved


def test_checkpoint_saved_at_two_ranks_resumes_at_one_and_four(pool2, rank_pools, tmp_path):
    """DCP resharding: a model + AdamW checkpoint from 2 ranks loads bitwise at world size
    1 and 4, and the next step gives the loss and update of the run that went on at 2
    (to fp32 rounding: the global batch is split differently, so reductions differ)."""
    path = str(tmp_path / "ws2")
    straight = pool2.run(save_then_continue, path)[0]
    for world_size in (1, 4):
        results = rank_pools(world_size).run(resume, path)
        for result in results:
            assert result["world_size"] == world_size
            _equal(result["loaded"], straight["saved"])
            torch.testing.assert_close(torch.tensor(result["loss"]), torch.tensor(straight["loss"]), rtol=1e-6, atol=0)
            _equal(result["params"], straight["params"], rtol=1e-5, atol=1e-6)
