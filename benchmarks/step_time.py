"""Step time on 2 CPU ranks (gloo, loopback): ours vs torch FSDP2, eager and compiled,
against a compute-only run of the same setups on one rank.

    python -m benchmarks.step_time [--quick] [--model llama|hf-llama] [--layers 8] [--dim 512]
                                   [--vocab 16384] [--seq 256] [--batch 2] [--steps 8] [--warm-cache]
                                   [--setups fsdp2-eager,fsdp2-compiled,ours-eager,
                                             ours-eager-nooverlap,ours-compiled-nopasses,ours-compiled,ours-compiled-dtensor-step,
                                             ours-compiled-noreshard,ours-compiled-gloo,
                                             ours-compiled-noreshard-gloo,fsdp2-blocks-compiled,
                                             ours-blocks-compiled,simplefsdp-manual,
                                             simplefsdp-manual-noreshard,simplefsdp-auto]

A Llama-style model (tied embeddings; ``--model hf-llama``: a ``transformers``
``LlamaForCausalLM`` of the same shapes, see ``benchmarks/_models.py``), one unit per
decoder layer plus the root, a plain ``torch.optim.AdamW`` (ours steps it on the local shards without
``DTensor`` dispatch by default, ``config.local_shard_optimizer_step``), fp32. Six setups: torch FSDP2 eager, FSDP2 + ``torch.compile``, ours eager,
ours eager without its overlap (``config.patch(eager_overlap=False)``), ours compiled with our passes off (``config.patch(bucketing=False, reorder=False)``)
and ours compiled; each reshards the decoder layers after forward (FSDP2's default:
``reshard_after_forward=True`` for the layers, the root keeps its parameters).
And the **compute-only limit** (``unsharded-compiled``): every rank trains an
unsharded replica, compiled, on its own local batch, with no communication: the
fastest a data-parallel step can be here, and, cold, the unsharded model's compile
time that ours is compared with. The ratio columns divide by FSDP2 eager's and by
this limit's median step.
Two more, torchtitan's way of compiling (``--setups fsdp2-blocks-compiled,ours-blocks-compiled``):
each decoder layer ``torch.compile``d on its own, then sharded (FSDP2's, or ours), the
root run eagerly; our collectives then run eagerly around each compiled block, as FSDP2's.
Default model: 33.6M parameters; ``--quick`` uses a 1-layer 0.08M-parameter model and 2
steps (a smoke run: 1-2 minutes with warm compile caches).

Peers, on the newest torch (they need ``triton`` importable; without it they are
left out with one printed line; see ``benchmarks/_peers.py``):

- **SimpleFSDP + manual bucketing** (torchtitan's graph_trainer): every parameter a
  ``Shard(0)`` DTensor all-gathered in the graph by DTensor's ``redistribute`` when
  read (its gradient reduce-scattered by the backward), compiled with Inductor's
  ``manual_overlap_bucketing`` as the post-grad pass, one bucket per decoder layer
  (plus the embedding, and norm + output), with ordering dependencies; the decoder
  layers' gathers are recomputed in the backward (selective checkpointing), as
  ours and FSDP2 reshard them;
- the same with ``reshard_after_forward=False`` (gathered parameters saved for the
  backward), and **ours compiled** with ``reshard_after_forward=False``;
- **SimpleFSDP + Inductor auto bucketing**: Inductor's own overlap scheduling with
  collective bucketing (``aten_distributed_optimizations.enable_overlap_scheduling``
  and ``collective_bucketing``, analytical estimates: its compute estimates are a
  GPU roofline, 0 on CPU).

Each peer's Inductor options are set with ``torch._inductor.config.patch`` around
its own steps only, so the other setups compile with the defaults.

One process group of 2 ranks (gloo over loopback, started by ``RankPool``, 1
thread per rank), ``--batch`` sequences per rank. Each setup is built twice:

- **2 ranks**: sharded over both ranks;
- **compute-only**: sharded over a 1-rank group of each rank's own (world size 1,
  the same per-rank batch), so the compute per rank is the same and the
  collectives are local copies. Both ranks run it at once, so it sees the same
  CPU contention as the 2-rank run (both cores busy).
  "Exposed communication" = median step (2 ranks) - median step (compute-only).

Every variant is built first, then each one's first step is run (compiles; timed
as "compile: first step"), then the timed steps go round-robin, one step of each
variant in turn (compute-only ones included), so machine noise hits all alike. A
step is forward, cross-entropy, backward and ``optimizer.step()`` after a
barrier, timed on rank 0; the table shows the median.

Compile time is cold: each setup's first step runs under
``torch._inductor.utils.fresh_cache()`` (empty Inductor/AOTAutograd caches on
disk and in memory), so no setup reuses kernels compiled for another or cached by
an earlier run; both ranks compile at once on the 2 cores (a cold compile is
mostly C++ compiler time: 1-2 minutes per setup here). ``--warm-cache`` (implied
by ``--quick``) uses Inductor's persistent caches instead, as the compute-only
copies always do.

"Of which our passes" sums the time fsdp_compile's joint and post-grad passes took in
that first step (``fsdp_compile.passes.registration.pass_seconds``, per graph; 0 when
Inductor's caches skipped them). "Graphs compiled" counts calls of the compiler backend (the ``inductor``
backend wrapped by a counter): graphs Dynamo handed to Inductor during the
first step, each compiled into a forward and a backward. "Compiled-graph
calls/step" counts calls of those compiled graphs in the last timed step (FSDP2
runs its per-layer graph once per layer); "recompiles" are backend calls during
the timed steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks import _models
from benchmarks._common import benchmark_parser, table_header

# id (for --setups) -> (label, implementation, compiled, fsdp_compile.config changes)
SETUPS = {
    "unsharded-compiled": ("compute-only limit: unsharded, compiled", "unsharded", True, {}),
    "fsdp2-eager": ("fsdp2 eager", "fsdp2", False, {}),
    "fsdp2-compiled": ("fsdp2 + torch.compile", "fsdp2", True, {}),
    "ours-eager": ("ours eager", "ours", False, {}),
    "ours-eager-nooverlap": ("ours eager, no overlap", "ours", False, {"eager_overlap": False}),
    "ours-compiled-nopasses": ("ours compiled, passes off", "ours", True, {"bucketing": False, "reorder": False}),
    "ours-compiled": ("ours compiled", "ours", True, {}),
    # Before the default local-shard optimizer step: every AdamW step on the DTensors.
    "ours-compiled-dtensor-step": (
        "ours compiled, optimizer on DTensors (local_shard_optimizer_step off)", "ours", True, {"local_shard_optimizer_step": False}
    ),
    "ours-compiled-noreshard": ("ours compiled, no reshard", "ours", True, {}),
    # gloo's own all-gather and reduce-scatter in the compiled code (config.gloo_all_to_all off).
    "ours-compiled-gloo": ("ours compiled, gloo's own collectives", "ours", True, {"gloo_all_to_all": False}),
    "ours-compiled-noreshard-gloo": ("ours compiled, no reshard, gloo's own collectives", "ours", True, {"gloo_all_to_all": False}),
    "fsdp2-blocks-compiled": ("fsdp2, blocks compiled one by one", "fsdp2", "blocks", {}),
    "ours-blocks-compiled": ("ours, blocks compiled one by one", "ours", "blocks", {}),
    "simplefsdp-manual": ("SimpleFSDP + manual bucketing", "simplefsdp", True, {}),
    "simplefsdp-manual-noreshard": ("SimpleFSDP + manual bucketing, no reshard", "simplefsdp", True, {}),
    "simplefsdp-auto": ("SimpleFSDP + Inductor auto bucketing", "simplefsdp", True, {}),
}
#: The setups ``benchmarks.shaped_link`` runs by default (step_time runs them all).
BASE_SETUPS = ["fsdp2-eager", "fsdp2-compiled", "ours-eager", "ours-compiled-nopasses", "ours-compiled"]
#: The setup that is its own compute-only run: each rank its local batch, unsharded, no communication.
LIMIT = "unsharded-compiled"
#: Setups compared with the peers, run only where the peers can run (``benchmarks/_peers.py``):
#: id -> (reshard the decoder layers after forward, the peer's Inductor pass or None).
PEER_SETUPS = {
    "ours-compiled-noreshard": (False, None),
    "ours-compiled-noreshard-gloo": (False, None),
    "simplefsdp-manual": (True, "manual"),
    "simplefsdp-manual-noreshard": (False, "manual"),
    "simplefsdp-auto": (True, "auto"),
}

#: Default size: 8 layers, dim 512, vocab 16384 (33.6M parameters), seq 256, batch 2/rank.
FULL = {"layers": 8, "dim": 512, "vocab": 16384, "seq": 256, "batch": 2, "steps": 8}
#: ``--quick``: 1 layer, dim 64, vocab 512 (0.08M parameters), seq 64, 2 steps.
QUICK = {"layers": 1, "dim": 64, "vocab": 512, "seq": 64, "batch": 2, "steps": 2}


def add_model_args(p: argparse.ArgumentParser, setups: list[str] | None = None) -> None:
    """Model/step flags shared with ``benchmarks.shaped_link`` (unset ones come from FULL or QUICK);
    ``setups``: the default of ``--setups`` (``BASE_SETUPS`` if None)."""
    setups = BASE_SETUPS if setups is None else setups
    p.add_argument("--model", default="llama", choices=_models.FAMILIES, help="model family (default llama)")
    for flag in FULL:
        p.add_argument(f"--{flag}", type=int, default=None, help=f"default {FULL[flag]} ({QUICK[flag]} with --quick)")
    p.add_argument("--setups", default=",".join(setups), help="comma-separated subset of: " + ", ".join(SETUPS))
    p.add_argument(
        "--warm-cache",
        action="store_true",
        help="compile with Inductor's persistent caches (default: cold, except with --quick)",
    )


def parser() -> argparse.ArgumentParser:
    p = benchmark_parser(__doc__, quick_help="tiny model, few steps (smoke run)")
    add_model_args(p, list(SETUPS))
    return p


def resolve(args) -> argparse.Namespace:
    """``args`` (a Namespace, a list of CLI strings or None) with every size filled in."""
    if args is None or isinstance(args, (list, tuple)):
        args = parser().parse_args(list(args or []))
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    names = [n.strip() for n in args.setups.split(",") if n.strip()] if isinstance(args.setups, str) else list(args.setups)
    unknown = [n for n in names if n not in SETUPS]
    if unknown:
        raise SystemExit(f"unknown setup(s) {unknown}; choose from {list(SETUPS)}")
    peers = [n for n in names if SETUPS[n][1] == "simplefsdp"]
    if peers and not getattr(args, "skipped", None):
        from benchmarks import _peers

        line = _peers.skip_line("setups " + ", ".join(peers))
        if line:
            names = [n for n in names if n not in peers]
            args.skipped = line
    args.skipped = getattr(args, "skipped", None)
    args.setups = names
    args.warm_cache = args.warm_cache or args.quick
    return args


def model_kwargs(args) -> dict:
    """The model's description for ``args`` (``benchmarks._models.spec``)."""
    return _models.spec(getattr(args, "model", "llama"), vocab=args.vocab, dim=args.dim, layers=args.layers, seq=args.seq)


