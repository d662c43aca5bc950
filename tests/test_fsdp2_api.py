"""FSDP2's ``FSDPModule`` API beyond the features of ``test_features.py``: every public
method of torch's ``FSDPModule`` exists here; parameters without a gradient (unused, or
used by some ranks only) behave as FSDP2's; hints that change nothing here are accepted;
what is not supported raises naming the module; recovery after an aborted step."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.models import fully_shard_of

STEPS = 3


class Experts(nn.Module):
    """Two experts; ``b`` runs only when asked (a branch on the data, as an MoE layer
    that loops over the experts that received tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, use_b: bool):
        y = self.a(x)
        return y + self.b(x) if use_b else y


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.experts, self.out = nn.Linear(8, 8), Experts(), nn.Linear(8, 1)

    def forward(self, x, use_b: bool):
        return self.out(self.experts(torch.relu(self.inp(x)), use_b))


# ---------------------------------------------------------------- on every rank


def train_routed(
    kind: str, use_b: str, reshard: bool, reduce_unused: bool, backend: str | None = None, one_rank_shards: bool = False
) -> dict:
    """AdamW steps of :class:`Routed` sharded by ``kind`` (``"ours"`` / ``"fsdp2"``), the
    experts a unit of their own. ``use_b``: ``"never"``, or ``"rank1"`` (only rank 1 runs
    expert ``b``). ``one_rank_shards``: HSDP over (replicate=2, shard=1). Returns which
    gradients were ``None`` after the first backward and the full parameters after the last step."""
    import torch.distributed as dist

    from fsdp_compile.testing import full_parameters
    from fsdp_compile.testing._torch_internals import reset_dynamo

    reset_dynamo()
    fully_shard = fully_shard_of(kind)
    torch.manual_seed(0)
    model = Routed()
    mesh = None
    if one_rank_shards:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    fully_shard(model.experts, reshard_after_forward=reshard, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if reduce_unused:
        model.experts.set_reduce_scatter_unused_params(True)
    run = torch.compile(model, backend=backend) if backend else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # weight decay: a zero gradient is not None
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    no_grad = None
    for _ in range(STEPS):
        run(torch.randn(4, 8, generator=gen), use_b == "rank1" and rank == 1).square().mean().backward()
        if no_grad is None:
            no_grad = sorted(n for n, p in model.named_parameters() if p.grad is None)
        opt.step()
        opt.zero_grad()
    return {"no_grad": no_grad, "params": full_parameters(model)}


def api_calls() -> dict:
    """The hints accepted, the deprecated divide-factor alias, what raises."""
    import warnings

    from fsdp_compile import fully_shard, share_comm_ctx
    from fsdp_compile.testing.models import MLPStack

    torch.manual_seed(0)
    model = MLPStack(dim=4, n_layers=2)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    layer = model.layers[0]
    model.set_is_last_backward(False)
    model.set_post_optim_event(object())
    model.set_force_sum_reduction_for_comms(True)
    model.set_separate_reduce_scatter_group(True)
    model.set_symm_mem_for_comm()
    model.set_keep_unsharded_storage(True)
    model.set_allocate_memory_from_process_group_for_comm(True)
    model.set_reduce_scatter_max_input_buffers(2)
    model.set_requires_all_reduce(False)  # a 1-D mesh: nothing to all-reduce, as FSDP2
    model.set_requires_all_reduce(True)
    model.set_manual_backward_finalization(True)
    layer.set_unshard_in_backward(False)
    share_comm_ctx([model, layer])
    out: dict = {"finalize": model.finalize_backward(), "finalize_async": model.finalize_backward(async_op=True).wait()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer.set_reduce_scatter_divide_factor(2.0)
    out["alias_warns"] = [w.category.__name__ for w in caught]
    out["alias_sets"] = layer._fsdp_unit.gradient_divide_factor
    errors = {}
    calls = {
        "custom_all_gather": lambda: layer.set_custom_all_gather(object()),
        "custom_reduce_scatter": lambda: layer.set_custom_reduce_scatter(object()),
        "max_input_buffers_0": lambda: layer.set_reduce_scatter_max_input_buffers(0),
        "max_input_buffers_float": lambda: layer.set_reduce_scatter_max_input_buffers(2.5),
        "max_input_buffers_bool": lambda: layer.set_reduce_scatter_max_input_buffers(True),
        "reset_on_a_block": layer.reset_iter_state,
        "manual_finalization_on_a_block": lambda: layer.set_manual_backward_finalization(True),
        "share_comm_ctx_unsharded": lambda: share_comm_ctx([model, nn.Linear(2, 2)]),
    }
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except Exception as e:  # noqa: BLE001
            errors[name] = (type(e).__name__, str(e))
    out["errors"] = errors
    return out


def hsdp_accumulation(kind: str, backend: str | None, first_micro_batch: str) -> dict:
    """HSDP on 4 ranks (replicate 2 x shard 2), 2 micro-batches per AdamW step: the first
    with ``set_requires_all_reduce(False)`` (``"no_all_reduce"``) or
    ``set_requires_gradient_sync(False)`` (``"no_sync"``), the second with
    ``set_requires_gradient_sync(True)`` (as ``transformers``' Trainer does). Returns the
    parameters after each step, the functional collectives each micro-batch ran (compiled
    with gloo's own collectives, not the all-to-all transport, so that the profile names
    reduce-scatters, and without prefetch, so that one of gloo's coalesced all-gathers is
    in flight at a time: README, Limitations), and the graphs compiled after the first
    and the last step."""
    from fsdp_compile.base import config

    with config.patch(gloo_all_to_all=False, prefetch_depth=0):
        return _hsdp_accumulation(kind, backend, first_micro_batch)


#: The functional collective's name of each c10d op eager code issues (as FSDP2's).
_EAGER_COLLECTIVES = {
    "c10d::_allgather_base_": "all_gather_into_tensor",
    "c10d::_reduce_scatter_base_": "reduce_scatter_tensor",
    "c10d::allreduce_": "all_reduce",
}


def _hsdp_accumulation(kind: str, backend: str | None, first_micro_batch: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compile.testing import full_parameters
    from fsdp_compile.testing._torch_internals import reset_dynamo
    from fsdp_compile.testing.models import MLPStack
    from tests.models import compile_counting_graphs

    reset_dynamo()
    fully_shard = fully_shard_of(kind)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = MLPStack(dim=10, n_layers=3, bias=True)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    run, counter = compile_counting_graphs(model, backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    params, collectives, graphs = [], [], []
    for _ in range(STEPS):
        for micro in range(2):
            if micro == 0:
                getattr(model, {"no_all_reduce": "set_requires_all_reduce", "no_sync": "set_requires_gradient_sync"}[first_micro_batch])(False)
            else:
                model.set_requires_gradient_sync(True)
            with torch.profiler.profile() as prof:
                run(torch.randn(4, 10, generator=gen)).square().mean().backward()
            ran: dict = {}
            for e in prof.key_averages():
                # Compiled code runs functional collectives (Inductor may run the in-place
                # all_reduce_); eager code FSDP2's c10d ops.
                name = _EAGER_COLLECTIVES.get(e.key) or (e.key.startswith("_c10d_functional::") and e.key.split("::")[1].rstrip("_"))
                if name and "wait" not in name:
                    ran[name] = ran.get(name, 0) + e.count
            collectives.append(ran)
        opt.step()
        opt.zero_grad()
        params.append(full_parameters(model))
        graphs.append(counter.frame_count if counter else None)
    return {"params": params, "collectives": collectives, "graphs": graphs}


def recover_after_aborted_steps(kind: str) -> dict:
    """A forward, then a backward, raise midway; after ``reset_iter_state`` on the root,
    training goes on exactly as if they had never run."""
    from fsdp_compile.testing import full_parameters
    from fsdp_compile.testing.models import MLPStack

    class Boom(Exception):
        pass

    aborting = {"forward": False, "backward": False}

    def raise_in_forward(module, args):
        if aborting["forward"]:
            raise Boom()

    def raise_in_backward(grad):
        raise Boom()

    def abort_backward_here(module, args, output) -> None:
        # After the last layer's backward (its reduce-scatter in flight), before this one's.
        if aborting["backward"]:
            output.register_hook(raise_in_backward)

    def in_flight(model) -> int:
        """Our eager state an aborted step can leave behind (0 for FSDP2: not ours)."""
        if kind != "ours":
            return 0
        from fsdp_compile._fsdp_state import forward_context

        return model._fsdp_unit.eager.in_flight() + forward_context.depth

    left = {}

    def train(abort: bool) -> dict:
        torch.manual_seed(0)
        model = MLPStack(dim=8, n_layers=3)
        for layer in model.layers:
            fully_shard_of(kind)(layer)
        fully_shard_of(kind)(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 8)
        if abort:
            model.layers[1].register_forward_pre_hook(raise_in_forward)
            model.layers[1].register_forward_hook(abort_backward_here)
            for where in ("forward", "backward"):
                aborting[where] = True
                with pytest.raises(Boom):
                    model(x).square().mean().backward()
                aborting[where] = False
                left[where] = in_flight(model)
                model.reset_iter_state()
                left[where + ", after reset"] = in_flight(model)
            model.zero_grad(set_to_none=True)
        for _ in range(STEPS):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return full_parameters(model)

    return {"clean": train(False), "after_aborts": train(True), "left": left}


# ---------------------------------------------------------------- tests


def _close(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=lambda m, name=name: f"{name}: {m}", **tol)


def test_every_public_method_of_torchs_fsdp_module_exists():
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from fsdp_compile import FSDPModule

    module_api = set(dir(nn.Module))
    missing = sorted(n for n in dir(TorchFSDPModule) if not n.startswith("_") and n not in module_api and not hasattr(FSDPModule, n))
    assert missing == []
    # Ours subclasses torch's (other stacks' isinstance checks see our units), so each of
    # torch's methods must be ours: one inherited from torch's reaches into FSDP2's state.
    assert issubclass(FSDPModule, TorchFSDPModule)
    inherited = sorted(n for n in vars(TorchFSDPModule) if callable(getattr(TorchFSDPModule, n)) and n not in {"__new__"}
                       and getattr(FSDPModule, n) is getattr(TorchFSDPModule, n))
    assert inherited == []


def test_every_public_name_of_torchs_fsdp_package_that_applies_exists():
    import torch.distributed.fsdp as torch_fsdp

    import fsdp_compile

    # FSDP1's API
    not_applicable = {n for n in torch_fsdp.__all__ if n in dir(torch.distributed.fsdp.fully_sharded_data_parallel)}
    missing = [n for n in torch_fsdp.__all__ if not hasattr(fsdp_compile, n) and n not in not_applicable]
    assert missing == []


def test_fully_shard_takes_every_argument_of_torchs():
    import inspect

    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_compile import fully_shard

    ours = inspect.signature(fully_shard).parameters
    assert [n for n in inspect.signature(torch_fully_shard).parameters if n not in ours] == []


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "no-reshard"])
def test_unused_parameters_keep_no_gradient_as_in_fsdp2(pool2, reshard):
    """Expert ``b`` never runs: its gradient stays ``None`` (AdamW then leaves it alone),
    eager and compiled, as with FSDP2 and an unsharded model."""
    expected = pool2.run(train_routed, "fsdp2", "never", reshard, False)[0]
    assert expected["no_grad"] == ["experts.b.bias", "experts.b.weight"]
    for backend in (None, "aot_eager"):
        got = pool2.run(train_routed, "ours", "never", reshard, False, backend)[0]
        assert got["no_grad"] == expected["no_grad"], backend
        _close(got["params"], expected["params"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "no-reshard"])
def test_reduce_scatter_unused_params_trains_ranks_that_use_different_experts(pool2, reshard):
    """Only rank 1 runs expert ``b`` (eager): with ``set_reduce_scatter_unused_params(True)``
    rank 0 reduces zeros for it, both ranks issue the same collectives (the backward
    re-gathers the whole unit on both), and training matches FSDP2 with the same setting."""
    expected = pool2.run(train_routed, "fsdp2", "rank1", reshard, True)
    got = pool2.run(train_routed, "ours", "rank1", reshard, True)
    for g, e in zip(got, expected, strict=True):
        assert g["no_grad"] == e["no_grad"] == []
        _close(g["params"], e["params"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "no-reshard"])
def test_reduce_scatter_unused_params_gives_zero_gradients_on_a_one_rank_shard_group(pool2, reshard):
    """upstream's ``test_reduce_scatter_unused_dtensor_param`` (2 ranks): with
    ``set_reduce_scatter_unused_params(True)`` and a shard group of one rank, an expert no
    rank runs gets a zero gradient, as FSDP2 reduces zeros for it, and AdamW's weight decay
    steps it (its gradient stayed ``None``: the parameters then differed from FSDP2's)."""
    expected = pool2.run(train_routed, "fsdp2", "never", reshard, True, None, True)
    got = pool2.run(train_routed, "ours", "never", reshard, True, None, True)
    for g, e in zip(got, expected, strict=True):
        assert g["no_grad"] == e["no_grad"] == []
        _close(g["params"], e["params"], rtol=0, atol=0)


def test_fsdp2_hints_are_accepted_and_unsupported_methods_raise(pool2):
    result = pool2.run(api_calls)[0]
    assert result["finalize"] is None and result["finalize_async"] is None
    assert result["alias_warns"] == ["FutureWarning"] and result["alias_sets"] == 2.0
    errors = result["errors"]
    for name in ("custom_all_gather", "custom_reduce_scatter"):
        kind, message = errors[name]
        assert kind == "NotImplementedError" and "FSDPLinear" in message, (name, message)
    assert errors["max_input_buffers_0"][0] == "ValueError"
    assert errors["max_input_buffers_float"][0] == errors["max_input_buffers_bool"][0] == "TypeError"
    assert errors["share_comm_ctx_unsharded"][0] == "ValueError" and "Linear" in errors["share_comm_ctx_unsharded"][1]
    for name in ("reset_on_a_block", "manual_finalization_on_a_block"):
        kind, message = errors[name]
        assert kind == "RuntimeError" and "root" in message, (name, message)


@pytest.fixture(scope="module")
def pool4(rank_pools):
    return rank_pools(4)


@pytest.mark.parametrize("backend", [None, "aot_eager_passes"], ids=["eager", "aot_eager_passes"])
def test_hsdp_accumulation_without_all_reduce_matches_fsdp2(pool4, backend):
    """``set_requires_all_reduce(False)`` on the first of two micro-batches: that backward
    reduce-scatters and all-reduces nothing; the last one all-reduces the sum of both;
    training matches FSDP2's with the same calls (and ``set_requires_gradient_sync``),
    with one graph per mode, compiled once (``aot_eager_passes``: eager's ops through our
    passes; compared within a tolerance, as a reduce-scatter over 4 ranks bucketed sums
    in another order)."""
    expected = pool4.run(hsdp_accumulation, "fsdp2", None, "no_all_reduce")[0]
    for mode in ("no_all_reduce", "no_sync"):
        for rank, got in enumerate(pool4.run(hsdp_accumulation, "ours", backend, mode)):
            for step, (g, e) in enumerate(zip(got["params"], expected["params"], strict=True)):
                _close(g, e, rtol=1e-5, atol=1e-6)
            first, last = got["collectives"][-2], got["collectives"][-1]
            assert "all_reduce" not in first, (mode, rank, first)
            assert ("reduce_scatter_tensor" in first) == (mode == "no_all_reduce"), (mode, rank, first)
            assert last.get("all_reduce", 0) > 0 and last.get("reduce_scatter_tensor", 0) > 0, (mode, rank, last)
            if backend:
                assert got["graphs"][0] == got["graphs"][-1] <= 2, got["graphs"]


@pytest.mark.parametrize("kind", ["ours", "fsdp2"])
def test_reset_iter_state_recovers_from_an_aborted_forward_and_backward(pool2, kind):
    for result in pool2.run(recover_after_aborted_steps, kind):
        _close(result["after_aborts"], result["clean"], rtol=0, atol=0)
        left = result["left"]
        if kind == "ours":
            assert left["backward"] > 0, left  # the aborted backward left reductions and re-gathers
        assert left["forward, after reset"] == left["backward, after reset"] == 0, left


def accumulation_collectives(kind: str, backend: str | None) -> dict:
    """Collectives per micro-batch, counted by torch's ``CommDebugMode``, of two micro-batches
    with ``set_requires_gradient_sync(False)`` then a synced one (3 blocks and a root that
    owns parameters), and the parameters after the AdamW step."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from fsdp_compile.testing import full_parameters
    from fsdp_compile.testing._torch_internals import reset_dynamo
    from fsdp_compile.testing.models import MLPStack

    reset_dynamo()
    fully_shard = fully_shard_of(kind)
    torch.manual_seed(0)
    model = nn.Sequential(MLPStack(dim=8, n_layers=3, bias=True), nn.Linear(8, 2))
    for layer in model[0].layers:
        fully_shard(layer)
    fully_shard(model)
    run = torch.compile(model, backend=backend) if backend else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    counts = []
    for _ in range(2):  # compiled: counted from the second step (the first compiles)
        counts = []
        for micro in range(3):
            model.set_requires_gradient_sync(micro == 2)
            # (An input that requires grad: the first block's backward then reads its
            # weight, which FSDP2 re-gathers either way and we only when it is read.)
            x = torch.randn(4, 8, generator=gen).requires_grad_()
            if backend is None:
                with CommDebugMode() as comm:
                    run(x).square().mean().backward()
                counts.append({str(op): n for op, n in comm.get_comm_counts().items()})
            else:  # torch.compile runs nothing compiled under a dispatch mode: the profiler counts
                with torch.profiler.profile() as prof:
                    run(x).square().mean().backward()
                functional = [e for e in prof.key_averages() if e.key.startswith("_c10d_functional::")]
                counts.append(sum(e.count for e in functional if "wait" not in e.key))
        opt.step()
        opt.zero_grad()
    return {"counts": counts, "params": full_parameters(model)}


def test_gradient_accumulation_communicates_per_unit_as_fsdp2(pool2):
    """Micro-batches without sync gather each unit with one all-gather and reduce nothing;
    the synced one reduce-scatters each unit once, the accumulated gradients included: the
    counts FSDP2's own test checks (``CommDebugMode``), eager, and FSDP2's parameters.
    Compiled (counted by the profiler: ``torch.compile`` compiles nothing under a dispatch
    mode such as ``CommDebugMode``), the same number of functional collectives after our
    bucketing."""
    fsdp2 = pool2.run(accumulation_collectives, "fsdp2", None)
    eager = pool2.run(accumulation_collectives, "ours", None)
    compiled = pool2.run(accumulation_collectives, "ours", "aot_eager_passes")
    gather, reduce = "c10d._allgather_base_", "c10d._reduce_scatter_base_"
    for rank in range(2):
        # 4 units: 4 all-gathers in forward, 3 re-gathers in backward; 4 reduce-scatters when synced.
        assert fsdp2[rank]["counts"] == [{gather: 7}, {gather: 7}, {gather: 7, reduce: 4}], fsdp2[rank]["counts"]
        assert eager[rank]["counts"] == fsdp2[rank]["counts"], (eager[rank]["counts"], fsdp2[rank]["counts"])
        assert compiled[rank]["counts"] == [7, 7, 11], compiled[rank]["counts"]
        _close(eager[rank]["params"], fsdp2[rank]["params"], rtol=1e-6, atol=1e-7)
        _close(compiled[rank]["params"], eager[rank]["params"], rtol=1e-6, atol=1e-7)


class Float8Frozen(nn.Module):
    """A frozen float8 weight (stored in float8, computed in fp32) in an fp32 unit."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.table = nn.Parameter(torch.randn(6, 4).to(torch.float8_e4m3fn), requires_grad=False)

    def forward(self, x):
        return self.proj(x) @ self.table.float()


def train_float8_frozen(kind: str, backend: str | None) -> dict:
    from fsdp_compile.testing import full_parameters
    from fsdp_compile.testing._torch_internals import reset_dynamo

    reset_dynamo()
    torch.manual_seed(0)
    model = fully_shard_of(kind)(Float8Frozen())
    run = torch.compile(model, backend=backend) if backend else model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(STEPS):
        run(torch.full((3, 4), float(step))).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: p.float() for n, p in full_parameters(model).items()}


def test_frozen_float8_parameters_gather_as_bytes_as_fsdp2(pool2):
    """gloo has no float8 collectives: a float8 parameter's all-gather moves its bytes
    (FSDP2's unit gathers move ``uint8`` when dtypes differ), eager and compiled."""
    fsdp2 = pool2.run(train_float8_frozen, "fsdp2", None)
    eager = pool2.run(train_float8_frozen, "ours", None)
    compiled = pool2.run(train_float8_frozen, "ours", "aot_eager")
    for rank in range(2):
        _close(eager[rank], fsdp2[rank], rtol=0, atol=0)
        _close(compiled[rank], eager[rank], rtol=0, atol=0)


def jvp_then_backward(kind: str) -> dict:
    """``torch.func.jvp`` through sharded modules (forward-mode derivative in the inputs, as
    consistency and flow-matching models take it), then a backward through both outputs."""
    from fsdp_compile.testing import full_tensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    fully_shard_of(kind)(model[0])
    fully_shard_of(kind)(model)
    x, direction = torch.randn(2, 4), torch.ones(2, 4)
    out, tangent = torch.func.jvp(model, (x,), (direction,))
    (out.square().sum() + tangent.sum()).backward()
    return {"out": out.detach(), "tangent": tangent.detach(), "grads": [full_tensor(p.grad) for p in model.parameters()]}


def test_jvp_through_sharded_modules_matches_fsdp2(pool2):
    for got, expected in zip(pool2.run(jvp_then_backward, "ours"), pool2.run(jvp_then_backward, "fsdp2"), strict=True):
        torch.testing.assert_close(got["out"], expected["out"], rtol=0, atol=0)
        torch.testing.assert_close(got["tangent"], expected["tangent"], rtol=0, atol=0)
        for g, e in zip(got["grads"], expected["grads"], strict=True):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)


