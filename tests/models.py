"""Small models the tests shard: an MLP stack and a Llama-style decoder."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLPStack(nn.Module):
    """``n_layers`` bias-free (or biased) Linear+ReLU layers of width ``dim``."""

    def __init__(self, dim: int = 16, n_layers: int = 4, bias: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=bias) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return x


@dataclass
class LlamaConfig:
    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 48
    max_seq_len: int = 64
    tie_embeddings: bool = True
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(max_seq_len).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate pairs (even, odd).
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out1 = x1 * cos - x2 * sin
    out2 = x1 * sin + x2 * cos
    return torch.stack((out1, out2), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


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