def describe(args, n_params: int) -> str:
    name, shapes = _models.describe(model_kwargs(args)).split(" (", 1)
    return (
        f"{name}, {n_params / 1e6:.1f}M parameters ({shapes}, seq {args.seq}, batch {args.batch}/rank, fp32, AdamW, "
        f"setups interleaved step by step, {args.steps} timed steps each"
    )


def counting_inductor(stats: dict):
    """The ``inductor`` backend, counting compiles (``stats["graphs"]``) and calls of
    the compiled graphs (``stats["calls"]``)."""
    from torch._dynamo import lookup_backend

    inductor = lookup_backend("inductor")

    def backend(gm, example_inputs):
        stats["graphs"] += 1
        compiled = inductor(gm, example_inputs)

        def call(*args):
            stats["calls"] += 1
            return compiled(*args)

        return call

    return backend


def gloo_collectives(prof) -> list[tuple[str, int, str]]:
    """The collectives gloo ran inside a ``torch.profiler`` region, in issue order:
    ``(op, numel of the input, dtype)`` from its ``gloo:<op>`` events (what the
    backend actually sent: FSDP2's and our eager and compiled collectives all end
    there; gloo implements a reduce-scatter as an all-reduce of the full tensor)."""
    events = sorted((e for e in prof.events() if e.name.startswith("gloo:")), key=lambda e: e.time_range.start)
    out = []
    for e in events:
        shape = e.input_shapes[0] if e.input_shapes and e.input_shapes[0] else [0]
        numel = 1
        for size in shape:
            numel *= size
        dtype = (e.input_dtypes[0] if getattr(e, "input_dtypes", None) else None) or "float"
        out.append((e.name.split(":", 1)[1], numel, dtype))
    return out


