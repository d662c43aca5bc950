"""Peak memory per rank: ours vs torch FSDP2, eager and compiled (2 CPU ranks, gloo).

    python -m benchmarks.memory [--layers 16] [--dim 2048] [--batch 16] [--quick]

Eight setups: {FSDP2 eager, FSDP2 + torch.compile, ours eager, ours compiled}
x reshard_after_forward {True, False} (set on every layer; the root keeps
FSDP2's default).

A bias-free MLP, each layer its own unit. After two warm-up steps, one step is
measured: "kept after forward" is the resident memory the forward leaves for
the backward (RSS after forward minus RSS before it); "step peak" is the
resident high-water mark during forward + backward minus RSS before the step.
glibc is told to return freed blocks to the OS (MALLOC_MMAP_THRESHOLD_), so
RSS follows tensor lifetimes.
"""

from __future__ import annotations

import gc
import os

from benchmarks._common import benchmark_parser, one_thread_per_rank, table_header

SETUPS = [
    (f"{name}, reshard={reshard}", kind, backend, reshard)
    for reshard in (True, False)
    for name, kind, backend in (
        ("fsdp2 eager", "fsdp2", None),
        ("fsdp2 + torch.compile", "fsdp2", "inductor"),
        ("ours eager", "ours", None),
        ("ours compiled", "ours", "inductor"),
    )
]


def measure(kind: str, backend: str | None, reshard: bool, layers: int, dim: int, batch: int) -> dict:
    import torch

    from benchmarks._memory_probe import hwm_mib, reset_hwm, rss_mib

    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp_compile import fully_shard
    from fsdp_compile.testing.models import MLPStack

    torch.manual_seed(0)
    model = MLPStack(dim=dim, n_layers=layers, bias=False)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model)
    run = torch.compile(model, backend=backend) if backend else model
    x = torch.randn(batch, dim)

    def step(probe: bool):
        gc.collect()
        before = rss_mib()
        reset_hwm()
        loss = run(x).square().mean()
        after_forward = rss_mib()
        loss.backward()
        peak = hwm_mib()
        for p in model.parameters():
            p.grad = None
        del loss
        return after_forward - before, peak - before

    for _ in range(2):
        step(False)
    kept, peak = step(True)
    layer_mib = dim * dim * 4 / 2**20
    return {"kept_mib": kept, "peak_mib": peak, "layer_mib": layer_mib}


def measure_checkpointing(mode, backend: str | None, layers: int, dim: int, seq: int, batch: int) -> dict:
    """A Llama-style model with ``activation_checkpointing=mode`` inside each sharded
    decoder layer: resident memory the forward keeps, and the step's peak."""
    import torch
    import torch.nn.functional as F

    from benchmarks._memory_probe import hwm_mib, reset_hwm, rss_mib
    from fsdp_compile import fully_shard
    from fsdp_compile.testing.models import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, dim=dim, n_layers=layers, n_heads=8, ffn_dim=dim * 8 // 3, max_seq_len=seq, activation_checkpointing=mode)
    model = Llama(cfg)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    run = torch.compile(model, backend=backend) if backend else model
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))

    def step():
        gc.collect()
        before = rss_mib()
        reset_hwm()
        loss = F.cross_entropy(run(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        kept = rss_mib() - before
        loss.backward()
        peak = hwm_mib() - before
        for p in model.parameters():
            p.grad = None
        return kept, peak

    for _ in range(2):
        step()
    kept, peak = step()
    return {"kept_mib": kept, "peak_mib": peak}


def main(argv=None) -> None:
    p = benchmark_parser(__doc__, quick_help="2 layers of width 256 (a smoke run)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.dim, args.batch = 2, 256, 4
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    one_thread_per_rank()
    from fsdp_compile.testing import RankPool

    rows = []
    with RankPool(2, timeout_s=1800) as pool:
        for label, kind, backend, reshard in SETUPS:
            per_rank = pool.run(measure, kind, backend, reshard, args.layers, args.dim, args.batch)
            rows.append((label, per_rank))
    layer_mib = rows[0][1][0]["layer_mib"]
    print(f"\n{args.layers}-layer {args.dim}-wide bias-free MLP, batch {args.batch}/rank, 2 ranks; "
          f"one gathered layer = {layer_mib:.0f} MiB\n")
    print(table_header('setup', 'kept after forward, MiB (layers) rank0 / rank1', 'step peak, MiB rank0 / rank1'))
    for label, per_rank in rows:
        kept = " / ".join(f"{r['kept_mib']:.0f} ({r['kept_mib'] / layer_mib:.1f})" for r in per_rank)
        peak = " / ".join(f"{r['peak_mib']:.0f}" for r in per_rank)
        print(f"| {label} | {kept} | {peak} |")

    # Activation checkpointing inside each sharded decoder layer.
    ac_layers, ac_dim, ac_seq, ac_batch = (1, 64, 64, 2) if args.quick else (4, 512, 1024, 4)
    ac_rows = []
    with RankPool(2, timeout_s=1800) as pool:
        for backend in (None, "inductor"):
            for mode in (False, "selective", "full"):
                r = pool.run(measure_checkpointing, mode, backend, ac_layers, ac_dim, ac_seq, ac_batch)[0]
                ac_rows.append((f"ours {'compiled' if backend else 'eager'}", mode or "none", r))
    print(f"\nActivation checkpointing: Llama-style, {ac_layers} layers, dim {ac_dim}, seq {ac_seq}, "
          f"batch {ac_batch}/rank, 2 ranks (rank 0)\n")
    print(table_header('setup', 'checkpointing', 'kept after forward (MiB)', 'step peak (MiB)'))
    for setup, mode, r in ac_rows:
        print(f"| {setup} | {mode} | {r['kept_mib']:.0f} | {r['peak_mib']:.0f} |")


if __name__ == "__main__":
    main()
