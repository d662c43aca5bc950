"""A Hugging Face ``transformers`` Llama, built from a config (no download), sharded per
decoder layer with fsdp_compile, compiled, trained for a few steps.

    pip install -e ".[examples]"
    python examples/hf_llama.py            # starts 2 CPU ranks itself (gloo)
    torchrun --nproc-per-node 8 examples/hf_llama.py --hidden 1024 --layers 8
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from _launch import run_on_ranks


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=2, help="per rank")
    p.add_argument("--compile-backend", default="inductor", help="inductor | aot_eager | eager")
    p.add_argument("--world-size", type=int, default=2)
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> list[float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp_compile import fully_shard

    rank = dist.get_rank()
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    step = model if args.compile_backend == "eager" else torch.compile(model, backend=args.compile_backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for i in range(args.steps):
        g = torch.Generator().manual_seed(i * 7919 + rank)
        tokens = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), generator=g)
        start = time.perf_counter()
        loss = step(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
        if rank == 0:
            print(f"step {i}  loss {losses[-1]:.4f}  step time {(time.perf_counter() - start) * 1000:.1f} ms", flush=True)
    return losses


def main(argv=None) -> None:
    args = parse_args(argv)
    run_on_ranks(train, args, args.world_size)


if __name__ == "__main__":
    main()