def measure(
    model_spec: dict,
    seq: int,
    batch: int,
    steps: int,
    setups: list[str],
    *,
    compute_only: bool = True,
    cold_compile: bool = True,
    record_collectives: bool = False,
    breakdown: bool = False,
) -> dict:
    """Runs on every rank of an initialised process group; rank 0's result is used.

    Every setup is sharded over all ranks; with ``compute_only`` a second copy of
    it is sharded over a 1-rank group of its own on each rank (world size 1,
    same per-rank batch), and both kinds are timed in the same round-robin."""
    import contextlib
    import warnings

    import torch
    import torch._inductor.config as inductor_config
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._inductor.utils import fresh_cache
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    from fsdp_compile import fully_shard as ours_fully_shard
    from fsdp_compile.base import config

    # Each setup compiles its own model instance; Dynamo sees another instance of the
    # same forward code as a recompile of that frame, and fsdp_compile warns about it.
    warnings.filterwarnings("ignore", message="fsdp_compile: recompiling")
    torch._dynamo.config.cache_size_limit = 64
    rank, world = dist.get_rank(), dist.get_world_size()

    # (setup id, local): local = the compute-only copy on this rank's own 1-rank group.
    variants = [(name, False) for name in setups]
    local_mesh = None
    if compute_only:
        variants += [(name, True) for name in setups if SETUPS[name][1] != "unsharded"]
        groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
        local_mesh = DeviceMesh.from_group(groups[rank], "cpu")
    built = {}
    prefix = _models.block_prefix(model_spec)
    world_mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu") if any(SETUPS[n][1] == "simplefsdp" for n in setups) else None
    for key in variants:
        name, local = key
        _, kind, compiled, changes = SETUPS[name]
        reshard, peer_pass = PEER_SETUPS.get(name, (True, None))
        if local:
            # fsdp_compile's first-run check compares collective sequences over the
            # default group; on per-rank groups the group names differ by design.
            changes = dict(changes, check_collective_consistency=False)
        torch.manual_seed(0)
        model = _models.build(model_spec, own_frame=kind == "unsharded")
        inductor_changes = {}
        if kind == "unsharded":
            pass  # each rank trains its own replica on its local batch: no communication
        elif kind == "simplefsdp":
            from benchmarks import _peers

            _peers.simple_fsdp(model, local_mesh if local else world_mesh, lambda fqn: reshard and fqn.startswith(prefix))
            if peer_pass:
                inductor_changes = _peers.inductor_options(peer_pass, model)
        else:
            shard = ours_fully_shard if kind == "ours" else fsdp2_fully_shard
            mesh = {"mesh": local_mesh} if local else {}
            if compiled == "blocks":
                # torchtitan's order: each block compiled on its own, then sharded; the root runs eagerly.
                stats = {"graphs": 0, "calls": 0}
                holder = _models.block_list(model)
                for i, layer in enumerate(list(holder)):
                    holder[i] = torch.compile(layer, backend=counting_inductor(stats))
            for layer in _models.blocks(model):
                shard(layer, **mesh, **({} if reshard else {"reshard_after_forward": False}))
            shard(model, **mesh)
        if compiled != "blocks":
            stats = {"graphs": 0, "calls": 0}
        run_fn = torch.compile(model, backend=counting_inductor(stats)) if compiled is True else model
        # The user's plain recipe; ours steps it on the local shards by default from its
        # second step (config.local_shard_optimizer_step).
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        built[key] = (run_fn, opt, changes, stats, inductor_changes)
    n_params = sum(p.numel() for p in _models.build(model_spec).parameters())

    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, model_spec["vocab"], (batch, seq + 1), generator=gen)

    def train_step(key) -> None:
        run_fn, opt, changes, _, inductor_changes = built[key]
        # A peer's Inductor options hold during its own steps only (its compiles happen
        # in its first step: the forward graph in the call, the backward in backward()).
        with config.patch(**changes), inductor_config.patch(inductor_changes), quiet(inductor_changes):
            logits = run_fn(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def quiet(inductor_changes):
        if not inductor_changes:
            return contextlib.nullcontext()
        from benchmarks import _peers

        return _peers.quiet_cpu_estimates()

    def timed_step(key) -> float:
        dist.barrier()
        start = time.perf_counter()
        train_step(key)
        return time.perf_counter() - start

    # First steps (compiles): the distributed setups first, each cold if asked;
    # the compute-only copies with the persistent caches (their compile is not reported).
    from fsdp_compile.passes.registration import pass_seconds

    first, graphs, our_passes = {}, {}, {}
    for key in variants:
        cold = cold_compile and SETUPS[key[0]][2] and not key[1]
        recorded = len(pass_seconds)
        with fresh_cache() if cold else contextlib.nullcontext():
            first[key] = timed_step(key)
        graphs[key] = built[key][3]["graphs"]
        our_passes[key] = sum(seconds for *_, seconds in pass_seconds[recorded:])
    times = {key: [] for key in variants}
    other_threads_cpu = {key: [] for key in variants}
    calls = {}
    for _ in range(steps):
        for key in variants:
            before = built[key][3]["calls"]
            cpu, main_cpu = time.process_time(), time.thread_time()
            times[key].append(timed_step(key))
            other_threads_cpu[key].append((time.process_time() - cpu) - (time.thread_time() - main_cpu))
            calls[key] = built[key][3]["calls"] - before

    collectives = {}
    if record_collectives:
        from torch.profiler import ProfilerActivity, profile

        for name in setups:
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                train_step((name, False))
            collectives[name] = gloo_collectives(prof)

    profiled = {}
    if breakdown:
        from torch.profiler import ProfilerActivity, profile

        from benchmarks.breakdown import categorize

        for name in setups:
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                train_step((name, False))
                step_s = time.perf_counter() - start
            profiled[name] = categorize(prof, step_s)

    def by_setup(values: dict, local: bool = False) -> dict:
        return {name: values[(name, local)] for name in setups if (name, local) in values}

    medians = {key: statistics.median(t) for key, t in times.items()}
    return {
        "world_size": world,
        "n_params": n_params,
        "first": by_setup(first),
        "times": by_setup(times),
        "median": by_setup(medians),
        "compute_only": {name: medians.get((name, True), medians[(name, False)]) for name in setups},
        "other_threads_cpu": by_setup({key: statistics.median(t) for key, t in other_threads_cpu.items()}),
        "breakdown": profiled,
        "graphs": by_setup(graphs),
        "our_passes": by_setup(our_passes),
        "calls_per_step": by_setup(calls),
        "recompiles": {name: built[(name, False)][3]["graphs"] - graphs[(name, False)] for name in setups},
        "collectives": collectives,
    }


def run_on_pool(args, **kwargs) -> dict:
    """``measure`` on 2 fresh gloo ranks (loopback); rank 0's result."""
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    from fsdp_compile.testing import RankPool

    # A collective that waits longer than pg_timeout_s raises (with the rank's stack);
    # the smoke run's steps take well under a second, and a hang should not cost 30 minutes.
    pg_timeout_s = 300 if getattr(args, "quick", False) else 1800
    with RankPool(2, timeout_s=3600, pg_timeout_s=pg_timeout_s) as pool:
        return pool.run(measure, model_kwargs(args), args.seq, args.batch, args.steps, args.setups, **kwargs)[0]


def table(args, res: dict) -> str:
    tokens = args.batch * args.seq * res["world_size"]
    lines = [
        describe(args, res["n_params"])
        + ". 2 CPU ranks (gloo, loopback, 1 thread each); compute-only: each rank runs the same setup alone "
        "(world size 1, same per-rank batch), interleaved with the others; exposed communication = step - "
        "compute-only step. Compile times "
        + ("with Inductor's persistent caches (warm if an earlier run compiled the same kernels)." if args.warm_cache else "cold (fresh caches per setup)."),
        "",
        table_header(
            "setup",
            "median step (ms)",
            "x fsdp2 eager",
            "x compute-only limit",
            "tokens/s",
            "compile: first step (s)",
            "of which our passes (s)",
            "graphs compiled",
            "compiled-graph calls/step",
            "recompiles",
            "compute-only step, 1 rank (ms)",
            "exposed communication (ms)",
        ),
    ]
    def ratio(step: float, baseline: str) -> str:
        return f"{step / res['median'][baseline]:.2f}" if baseline in res["median"] else "-"

    for name in args.setups:
        step = res["median"][name]
        local = res["compute_only"][name]
        label, _, compiled, _ = SETUPS[name]
        graphs = str(res["graphs"][name]) if compiled else "-"
        passes = f"{res['our_passes'][name]:.2f}" if compiled and SETUPS[name][1] == "ours" else "-"
        calls = str(res["calls_per_step"][name]) if compiled else "-"
        recompiles = str(res["recompiles"][name]) if compiled else "-"
        lines.append(
            f"| {label} | {step * 1e3:.0f} | {ratio(step, 'fsdp2-eager')} | {ratio(step, LIMIT)} | {tokens / step:.0f} | {res['first'][name]:.1f} | {passes} | {graphs} | {calls} "
            f"| {recompiles} | {local * 1e3:.0f} | {(step - local) * 1e3:.0f} |"
        )
    if any(name in PEER_SETUPS for name in args.setups):
        lines += [
            "",
            "Rows without \"no reshard\" re-gather the decoder layers in the backward (reshard_after_forward=True); "
            "\"no reshard\" saves them from the forward. SimpleFSDP: per-parameter DTensor all-gathers in the graph "
            "(torchtitan's graph_trainer design); manual bucketing = Inductor's manual_overlap_bucketing, one bucket "
            "per decoder layer; auto bucketing = Inductor's overlap scheduling with collective bucketing "
            "(analytical estimates; without a GPU its compute estimates are 0).",
        ]
    if args.skipped:
        lines += ["", args.skipped]
    return "\n".join(lines)


def tables(args=None) -> list[str]:
    """Run the benchmark; the result tables as markdown strings (one here).

    ``args``: an ``argparse.Namespace`` from :func:`parser`, a list of CLI strings
    (``["--quick"]``) or ``None`` for the defaults."""
    args = resolve(args)
    if not args.setups:
        return [args.skipped or "No setup to run."]
    return [table(args, run_on_pool(args, cold_compile=not args.warm_cache))]


def main(argv=None) -> None:
    args = resolve(parser().parse_args(argv))
    for text in tables(args):
        print("\n" + text + "\n")


if __name__ == "__main__":
    main()
