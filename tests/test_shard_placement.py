"""``shard_placement_fn``: parameters sharded on a dimension other than 0, as FSDP2's."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from fsdp_compile.testing import assert_parity
from tests.models import shard_blocks
from tests.test_harness import batch, build_mlp, mse


def _matrices_on_dim_1(param):
    return Shard(1) if param.ndim == 2 else None


def shard_on_dim_1(model, fully_shard):
    shard_blocks(model, fully_shard, root_too=True, shard_placement_fn=_matrices_on_dim_1)


class _Uneven(torch.nn.Module):
    """Dims that 2 ranks cannot split evenly on dim 1 (7 columns)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 7), torch.nn.Linear(7, 6)])

    def forward(self, x):
        return self.layers[1](torch.relu(self.layers[0](x)))


def placements(shard_fn_name: str) -> dict:
    from fsdp_compile import fully_shard

    model = build_mlp()
    globals()[shard_fn_name](model, fully_shard)
    return {n: tuple(map(repr, p.placements)) for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "reference,backends", [("fsdp2", ("eager", "aot_eager")), ("single_process", ("eager", "aot_eager_passes"))]
)
def test_dim_1_sharding_matches_fsdp2_and_reference(pool2, reference, backends):
    report = assert_parity(build_mlp, batch, mse, shard_fn=shard_on_dim_1, reference=reference, backends=backends, pool=pool2)
    assert set(report.max_param_gap) == {f"ours:{b}" for b in backends}
    placed = pool2.run(placements, "shard_on_dim_1")[0]
    assert placed["layers.0.weight"] == ("Shard(dim=1)",) and placed["layers.0.bias"] == ("Shard(dim=0)",)


def test_uneven_dim_1_is_padded_like_dim_0(pool2):
    assert_parity(_Uneven, batch, mse, shard_fn=shard_on_dim_1, reference="single_process", backends=("eager", "aot_eager"), pool=pool2)


@pytest.mark.parametrize(
    "fn,error,match",
    [
        (lambda p: Replicate(), TypeError, r"'0\.weight'.*Shard\(dim\)"),
        (lambda p: Shard(2), ValueError, r"'0\.weight'.*\[-2, 2\)"),
    ],
)
def test_bad_shard_placements_are_rejected(fake_pg, fn, error, match):
    from fsdp_compile import fully_shard

    with pytest.raises(error, match=match):
        fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4)), shard_placement_fn=fn)
