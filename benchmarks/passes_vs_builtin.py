"""Our passes vs Inductor's built-in FX bucketing, on the same captured graphs (modelled).

    python -m benchmarks.passes_vs_builtin [--quick] [--world-size 8] [--layers 4] [--dim 512] [--seq 256]

Compiles a Llama-style model sharded with ``fully_shard`` (one unit per
decoder layer) on the ``fake`` process group, captures Inductor's post-grad
forward and backward graphs before our passes, and applies to copies:

* ``traced``: nothing (one collective per parameter, each waited at once);
* ``inductor built-in``: ``bucket_all_gather`` + ``bucket_reduce_scatter``
  (``torch/_inductor/fx_passes/bucketing.py``, default size caps);
* ``inductor overlap scheduling``: Inductor's own bucketing + overlap scheduler
  (``fx_passes/overlap_scheduling.py``: what
  ``aten_distributed_optimizations.enable_overlap_scheduling`` with
  ``collective_bucketing`` runs), fed the per-node estimates of our cost model on
  the profile being simulated (its own compute estimates are a GPU roofline: 0
  on CPU); once with its default pre-bucketing of FSDP collectives (buckets sized
  by its NCCL model) and once without;
* ``manual_overlap_bucketing``: Inductor's manual bucketing as SimpleFSDP
  (torchtitan's graph_trainer) uses it: one bucket per decoder layer, plus the
  embedding and norm + output, each prefetched one bucket ahead;
* ``ours: bucketing``: one bucket per unit and dtype;
* ``ours: bucketing + reordering``: plus prefetch and late waits.

The Inductor overlap-scheduling and manual rows need ``triton`` importable (the
newest torch; see ``benchmarks/_peers.py``); without it they are left out with
one printed line. ``--quick``: 2 layers, dim 128, seq 64.

Every variant is simulated with our cost model on each hardware profile.
The numbers are modelled, not measured.
"""

from __future__ import annotations

from benchmarks._common import benchmark_parser, one_thread_per_rank, table_header


def _capture_graphs(world_size: int, layers: int, dim: int, seq: int):
    import torch
    import torch._inductor.config as inductor_config
    import torch.distributed as dist
    import torch.fx as fx
    import torch.nn.functional as F

    from benchmarks import _models
    from fsdp_compile import config, fully_shard
    from fsdp_compile.passes.schedule import copy_graph
    from fsdp_compile.testing._torch_internals import register_fake_process_group
    from fsdp_compile.testing.models import Llama, LlamaConfig

    register_fake_process_group()
    dist.init_process_group("fake", rank=0, world_size=world_size)
    cfg = LlamaConfig(vocab_size=2048, dim=dim, n_layers=layers, n_heads=8, ffn_dim=dim * 8 // 3, max_seq_len=seq)
    model = Llama(cfg)
    plans = _models.bucket_plans(model)  # SimpleFSDP's buckets: one per decoder layer
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    captured: list[fx.GraphModule] = []

    def spy(graph: fx.Graph) -> None:
        captured.append(fx.GraphModule(torch.nn.Module(), copy_graph(graph)))

    previous = inductor_config.post_grad_custom_post_pass
    inductor_config.post_grad_custom_post_pass = [spy, *previous]
    try:
        with config.patch(bucketing=False, reorder=False):
            tokens = torch.randint(0, cfg.vocab_size, (2, seq + 1))
            logits = torch.compile(model)(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    finally:
        inductor_config.post_grad_custom_post_pass = previous
    return captured, plans


def _variants(gm, profile: str, plans, peers: bool):
    """The variants of one captured graph for one hardware profile (Inductor's
    overlap scheduler is given that profile's estimates)."""
    import copy

    import torch.fx as fx

    from fsdp_compile.passes.bucketing import bucket_collectives
    from fsdp_compile.passes.reordering import reorder_for_overlap
    from fsdp_compile.passes.schedule import copy_graph

    def fresh():
        return fx.GraphModule(gm, copy_graph(gm.graph))

    traced = fresh()
    builtin = fresh()
    from torch._inductor.fx_passes.bucketing import bucket_all_gather, bucket_reduce_scatter

    bucket_all_gather(builtin)
    bucket_reduce_scatter(builtin)
    peer_variants = {}
    if peers:
        from benchmarks import _peers

        peer_variants = {
            "inductor overlap scheduling + bucketing": _peers.overlap_schedule(fresh(), profile),
            "inductor overlap scheduling + bucketing, no pre-bucketing": _peers.overlap_schedule(
                fresh(), profile, pre_bucketing=False
            ),
            "inductor manual_overlap_bucketing (SimpleFSDP)": _peers.manual_bucketing(fresh(), plans),
        }
    ours_bucketed = fresh()
    bucket_collectives(ours_bucketed.graph)
    ours = copy.copy(fresh())
    bucket_collectives(ours.graph)
    reorder_for_overlap(ours.graph)
    return {
        "traced": traced,
        "inductor built-in bucketing": builtin,
        **peer_variants,
        "ours: bucketing": ours_bucketed,
        "ours: bucketing + reordering": ours,
    }


def main(argv=None) -> None:
    p = benchmark_parser(__doc__, quick_help="small model (2 layers, dim 128, seq 64) unless set below")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--layers", type=int, default=None, help="default 4 (2 with --quick)")
    p.add_argument("--dim", type=int, default=None, help="default 512 (128 with --quick)")
    p.add_argument("--seq", type=int, default=None, help="default 256 (64 with --quick)")
    args = p.parse_args(argv)
    for key, full, quick in (("layers", 4, 2), ("dim", 512, 128), ("seq", 256, 64)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    one_thread_per_rank()

    from benchmarks import _peers
    from fsdp_compile.passes.cost_model import PROFILES, collective_kind, simulate

    skipped = _peers.skip_line("the Inductor overlap scheduling and manual_overlap_bucketing rows")
    graphs, plans = _capture_graphs(args.world_size, args.layers, args.dim, args.seq)
    print(
        f"\nLlama-style, {args.layers} layers, dim {args.dim}, seq {args.seq}, batch 2, world size "
        f"{args.world_size} (fake process group). Modelled with fsdp_compile's cost model, not measured."
        + (
            ""
            if skipped
            else " Inductor's overlap scheduler is given the cost model's estimates for each profile;"
            " manual_overlap_bucketing's plan: " + ", ".join(map(str, plans)) + "."
        )
        + "\n"
    )
    if skipped:
        print(skipped + "\n")
    for profile in PROFILES:
        print(f"### {profile}\n")
        print(table_header('graph', 'variant', 'collectives', 'step (ms)', 'communication (ms)', 'exposed (ms)', 'overlap', 'peak (MiB)'))
        for name, gm in zip(("forward", "backward"), graphs, strict=True):
            for variant, g in _variants(gm, profile, plans, peers=not skipped).items():
                sim = simulate(g.graph, profile)
                n_coll = sum(1 for n in g.graph.nodes if collective_kind(n) in ("all_gather", "reduce_scatter"))
                print(
                    f"| {name} | {variant} | {n_coll} | {sim.step_s * 1e3:.2f} | {sim.communication_s * 1e3:.2f} "
                    f"| {sim.exposed_s * 1e3:.2f} | {sim.overlap_fraction:.0%} | {sim.peak_bytes / 2**20:.1f} |"
                )
        print()


if __name__ == "__main__":
    main()
