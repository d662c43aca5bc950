"""Rank-side functions for the debugging tests."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn


class RankDependent(nn.Module):
    """Rank 0 runs an extra sharded layer: its graph has more collectives."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        x = self.a(x)
        if dist.get_rank() == 0:
            x = self.extra(x)
        return self.b(x)


def run_rank_dependent_graph(backend: str = "inductor") -> tuple[str, float]:
    from fsdp_compile import fully_shard

    torch.manual_seed(0)
    model = RankDependent()
    for m in (model.a, model.extra, model.b, model):
        fully_shard(m)
    compiled = torch.compile(model, backend=backend)
    start = time.perf_counter()
    try:
        compiled(torch.randn(2, 4)).sum().backward()
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return str(e), time.perf_counter() - start
    return "no error", time.perf_counter() - start


def compile_under_dump(path: str) -> list[str]:
    import fsdp_compile.debug
    from fsdp_compile import fully_shard
    from fsdp_compile.testing.models import MLPStack

    torch.manual_seed(0)
    model = MLPStack(dim=8, n_layers=3, bias=True)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    with fsdp_compile.debug.dump(path) as here:
        torch.compile(model)(torch.randn(2, 8)).sum().backward()
    return sorted(str(p.relative_to(here)) for p in here.rglob("*") if p.is_file() and "depyf" not in p.parts) + [
        f"depyf files: {sum(1 for _ in (here / 'depyf').rglob('*'))}"
    ]


class EagerLinear(nn.Linear):
    """A layer whose forward Dynamo must not trace (as FSDP2's hooks are)."""

    @torch._dynamo.disable
    def forward(self, x):
        return super().forward(x)


class BreaksInsideAUnit(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = EagerLinear(4, 4)

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)


def warnings_from_break_and_recompile() -> list[str]:
    import warnings

    from fsdp_compile import fully_shard

    torch.manual_seed(0)
    model = BreaksInsideAUnit()
    fully_shard(model.b)
    fully_shard(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend="aot_eager")(torch.randn(2, 4)).sum().backward()
        # Recompiles of a graph that holds units (no break of its own). Dynamo skips the
        # code of a frame it could not resume for the rest of the process, so start afresh.
        torch._dynamo.reset()
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        fully_shard(model[0])
        fully_shard(model)
        compiled = torch.compile(model, backend="aot_eager")
        compiled(torch.randn(2, 4)).sum().backward()
        model.eval()
        with torch.no_grad():
            compiled(torch.randn(2, 4))
        compiled(torch.randn(3, 4))  # eval + new batch size: more recompiles
    return [str(w.message) for w in caught if "fsdp_compile" in str(w.message)]


@torch._dynamo.disable
def _eager_linear(x, module):
    return torch.nn.functional.linear(x, module.weight)


class ReadsAnotherUnitEagerly(nn.Module):
    """The root's compiled forward calls eager code that reads another unit's weight."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return _eager_linear(self.a(x), self.b)


def warnings_from_eager_gather() -> list[str]:
    import warnings

    from fsdp_compile import fully_shard

    torch.manual_seed(0)
    model = ReadsAnotherUnitEagerly()
    fully_shard(model.b)
    fully_shard(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend="aot_eager")(torch.randn(2, 4)).sum().backward()
    return [str(w.message) for w in caught if "fsdp_compile" in str(w.message)]
