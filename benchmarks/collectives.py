"""gloo's all-gather and reduce-scatter against the all-to-alls ``config.gloo_all_to_all``
sends instead (``fsdp_compile.passes.transport``), on 2 CPU ranks over loopback.

    python -m benchmarks.collectives [--sizes 1 4] [--iters 10] [--quick]

For a shard of ``n`` fp32 elements per rank: the all-gather
(``all_gather_into_tensor``, output ``2n``) against ``repeat`` + ``all_to_all_single``
(the same output), and for a gradient of ``2n`` elements the reduce-scatter
(``reduce_scatter_tensor``, ``avg``) against ``all_to_all_single`` + ``sum`` + divide
(the same shard). Each is timed as the compiled code runs it: issue, then wait; the
median of ``--iters`` calls after 3 warm-up calls, wall time and the process's CPU time
(all its threads: gloo's included) on rank 0. The results are checked equal first.
"""

from __future__ import annotations

from benchmarks._common import benchmark_parser, one_thread_per_rank, table_header


def measure(sizes_m: list[float], iters: int) -> list[dict]:
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from fsdp_compile.base.compat import c10d_functional, group_name_of

    torch.set_num_threads(1)
    group = group_name_of(dist.group.WORLD)
    ws = dist.get_world_size()
    ops = c10d_functional
    wait = ops.wait_tensor

    def native_gather(shard):
        return wait(ops.all_gather_into_tensor(shard, ws, group))

    def lowered_gather(shard):
        n = shard.shape[0]
        return wait(ops.all_to_all_single(shard.repeat(ws), [n] * ws, [n] * ws, group))

    def native_reduce(grad):
        return wait(ops.reduce_scatter_tensor(grad, "avg", ws, group))

    def lowered_reduce(grad):
        rows = grad.shape[0] // ws
        return wait(ops.all_to_all_single(grad, [rows] * ws, [rows] * ws, group)).view(ws, rows).sum(0) / ws

    rows = []
    for size_m in sizes_m:
        n = int(size_m * (1 << 20))
        shard = torch.randn(n, generator=torch.Generator().manual_seed(dist.get_rank()))
        grad = torch.randn(ws * n, generator=torch.Generator().manual_seed(100 + dist.get_rank()))
        assert torch.equal(native_gather(shard), lowered_gather(shard))
        torch.testing.assert_close(native_reduce(grad), lowered_reduce(grad), rtol=0, atol=0)
        row = {"n": n}
        for name, fn, arg in (
            ("all_gather", native_gather, shard),
            ("all_gather_a2a", lowered_gather, shard),
            ("reduce_scatter", native_reduce, grad),
            ("reduce_scatter_a2a", lowered_reduce, grad),
        ):
            walls, cpus = [], []
            for i in range(3 + iters):
                dist.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                fn(arg)
                if i >= 3:
                    walls.append(time.perf_counter() - wall)
                    cpus.append(time.process_time() - cpu)
            row[name] = (statistics.median(walls), statistics.median(cpus))
        rows.append(row)
    return rows


def main(argv=None) -> None:
    p = benchmark_parser(__doc__, quick_help="one small size (64Ki elements), 5 calls")
    p.add_argument("--sizes", type=float, nargs="+", default=[1.0, 4.0], help="shard sizes, Mi fp32 elements per rank")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.iters = [1 / 16], 5
    one_thread_per_rank()
    from fsdp_compile.testing import RankPool

    with RankPool(2) as pool:
        rows = pool.run(measure, args.sizes, args.iters)[0]
    print("2 gloo ranks on loopback, 1 thread each; median wall / CPU ms of one call (issue + wait), rank 0.\n")
    print(table_header("shard (fp32 elements)", "all-gather: gloo", "as all-to-all", "reduce-scatter: gloo", "as all-to-all"))
    for row in rows:
        cells = [f"{row[k][0] * 1e3:.1f} / {row[k][1] * 1e3:.1f}" for k in ("all_gather", "all_gather_a2a", "reduce_scatter", "reduce_scatter_a2a")]
        print(f"| {row['n']:,} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