def pipelining_micro_batches(kind: str, switched_before_import: bool = False) -> dict:
    """What a ``torch.distributed.pipelining`` schedule does to its stage's sharded module:
    each micro-batch's backward with sync off (``backward_maybe_with_nosync``), then its
    ``REDUCE_GRAD`` action (``perform_reduce_grad``, torch's own code, run on a stand-in
    stage), then an AdamW step; the parameters after 2 steps. ``switched_before_import``:
    pipelining's module bound ``torch.distributed.fsdp.fully_shard`` after a stack's switch
    to ours (torch 2.13's calls ``fully_shard.state(module)`` on the one it bound)."""
    import types

    import torch.distributed.pipelining.stage as stage_module
    from torch.distributed.pipelining.stage import _PipelineStageBase

    if switched_before_import and hasattr(stage_module, "fully_shard"):
        import fsdp_compile

        torchs, stage_module.fully_shard = stage_module.fully_shard, fsdp_compile.fully_shard
        try:
            return pipelining_micro_batches(kind)
        finally:
            stage_module.fully_shard = torchs

    from fsdp_compile.testing import full_parameters
    from fsdp_compile.testing.models import MLPStack

    torch.manual_seed(0)
    model = MLPStack(dim=8, n_layers=3, bias=True)
    for layer in model.layers:
        fully_shard_of(kind)(layer)
    fully_shard_of(kind)(model)
    stage = types.SimpleNamespace(submod=model, has_backward=True, scale_grads=lambda factor: None)
    stage._gradient_reduction_handle = None  # (torch 2.15's schedules finish through finalize_backward)
    manual_finalization = hasattr(_PipelineStageBase, "start_gradient_reduction")
    for name in ("start_gradient_reduction", "wait_for_gradient_reduction"):
        if hasattr(_PipelineStageBase, name):
            setattr(stage, name, types.MethodType(getattr(_PipelineStageBase, name), stage))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(2):
        for _ in range(3):
            if manual_finalization:  # torch 2.15's forward_one_chunk
                model.set_manual_backward_finalization(True)
            else:  # torch 2.13's backward_maybe_with_nosync
                model.set_is_last_backward(False)
            model.set_reshard_after_backward(False)
            model.set_requires_gradient_sync(False)
            model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        _PipelineStageBase.perform_reduce_grad(stage, 1)
        opt.step()
        opt.zero_grad()
    return full_parameters(model)


