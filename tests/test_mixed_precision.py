"""Mixed precision (FSDP2's MixedPrecisionPolicy) on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from tests.models import batch, build
from tests.test_parity import _assert_records_equal, _shard_model, train_all


def compiled_collective_dtypes(mp: str, name: str = "mlp") -> dict:
    """Dtypes of the captured collectives' inputs in the forward and backward graphs."""
    from fsdp_compile.base.compat import c10d_functional
    from fsdp_compile.testing import GraphCapture, collective_nodes

    model, units = build(name)
    _shard_model("ours", units, mp)
    capture = GraphCapture()
    x, y = batch(name, 0)
    torch.compile(model, backend=capture)(x).sum().backward()
    (fw,), (bw,) = capture.forward_graphs, capture.backward_graphs
    dtypes = lambda g, op: sorted({str(n.args[0].meta["val"].dtype) for n in collective_nodes(g, op)})  # noqa: E731
    return {
        "forward_all_gather": dtypes(fw, c10d_functional.all_gather_into_tensor),
        "backward_reduce_scatter": dtypes(bw, c10d_functional.reduce_scatter_tensor),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }


_cache: dict = {}


def _compiled_variant(name: str, mp: str) -> str:
    """Compiled through our passes without Inductor's code generation (``inductor_passes``):
    casts, gathers and reductions in low precision are handled there. bf16 under real
    Inductor: ``test_examples.py`` (``examples/train.py --bf16``)."""
    return "ours-inductor_passes"


def _results(pool2, name: str, mp: str) -> dict:
    key = (name, mp)
    if key not in _cache:
        variants = ["ours-eager", "ours-aot_eager", _compiled_variant(name, mp), "fsdp2"]
        _cache[key] = pool2.run(train_all, name, variants, 3, False, mp)[0]
    return _cache[key]


def _has_param_dtype_override() -> bool:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return "param_dtype_override_fn" in MixedPrecisionPolicy.__dataclass_fields__


needs_override = pytest.mark.skipif(not _has_param_dtype_override(), reason="MixedPrecisionPolicy.param_dtype_override_fn is torch >= 2.15")


@pytest.mark.parametrize(
    "name,mp",
    [
        (name, mp) for name in ("mlp", "llama") for mp in ("bf16", "bf16-reduce-bf16")
    ] + [pytest.param("routed", "bf16-router-fp32", marks=needs_override)],  # its routers stay fp32
)
def test_matches_torch_fsdp2_with_the_same_policy(pool2, name, mp):
    r = _results(pool2, name, mp)
    _assert_records_equal(r["ours-eager"], r["ours-aot_eager"], exact=True, what=f"{mp}: aot_eager vs eager")
    # Same casts as FSDP2, but bf16 rounding of different kernels: bf16-level tolerance.
    for variant in ("ours-eager", _compiled_variant(name, mp)):
        _assert_records_equal(r["fsdp2"], r[variant], exact=False, rtol=2e-2, atol=2e-3, what=f"{mp}: {variant} vs FSDP2")


@pytest.mark.parametrize(
    "name,mp,gather,reduce",
    [
        ("mlp", "bf16", ["torch.bfloat16"], "torch.float32"),
        ("mlp", "bf16-reduce-bf16", ["torch.bfloat16"], "torch.bfloat16"),
        ("mlp", "bf16-reduce-unset", ["torch.bfloat16"], "as FSDP2"),
    ],
)
def test_collective_dtypes_in_the_graph(pool2, name, mp, gather, reduce):
    from fsdp_compile.base.compat import fsdp2_reduces_in_original_dtype

    if reduce == "as FSDP2":  # torch 2.15's FSDP2 upcasts the gradient first
        reduce = "torch.float32" if fsdp2_reduces_in_original_dtype() else "torch.bfloat16"
    d = pool2.run(compiled_collective_dtypes, mp, name)[0]
    assert d["forward_all_gather"] == gather  # bf16 gathers move half the bytes
    assert d["backward_reduce_scatter"] == [reduce]
    assert d["param_dtypes"] == d["grad_dtypes"] == ["torch.float32"]  # sharded state stays fp32


