"""Models with low-precision parameter subclasses (torchao), for tests on the rank pool:
QLoRA (frozen NF4 base weights, trainable LoRA adapters) and float8 training with
float8 all-gathers. Module-level functions, so the ranks can import them."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, LORA_RANK = 256, 8  # NF4 needs 64-element blocks, 256 blocks a scaler block, split evenly


class QLoRALinear(nn.Module):
    """A frozen NF4 weight plus a trainable low-rank adapter (torchtune's LoRALinear)."""

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        from torchao.quantization import to_nf4

        self.weight = nn.Parameter(to_nf4(nn.Linear(dim, dim, bias=False).weight.detach()), requires_grad=False)
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)

    def forward(self, x):
        return F.linear(x, self.weight) + self.lora_b(self.lora_a(x))


class QLoRABlock(nn.Module):
    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn_proj = QLoRALinear(dim, rank)
        self.mlp = QLoRALinear(dim, rank)

    def forward(self, x):
        x = x + torch.tanh(self.attn_proj(self.norm(x)))
        return x + F.gelu(self.mlp(x))


class QLoRAModel(nn.Module):
    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(QLoRABlock(DIM, LORA_RANK) for _ in range(n_layers))
        self.head = nn.Linear(DIM, 8)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_qlora() -> nn.Module:
    torch.manual_seed(0)
    model = QLoRAModel()
    for name, p in model.named_parameters():  # QLoRA trains the adapters (and the head) only
        if "lora" not in name and not name.startswith("head"):
            p.requires_grad_(False)
    return model


class Float8MLP(nn.Module):
    def __init__(self, dim: int = 64, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim, bias=False), nn.GELU(), nn.Linear(2 * dim, dim, bias=False))
            for _ in range(n_layers)
        )
        self.head = nn.Linear(dim, 8)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def build_float8() -> nn.Module:
    """Float8 training (emulated on CPU) with float8 all-gathers of the block weights."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = Float8MLP()
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn.startswith("layers"))
    return model


def batch(step: int, dim: int = DIM):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, dim, generator=g), torch.randn(8, 8, generator=g)


def batch_float8(step: int):
    """Every rank's slice is the same rows (the batch is one half twice): float8 scales its
    activations by their max over the local batch, so ranks and the single-process
    reference then compute with the same scales."""
    x, y = batch(step, 64)
    return torch.cat([x[:4], x[:4]]), torch.cat([y[:4], y[:4]])


def mse(out, target):
    return F.mse_loss(out, target)


def shard_layers(model, fully_shard) -> None:
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