@pytest.mark.parametrize("switched_before_import", [False, True], ids=["torchs-fully-shard", "ours-bound"])
def test_pipelinings_gradient_reduction_step_reduces_our_accumulated_gradients(pool2, switched_before_import):
    """torch's pipelining finishes its micro-batches' gradient accumulation by reaching into
    FSDP2's state (torch 2.13: ``fully_shard.state(stage)._state_ctx.all_states``, each
    group's ``post_backward()``) or through ``finalize_backward()`` (torch 2.15): our units
    answer both, reducing what the micro-batches accumulated, as FSDP2's (an unanswered
    call left the gradients unreduced: silently wrong). Also where pipelining bound our
    ``fully_shard`` (a stack's switch made before its import): ours has ``.state(module)``,
    as torch's composable API has (it raised ``AttributeError``)."""
    ours = pool2.run(pipelining_micro_batches, "ours", switched_before_import)
    for got, expected in zip(ours, pool2.run(pipelining_micro_batches, "fsdp2"), strict=True):
        _close(got, expected, rtol=1e-6, atol=1e-7)


def train_beside_torchs_replicate(kind: str, layout: str) -> dict:
    """Three MLPs trained with torch's composable ``replicate()`` (DDP) beside ``fully_shard``
    (``kind``'s): ``"replicate-inside"`` replicates ``model[0]`` before the root is sharded
    (the root's unit must leave that subtree to DDP, as FSDP2's does); ``"units-inside"``
    shards two MLPs, then replicates the root (DDP must leave our units alone)."""
    import torch.distributed as dist
    from torch.distributed._composable import replicate

    fully_shard = fully_shard_of(kind)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(3)))
    if layout == "replicate-inside":
        replicate(model[0])
        fully_shard(model[2])
        fully_shard(model)
    else:
        fully_shard(model[1])
        fully_shard(model[2])
        replicate(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        loss = model(torch.randn(4, 8, generator=gen)).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    kinds = [type(p).__name__ for p in model.parameters()]
    local = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "kinds": kinds, "local": local}


