"""A Hugging Face ``transformers`` Llama, built from a config (no download), sharded per
decoder layer with fsdp_compile, compiled, trained for a few steps.

    pip install -e ".[examples]"
    python examples/hf_llama.py            # starts 2 CPU ranks itself (gloo)
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist


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


def _spawned_rank(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(minutes=5)
    )
    try:
        train(args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned_rank, args=(args.world_size, port, args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
