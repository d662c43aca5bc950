"""Graphs and graph breaks per step: ours vs torch FSDP2 under torch.compile (2 CPU ranks).

    python -m benchmarks.graph_count [--layers 4]

A Llama-style model, each decoder layer its own unit plus the root, compiled
with ``torch.compile(model)`` (Dynamo counts do not depend on the backend;
``aot_eager`` keeps it quick). Two training steps: graphs compiled in the
first, recompiles in the second.
"""

from __future__ import annotations

from benchmarks._common import benchmark_parser, one_thread_per_rank, table_header


def count(kind: str, layers: int) -> dict:
    import torch
    import torch.nn.functional as F
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters

    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp_compile import fully_shard
    from fsdp_compile.runtime.vocabulary import is_collective_issue
    from fsdp_compile.testing.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=layers))
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    counters.clear()
    stats = {"compiled": 0, "calls": 0, "collectives": 0}

    def count_collectives(graph, _):
        stats["collectives"] += sum(map(is_collective_issue, graph.graph.nodes))
        return make_boxed_func(graph)

    def backend(gm, example_inputs):
        stats["compiled"] += 1
        compiled = aot_autograd(fw_compiler=count_collectives, bw_compiler=count_collectives)(gm, example_inputs)

        def call(*args):
            stats["calls"] += 1
            return compiled(*args)

        return call

    run = torch.compile(model, backend=backend)
    per_step = []
    for step in range(2):
        before = dict(stats)
        tokens = torch.randint(0, 64, (2, 17))
        loss = F.cross_entropy(run(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        per_step.append({k: stats[k] - before[k] for k in stats})
    return {
        "graphs_step1": per_step[0]["compiled"],
        "graph_calls_per_step": per_step[1]["calls"],
        "collectives_in_graphs": stats["collectives"],
        "recompiles_step2": per_step[1]["compiled"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "dynamo_frames_step1": counters["frames"]["total"],
    }


def main(argv=None) -> None:
    p = benchmark_parser(__doc__)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    one_thread_per_rank()
    from fsdp_compile.testing import RankPool

    with RankPool(2, timeout_s=1800) as pool:
        rows = [(label, pool.run(count, kind, args.layers)[0]) for label, kind in [("torch FSDP2", "fsdp2"), ("fsdp_compile", "ours")]]
    print(f"\n{args.layers}-layer Llama-style model, torch.compile, 2 ranks (rank 0)\n")
    print(
        table_header(
            "setup",
            "graphs compiled",
            "compiled-graph calls per step",
            "Dynamo frames (step 1)",
            "collectives inside graphs (fwd+bwd)",
            "graph-break counter",
            "recompiles in step 2",
        )
    )
    for label, r in rows:
        print(
            f"| {label} | {r['graphs_step1']} | {r['graph_calls_per_step']} | {r['dynamo_frames_step1']} "
            f"| {r['collectives_in_graphs']} | {r['graph_breaks']} | {r['recompiles_step2']} |"
        )
    print(
        "\nFSDP2's hooks run outside Dynamo (torch._dynamo.disable): each sharded module is "
        "its own frame, and the graphs hold no collective."
    )


if __name__ == "__main__":
    main()
