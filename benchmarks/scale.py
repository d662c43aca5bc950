"""Scale by simulation: Llama-3-8B / 70B shaped FSDP steps at 8, 64 and 512 ranks (modelled).

    python -m benchmarks.scale [--quick] [--extrapolate] [--models llama3-8b llama3-70b]
                               [--world-sizes 8 64 512] [--layers K] [--wrap W]
                               [--prefetch-depth D] [--reduce-scatter-depth D]

Nothing here runs a real step: the models are far too big for a CPU machine.
Each configuration is *traced* at full width with no memory behind it:

* the model is built on the ``meta`` device, sharded with our ``fully_shard``
  (one unit per decoder layer plus the root; bf16 parameters and gathers, fp32
  gradient reduction, as torchtitan) at world size N on the ``fake`` process
  group, then materialised as CPU ``FakeTensor``s (``to_empty`` under a
  ``FakeTensorMode``; CPU rather than meta so that SDPA traces as the fused
  flash-attention op, as on a GPU, not as the math decomposition);
* one training step (forward, cross-entropy in fp32, backward; batch 1,
  sequence 8192) is compiled through Inductor's own pipeline up to its
  post-grad passes: Dynamo, AOTAutograd with Inductor's decompositions and
  joint-graph passes, our joint pass (reshard-after-forward recompute tags),
  the min-cut partitioner, and Inductor's post-grad passes, where our
  post-grad pass is replaced by a capture of the graph. Inductor's code
  generation is skipped (its inner compiler returns the graph, which runs on
  fake tensors);
* on copies of the captured forward and backward graphs we run, timed, what
  ``passes/registration.py`` runs for the default configuration (bucketing,
  reordering; pinning is timed separately since it only adds ordering edges),
  and simulate them with ``passes/cost_model.py`` on ``h100-nvlink`` and
  ``h100-ib-400g``. "Step without our passes" simulates the captured graph
  as traced (one collective per parameter, each waited at once).

Depth: every model is traced at full depth (on 2 otherwise idle cores:
8B about 45 s, 70B about 2 minutes per world size; about 10 minutes in
all). ``--extrapolate`` instead traces models deeper than 32 layers at 4
and 8 layers (full width) and extrapolates every modelled quantity (times,
bytes, FLOPs, collective counts, peak memory) linearly in the number of
layers: the decoder layers are identical, so each adds the same amount once
the schedule is periodic. Checked against full-depth traces at N = 8 (8B
and 70B): every modelled figure agrees within 0.1%. The run time of our
passes grows faster than linearly with depth, so it is not extrapolated.

Memory per rank: the simulation's peak of live bytes produced by each graph
(graph inputs excluded) and the same peak counted keeping a value live while
an alias of it (a view, ``wait_tensor``) is used (``simulate`` frees it at
its last direct use, which undercounts); the activations the forward saves
for the backward; and the sharded fp32 parameters + gradients + Adam moments
(16 bytes per parameter / N, rank 0's padded shards). The estimated peak is
``params + Adam (12 B / parameter / N) + max(forward peak, saved + backward
peak)`` with the alias-keeping peaks (the backward's includes the sharded
gradients it produces; gradients are freed between steps): an upper bound,
as the backward frees saved activations as it goes.

Everything is MODELLED by our cost model, not measured, with its
simplifications: every post-grad node is its own kernel (no fusion, so
memory-bound pointwise work is overcounted), causal attention is counted as
full attention, a collective's latency is one ``alpha`` whatever N (no
per-hop ring latency), and one link bandwidth per profile (``h100-nvlink``
beyond 8 GPUs is hypothetical: NVLink domains hold 8). ``--quick``:
Llama-3-8B at 2 layers, N = 8 only (about 20 s).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace

from benchmarks._common import benchmark_parser, one_thread_per_rank, table_header

SEQ_LEN = 8192
BATCH = 1
WORLD_SIZES = (8, 64, 512)
PROFILE_NAMES = ("h100-nvlink", "h100-ib-400g")
#: With ``extrapolate``, models deeper than this are traced at EXTRAPOLATION_DEPTHS layers.
MAX_TRACED_DEPTH = 32
EXTRAPOLATION_DEPTHS = (4, 8)


def model_configs():
    """Llama-3 shapes (untied input/output embeddings, grouped-query attention)."""
    from fsdp_compile.testing.models import LlamaConfig

    common = dict(vocab_size=128256, max_seq_len=SEQ_LEN, tie_embeddings=False, rope_theta=500000.0)
    return {
        "llama3-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, **common),
        "llama3-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, **common),
    }


# --------------------------------------------------------------------------- tracing


@contextlib.contextmanager
def _fake_world(world_size: int):
    """The default process group is a ``fake`` one of ``world_size`` ranks inside the block.
    A ``fake`` group already there (another benchmark's) is put back afterwards."""
    import torch.distributed as dist

    from fsdp_compile.testing._torch_internals import register_fake_process_group

    previous = None
    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError("benchmarks.scale needs its own `fake` default process group; a real one is initialised")
        previous = (dist.get_rank(), dist.get_world_size())
        dist.destroy_process_group()
    register_fake_process_group()
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if previous is not None:
            dist.init_process_group("fake", rank=previous[0], world_size=previous[1])


#: How the model is cut into units (``--wrap``).
WRAPS = {
    "layers": "one unit per decoder layer plus the root (every decoder layer resharded after forward)",
    "torchtitan": "torchtitan's units: the token embedding, each decoder layer (the last one kept after "
    "forward: the backward needs it first), norm + output (kept), and the root",
    "embedding-ignored": "WHAT-IF, not a training setup: as 'layers', with the token embedding left out of FSDP "
    "(ignored_params: no gather, no reduction, its gradient never synchronised), to bound what any change "
    "to the embedding's communication could gain",
}


def _wrap(model, wrap: str, **kwargs) -> None:
    from fsdp_compile import fully_shard

    last = len(model.layers) - 1
    if wrap == "torchtitan":
        fully_shard(model.tok_embeddings, **kwargs)
    for i, layer in enumerate(model.layers):
        fully_shard(layer, **kwargs, **({"reshard_after_forward": False} if wrap == "torchtitan" and i == last else {}))
    if wrap == "torchtitan":
        fully_shard([model.norm, model.output], reshard_after_forward=False, **kwargs)
    ignored = {model.tok_embeddings.weight} if wrap == "embedding-ignored" else None
    fully_shard(model, ignored_params=ignored, **kwargs)


def _sharded_model(cfg, fake_mode, wrap: str = "layers"):
    """``cfg`` built on meta, sharded as ``wrap`` says (:data:`WRAPS`), then fake CPU tensors."""
    import torch

    from fsdp_compile import MixedPrecisionPolicy
    from fsdp_compile.testing.models import Llama

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with torch.device("meta"):
        model = Llama(cfg)
    _wrap(model, wrap, mp_policy=policy)
    with fake_mode:
        model.to_empty(device="cpu")
        # bf16 rotary tables keep q and k in bf16 (fp32 tables would promote them).
        model.rope_cos = model.rope_cos.to(torch.bfloat16)
        model.rope_sin = model.rope_sin.to(torch.bfloat16)
    return model


def parameter_counts(cfg, world_size: int, wrap: str = "layers") -> tuple[int, int, int]:
    """(parameters, of which not re-gathered in the backward, parameters on rank 0 incl.
    padding) of ``cfg``, from a meta-device model: each parameter is split along dim 0
    like ``torch.chunk``, rank 0 holding the largest piece (``ceil(dim0 / N)`` rows).
    Not re-gathered: the units kept after forward (the root; with ``torchtitan``, also
    the last layer and norm + output) and the token embedding (its backward does not
    read the weight). With ``embedding-ignored`` every rank holds the whole embedding."""
    import torch

    from fsdp_compile.testing.models import Llama

    with torch.device("meta"):
        model = Llama(cfg)
    total = sum(p.numel() for p in model.parameters())
    kept = total - sum(p.numel() for p in model.layers.parameters())
    if wrap == "torchtitan":
        kept += sum(p.numel() for p in model.layers[-1].parameters())
    local = sum(-(-p.shape[0] // world_size) * (p[0].numel() if p.dim() > 1 else 1) for p in model.parameters())
    if wrap == "embedding-ignored":
        embedding = model.tok_embeddings.weight
        local += embedding.numel() - -(-embedding.shape[0] // world_size) * embedding[0].numel()
    return total, kept, local


@dataclass
class Trace:
    """Forward and backward post-grad graphs of one step, before our post-grad passes."""

    forward: object  # fx.GraphModule
    backward: object
    trace_s: float


def trace_step(cfg, world_size: int, wrap: str = "layers") -> Trace:
    """Compile one training step of ``cfg`` sharded over ``world_size`` fake ranks (see the
    module docstring) and return its captured graphs."""
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import torch.fx as fx
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_compile.passes.schedule import copy_graph
    from fsdp_compile.testing._torch_internals import compile_fx_up_to_post_grad

    captured: list[fx.GraphModule] = []

    def capture(graph: fx.Graph) -> None:  # stands in for our post-grad pass
        captured.append(fx.GraphModule(torch.nn.Module(), copy_graph(graph)))

    backend = compile_fx_up_to_post_grad()

    start = time.perf_counter()
    torch._dynamo.reset()
    try:
        with _fake_world(world_size):
            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            model = _sharded_model(cfg, fake_mode, wrap)

            def step(tokens, targets):
                logits = model(tokens)
                return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

            with (
                inductor_config.patch(post_grad_custom_post_pass=[capture]),
                functorch_config.patch(enable_autograd_cache=False),
                fake_mode,
            ):
                tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ_LEN))
                targets = torch.randint(0, cfg.vocab_size, (BATCH, SEQ_LEN))
                torch.compile(step, backend=backend, fullgraph=True)(tokens, targets).backward()
    finally:
        torch._dynamo.reset()
    if len(captured) != 2:
        raise RuntimeError(f"expected one forward and one backward graph, captured {len(captured)}")
    return Trace(captured[0], captured[1], time.perf_counter() - start)


# --------------------------------------------------------------------------- passes and simulation


def run_our_passes(gm) -> tuple[object, float, float]:
    """A copy of ``gm`` after our post-grad passes, as ``registration.py`` runs them
    (bucketing, reordering); returns (graph, their seconds, pinning seconds on a further copy)."""
    import torch.fx as fx

    from fsdp_compile.base import config
    from fsdp_compile.passes.pinning import pin_schedule
    from fsdp_compile.passes.schedule import bucket_cap_bytes, copy_graph, schedule_collectives

    def ours():
        graph = copy_graph(gm.graph)
        start = time.perf_counter()
        schedule_collectives(graph, bucket_cap_bytes(graph))
        return graph, time.perf_counter() - start

    (graph, first_s), (_, second_s) = ours(), ours()  # the faster of two runs: the first one warms up
    pinned = fx.GraphModule(gm, copy_graph(graph))
    start = time.perf_counter()
    pin_schedule(pinned.graph, config.reduce_scatter_depth)
    return graph, min(first_s, second_s), time.perf_counter() - start


@dataclass
class Measures:
    """Per-step quantities of one (model, depth, N). All but the run times grow by the same
    amount per decoder layer, so they extrapolate linearly in depth."""

    flops: float = 0.0  # matmul + attention FLOPs counted in the graphs
    comm_bytes: float = 0.0  # bytes each rank sends, ring: (N-1)/N * buffer
    # (forward all-gathers, backward all-gathers, reduce-scatters + all-reduces)
    collectives_traced: tuple = (0, 0, 0)
    collectives: tuple = (0, 0, 0)
    peak_forward: float = 0.0  # simulate()'s peak
    peak_backward: float = 0.0
    peak_forward_aliases: float = 0.0  # peak_live_bytes_keeping_aliases
    peak_backward_aliases: float = 0.0
    saved: float = 0.0  # forward outputs the backward reads (activations, kept gathers)
    passes_s: float | None = 0.0  # None: not measured (extrapolated depth)
    pinning_s: float | None = 0.0
    trace_s: float = 0.0
    # profile -> (step, compute, communication, exposed, step without our passes), seconds
    times: dict = field(default_factory=dict)
    # profile -> per graph (forward, backward): compute, communication, and the exposed
    # communication by phase (start, middle, end; passes/cost_model.exposure_by_phase), seconds
    split: dict = field(default_factory=dict)
    # profile -> steady-state periods across the step boundary (benchmarks/_across_steps.py):
    # (in step, optimizer in backward, across steps, compute, optimizer, communication, held bytes,
    # boundary chain, lower bound)
    across: dict = field(default_factory=dict)


def _collectives(graph) -> list:
    from fsdp_compile.passes.cost_model import collective_kind

    return [n for n in graph.nodes if collective_kind(n) in ("all_gather", "reduce_scatter", "all_reduce")]


def _count_by_kind(forward, backward) -> tuple:
    from fsdp_compile.passes.cost_model import collective_kind

    def count(graph, kinds):
        return sum(1 for n in graph.nodes if collective_kind(n) in kinds)

    return count(forward, ("all_gather",)), count(backward, ("all_gather",)), count(backward, ("reduce_scatter", "all_reduce"))


def _saved_for_backward(forward) -> list:
    """Forward outputs the graph itself produced (views resolved to their base;
    graph inputs such as the sharded parameters and the tokens left out)."""
    from fsdp_compile.runtime.vocabulary import is_view

    (output,) = [n for n in forward.nodes if n.op == "output"]
    bases = {}
    for node in output.args[0]:
        while hasattr(node, "op") and is_view(node):
            node = node.args[0]
        if hasattr(node, "op") and node.op == "call_function":
            bases[node] = None
    return list(bases)


def peak_live_bytes_keeping_aliases(graph) -> int:
    """Peak of live bytes produced by ``graph``, like ``simulate``'s, except that a value
    stays live while any alias of it (view, ``wait_tensor``, ``getitem`` of a tuple) is
    still used: ``simulate`` frees a value at its last *direct* use, so a tensor read
    only through a view (most saved activations, every gathered weight after its wait)
    counts as freed early."""
    from fsdp_compile.passes.cost_model import tensor_bytes
    from fsdp_compile.runtime.vocabulary import collective_kind, is_alias

    def base(node):
        while is_alias(node) and node.args and hasattr(node.args[0], "op"):
            node = node.args[0]
        return node

    nodes = list(graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    last_use: dict = {}

    def used_at(node, i: int) -> None:
        last_use[base(node)] = max(last_use.get(base(node), i), i)

    for i, node in enumerate(nodes):
        for used in node.all_input_nodes:
            used_at(used, i)
        if collective_kind(node) and hasattr(node.args[0], "op"):  # the input lives until the wait
            for wait in node.users:
                used_at(node.args[0], position[wait])
    frees = {}
    for node, i in last_use.items():
        frees.setdefault(i, []).append(node)
    live = peak = 0
    for i, node in enumerate(nodes):
        if node.op == "call_function" and not is_alias(node):
            live += tensor_bytes(node)
            peak = max(peak, live)
        for dead in frees.get(i, []):
            if dead.op == "call_function" and not is_alias(dead):
                live -= tensor_bytes(dead)
    return peak


def measure(tr: Trace) -> Measures:
    from benchmarks._across_steps import simulate_across_steps
    from fsdp_compile.passes.cost_model import (
        collective_kind,
        exposure_by_phase,
        node_flops,
        simulate,
        tensor_bytes,
    )

    m = Measures(trace_s=tr.trace_s)
    finals = []
    for gm in (tr.forward, tr.backward):
        final, passes_s, pinning_s = run_our_passes(gm)
        finals.append(final)
        m.passes_s += passes_s
        m.pinning_s += pinning_s
    m.collectives_traced = _count_by_kind(tr.forward.graph, tr.backward.graph)
    m.collectives = _count_by_kind(*finals)
    for final in finals:
        notes: set = set()
        m.flops += sum(node_flops(n, notes) for n in final.nodes if n.op == "call_function")
        for n in _collectives(final):
            world_size = n.args[-2]
            buffer = tensor_bytes(n) if collective_kind(n) == "all_gather" else tensor_bytes(n.args[0])
            m.comm_bytes += (world_size - 1) / world_size * buffer
    m.saved = sum(tensor_bytes(n) for n in _saved_for_backward(tr.forward.graph))
    m.peak_forward_aliases, m.peak_backward_aliases = (peak_live_bytes_keeping_aliases(g) for g in finals)
    for profile in PROFILE_NAMES:
        sims = [simulate(g, profile) for g in finals]
        raw = [simulate(gm.graph, profile) for gm in (tr.forward, tr.backward)]
        m.times[profile] = (
            sum(s.step_s for s in sims),
            sum(s.compute_s for s in sims),
            sum(s.communication_s for s in sims),
            sum(s.exposed_s for s in sims),
            sum(s.step_s for s in raw),
        )
        m.split[profile] = tuple(
            x
            for g, sim in zip(finals, sims, strict=True)
            for x in (
                sim.compute_s,
                sim.communication_s,
                *vars(exposure_by_phase(g, sim)).values(),
            )
        )
        m.peak_forward, m.peak_backward = sims[0].peak_bytes, sims[1].peak_bytes
        m.across[profile] = tuple(vars(simulate_across_steps(*finals, profile)).values())
    return m


def _extrapolate(a: Measures, b: Measures, depth_a: int, depth_b: int, depth: int) -> Measures:
    """Linear in the number of layers through the two traced depths."""
    k = (depth - depth_a) / (depth_b - depth_a)

    def line(x, y):
        return x + k * (y - x)

    out = Measures()
    for name in ("flops", "comm_bytes", "peak_forward", "peak_backward", "peak_forward_aliases",
                 "peak_backward_aliases", "saved"):
        setattr(out, name, line(getattr(a, name), getattr(b, name)))
    out.passes_s = out.pinning_s = None  # grow faster than linearly with depth: not extrapolated
    for name in ("collectives_traced", "collectives"):
        setattr(out, name, tuple(round(line(x, y)) for x, y in zip(getattr(a, name), getattr(b, name), strict=True)))
    out.trace_s = a.trace_s + b.trace_s  # what it cost here
    out.times = {p: tuple(line(x, y) for x, y in zip(a.times[p], b.times[p], strict=True)) for p in a.times}
    out.split = {p: tuple(line(x, y) for x, y in zip(a.split[p], b.split[p], strict=True)) for p in a.split}
    out.across = {p: tuple(line(x, y) for x, y in zip(a.across[p], b.across[p], strict=True)) for p in a.across}
    return out


# --------------------------------------------------------------------------- the runs and the tables


@dataclass
class Result:
    model: str
    cfg: object
    world_size: int
    how: str  # how the numbers were obtained (traced depth, or extrapolated)
    m: Measures
    params: int
    kept_params: int  # not re-gathered in the backward (parameter_counts)
    local_params: int  # on rank 0, padded


def run_config(
    name: str, cfg, world_size: int, extrapolate: bool = False, layers: int | None = None, wrap: str = "layers"
) -> Result:
    """``cfg`` at ``world_size``: traced at ``layers`` (default: full depth), or, with
    ``extrapolate`` and a model deeper than MAX_TRACED_DEPTH, traced at EXTRAPOLATION_DEPTHS
    and extrapolated to full depth."""
    depth = layers or cfg.n_layers
    counts = parameter_counts(replace(cfg, n_layers=depth), world_size, wrap)
    units = "; units: " + {
        "torchtitan": "torchtitan's",
        "embedding-ignored": "decoder layers + root, WHAT-IF: token embedding not sharded",
    }.get(wrap, "decoder layers + root")
    if not extrapolate or depth <= MAX_TRACED_DEPTH:
        m = measure(trace_step(replace(cfg, n_layers=depth), world_size, wrap))
        how = f"traced, {depth} layers" + (f" (of {cfg.n_layers})" if depth < cfg.n_layers else "") + units
        return Result(name, replace(cfg, n_layers=depth), world_size, how, m, *counts)
    da, db = EXTRAPOLATION_DEPTHS
    ma = measure(trace_step(replace(cfg, n_layers=da), world_size, wrap))
    mb = measure(trace_step(replace(cfg, n_layers=db), world_size, wrap))
    how = f"extrapolated to {depth} layers from traces of {da} and {db}" + units
    return Result(name, replace(cfg, n_layers=depth), world_size, how, _extrapolate(ma, mb, da, db, depth), *counts)


def _expected_flops(r: Result) -> float:
    """6 x (parameters outside the embedding lookup) x tokens, plus attention as the cost
    model counts it (torch's FLOP counter: 4 b h s^2 d forward, 2.5x that backward, whose
    flash kernel recomputes the scores; causal masking not halved)."""
    c = r.cfg
    tokens = BATCH * SEQ_LEN
    dense = 6 * (r.params - c.vocab_size * c.dim) * tokens
    attention = 14 * c.n_layers * BATCH * c.n_heads * SEQ_LEN**2 * (c.dim // c.n_heads)
    return dense + attention


def _expected_comm_bytes(r: Result) -> float:
    """Ring volume per rank: (N-1)/N x (bf16 forward gather of every parameter + bf16
    backward re-gather of the parameters not kept after forward (parameter_counts) + fp32
    reduce-scatter)."""
    n = r.world_size
    return (n - 1) / n * (2 * r.params + 2 * (r.params - r.kept_params) + 4 * r.params)


GiB, GB = 2**30, 1e9


def _title(r: Result) -> str:
    c = r.cfg
    return (
        f"{r.model} shaped ({r.params / 1e9:.2f}B parameters: dim {c.dim}, {c.n_layers} layers, {c.n_heads} heads, "
        f"{c.n_kv_heads} kv heads, ffn {c.ffn_dim}, vocab {c.vocab_size}), seq {SEQ_LEN}, batch {BATCH} per rank"
    )


def time_table(results: list[Result]) -> str:
    r0 = results[0]
    rows = [
        f"**Step time, MODELLED (not measured)** — {_title(r0)}; {r0.how}",
        "",
        table_header(
            "N",
            "profile",
            "step (ms)",
            "compute (ms)",
            "communication (ms)",
            "exposed comm. (ms)",
            "overlap",
            "tokens/s per rank",
            "step without our passes (ms)",
        ),
    ]
    for r in results:
        for profile, (step, compute, comm, exposed, raw) in r.m.times.items():
            overlap = 1 - exposed / comm if comm else 1.0
            rows.append(
                f"| {r.world_size} | {profile} | {step * 1e3:.0f} | {compute * 1e3:.0f} | {comm * 1e3:.0f} "
                f"| {exposed * 1e3:.0f} | {overlap:.0%} | {BATCH * SEQ_LEN / step:.0f} | {raw * 1e3:.0f} |"
            )
    return "\n".join(rows)


def exposure_table(results: list[Result]) -> str:
    """Against which bound the step is measured, and where what stays exposed sits."""
    r0 = results[0]
    rows = [
        f"**What stays exposed, MODELLED** — {r0.model}; {r0.how}",
        "",
        table_header(
            "N",
            "profile",
            "step (ms)",
            "x max(compute, comm.)",
            "per-graph bound (ms)",
            "x per-graph bound",
            "fwd: compute / comm. (ms)",
            "bwd: compute / comm. (ms)",
            "exposed fwd: start / middle / end (ms)",
            "exposed bwd: start / middle / end (ms)",
        ),
    ]
    for r in results:
        for profile, (step, compute, comm, _exposed, _raw) in r.m.times.items():
            cf, mf, f0, f1, f2, cb, mb, b0, b1, b2 = (x * 1e3 for x in r.m.split[profile])
            bound = max(cf, mf) + max(cb, mb)
            rows.append(
                f"| {r.world_size} | {profile} | {step * 1e3:.0f} | {step / max(compute, comm):.2f} | {bound:.0f} "
                f"| {step * 1e3 / bound:.2f} | {cf:.0f} / {mf:.0f} | {cb:.0f} / {mb:.0f} "
                f"| {f0:.0f} / {f1:.0f} / {f2:.0f} | {b0:.0f} / {b1:.0f} / {b2:.0f} |"
            )
    rows += [
        "",
        "The step-wide max(compute, communication) assumes any collective can hide behind any compute. "
        "It cannot: a reduce-scatter needs the backward's gradient and (reshard_after_forward=True) a "
        "re-gather is by design not done in the forward, so the backward's communication cannot hide "
        "behind the forward's compute. Per-graph bound: max(compute, communication) of the forward graph "
        "plus the same of the backward graph; no order of these graphs' operations is faster. What a "
        "schedule still exposes above it is mostly at the graphs' edges: a graph's first gathers have no "
        "compute before them to hide behind, and its last reduce-scatters none after them. Exposed, by phase (passes/cost_model.exposure_by_phase): *start*, "
        "collectives issued before the graph's first matmul (nothing to hide behind); *end*, collectives "
        "waited after its last matmul (nothing left to hide them); *middle*, the rest, exposed where the "
        "link is the bottleneck.",
    ]
    return "\n".join(rows)


def across_steps_table(results: list[Result]) -> str:
    """Steady-state step period with the optimizer, in step and across the boundary."""
    r0 = results[0]
    rows = [
        f"**Across the step boundary, MODELLED** — {r0.model}; {r0.how}; Adam on the fp32 shards; "
        "steady-state period between forwards (benchmarks/_across_steps.py)",
        "",
        table_header(
            "N",
            "profile",
            "compute + optimizer / comm. (ms)",
            "in step: opt.step() after backward (ms, x max)",
            "optimizer in backward (ms, x max)",
            "across steps: + next forward's first gathers behind it (ms, x max)",
            "gathered bytes held across the boundary (GiB)",
            "boundary chain (ms)",
            "lower bound, any schedule of these buckets (ms, x max)",
            "what-if, not built: the reduce-scatters of the k units gathered last deferred to the next "
            "forward (ms, x max; k; unsharded gradients held, GiB)",
        ),
    ]
    for r in results:
        for profile, values in r.m.across.items():
            in_step, in_backward, across, compute, optimizer, comm, held, chain, floor, deferred, k, kept = values
            bound = max(compute + optimizer, comm)

            def cell(t: float, bound: float = bound) -> str:
                return f"{t * 1e3:.0f} ({t / bound:.2f})"

            rows.append(
                f"| {r.world_size} | {profile} | {(compute + optimizer) * 1e3:.0f} / {comm * 1e3:.0f} "
                f"| {cell(in_step)} | {cell(in_backward)} | {cell(across)} | {held / GiB:.2f} | {chain * 1e3:.0f} "
                f"| {cell(floor)} | {cell(deferred)}; k = {k}; {kept / GiB:.2f} |"
            )
    rows += [
        "",
        "x max: against max(compute + optimizer, communication) per step. The units the backward reduces "
        "last (the first layer, the root with the token embedding) are the ones the forward gathers first. "
        "Their reduce-scatters issued after the backward's last matmul, and the forward's gathers issued "
        "before its first one, are a chain (reduce-scatter, optimizer step, all-gather) between the two "
        "matmuls that no order of the step's work hides: no schedule, within or across steps, is faster "
        "than the compute from the forward's first matmul to the backward's last plus that chain, nor "
        "than compute + optimizer, nor than the communication (the lower-bound column). The what-if "
        "column moves the reduce-scatters of the units the forward gathers last into the next forward "
        "(in 1 ms chunks where its link idles, each unit's optimizer step right before its gather): the "
        "library does not do this.",
    ]
    return "\n".join(rows)


def _seconds(s: float | None) -> str:
    return "n/a (extrapolated)" if s is None else f"{s:.2f}"


def memory_table(results: list[Result]) -> str:
    r0 = results[0]
    rows = [
        f"**Memory per rank, collectives, pass run time** — {r0.model}; {r0.how}; memory MODELLED",
        "",
        table_header(
            "N",
            "collectives traced → after our passes (fwd all-gather + bwd all-gather + reduce-scatter)",
            "forward peak: simulate / aliases kept (GiB)",
            "saved for backward (GiB)",
            "backward peak: simulate / aliases kept (GiB)",
            "params+grads+Adam, fp32 sharded (GiB)",
            "est. peak per rank (GiB, upper bound)",
            "bucketing + reordering (s)",
            "pinning (s)",
            "trace (s)",
        ),
    ]
    for r in results:
        m = r.m
        state = 16 * r.local_params  # fp32 parameters, gradients, Adam's two moments
        total = 12 * r.local_params + max(m.peak_forward_aliases, m.saved + m.peak_backward_aliases)
        rows.append(
            f"| {r.world_size} | {'+'.join(map(str, m.collectives_traced))} → {'+'.join(map(str, m.collectives))} "
            f"| {m.peak_forward / GiB:.1f} / {m.peak_forward_aliases / GiB:.1f} | {m.saved / GiB:.1f} "
            f"| {m.peak_backward / GiB:.1f} / {m.peak_backward_aliases / GiB:.1f} | {state / GiB:.1f} "
            f"| {total / GiB:.1f} | {_seconds(m.passes_s)} | {_seconds(m.pinning_s)} | {m.trace_s:.0f} |"
        )
    return "\n".join(rows)


def sanity_table(results: list[Result]) -> str:
    rows = [
        "**Sanity checks: what the graphs hold vs the textbook formulas** (per rank, per step)",
        "",
        table_header(
            "model", "N", "FLOPs in graphs (TFLOP)", "6·P·T + attention (TFLOP)", "sent per rank (GB)", "(N−1)/N·(2+2+4 B)·P (GB)"
        ),
    ]
    for r in results:
        rows.append(
            f"| {r.model} | {r.world_size} | {r.m.flops / 1e12:.1f} | {_expected_flops(r) / 1e12:.1f} "
            f"| {r.m.comm_bytes / GB:.2f} | {_expected_comm_bytes(r) / GB:.2f} |"
        )
    rows += [
        "",
        "P: parameters; T: tokens per rank; attention counted as the cost model does (backward 2.5x the "
        "forward: the flash backward recomputes the scores; causal mask not halved); "
        "embedding lookup not a matmul. Sent bytes: bf16 forward all-gather, bf16 backward re-gather "
        "(not of the units kept after forward, nor of the token embedding, whose backward does not read it), "
        "fp32 reduce-scatter; the graphs' "
        "figure is a little higher where dim 0 pads to a multiple of N.",
    ]
    return "\n".join(rows)


def run(
    quick: bool = False,
    models=None,
    world_sizes=None,
    extrapolate: bool = False,
    layers: int | None = None,
    wrap: str = "layers",
):
    """All results, grouped by model."""
    configs = model_configs()
    if quick:
        models, world_sizes, layers = models or ["llama3-8b"], world_sizes or [8], layers or 2
    grouped = {}
    for name in models or list(configs):
        grouped[name] = [run_config(name, configs[name], n, extrapolate, layers, wrap) for n in world_sizes or WORLD_SIZES]
    return grouped


def tables(quick: bool = False, **kwargs) -> list[str]:
    """The result tables as markdown strings (for ``python -m benchmarks``)."""
    grouped = run(quick, **kwargs)
    out = []
    for results in grouped.values():
        out += [time_table(results), exposure_table(results), across_steps_table(results), memory_table(results)]
    out.append(sanity_table([r for results in grouped.values() for r in results]))
    return out


HEADER = (
    "MODELLED, NOT MEASURED: every time and memory figure below comes from fsdp_compile's cost model "
    "(passes/cost_model.py) run on graphs traced with fake tensors on the `fake` process group; "
    "no step ran. Profiles: " + ", ".join(PROFILE_NAMES) + "."
)


def main(argv=None) -> None:
    p = benchmark_parser(__doc__, quick_help="llama3-8b at 2 layers, N=8 only")
    p.add_argument("--models", nargs="+", choices=sorted(model_configs()), default=None)
    p.add_argument("--world-sizes", nargs="+", type=int, default=None)
    p.add_argument(
        "--extrapolate",
        action="store_true",
        help=f"trace models deeper than {MAX_TRACED_DEPTH} layers at {EXTRAPOLATION_DEPTHS} layers and extrapolate",
    )
    p.add_argument("--layers", type=int, default=None, help="trace this many layers and report them as they are")
    p.add_argument(
        "--wrap",
        choices=sorted(WRAPS),
        default="layers",
        help="the units: " + "; ".join(f"{k}: {v}" for k, v in WRAPS.items()),
    )
    p.add_argument("--prefetch-depth", type=int, default=None, help="config.prefetch_depth for our passes (default: the config's)")
    p.add_argument(
        "--reduce-scatter-depth", type=int, default=None, help="config.reduce_scatter_depth for our passes (default: the config's)"
    )
    args = p.parse_args(argv)
    one_thread_per_rank()
    start = time.perf_counter()
    from fsdp_compile.base import config

    depths = {"prefetch_depth": args.prefetch_depth, "reduce_scatter_depth": args.reduce_scatter_depth}
    with config.patch(**{k: v for k, v in depths.items() if v is not None}):
        out = tables(
            args.quick,
            models=args.models,
            world_sizes=args.world_sizes,
            extrapolate=args.extrapolate,
            layers=args.layers,
            wrap=args.wrap,
        )
    print(f"\n{HEADER}\n")
    for table in out:
        print(table, end="\n\n")
    print(f"(benchmarks.scale took {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
