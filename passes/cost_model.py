"""Cost model: analytic compute and communication time, and a two-stream simulation.

Inductor's own estimates are 0 for non-GPU nodes and its overlap scheduler
needs a GPU roofline, so this model is ours. It is deliberately simple and
deterministic (every rank must reach the same decisions from the same graph):

* compute node: ``max(flops / flops_per_s, bytes / mem_bytes_per_s)``, with
  FLOPs counted for matmuls and attention, bytes for everything else; views
  and constants cost nothing;
* collective (ring, alpha-beta): ``alpha + (n - 1) / n * bytes / link_bytes_per_s``
  where ``bytes`` is the full (gathered / pre-reduction) buffer, doubled for
  an all-reduce;
* simulation of the final node order on one compute and one communication
  stream: an issue starts when both the program reaches it and the link is
  free; a wait blocks compute until its collective ends. It reports the step
  time, the exposed communication (time compute spent blocked in waits) and
  the peak of live bytes produced by the graph (inputs excluded).

Shapes come from ``node.meta["val"]``; a symbolic size is evaluated at its
hint (``symbolic_size_hint``) and the fact is recorded in the report.
"""

from __future__ import annotations

import operator

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fsdp_compile._compat import c10d_functional
from fsdp_compile.passes.graph_utils import ALL_GATHER, REDUCE_SCATTER, WAIT
from fsdp_compile.runtime.collectives import tag_of

aten = torch.ops.aten


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    flops_per_s: float  # dense matmul throughput (the training dtype)
    mem_bytes_per_s: float  # memory bandwidth for bandwidth-bound kernels
    link_bytes_per_s: float  # per-rank collective bandwidth
    alpha_s: float  # fixed cost of one collective

    def collective_seconds(self, kind: str, buffer_bytes: int, world_size: int) -> float:
        factor = 2.0 if kind == "all_reduce" else 1.0
        return self.alpha_s + factor * (world_size - 1) / world_size * buffer_bytes / self.link_bytes_per_s


PROFILES: dict[str, HardwareProfile] = {
    # H100 SXM: ~700 TFLOP/s achievable bf16 dense, 3.35 TB/s HBM3;
    # NVLink 4: ~450 GB/s per direction per GPU (intra-node ring).
    "h100-nvlink": HardwareProfile("h100-nvlink", 700e12, 3.0e12, 450e9, 10e-6),
    # Same GPU across nodes on one 400 Gb/s InfiniBand NIC per GPU (~50 GB/s).
    "h100-ib-400g": HardwareProfile("h100-ib-400g", 700e12, 3.0e12, 50e9, 25e-6),
    # Measured on this project's 2-core CI machine with
    # `python -m benchmarks.calibrate_cpu` (1 thread per rank, gloo over loopback):
    # 134 GFLOP/s fp32 matmul, 13.4 GB/s copy, all-gather alpha 208 us, 0.47 GB/s.
    "cpu-gloo": HardwareProfile("cpu-gloo", 134e9, 13.4e9, 0.47e9, 208e-6),
}


def get_profile(name: str) -> HardwareProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware profile {name!r}; known: {sorted(PROFILES)}") from None


#: Value used for a symbolic size without a hint (dynamic shapes).
symbolic_size_hint: int = 1024


def _concrete(x, notes: set) -> int:
    if isinstance(x, int):
        return x
    try:
        node = x.node
        if node.has_hint():
            notes.add("symbolic sizes evaluated at their hints")
            return int(node.hint)
    except AttributeError:
        pass
    notes.add(f"symbolic sizes without a hint evaluated at {symbolic_size_hint}")
    return symbolic_size_hint


def _numel(t: torch.Tensor, notes: set) -> int:
    n = 1
    for s in t.shape:
        n *= _concrete(s, notes)
    return n


def tensor_bytes(node: fx.Node, notes: set | None = None) -> int:
    notes = notes if notes is not None else set()
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return _numel(v, notes) * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(_numel(t, notes) * t.element_size() for t in v if isinstance(t, torch.Tensor))
    return 0