def gathered_dtypes_with_override() -> dict:
    """Each parameter's gathered dtype under ``param_dtype_override_fn`` (the routers kept
    fp32), and the error for an override FSDP2 rejects too."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_compile import fully_shard
    from fsdp_compile._fully_shard import managed_params
    from tests.test_parity import MIXED_PRECISION

    model, units = build("routed")
    _shard_model("ours", units, "bf16-router-fp32")
    out = {"dtypes": {p.fqn: str(p.spec.param_dtype) for p in managed_params(model)}}
    bad = MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: torch.float16)
    other, _ = build("mlp")
    try:
        fully_shard(other, mp_policy=bad)
        out["bad"] = "no error"
    except ValueError as e:
        out["bad"] = str(e)
    assert MIXED_PRECISION  # (imported for its policies)
    return out


@needs_override
def test_param_dtype_override_fn_keeps_chosen_parameters_in_their_dtype(pool2):
    d = pool2.run(gathered_dtypes_with_override)[0]
    routers = {name: d["dtypes"].pop(name) for name in list(d["dtypes"]) if "router" in name}
    assert set(routers) == {"layers.0.router.weight", "layers.1.router.weight"}
    assert set(routers.values()) == {"torch.float32"}
    assert set(d["dtypes"].values()) == {"torch.bfloat16"}, d["dtypes"]
    assert "param_dtype_override_fn returned torch.float16" in d["bad"] and "shape (5, 5)" in d["bad"]


class _WithIndexTable(torch.nn.Module):
    """A linear layer reading its input through an integer parameter (a frozen index
    table, as quantized and sparse models keep)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 4)
        self.table = torch.nn.Parameter(torch.tensor([7, 0, 6, 1, 5, 2, 4, 3]), requires_grad=False)

    def forward(self, x):
        return self.lin(x[:, self.table])


def train_with_index_table(kind: str, steps: int = 3) -> dict:
    """``_WithIndexTable`` under a bf16 policy, ``kind``: FSDP2 (eager), ours eager or ours
    compiled (``aot_eager``): losses, full parameters, and each parameter's gathered dtype."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_compile._fully_shard import managed_params
    from fsdp_compile.testing import full_parameters
    from tests.models import fully_shard_of

    model = _WithIndexTable()
    fully_shard_of("fsdp2" if kind == "fsdp2" else "ours")(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    run = torch.compile(model, backend="aot_eager") if kind == "ours-aot_eager" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, params = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 8, generator=g).chunk(dist.get_world_size())[dist.get_rank()]
        loss = run(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        params.append(full_parameters(model))
    gathered = {} if kind == "fsdp2" else {p.fqn: str(p.spec.param_dtype) for p in managed_params(model)}
    return {"losses": losses, "params": params, "gathered": gathered}


def test_integer_parameter_keeps_its_dtype_under_a_bf16_policy(pool2):
    """As in FSDP2, ``param_dtype`` applies to floating-point parameters only: an integer
    parameter is gathered as it is (it was cast to bf16 and failed as an index); the
    model trains like FSDP2's (bf16-level tolerance, as above: torch 2.15's FSDP2 reduces
    bf16 gradients in another order), compiled bitwise eager."""
    fsdp2 = pool2.run(train_with_index_table, "fsdp2")[0]
    eager, compiled = (pool2.run(train_with_index_table, kind)[0] for kind in ("ours-eager", "ours-aot_eager"))
    for kind, ours in (("ours-eager", eager), ("ours-aot_eager", compiled)):
        assert ours["gathered"] == {"lin.weight": "torch.bfloat16", "lin.bias": "torch.bfloat16", "table": "None"}, kind
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(fsdp2["losses"]), rtol=2e-2, atol=2e-3)
        for mine, theirs in zip(ours["params"], fsdp2["params"], strict=True):
            assert torch.equal(mine["table"], theirs["table"]), kind
            for name in theirs:
                torch.testing.assert_close(mine[name], theirs[name], rtol=2e-2, atol=2e-3, msg=f"{kind}: {name}")
    assert compiled["losses"] == eager["losses"]
    for mine, theirs in zip(compiled["params"], eager["params"], strict=True):
        for name in theirs:
            torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=0, msg=f"aot_eager vs eager: {name}")
