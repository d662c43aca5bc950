"""QLoRA with fsdp_compile: a small Hugging Face ``transformers`` Llama (built from a
config, no download) whose attention and MLP projections become frozen 4-bit NF4
weights (torchao) plus trainable LoRA adapters; each decoder layer is one sharding unit,
the model is compiled, and only the adapters train.

    pip install -e ".[examples,torchao]"
    python examples/qlora.py                       # starts 2 CPU ranks itself (gloo)
    python examples/qlora.py --steps 3 --compile-backend aot_eager
    torchrun --nproc-per-node 4 examples/qlora.py --hidden 1024 --intermediate 2048

The NF4 weights stay NF4 when sharded (each rank holds its rows' 4-bit codes and
scales) and are all-gathered as such, through FSDP2's all-gather extension; they get no
gradient, so only the adapters' gradients are reduce-scattered. NF4 quantizes blocks of
64 values, with the blocks' scales quantized in groups of 256 blocks: every projection
weight's numel must be a multiple of 64 * 256 = 16384, and that number of groups (numel /
16384: 4 for a 256 x 256 weight) a multiple of the world size, so that a shard is whole
groups. Synthetic tokens that follow a fixed rule (so the loss falls); rank 0 prints the
loss of every step and, at the end, the local tensor type of a sharded NF4 weight.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _launch import run_on_ranks
from train import synthetic_tokens

NF4_GROUP = 64 * 256  # to_nf4's defaults: block_size 64, scaler_block_size 256


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=2, help="per rank")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--compile-backend", default="inductor", help="inductor | aot_eager | eager (no compile)")
    p.add_argument("--world-size", type=int, default=2, help="CPU ranks to start when not under torchrun")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for module in ("torchao", "transformers"):
        if importlib.util.find_spec(module) is None:
            p.error(f"qlora.py needs {module}: pip install -e '.[examples,torchao]'")
    return args


class QLoRALinear(nn.Module):
    """A frozen NF4 copy of ``linear``'s weight plus a trainable low-rank adapter:
    ``x W^T + (alpha / rank) x A^T B^T``, B zero-initialised (so training starts from the
    base model), A as ``nn.Linear`` initialises it (LoRA's choice)."""

    def __init__(self, linear: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        from torchao.quantization import to_nf4

        if linear.bias is not None:
            raise ValueError("QLoRALinear: the base linear has a bias (Llama's projections have none)")
        self.weight = nn.Parameter(to_nf4(linear.weight.detach()), requires_grad=False)
        self.lora_a = nn.Linear(linear.in_features, rank, bias=False, device=linear.weight.device)
        self.lora_b = nn.Linear(rank, linear.out_features, bias=False, device=linear.weight.device)
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NF4Tensor intercepts F.linear: dequantize to x's dtype, then matmul (no weight gradient).
        return F.linear(x, self.weight) + self.scaling * self.lora_b(self.lora_a(x))


def apply_qlora(model, rank: int, alpha: float, world_size: int) -> list[str]:
    """Freeze ``model``, then swap every attention / MLP projection of its decoder layers
    for a :class:`QLoRALinear` (whose adapters train). Returns the swapped names."""
    for p in model.parameters():
        p.requires_grad_(False)
    swapped = []
    for i, layer in enumerate(model.model.layers):
        for block_name in ("self_attn", "mlp"):
            block = getattr(layer, block_name)
            for name, child in list(block.named_children()):
                if not isinstance(child, nn.Linear):
                    continue
                fqn = f"model.layers.{i}.{block_name}.{name}"
                numel = child.weight.numel()
                if numel % NF4_GROUP or (numel // NF4_GROUP) % world_size:
                    raise ValueError(
                        f"{fqn}: its {tuple(child.weight.shape)} weight cannot be NF4-sharded over {world_size} ranks "
                        f"(numel must be a multiple of {NF4_GROUP} * world size); change --hidden / --intermediate"
                    )
                setattr(block, name, QLoRALinear(child, rank, alpha))
                swapped.append(fqn)
    return swapped


def train(args: argparse.Namespace) -> list[float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp_compile import fully_shard

    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,  # k/v projections as large as q's: NF4 needs 16384-element groups
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)  # same base weights and adapters on every rank
    model = LlamaForCausalLM(config).to(device)
    swapped = apply_qlora(model, args.lora_rank, args.lora_alpha, world_size)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    step_fn = model if args.compile_backend == "eager" else torch.compile(model, backend=args.compile_backend)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr)
    if rank == 0:
        n_train = sum(p.numel() for p in trainable)  # DTensor numel: the full parameter's
        n_all = sum(p.numel() for p in model.parameters())
        print(f"{len(swapped)} projections NF4 + LoRA (rank {args.lora_rank}); trainable {n_train} of {n_all}", flush=True)

    losses = []
    for step in range(args.steps):
        data = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 7919 + rank)
        tokens = synthetic_tokens(args.batch_size, args.seq_len, args.vocab, data).to(device)
        start = time.perf_counter()
        loss = step_fn(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        losses.append(reported.item() / world_size)
        if rank == 0:
            note = " (includes compilation)" if step == 0 and args.compile_backend != "eager" else ""
            print(
                f"step {step:3d}  loss {losses[-1]:.4f}  step time {(time.perf_counter() - start) * 1000:8.1f} ms{note}",
                flush=True,
            )

    weight = model.model.layers[0].self_attn.q_proj.weight
    if rank == 0:
        with torch.no_grad():
            local = weight.to_local()
        print(
            f"model.layers.0.self_attn.q_proj.weight: {type(weight.data).__name__} {tuple(weight.shape)} "
            f"{weight.placements}, local tensor type: {type(local).__name__} {tuple(local.shape)}",
            flush=True,
        )
    return losses


def main(argv=None) -> None:
    args = parse_args(argv)
    print(f"compile backend: {args.compile_backend}", flush=True)
    run_on_ranks(train, args, args.world_size)


if __name__ == "__main__":
    main()
