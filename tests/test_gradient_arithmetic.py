"""Gradient reduction arithmetic: FSDP2's, bit for bit.

FSDP2 reduces float32 / bfloat16 gradients with the group's average, and float16 ones
(overflow risk), or any with ``set_force_sum_reduction_for_comms(True)``, with sums:
divided by a power of two before and by the rest of the factor after
(``_get_gradient_divide_factors`` in torch's ``_fsdp_collectives.py``). Rounding differs
between those forms, so we follow FSDP2's choice for every dtype, group size, divide
factor and sum setting: checked here against torch's own function (every case), and by
training against FSDP2 on 2 and 4 gloo ranks (eager bitwise; compiled with
``aot_eager`` bitwise our eager run).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn as nn

from tests.models import fully_shard_of


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def _torchs(reduce_dtype, shard: int, replicas: int, factor, force_sum: bool) -> tuple:
    """torch's ``_get_gradient_divide_factors`` as (rs op, ar op, premultiply, pre, post); a
    ``PREMUL_SUM`` by 1 (factor 1.0) is a sum, as ours does it (x * 1.0 is x, bit for bit)."""
    from torch.distributed import ReduceOp
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    pre, post, rs_op, ar_op = _get_gradient_divide_factors(
        _Group(shard), _Group(replicas) if replicas > 1 else None, reduce_dtype, "cpu", factor, force_sum
    )
    names = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg"}
    premultiply = None
    if rs_op not in names:  # PREMUL_SUM(1 / factor)
        rs_op, premultiply = ReduceOp.SUM, (None if factor == 1 else 1.0 / factor)
    norm = lambda x: None if x is None or x == 1 else float(x)  # noqa: E731
    return names[rs_op], names[ar_op], premultiply, norm(pre), norm(post)


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gradient_reduction_is_fsdp2s_for_every_group_and_factor(reduce_dtype):
    from fsdp_compile.runtime.collectives import gradient_reduction

    cases = itertools.product((2, 3, 4, 8, 6), (1, 2, 4), (None, 1.0, 2.0, 3.0, 8.0, 16.0), (False, True))
    for shard, replicas, factor, force_sum in cases:
        got = tuple(gradient_reduction(reduce_dtype, shard, replicas, factor, force_sum))
        assert got == _torchs(reduce_dtype, shard, replicas, factor, force_sum), (shard, replicas, factor, force_sum)


#: (name, (param_dtype, reduce_dtype), divide factor, force_sum). ``fp16-params`` (no
#: reduce dtype): FSDP2 reduces in float16 on torch 2.13 and, the gradient upcast, in
#: float32 on 2.15 (``compat.fsdp2_reduces_in_original_dtype``); ours follows each.
CASES = [
    ("fp16-params", (torch.float16, None), None, False),
    ("fp16-reduce", (None, torch.float16), None, False),
    ("fp16-factor3", (torch.float16, torch.float16), 3.0, False),
    ("fp32-force-sum", (None, None), None, True),
    ("fp32-factor3-force-sum", (None, None), 3.0, True),
    ("bf16-force-sum", (torch.bfloat16, None), None, True),
]


def train_gradient_arithmetic(kind: str, backend: str | None) -> dict:
    """Two linear layers (each a unit) and a root, trained 3 SGD steps per case of
    :data:`CASES`: the full gradients of each step and the final parameters."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_compile.testing import full_parameters, full_tensor

    fully_shard = fully_shard_of(kind)
    out = {}
    for name, (param_dtype, reduce_dtype), factor, force_sum in CASES:
        torch._dynamo.reset()  # a new model per case: compile each afresh
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 12), nn.Linear(12, 5))
        model = copy.deepcopy(ref)
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for m in (model[0], model[2], model):
            fully_shard(m, mp_policy=mp)
            if factor is not None:
                m.set_gradient_divide_factor(factor)
            m.set_force_sum_reduction_for_comms(force_sum)
        run = torch.compile(model, backend=backend) if backend else model
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(1 + dist.get_rank())
        grads = []
        for _ in range(3):
            x = torch.randn(8, 16, generator=gen) * 3
            run(x).float().square().mean().backward()
            grads.append([full_tensor(p.grad) for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        out[name] = {"grads": grads, "params": full_parameters(model)}
    return out


def _assert_same(got: dict, expected: dict, what: str, exact: bool = True) -> None:
    """Every step's gradients and the final parameters equal (``exact``), or within
    their dtype's rounding (sums taken in another order)."""
    assert got.keys() == expected.keys()
    for name in got:
        pairs = [
            (f"step {step}, gradient {i}", a, b)
            for step, (g, e) in enumerate(zip(got[name]["grads"], expected[name]["grads"], strict=True))
            for i, (a, b) in enumerate(zip(g, e, strict=True))
        ]
        pairs += [(key, got[name]["params"][key], expected[name]["params"][key]) for key in got[name]["params"]]
        for where, a, b in pairs:
            if exact:
                assert torch.equal(a, b), f"{what}: {name}, {where}: max diff {(a.float() - b.float()).abs().max()}"
            else:
                tol = {"fp16": 4e-3, "bf16": 3e-2, "fp32": 2e-5}[name[:4]]  # the reduction's dtype
                torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{what}: {name}, {where}: {m}")


@pytest.fixture(scope="module")
def pool4(rank_pools):
    return rank_pools(4)


@pytest.mark.parametrize("ranks", [2, 4])
def test_gradients_are_fsdp2s_bitwise_in_float16_and_with_sum_reductions(pool2, pool4, ranks):
    """4 ranks: FSDP2 divides by 2 before the sum and by 2 after in float16; 2 ranks: by 2
    before only. Our eager run is FSDP2's bit for bit. Compiled (``aot_eager``): bitwise
    our eager run on 2 ranks; on 4, within rounding (gloo's reduce-scatter is a ring
    all-reduce whose order of summation depends on an element's offset in the buffer, and
    eager buckets a unit's gradients into one buffer where this graph reduces each alone)."""
    pool = pool2 if ranks == 2 else pool4
    expected = pool.run(train_gradient_arithmetic, "fsdp2", None)
    eager = pool.run(train_gradient_arithmetic, "ours", None)
    compiled = pool.run(train_gradient_arithmetic, "ours", "aot_eager")
    for rank in range(ranks):
        _assert_same(eager[rank], expected[rank], f"eager vs FSDP2, rank {rank}")
        _assert_same(compiled[rank], eager[rank], f"aot_eager vs eager, rank {rank}", exact=ranks == 2)


def train_counting_reduce_scatters(transport: bool, watched_by: str | None) -> dict:
    """An eager bucketed step on gloo per reduce dtype (float32 ``avg``, bfloat16 and
    float16 sums): the gradients, and which collectives went to ``torch.distributed``
    (``watched_by``: ``"CommDebugMode"``, with its count of reduce-scatters, or
    ``"patch"``: ``dist.reduce_scatter_single`` patched, as torch's FSDP2 tests do)."""
    from unittest import mock

    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.debug import CommDebugMode

    import fsdp_compile
    import fsdp_compile.runtime.collectives as collectives
    from fsdp_compile.testing import full_tensor

    calls: dict = {}
    issue = collectives.issue_c10d_collective

    def counting_issue(kind, *args, **kwargs):
        calls[kind] = calls.get(kind, 0) + 1
        return issue(kind, *args, **kwargs)

    real_reduce_scatter = dist.reduce_scatter_single

    def patched_reduce_scatter(*args, **kwargs):
        calls["patched"] = calls.get("patched", 0) + 1
        return real_reduce_scatter(*args, **kwargs)

    grads = {}
    with fsdp_compile.config.patch(gloo_all_to_all=transport), mock.patch.object(collectives, "issue_c10d_collective", counting_issue):
        for reduce_dtype in (torch.float32, torch.bfloat16, torch.float16):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 13), nn.Linear(13, 5))
            mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
            for m in (model[0], model[2], model):
                fsdp_compile.fully_shard(m, mp_policy=mp)
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1 + dist.get_rank())) * 3
            if watched_by == "CommDebugMode":
                with CommDebugMode() as comm:
                    model(x).square().mean().backward()
                counted = comm.get_comm_counts().get(torch.ops.c10d._reduce_scatter_base_, 0)
                calls["counted"] = calls.get("counted", 0) + counted
            elif watched_by == "patch":
                with mock.patch.object(dist, "reduce_scatter_single", patched_reduce_scatter):
                    model(x).square().mean().backward()
            else:
                model(x).square().mean().backward()
            grads[str(reduce_dtype)] = [full_tensor(p.grad) for p in model.parameters()]
    return {"calls": calls, "grads": grads}


