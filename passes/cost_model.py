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
hint (``fsdp_compile.config.symbolic_size_hint``) and the fact is recorded in the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from fsdp_compile.base import config
from fsdp_compile.runtime.process_groups import is_tensor_parallel_group
from fsdp_compile.runtime.vocabulary import (
    WAIT,
    aten,
    collective_kind,
    group_of,
    is_alias,
    is_aten_kernel,
    is_zero_constructor,
    positions,
    tag_of,
    world_size_of,
)


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
    notes.add(f"symbolic sizes without a hint evaluated at {config.symbolic_size_hint}")
    return config.symbolic_size_hint


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


#: CPU attention ops, absent from ``torch.utils.flop_counter``'s registry; their
#: FLOPs are the same as the flash-attention kernels'.
_CPU_ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_ATTENTION_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _concrete_value(x, notes: set):
    """A recorded value with every symbolic size made concrete (meta tensors for tensors)."""
    if isinstance(x, torch.Tensor):
        return torch.empty([_concrete(s, notes) for s in x.shape], dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_concrete_value(v, notes) for v in x)
    return x


def counts_flops(target) -> bool:
    """Whether :func:`node_flops` counts FLOPs for this op: matmuls, convolutions, attention."""
    return target.overloadpacket in flop_registry or target in (_CPU_ATTENTION, _CPU_ATTENTION_BACKWARD)


