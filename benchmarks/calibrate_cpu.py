"""Measure the constants of the ``cpu-gloo`` cost-model profile on this machine.

    python -m benchmarks.calibrate_cpu

Single-thread fp32 matmul FLOP/s, memory copy bandwidth, and gloo all-gather
latency (alpha) and bandwidth (beta) between 2 ranks on loopback, fitted from
a small and a large message (ring model: t = alpha + (n-1)/n * bytes / bw).
"""

from __future__ import annotations

import time

from benchmarks._common import one_thread_per_rank


def _best(fn, repeat=7):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_collectives() -> dict:
    import torch
    import torch.distributed as dist

    from fsdp_compile.base.compat import c10d_functional

    group = dist.group.WORLD.group_name
    ws = dist.get_world_size()
    out = {}
    for numel in (256, 4 * 2**20):
        x = torch.ones(numel)

        def gather():
            t = c10d_functional.all_gather_into_tensor(x, ws, group)
            c10d_functional.wait_tensor(t)

        gather()
        dist.barrier()
        out[numel * 4] = _best(gather)
    (small_b, small_t), (large_b, large_t) = sorted(out.items())
    per_byte = (large_t - small_t) / ((ws - 1) / ws * ws * (large_b - small_b))
    return {"alpha_s": small_t, "link_bytes_per_s": 1 / per_byte}


def main() -> None:
    one_thread_per_rank()
    import torch

    from fsdp_compile.testing import RankPool

    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    t = _best(lambda: a @ b)
    flops = 2 * 512**3 / t
    big = torch.randn(16 * 2**20)
    dst = torch.empty_like(big)
    t = _best(lambda: dst.copy_(big))
    mem = 2 * big.numel() * 4 / t
    with RankPool(2) as pool:
        comm = pool.run(measure_collectives)[0]
    print(f"matmul fp32, 1 thread : {flops / 1e9:8.1f} GFLOP/s")
    print(f"memory copy           : {mem / 1e9:8.1f} GB/s (read + write)")
    print(f"gloo all-gather alpha : {comm['alpha_s'] * 1e6:8.1f} us")
    print(f"gloo all-gather bw    : {comm['link_bytes_per_s'] / 1e9:8.2f} GB/s per rank")


if __name__ == "__main__":
    main()