def test_eager_reduce_scatters_over_two_gloo_ranks_are_all_to_alls_with_gloos_bits(pool2):
    """Eager, 2 gloo ranks: each bucket's reduce-scatter goes out as an all-to-all of
    its halves, added on arrival (gloo's own reduce-scatter all-reduces a copy of the
    whole input: twice the bytes), with the same bits as gloo's for ``avg`` and for sums
    in bfloat16 and float16. Watched op by op (``CommDebugMode``, a patched
    ``dist.reduce_scatter_single``) it is FSDP2's reduce-scatter; ``gloo_all_to_all=False``
    keeps gloo's."""
    kept = pool2.run(train_counting_reduce_scatters, False, None)
    runs = {
        "sent": pool2.run(train_counting_reduce_scatters, True, None),
        "counted": pool2.run(train_counting_reduce_scatters, True, "CommDebugMode"),
        "patched": pool2.run(train_counting_reduce_scatters, True, "patch"),
    }
    expected = {
        "sent": {"all_gather": 12, "all_to_all": 9},
        "counted": {"all_gather": 12, "reduce_scatter": 9, "counted": 9},
        "patched": {"all_gather": 12, "reduce_scatter": 9, "patched": 9},
    }
    for rank in range(2):
        assert kept[rank]["calls"] == {"all_gather": 12, "reduce_scatter": 9}
        for name, run in runs.items():
            assert run[rank]["calls"] == expected[name], name
            for dtype, grads in kept[rank]["grads"].items():
                for i, (a, b) in enumerate(zip(run[rank]["grads"][dtype], grads, strict=True)):
                    assert torch.equal(a, b), f"{name}, {dtype}, gradient {i}: max diff {(a - b).abs().max()}"