def node_flops(node: fx.Node, notes: set) -> int:
    """FLOPs of a node, by ``torch.utils.flop_counter``'s formulas (0 for ops it has none for)."""
    if not is_aten_kernel(node) or not counts_flops(node.target):
        return 0
    target = node.target
    formula = flop_registry.get(target.overloadpacket)
    args, kwargs = _concrete_value(fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val")), notes)
    if target is _CPU_ATTENTION:
        return sdpa_flop_count(*(t.shape for t in args[:3]))
    if target is _CPU_ATTENTION_BACKWARD:
        return sdpa_backward_flop_count(*(t.shape for t in args[:4]))
    return int(formula(*args, out_val=_concrete_value(node.meta.get("val"), notes), **kwargs))


def compute_seconds(node: fx.Node, profile: HardwareProfile, notes: set) -> float:
    """``max(flops / flops_per_s, bytes moved / mem_bytes_per_s)``; 0 for views,
    waits, tuple items and constants."""
    if not is_aten_kernel(node) or is_zero_constructor(node) or is_alias(node):
        return 0.0
    flops = node_flops(node, notes)
    moved = tensor_bytes(node, notes) + sum(tensor_bytes(i, notes) for i in node.all_input_nodes)
    return max(flops / profile.flops_per_s, moved / profile.mem_bytes_per_s)


def collective_owner(node: fx.Node) -> str:
    """Whose collective: our unit's name (``""`` for the root), ``"TP"`` for tensor
    parallelism's (DTensor's), ``"?"`` for anyone else's."""
    tag = tag_of(node)
    if tag is not None:
        return tag.unit_fqn
    return "TP" if is_tensor_parallel_group(group_of(node)) else "?"


def collective_seconds(node: fx.Node, profile: HardwareProfile, notes: set, default_world_size: int = 2) -> float:
    kind = collective_kind(node)
    # all_reduce's schema names no group size; use the graph's other collectives'.
    world_size = world_size_of(node) or default_world_size
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


def _last_uses(graph: fx.Graph) -> dict[int, list[fx.Node]]:
    """Position -> buffers that die there. A buffer lives from its node to the last
    user of it or of any alias of it (views, waits, tuple items), and a
    collective's input until the collective's wait."""
    position = positions(graph)
    nodes = list(graph.nodes)
    root: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        source = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        root[n] = root.get(source, source) if is_alias(n) and source is not None else n
    last_use: dict[fx.Node, int] = {}

    def used(buffer: fx.Node, at: fx.Node) -> None:
        r = root.get(buffer, buffer)
        last_use[r] = max(last_use.get(r, 0), position[at])

    for n in nodes:
        for i in n.all_input_nodes:
            used(i, n)
        if collective_kind(n) and len(n.users) == 1 and isinstance(n.args[0], fx.Node):
            used(n.args[0], next(iter(n.users)))
    frees: dict[int, list[fx.Node]] = {}
    for n, i in last_use.items():
        frees.setdefault(i, []).append(n)
    return frees


def _allocates(node: fx.Node) -> bool:
    return node.op == "call_function" and not is_alias(node)


def simulate(graph: fx.Graph, profile: HardwareProfile | str, *, ignore_own_copies: bool = False) -> Simulation:
    """Simulate ``graph`` in its current order (see module docstring).

    ``ignore_own_copies`` leaves out the cost of our tagged non-collective nodes
    (padding, copy-in/out): they differ between ranks (only some ranks pad),
    so decisions that must agree across ranks are made without them.
    """
    profile = get_profile(profile) if isinstance(profile, str) else profile
    notes: set = set()
    nodes = list(graph.nodes)
    frees = _last_uses(graph)
    world_size = next((world_size_of(n) for n in nodes if collective_kind(n) in ("all_gather", "reduce_scatter")), 2)
    sim = Simulation(profile.name, 0.0, 0.0, 0.0, 0.0, 0)
    t_compute = t_link = 0.0
    live = 0
    pending: dict[fx.Node, CollectiveTiming] = {}  # wait node -> its collective
    for i, node in enumerate(nodes):
        if _allocates(node):
            live += tensor_bytes(node, notes)
            sim.peak_bytes = max(sim.peak_bytes, live)
        kind = collective_kind(node)
        if kind:
            duration = collective_seconds(node, profile, notes, world_size)
            start = max(t_link, t_compute)
            t_link = start + duration
            timing = CollectiveTiming(
                node.name, kind, collective_owner(node), tensor_bytes(node, notes), t_compute, start, t_link
            )
            sim.collectives.append(timing)
            sim.communication_s += duration
            if len(node.users) == 1 and next(iter(node.users)).target is WAIT:
                pending[next(iter(node.users))] = timing
        elif node in pending:
            timing = pending.pop(node)
            timing.wait_s = t_compute
            timing.exposed_s = max(0.0, timing.end_s - t_compute)
            sim.exposed_s += timing.exposed_s
            t_compute = max(t_compute, timing.end_s)
        elif not (ignore_own_copies and tag_of(node) is not None):
            duration = compute_seconds(node, profile, notes)
            if duration:
                sim.compute_spans.append((node.name, t_compute, t_compute + duration))
                t_compute += duration
                sim.compute_s += duration
        live -= sum(tensor_bytes(dead, notes) for dead in frees.get(i, []) if _allocates(dead))
    sim.step_s = max(t_compute, t_link)
    sim.notes = sorted(notes)
    return sim


@dataclass(frozen=True)
class ExposureByPhase:
    """Where a simulated graph's exposed communication sits, against its matmuls.

    * ``start``: collectives issued before the graph's first matmul/attention: nothing
      runs before them to hide behind (a forward's first gathers);
    * ``end``: collectives waited after the graph's last matmul ends: nothing is left
      to hide them (a backward's last reduce-scatters);
    * ``middle``: the rest: hideable in principle; exposed where the link, not the
      compute, is the bottleneck (or where the schedule waits too early).
    """

    start: float
    middle: float
    end: float


def exposure_by_phase(graph: fx.Graph, sim: Simulation) -> ExposureByPhase:
    """Split ``sim.exposed_s`` (a :func:`simulate` of ``graph`` in its current order) by
    :class:`ExposureByPhase`'s phases; the three parts sum to ``sim.exposed_s``."""
    notes: set = set()
    matmuls = {n.name for n in graph.nodes if n.op == "call_function" and node_flops(n, notes) > 0}
    spans = [(t0, t1) for name, t0, t1 in sim.compute_spans if name in matmuls]
    if not spans:
        return ExposureByPhase(0.0, sim.exposed_s, 0.0)
    first_start, last_end = spans[0][0], spans[-1][1]
    start = middle = end = 0.0
    for c in sim.collectives:
        if c.issue_s <= first_start:
            start += c.exposed_s
        elif c.wait_s is not None and c.wait_s >= last_end:
            end += c.exposed_s
        else:
            middle += c.exposed_s
    return ExposureByPhase(start, middle, end)
