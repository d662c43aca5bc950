"""Module-level model/data/loss functions for the parity-harness tests (they run on the ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fsdp_compile.testing.models import MLPStack


def build_mlp():
    torch.manual_seed(0)
    return MLPStack(dim=6, n_layers=3, bias=True)


def shard_mlp(model, fully_shard):
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)


def mse(output, target):
    return F.mse_loss(output, target)
