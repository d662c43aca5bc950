"""Peak memory per rank: ours compiled vs torch FSDP2 eager (2 CPU ranks, gloo).

    python -m benchmarks.memory [--layers 16] [--dim 2048] [--batch 16]

A bias-free MLP, each layer its own unit. After two warm-up steps, one step is
measured: "kept after forward" is the resident memory the forward leaves for
the backward (RSS after forward minus RSS before it); "step peak" is the
resident high-water mark during forward + backward minus RSS before the step.
glibc is told to return freed blocks to the OS (MALLOC_MMAP_THRESHOLD_), so
RSS follows tensor lifetimes.
"""

from __future__ import annotations

import argparse
import gc
import os

SETUPS = [
    ("fsdp2 eager", "fsdp2", None, True),
    ("ours compiled (inductor), reshard=True", "ours", "inductor", True),
    ("ours compiled (inductor), reshard=False", "ours", "inductor", False),
    ("ours eager, reshard=True", "ours", None, True),
]


def measure(kind: str, backend: str | None, reshard: bool, layers: int, dim: int, batch: int) -> dict:
    import torch

    from benchmarks._memory_probe import reset_hwm, rss_mib
    from benchmarks._memory_probe import hwm_mib

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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fsdp_compile.testing import RankPool

    rows = []
    with RankPool(2, timeout_s=1800) as pool:
        for label, kind, backend, reshard in SETUPS:
            per_rank = pool.run(measure, kind, backend, reshard, args.layers, args.dim, args.batch)
            rows.append((label, per_rank))
    layer_mib = rows[0][1][0]["layer_mib"]
    print(f"\n{args.layers}-layer {args.dim}-wide bias-free MLP, batch {args.batch}/rank, 2 ranks; "
          f"one gathered layer = {layer_mib:.0f} MiB\n")
    print("| setup | kept after forward, MiB (layers) rank0 / rank1 | step peak, MiB rank0 / rank1 |")
    print("|---|---|---|")
    for label, per_rank in rows:
        kept = " / ".join(f"{r['kept_mib']:.0f} ({r['kept_mib'] / layer_mib:.1f})" for r in per_rank)
        peak = " / ".join(f"{r['peak_mib']:.0f}" for r in per_rank)
        print(f"| {label} | {kept} | {peak} |")


if __name__ == "__main__":
    main()