_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_FREE = {aten.full.default, aten.zeros.default, aten.empty.memory_format, aten.scalar_tensor.default}


def node_flops(node: fx.Node, notes: set) -> int:
    if node.target in _MATMULS:
        a, b = (node.args[1], node.args[2]) if node.target in (aten.addmm.default, aten.baddbmm.default) else node.args[:2]
        av, bv = a.meta["val"], b.meta["val"]
        batch = _concrete(av.shape[0], notes) if av.dim() == 3 else 1
        m, k = _concrete(av.shape[-2], notes), _concrete(av.shape[-1], notes)
        n = _concrete(bv.shape[-1], notes)
        return 2 * batch * m * n * k
    name = str(node.target)
    if "scaled_dot_product" in name and "backward" not in name:
        q = node.args[0].meta["val"]
        b, h, s, d = (_concrete(x, notes) for x in q.shape)
        return 4 * b * h * s * s * d
    if "scaled_dot_product" in name:
        q = node.args[1].meta["val"] if len(node.args) > 1 else node.args[0].meta["val"]
        b, h, s, d = (_concrete(x, notes) for x in q.shape[-4:])
        return 8 * b * h * s * s * d
    return 0


def compute_seconds(node: fx.Node, profile: HardwareProfile, notes: set) -> float:
    target = node.target
    if node.op != "call_function" or target in _FREE or target is WAIT or target is operator.getitem:
        return 0.0
    if isinstance(target, torch._ops.OpOverload) and target.is_view:
        return 0.0
    flops = node_flops(node, notes)
    moved = tensor_bytes(node, notes) + sum(tensor_bytes(i, notes) for i in node.all_input_nodes)
    return max(flops / profile.flops_per_s, moved / profile.mem_bytes_per_s)


