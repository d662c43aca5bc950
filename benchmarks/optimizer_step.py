"""The optimizer step alone: eager and ``torch.compile(opt.step)``, on our parameters and unsharded.

    python -m benchmarks.optimizer_step [--layers 8] [--dim 512] [--steps 20] [--quick]

A stack of ``Linear(dim, dim)`` layers, each ``fully_shard``ed, then the root, on 2 gloo
ranks (one thread each), with a plain ``torch.optim.AdamW(model.parameters())``; the
gradients are set once and the step is timed alone (``step()`` then nothing else), the
median over ``--steps`` calls after 3 warm-up calls, on rank 0. The first call's time
(with compilation, for the compiled step) is reported too. Setups:

* ``unsharded``: the unsharded stack (twice the elements per rank);
* ``ours`` (the default recipe: from the second step the update runs on the local
  shards, ``config.local_shard_optimizer_step``), ``ours, DTensor step`` (that off: the
  update dispatches through ``DTensor``);
* each eager and with ``torch.compile(opt.step)``.
"""

from __future__ import annotations

import copy
import os
import statistics
import time

from benchmarks._common import benchmark_parser, one_thread_per_rank, table_header

SETUPS = ("unsharded", "ours", "ours-dtensor-step")
LABELS = {"unsharded": "unsharded", "ours": "ours (default)", "ours-dtensor-step": "ours, DTensor step"}


def _time_steps(step, steps: int) -> tuple[float, float]:
    """(first call, median of ``steps`` calls after 3 more warm-up calls), in seconds."""
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def _rank_main(rank: int, world_size: int, port: int, layers: int, dim: int, steps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import fsdp_compile
    from fsdp_compile import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    base = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    rows = []
    for setup in SETUPS:
        for compiled in (False, True):
            model = copy.deepcopy(base)
            if setup != "unsharded":
                for layer in model:
                    fully_shard(layer)
                fully_shard(model)
            for p in model.parameters():
                p.grad = torch.ones_like(p) * 1e-3
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            torch._dynamo.reset()
            with fsdp_compile.config.patch(local_shard_optimizer_step=setup != "ours-dtensor-step"):
                first, median = _time_steps(torch.compile(opt.step) if compiled else opt.step, steps)
            rows.append((setup, compiled, first, median))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = benchmark_parser(__doc__, quick_help="4 layers of 128, 5 timed steps")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    layers, dim, steps = (4, 128, 5) if args.quick else (args.layers, args.dim, args.steps)
    one_thread_per_rank()
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = 29000 + os.getpid() % 1000
    mp.start_processes(_rank_main, args=(2, port, layers, dim, steps, queue), nprocs=2, start_method="spawn")
    rows = queue.get()
    print(f"\nOptimizer step alone: {layers} x Linear({dim}, {dim}), plain AdamW, 2 gloo ranks, median of {steps} (rank 0)\n")
    print(table_header("setup", "eager step (ms)", "compiled step (ms)", "eager first call (ms)", "compiled first call (s)"))
    by = {(s, c): (f, m) for s, c, f, m in rows}
    for setup in SETUPS:
        (ef, em), (cf, cm) = by[(setup, False)], by[(setup, True)]
        print(f"| {LABELS[setup]} | {em * 1e3:.2f} | {cm * 1e3:.2f} | {ef * 1e3:.1f} | {cf:.1f} |")


if __name__ == "__main__":
    main()
