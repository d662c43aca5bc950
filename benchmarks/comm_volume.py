"""Communication volume per step: what our compiled graphs send vs the ideal.

    python -m benchmarks.comm_volume [--world-size 8] [--layers 4] [--dim 256] [--quick]

A Llama-style model sharded with ``fully_shard`` (every decoder layer and the
root, all with the same ``reshard_after_forward``), compiled with Inductor on
the ``fake`` process group of ``--world-size`` ranks in this one process. The
forward and backward graphs are read after all of our passes (so collectives
are bucketed) and every collective is counted with the bytes one rank puts on
the wire in a ring algorithm: all-gather ``(N-1)/N x output``, reduce-scatter
``(N-1)/N x input``, all-reduce ``2(N-1)/N x input``.

Ideal (ZeRO-3 / FSDP2): ``3(N-1)/N x P`` with resharding (gather in forward,
gather again in backward, reduce-scatter the gradient), ``2(N-1)/N x P``
without; with bf16 parameters each gather moves half of that. ``P`` is the
parameters' fp32 bytes. Our backward re-gathers only the weights its
gradients need (e.g. not the embedding table's), so it can come in under the
ideal; padding of uneven shards puts it slightly over.
"""

from __future__ import annotations

from benchmarks._common import benchmark_parser, one_thread_per_rank, table_header

SETUPS = {
    "fp32, reshard_after_forward=True": (True, None),
    "fp32, reshard_after_forward=False": (False, None),
    "bf16 params, fp32 reduce, reshard=True": (True, "bf16"),
}


def _wire_bytes(node, world_size: int) -> tuple[str, int]:
    """(kind, bytes this rank sends) of one functional collective issue node."""
    from fsdp_compile.runtime.vocabulary import collective_kind

    kind = collective_kind(node)  # other variants (``reduce_scatter_tensor_out``...) by their op name
    val_in = node.args[0].meta["val"]
    bytes_in = val_in.numel() * val_in.element_size()
    share = (world_size - 1) / world_size
    if kind.startswith("all_gather"):
        return "all_gather", int(bytes_in * world_size * share)
    if kind.startswith("reduce_scatter"):
        return "reduce_scatter", int(bytes_in * share)
    return kind, int(2 * bytes_in * share)


def measure(world_size: int, layers: int, dim: int, reshard: bool, mp: str | None) -> dict:
    import torch
    import torch._inductor.config as inductor_config
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_compile import fully_shard
    from fsdp_compile.runtime.vocabulary import is_collective_issue
    from fsdp_compile.testing._torch_internals import register_fake_process_group
    from fsdp_compile.testing.models import Llama, LlamaConfig

    register_fake_process_group()
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=world_size)
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, dim=dim, n_layers=layers, n_heads=8, ffn_dim=dim * 8 // 3, max_seq_len=64)
    model = Llama(cfg)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)

    counts: dict[str, int] = {}
    wire: dict[str, int] = {}

    def issues(graph):
        # After pinning, a collective may sit inside a ``control_deps`` wrapper's subgraph.
        for node in graph.nodes:
            if is_collective_issue(node):
                yield node
            elif node.op == "call_function" and "control_deps" in str(node.target):
                subgraph = getattr(graph.owning_module, node.args[1].target)
                yield from issues(subgraph.graph)

    def count(graph) -> None:  # runs after our post-grad pass
        for node in issues(graph):
            kind, sent = _wire_bytes(node, world_size)
            counts[kind] = counts.get(kind, 0) + 1
            wire[kind] = wire.get(kind, 0) + sent

    previous = inductor_config.post_grad_custom_post_pass
    inductor_config.post_grad_custom_post_pass = [*previous, count]
    try:
        tokens = torch.randint(0, cfg.vocab_size, (2, 33))
        logits = torch.compile(model)(tokens[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    finally:
        inductor_config.post_grad_custom_post_pass = previous
    share = (world_size - 1) / world_size
    gathers = 2 if reshard else 1
    gather_bytes = param_bytes / 2 if mp else param_bytes
    ideal = share * (gathers * gather_bytes + param_bytes)
    return {"counts": counts, "wire": wire, "param_bytes": param_bytes, "ideal": ideal}


def table(world_size: int, layers: int, dim: int) -> str:
    rows = [
        f"Llama-style, {layers} layers, dim {dim}, world size {world_size} (fake process group), "
        "Inductor graphs after our passes; per rank per step.\n",
        table_header(
            "setup",
            "parameters (MiB fp32)",
            "collectives (all-gather / reduce-scatter)",
            "sent (MiB)",
            "ideal (MiB)",
            "sent / ideal",
        ),
    ]
    for label, (reshard, mp) in SETUPS.items():
        r = measure(world_size, layers, dim, reshard, mp)
        sent = sum(r["wire"].values())
        n_ag, n_rs = r["counts"].get("all_gather", 0), r["counts"].get("reduce_scatter", 0)
        rows.append(
            f"| {label} | {r['param_bytes'] / 2**20:.1f} | {n_ag} / {n_rs} | {sent / 2**20:.1f} "
            f"| {r['ideal'] / 2**20:.1f} | {sent / r['ideal']:.3f} |"
        )
    return "\n".join(rows)


def main(argv=None) -> None:
    p = benchmark_parser(__doc__, quick_help="2 layers of width 64")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.dim = 2, 64
    one_thread_per_rank(cold_caches=True)  # cache hits would skip the passes, and the counting
    print("\n" + table(args.world_size, args.layers, args.dim))


if __name__ == "__main__":
    main()