@pytest.mark.parametrize("layout", ["replicate-inside", "units-inside"])
def test_torchs_replicate_composes_with_our_units_as_with_fsdp2s(pool2, layout):
    """torch's ``replicate()`` and ``fully_shard`` split a model between them as with FSDP2:
    each leaves the other's modules alone (torch's composable registry names our units
    ``fully_shard``); losses, which parameters are ``DTensor``s, and every rank's local
    parameters after 3 steps are bitwise FSDP2's."""
    for ours, fsdp2 in zip(
        pool2.run(train_beside_torchs_replicate, "ours", layout),
        pool2.run(train_beside_torchs_replicate, "fsdp2", layout),
        strict=True,
    ):
        assert ours["kinds"] == fsdp2["kinds"] and "Parameter" in ours["kinds"] and "DTensor" in ours["kinds"]
        assert ours["losses"] == fsdp2["losses"]
        assert ours["local"].keys() == fsdp2["local"].keys()
        for name in ours["local"]:
            assert torch.equal(ours["local"][name], fsdp2["local"][name]), name


def fsdp2_private_state(kind: str, tie: bool) -> dict:
    """What code written against FSDP2 reads of its private state (upstream's
    ``test_fully_shard_is_root``, ``test_fully_shard_module_and_param_fqns`` and
    ``test_partial_group_reshard_toggle``, torchtitan's ``ChunkedCELoss`` pattern): which
    unit is the root, each group's module and parameter paths and mesh, and whether the
    head's group is gathered through a chunk loop with resharding off; then the gradients
    that loop gives over 2 Adam steps."""
    import torch.distributed as dist

    from fsdp_compile.testing import full_parameters
    from tests.test_fsdp2_compose_more import VOCAB, _chunked_model, shard_chunked

    fully_shard = fully_shard_of(kind)
    model = _chunked_model(tie)
    shard_chunked(model, fully_shard, tie, head_reshard=False)
    state = fully_shard.state(model)
    state._lazy_init()
    modules = {"root": model, "embed": model.embed, "body": model.body, "norm": model.norm, "head": model.head}
    out = {
        "is_root": {name: fully_shard.state(m)._is_root for name, m in modules.items()},
        "all_states": [
            next(n for n, m in modules.items() if fully_shard.state(m) is s or m._get_fsdp_state() is s)
            for s in state._state_ctx.all_states
        ],
        "groups": {},
    }
    for name, m in modules.items():
        group = m._get_fsdp_state()._fsdp_param_group
        out["groups"][name] = None if group is None else (
            group._module_fqn,
            sorted(p._param_fqn for p in group.fsdp_params),
            [type(p.sharded_param).__name__ for p in group.fsdp_params],
            group.mesh_info.shard_mesh_size,
            dist.get_process_group_ranks(group.mesh_info.shard_process_group),
        )
    head_group = model.head._get_fsdp_state()._fsdp_param_group
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    gathered, params = [], []
    for _ in range(2):
        h = model(tokens, skip_head=True)
        model.head.set_reshard_after_forward(False)
        model.head.set_reshard_after_backward(False)
        grads = []
        for chunk in torch.chunk(h.detach(), 2, dim=1):
            chunk = chunk.contiguous().requires_grad_(True)
            model.head(chunk).sum().backward()
            grads.append(chunk.grad)
            gathered.append(head_group.is_unsharded)
        model.head.set_reshard_after_forward(True)
        model.head.set_reshard_after_backward(True)
        model.head.reshard()
        gathered.append(head_group.is_unsharded)
        h.backward(torch.cat(grads, dim=1))
        out.setdefault("no_grad", [n for n, p in model.named_parameters() if p.grad is None])
        opt.step()
        opt.zero_grad()
        params.append(full_parameters(model))
    out["gathered"], out["params"] = gathered, params
    # torch 2.15's FSDP2 keeps the modules of a grouped unit still to run in a forward: none between steps.
    out["to_run"] = {name: getattr(m._get_fsdp_state(), "_modules_to_run_forward", None) for name, m in modules.items()}
    return out


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_fsdp2_private_state_reads_and_the_chunked_loss_toggle_match_fsdp2(pool2, tie):
    """Code written against FSDP2 reads ``_is_root``, ``_state_ctx.all_states`` (one per
    unit) and ``_fsdp_param_group`` (``_module_fqn``, ``fsdp_params``' ``_param_fqn`` and
    ``sharded_param``, ``mesh_info``, ``is_unsharded``) of each module's state: ours answers
    as FSDP2's does, for every module of a multi-module unit. The chunked loss that toggles
    resharding around the head's chunks keeps the head gathered through the loop, frees it
    at ``reshard()``, and trains as FSDP2 (every parameter gets a gradient)."""
    got = pool2.run(fsdp2_private_state, "ours", tie)
    expected = pool2.run(fsdp2_private_state, "fsdp2", tie)
    for g, e in zip(got, expected, strict=True):
        for key in ("is_root", "all_states", "groups", "gathered", "no_grad"):
            assert g[key] == e[key], (key, g[key], e[key])
        assert g["gathered"] == [True, True, False] * 2 and g["no_grad"] == []
        assert all(v == set() for v in g["to_run"].values()), g["to_run"]
        assert all(v is None or v == set() for v in e["to_run"].values()), e["to_run"]  # (None: torch 2.13)
        for step_got, step_expected in zip(g["params"], e["params"], strict=True):
            _close(step_got, step_expected, rtol=1e-6, atol=1e-7)


