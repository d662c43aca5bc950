"""Step time on 2 CPU ranks (gloo, loopback): ours vs torch FSDP2, eager and compiled.

    python -m benchmarks.step_time [--layers 4] [--dim 512] [--seq 256] [--steps 8]

A Llama-style model, one unit per decoder layer plus the root. All setups are
built first and compiled by a warm-up step, then timed round-robin (one step
of each setup in turn) so that machine noise hits all alike. Reports the median
step time, tokens/s and the first step (compile) time per setup.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

SETUPS = {
    "fsdp2 eager": ("fsdp2", None, {}),
    "fsdp2 + torch.compile": ("fsdp2", "inductor", {}),
    "ours eager": ("ours", None, {}),
    "ours compiled, passes off": ("ours", "inductor", {"bucketing": False, "reorder": False}),
    "ours compiled": ("ours", "inductor", {}),
}


def run(layers: int, dim: int, seq: int, batch: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from fsdp_compile import config
    from fsdp_compile import fully_shard as ours_fully_shard
    from fsdp_compile.testing.models import Llama, LlamaConfig
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    cfg = LlamaConfig(vocab_size=4096, dim=dim, n_layers=layers, n_heads=8, ffn_dim=dim * 8 // 3, max_seq_len=seq)
    built = {}
    for name, (kind, backend, changes) in SETUPS.items():
        torch.manual_seed(0)
        model = Llama(cfg)
        shard = ours_fully_shard if kind == "ours" else fsdp2_fully_shard
        for layer in model.layers:
            shard(layer)
        shard(model)
        run_fn = model
        if backend:
            torch._dynamo.config.cache_size_limit = 64
            run_fn = torch.compile(model, backend=backend)
        built[name] = (model, run_fn, torch.optim.AdamW(model.parameters(), lr=1e-4), changes)

    gen = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)

    def step(name) -> float:
        model, run_fn, opt, changes = built[name]
        with config.patch(**changes):
            dist.barrier()
            start = time.perf_counter()
            logits = run_fn(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - start

    first = {name: step(name) for name in SETUPS}
    times = {name: [] for name in SETUPS}
    for _ in range(steps):
        for name in SETUPS:
            times[name].append(step(name))
    n_params = sum(p.numel() for p in built["ours eager"][0].parameters())
    return {"first": first, "times": times, "n_params": n_params}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fsdp_compile.testing import RankPool

    with RankPool(2, timeout_s=3000) as pool:
        result = pool.run(run, args.layers, args.dim, args.seq, args.batch, args.steps)[0]
    tokens = args.batch * args.seq * 2
    print(
        f"\nLlama-style, {result['n_params'] / 1e6:.1f}M parameters ({args.layers} layers, dim {args.dim}), "
        f"seq {args.seq}, batch {args.batch}/rank, 2 CPU ranks (gloo, loopback), {args.steps} timed steps each\n"
    )
    print("| setup | median step (ms) | tokens/s | first step incl. compile (s) |")
    print("|---|---|---|---|")
    for name in SETUPS:
        median = statistics.median(result["times"][name])
        print(f"| {name} | {median * 1e3:.0f} | {tokens / median:.0f} | {result['first'][name]:.1f} |")


if __name__ == "__main__":
    main()
