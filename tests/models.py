"""Test models and data: the shipped reference models plus an awkward one, and batches;
and the two steps nearly every test takes with a model: shard it per block
(:func:`shard_blocks`) and compile it while counting Dynamo's graphs
(:func:`compile_counting_graphs`). Module-level functions: they run on the ranks too."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_compile import fully_shard
from fsdp_compile.testing.models import Llama, LlamaConfig, MLPStack

__all__ = [
    "Llama", "LlamaConfig", "MLPStack", "Routed", "Zoo", "build", "batch", "loss_fn",
    "shard_blocks", "fully_shard_of", "compile_counting_graphs",
]


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


class RoutedBlock(nn.Module):
    """A residual block gated by a router computed in fp32 (as MoE routers are): the
    router's weight is marked ``keep_fp32`` for ``param_dtype_override_fn``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, dim, bias=False)
        self.router.weight.keep_fp32 = True
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(F.linear(x.float(), self.router.weight.float()), -1).to(x.dtype)
        return x + self.proj(x * gate)


class Routed(nn.Module):
    def __init__(self, dim: int = 6, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(RoutedBlock(dim) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


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
    if name == "llama_untied":  # output projection a parameter of its own, as most decoders
        model = Llama(LlamaConfig(tie_embeddings=False))
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
    if name == "routed":
        model = Routed()
        return model, [*model.layers, model]
    raise KeyError(name)


def batch(name: str, step: int, global_batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch for ``step`` (identical on every rank): inputs and targets."""
    g = torch.Generator().manual_seed(1000 + step)
    if name.startswith("llama"):
        tokens = torch.randint(0, 64, (global_batch, 17), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    dim_in, dim_out = {"mlp": (5, 5), "zoo": (4, 3), "routed": (6, 6)}[name]
    return torch.randn(global_batch, dim_in, generator=g), torch.randn(global_batch, dim_out, generator=g)


def loss_fn(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name.startswith("llama"):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())
    return F.mse_loss(out, target)


def shard_blocks(model: nn.Module, shard_fn=fully_shard, *, blocks=None, root_too: bool = False, **block_kwargs) -> nn.Module:
    """Shard per block, then the root, as users do: ``shard_fn(block, **block_kwargs)``
    for each of ``blocks`` (default: ``model.layers``), then ``shard_fn(model)`` with
    the defaults, or with ``block_kwargs`` too if ``root_too``. Returns ``model``.

    ``shard_fn`` is our ``fully_shard`` unless given (e.g. torch's); the signature
    ``(model, fully_shard)`` also makes this a ``shard_fn`` for
    :func:`fsdp_compile.testing.assert_parity`."""
    for block in model.layers if blocks is None else blocks:
        shard_fn(block, **block_kwargs)
    shard_fn(model, **(block_kwargs if root_too else {}))
    return model


def fully_shard_of(kind: str):
    """``fully_shard`` of torch's FSDP2 for ``kind == "fsdp2"``, ours otherwise."""
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        return torch_fully_shard
    return fully_shard


def compile_counting_graphs(model: nn.Module, backend, **compile_kwargs):
    """``(run, counter)``: ``model`` compiled with ``backend`` behind Dynamo's
    ``CompileCounterWithBackend`` (its ``frame_count`` and ``graphs``), or
    ``(model, None)`` for ``backend=None``: eager, nothing to count."""
    if not backend:
        return model, None
    from fsdp_compile.testing._torch_internals import compile_counter

    counter = compile_counter(backend)
    return torch.compile(model, backend=counter, **compile_kwargs), counter


def max_gap(a: dict, b: dict) -> float:
    """The largest difference between two training runs' results: their per-step
    ``"losses"`` (floats) and ``"params"`` (per step, full parameters by name; the same
    names in both)."""
    gaps = [abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)]
    for pa, pb in zip(a["params"], b["params"], strict=True):
        assert pa.keys() == pb.keys()
        gaps += [(pa[k] - pb[k]).abs().max().item() for k in pa]
    return max(gaps)


def padded_gather_numel(params, world_size: int = 2) -> int:
    """How many elements a unit's all-gather outputs: each parameter's dim 0 padded to a
    multiple of ``world_size``. Computed from shapes only: indexing a sharded ``DTensor``
    (``p[0]``) would issue a collective of its own on every call."""
    total = 0
    for p in params:
        rows = p.shape[0] if p.ndim else 1
        per_row = p.numel() // rows if rows else 0
        if p.ndim <= 1:
            total += -(-p.numel() // world_size) * world_size
        else:
            total += -(-rows // world_size) * world_size * per_row
    return total