def train_with_own_meshes(kind: str, backend: str | None) -> dict:
    """An MLP sharded as one unit over both ranks, except its first layer's weight, which
    ``shard_placement_fn`` gives a mesh of its own: HSDP over (replicate=2, shard=1), ``Shard(1)``.
    3 AdamW steps; and what another mesh over the unit's group raises."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    from fsdp_compile.testing import full_parameters
    from tests.models import compile_counting_graphs

    fully_shard = fully_shard_of(kind)
    world = init_device_mesh("cpu", (2,))
    hsdp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    other = init_device_mesh("cpu", (2,), mesh_dim_names=("other",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    first_weight = model[0].weight

    def placement(param):
        if param is first_weight:
            return ShardPlacementResult(Shard(1), HSDPMeshInfo(hsdp, shard_mesh_dim=1, replicate_mesh_dim=0))
        return None

    try:
        fully_shard(nn.Linear(4, 4), mesh=world, shard_placement_fn=lambda p: ShardPlacementResult(None, FSDPMeshInfo(other, 0)))
        refused = None
    except ValueError as e:
        refused = str(e)
    fully_shard(model, mesh=world, shard_placement_fn=placement)
    meshes = {n: (tuple(p.device_mesh.shape), tuple(map(repr, p.placements))) for n, p in model.named_parameters()}
    run, counter = compile_counting_graphs(model, backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        loss = run(torch.randn(4, 8, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    graphs = counter and counter.frame_count
    return {"meshes": meshes, "losses": torch.stack(losses), "params": full_parameters(model), "graphs": graphs, "refused": refused}


def test_parameters_with_meshes_of_their_own_train_as_fsdp2(pool2):
    """``ShardPlacementResult`` with an HSDP mesh (``Shard(1)``) and another 1-D mesh inside a
    unit sharded over both ranks: the same placements as FSDP2's, eager bitwise FSDP2, compiled
    one graph matching it to fp32 rounding."""
    expected = pool2.run(train_with_own_meshes, "fsdp2", None)
    for backend in (None, "aot_eager"):
        for rank, (g, e) in enumerate(zip(pool2.run(train_with_own_meshes, "ours", backend), expected, strict=True)):
            assert g["meshes"] == e["meshes"], (g["meshes"], e["meshes"])
            assert g["meshes"]["0.weight"] == ((2, 1), ("Replicate()", "Shard(dim=1)")), g["meshes"]
            assert "same process group must use the same" in g["refused"] and "same process group" in e["refused"]
            if backend is None:
                assert torch.equal(g["losses"], e["losses"]), rank
                _close(g["params"], e["params"], rtol=0, atol=0)
            else:
                assert g["graphs"] == 1, g["graphs"]
                _close(g["params"], e["params"], rtol=1e-5, atol=1e-6)