def collective_kind(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    if node.target in (ALL_GATHER, c10d_functional.all_gather_into_tensor_out.default):
        return "all_gather"
    if node.target is REDUCE_SCATTER:
        return "reduce_scatter"
    if str(node.target).startswith("_c10d_functional.all_reduce"):
        return "all_reduce"
    return None


def collective_seconds(node: fx.Node, profile: HardwareProfile, notes: set, default_world_size: int = 2) -> float:
    kind = collective_kind(node)
    # all_reduce's schema names no group size; use the graph's other collectives'.
    world_size = node.args[-2] if kind != "all_reduce" else default_world_size
    buffer = tensor_bytes(node, notes) if kind == "all_gather" else tensor_bytes(node.args[0], notes)
    return profile.collective_seconds(kind, buffer, world_size)


@dataclass
class CollectiveTiming:
    name: str
    kind: str
    unit: str
    bytes: int
    issue_s: float
    start_s: float
    end_s: float
    wait_s: float | None = None  # when compute reached the wait
    exposed_s: float = 0.0


@dataclass
class Simulation:
    profile: str
    step_s: float
    compute_s: float
    communication_s: float
    exposed_s: float
    peak_bytes: int
    collectives: list[CollectiveTiming] = field(default_factory=list)
    compute_spans: list[tuple[str, float, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def overlap_fraction(self) -> float:
        return 1.0 - self.exposed_s / self.communication_s if self.communication_s else 1.0


def simulate(graph: fx.Graph, profile: HardwareProfile | str, *, ignore_own_copies: bool = False) -> Simulation:
    """Simulate ``graph`` in its current order (see module docstring).

    ``ignore_own_copies`` leaves out the cost of our tagged non-collective nodes
    (padding, copy-in/out): they differ between ranks (only some ranks pad),
    so decisions that must agree across ranks are made without them.
    """
    profile = get_profile(profile) if isinstance(profile, str) else profile
    notes: set = set()
    nodes = list(graph.nodes)
    t_compute = t_link = 0.0
    compute_total = comm_total = exposed = 0.0
    pending: dict[fx.Node, CollectiveTiming] = {}
    timings: list[CollectiveTiming] = []
    spans: list[tuple[str, float, float]] = []

    # Liveness for the memory peak: a buffer lives from its node to the last user
    # of it or of any alias of it (views, waits, tuple items), and a collective's
    # input until the collective's wait.
    position = {n: i for i, n in enumerate(nodes)}
    root: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        source = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        root[n] = root.get(source, source) if _is_alias(n) and source is not None else n
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        for i in n.all_input_nodes:
            r = root.get(i, i)
            last_use[r] = max(last_use.get(r, 0), position[n])
    for n in nodes:
        if collective_kind(n) and len(n.users) == 1:
            waiter = next(iter(n.users))
            src = n.args[0]
            if isinstance(src, fx.Node):
                r = root.get(src, src)
                last_use[r] = max(last_use.get(r, 0), position[waiter])
    world_size = next((n.args[-2] for n in nodes if collective_kind(n) in ("all_gather", "reduce_scatter")), 2)
    frees: dict[int, list[fx.Node]] = {}
    for n, i in last_use.items():
        frees.setdefault(i, []).append(n)
    live = peak = 0

    for i, node in enumerate(nodes):
        if node.op == "call_function" and not _is_alias(node):
            live += tensor_bytes(node, notes)
            peak = max(peak, live)
        kind = collective_kind(node)
        if kind:
            duration = collective_seconds(node, profile, notes, world_size)
            start = max(t_link, t_compute)
            t_link = start + duration
            tag = tag_of(node) or {}
            timing = CollectiveTiming(node.name, kind, tag.get("unit_fqn", "?"), tensor_bytes(node, notes), t_compute, start, t_link)
            timings.append(timing)
            comm_total += duration
            if len(node.users) == 1 and next(iter(node.users)).target is WAIT:
                pending[next(iter(node.users))] = timing
        elif node.target is WAIT and node in pending:
            timing = pending.pop(node)
            timing.wait_s = t_compute
            if timing.end_s > t_compute:
                timing.exposed_s = timing.end_s - t_compute
                exposed += timing.exposed_s
                t_compute = timing.end_s
        elif node.op == "call_function":
            if ignore_own_copies and tag_of(node) is not None:
                continue
            duration = compute_seconds(node, profile, notes)
            if duration:
                spans.append((node.name, t_compute, t_compute + duration))
                t_compute += duration
                compute_total += duration
        for dead in frees.get(i, []):
            if dead.op == "call_function" and not _is_alias(dead):
                live -= tensor_bytes(dead, notes)

    step = max(t_compute, t_link)
    return Simulation(profile.name, step, compute_total, comm_total, exposed, peak, timings, spans, sorted(notes))


def _is_alias(node: fx.Node) -> bool:
    """A node whose result shares its first input's memory: views, waits, tuple items."""
    target = node.target
    return (isinstance(target, torch._ops.OpOverload) and target.is_view) or target is WAIT or target is operator.getitem


def choose_bucket_cap(graph: fx.Graph, profile: str, candidates_mb=(None, 64, 16, 4, 1)) -> int | None:
    """``bucket_mode="auto"``: the cap (bytes, ``None`` = one bucket per unit) whose
    bucketed and reordered copy of ``graph`` simulates fastest; ties go to fewer,
    larger buckets. Rank-independent: our own copies are left out of the costs."""
    from fsdp_compile import config
    from fsdp_compile.passes.bucketing import bucket_collectives
    from fsdp_compile.passes.reordering import reorder_for_overlap

    best: tuple[float, int | None] | None = None
    for cap_mb in candidates_mb:
        cap = None if cap_mb is None else int(cap_mb * 2**20)
        trial = _copy_graph(graph)
        bucket_collectives(trial, cap)
        reorder_for_overlap(
            trial,
            prefetch_depth=config.prefetch_depth,
            reduce_scatter_depth=config.reduce_scatter_depth,
            max_inflight_bytes=config.max_inflight_bytes,
        )
        step = simulate(trial, profile, ignore_own_copies=True).step_s
        if best is None or step < best[0] * (1 - 1e-9):
            best = (step, cap)
    return best[1] if best else None


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        env[node] = new.node_copy(node, lambda n: env[n])
        env[node].meta = dict(node.meta)
    return new
