"""Test models and data: the shipped reference models plus an awkward one, and batches."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_compile.testing.models import Llama, LlamaConfig, MLPStack

__all__ = ["Llama", "LlamaConfig", "MLPStack", "Zoo", "build", "batch", "loss_fn"]


class Zoo(nn.Module):
    """Everything awkward at once: a frozen layer, buffers (one mutated in forward),
    a 0-dim parameter, a weight whose dim 0 (1) is smaller than the world size,
    another unit's weight read outside that unit's forward, and train/eval branches."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.tiny = nn.Linear(6, 1)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.head = nn.Linear(6, 3)
        self.register_buffer("shift", torch.linspace(-1, 1, 6))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        h = torch.tanh(self.embed(x)) + self.shift
        h = self.frozen(h)
        if self.training:
            h = h * 0.9
        reused = F.linear(h, self.head.weight)  # head's weight outside head's forward
        return self.head(h) + 0.5 * reused + self.tiny(h) * self.scale


def zoo_units(model: Zoo) -> list[nn.Module]:
    return [model.embed, model.head, model]


def mlp_units(model: MLPStack) -> list[nn.Module]:
    return [*model.layers, model]


def llama_units(model: Llama) -> list[nn.Module]:
    return [*model.layers, model]


def build(name: str) -> tuple[nn.Module, list]:
    """A freshly initialised model (seeded) and the modules to shard, bottom-up."""
    torch.manual_seed(0)
    if name == "mlp":
        model = MLPStack(dim=5, n_layers=3, bias=True)
        return model, mlp_units(model)
    if name == "llama":
        model = Llama(LlamaConfig())
        return model, llama_units(model)
    if name == "llama_ac":
        model = Llama(LlamaConfig(activation_checkpointing="full"))
        return model, llama_units(model)
    if name == "llama_sac":
        model = Llama(LlamaConfig(activation_checkpointing="selective"))
        return model, llama_units(model)
    if name == "llama_tied_across_units":
        model = Llama(LlamaConfig())
        return model, [model.tok_embeddings, *model.layers, model]
    if name == "zoo":
        model = Zoo()
        return model, zoo_units(model)
    raise KeyError(name)


def batch(name: str, step: int, global_batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch for ``step`` (identical on every rank): inputs and targets."""
    g = torch.Generator().manual_seed(1000 + step)
    if name.startswith("llama"):
        tokens = torch.randint(0, 64, (global_batch, 17), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    dim_in, dim_out = {"mlp": (5, 5), "zoo": (4, 3)}[name]
    return torch.randn(global_batch, dim_in, generator=g), torch.randn(global_batch, dim_out, generator=g)


def loss_fn(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name.startswith("llama"):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())
    return F.mse_loss(out, target)
