"""Steady-state step time across the step boundary, MODELLED (for ``benchmarks.scale``).

``passes/cost_model.simulate`` times one graph on its own: a forward's first gathers
start on an idle link with nothing to hide behind, a backward's last reduce-scatters
end with nothing after them. Training runs the graphs back to back with an optimizer
step between them, so what the edges cost depends on what happens *across* the
boundary. This module strings steps together and measures the period between the
starts of consecutive forwards, in four schedules (the last a what-if):

* ``in step``: forward, backward, then the optimizer over every unit's shard (what
  ``opt.step()`` after ``loss.backward()`` does);
* ``optimizer in backward``: each unit's optimizer step runs as soon as its
  reduce-scatter has been waited for, inside the backward (FSDP2's
  optimizer-in-backward pattern: a ``register_post_accumulate_grad_hook`` per
  parameter that steps and zeroes it);
* ``across steps``: as ``optimizer in backward``, and the next forward's first
  all-gathers (those issued before its first matmul) are issued right after the
  optimizer step of the unit they gather, inside the previous backward's tail;
* ``deferred reduce-scatters`` (a what-if: the library does not do this): as
  ``optimizer in backward``, but the reduce-scatters of the ``k`` units the next
  forward gathers last (the deepest layers) wait for that forward, which sends them in
  1 ms chunks wherever its link idles, and steps each such unit's optimizer right
  before it gathers that unit (sending what is left first). The backward's link then
  carries less; the cost is those units' unsharded gradients, held across the
  boundary. The best ``k`` is reported.

The optimizer is Adam on fp32 shards: 28 bytes of memory traffic per local
element (reads parameter, gradient and two moments; writes parameter and
moments) at the profile's memory bandwidth. One compute stream and one link:
collectives run in issue order, each after the previous one; compute blocks at
a wait until its collective ends (as in ``simulate``).

What no schedule can hide: the units reduced last in the backward are the ones
the forward gathers first (the token embedding and the first layer), so their
reduce-scatter, optimizer step and all-gather form one chain between the last
backward matmul and the first forward one: ``period >= (compute from the first
forward matmul to the last backward one) + that chain`` while the link is not the
bottleneck.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Adam on fp32 shards: read parameter, gradient, exp_avg, exp_avg_sq; write the three states back.
ADAM_BYTES_PER_ELEMENT = 28
STEPS = 4  # simulated; the period is taken between the last two forwards
FILL_CHUNK_S = 1e-3  # the deferred reduce-scatters' chunk (what-if schedule)


@dataclass(frozen=True)
class Op:
    what: str  # "compute", "issue", "wait", "optimizer"
    seconds: float = 0.0
    collective: int = -1  # index into the step's collectives (issue / wait)
    unit: str = ""  # the collective's or the optimizer step's unit
    kind: str = ""  # the collective's kind


@dataclass
class Program:
    """A graph in its scheduled order, reduced to what the timing needs."""

    ops: list
    first_matmul: int  # index in ops of the first compute op doing FLOPs
    last_matmul: int  # index in ops of the last one
    gathered_bytes_before_first_matmul: int


def program_of(graph, profile) -> Program:
    """``graph``'s ops in order, timed as ``passes/cost_model.simulate`` times them."""
    from fsdp_compile.passes.cost_model import (
        collective_owner,
        collective_seconds,
        compute_seconds,
        node_flops,
        tensor_bytes,
    )
    from fsdp_compile.runtime.vocabulary import WAIT, collective_kind, world_size_of

    notes: set = set()
    nodes = list(graph.nodes)
    world = next((world_size_of(n) for n in nodes if collective_kind(n) in ("all_gather", "reduce_scatter")), 2)
    ops, waits, first_matmul, last_matmul, gathered_early = [], {}, None, 0, 0
    for node in nodes:
        kind = collective_kind(node)
        if kind:
            index = len(waits)
            ops.append(Op("issue", collective_seconds(node, profile, notes, world), index, collective_owner(node), kind))
            if len(node.users) == 1 and next(iter(node.users)).target is WAIT:
                waits[next(iter(node.users))] = (index, collective_owner(node), kind)
            else:
                waits[object()] = (index, collective_owner(node), kind)
            if first_matmul is None and kind == "all_gather":
                gathered_early += tensor_bytes(node, notes)
        elif node in waits:
            index, unit, kind = waits[node]
            ops.append(Op("wait", collective=index, unit=unit, kind=kind))
        else:
            seconds = compute_seconds(node, profile, notes)
            if seconds:
                if node_flops(node, notes) > 0:
                    first_matmul = len(ops) if first_matmul is None else first_matmul
                    last_matmul = len(ops)
                ops.append(Op("compute", seconds))
    return Program(ops, first_matmul or 0, last_matmul, gathered_early)


def local_elements_by_unit(backward_graph) -> dict[str, int]:
    """Each unit's local gradient elements: its reduce-scatters' outputs (fp32)."""
    from fsdp_compile.passes.cost_model import collective_owner
    from fsdp_compile.runtime.vocabulary import collective_kind

    out: dict[str, int] = {}
    for node in backward_graph.nodes:
        if collective_kind(node) in ("reduce_scatter", "all_reduce"):
            val = node.meta.get("val")
            out[collective_owner(node)] = out.get(collective_owner(node), 0) + int(val.numel())
    return out


def reduced_bytes_by_unit(backward_graph) -> dict[str, int]:
    """Each unit's unsharded gradient bytes: its reduce-scatters' inputs."""
    from fsdp_compile.passes.cost_model import collective_owner, tensor_bytes
    from fsdp_compile.runtime.vocabulary import collective_kind

    out: dict[str, int] = {}
    for node in backward_graph.nodes:
        if collective_kind(node) == "reduce_scatter":
            out[collective_owner(node)] = out.get(collective_owner(node), 0) + tensor_bytes(node.args[0], set())
    return out


def _with_optimizer_in_backward(backward: Program, optimizer_s: dict[str, float]) -> list:
    """``backward.ops`` with each unit's optimizer step right after the wait of its last
    reduce-scatter (where a post-accumulate-grad hook would run)."""
    last_wait = {}
    for i, op in enumerate(backward.ops):
        if op.what == "wait" and op.kind in ("reduce_scatter", "all_reduce"):
            last_wait[op.unit] = i
    steps_after = {}
    for unit, at in last_wait.items():
        steps_after.setdefault(at, []).append(Op("optimizer", optimizer_s.get(unit, 0.0), unit=unit))
    ops = []
    for i, op in enumerate(backward.ops):
        ops.append(op)
        ops += steps_after.get(i, [])
    return ops


@dataclass
class AcrossSteps:
    """Steady-state periods (seconds) of the four schedules, and their shared figures."""

    in_step: float
    optimizer_in_backward: float
    across_steps: float
    compute: float  # forward + backward compute per step
    optimizer: float  # optimizer steps per step
    communication: float
    held_bytes: int  # gathered bytes the early forward gathers hold across the boundary
    boundary_chain: float  # link time that must fall between the last backward and first forward matmul
    lower_bound: float  # no schedule's period is shorter (see simulate_across_steps)
    deferred: float  # the what-if schedule with its best k (module docstring)
    deferred_units: int  # that k
    deferred_held_bytes: int  # the unsharded gradients it holds across the boundary


def simulate_across_steps(forward_graph, backward_graph, profile, steps: int = STEPS) -> AcrossSteps:
    """The four schedules of the module docstring on ``forward_graph`` / ``backward_graph``
    (after our passes), ``steps`` steps each; the period between the last two forwards'
    first matmuls. And a lower bound on any schedule's period with these units and buckets:
    the larger of compute + optimizer, the communication, and the compute from the
    forward's first matmul to the backward's last plus the boundary chain (the
    reduce-scatters after that last matmul and the gathers before that first one, of the
    units that have both: the chain runs between two such spans, and nothing in a span
    can run before the chain ends or after the next one starts)."""
    from fsdp_compile.passes.cost_model import get_profile

    profile = get_profile(profile) if isinstance(profile, str) else profile
    forward, backward = program_of(forward_graph, profile), program_of(backward_graph, profile)
    elements = local_elements_by_unit(backward_graph)
    optimizer_s = {u: ADAM_BYTES_PER_ELEMENT * n / profile.mem_bytes_per_s for u, n in elements.items()}
    total_optimizer = sum(optimizer_s.values())

    backward_with_optimizer = _with_optimizer_in_backward(backward, optimizer_s)

    def period(schedule: str, deferred: frozenset = frozenset()) -> float:
        hoisted = set()
        if schedule == "across steps":  # the forward's gathers issued before its first matmul
            hoisted = {i for i, op in enumerate(forward.ops[: forward.first_matmul]) if op.what == "issue"}
        t_compute = t_link = 0.0
        starts = []
        ends: dict = {}
        # The deferred units' reduce-scatters, in the order the next forward gathers them.
        deferred_reductions = sorted(
            (op for op in backward.ops if op.what == "issue" and op.unit in deferred and op.kind != "all_gather"),
            key=lambda op: gather_order.get(op.unit, len(gather_order)),
        )

        def issue(op: Op, tag) -> None:
            nonlocal t_link
            start = max(t_link, t_compute)
            t_link = start + op.seconds
            ends[tag] = t_link

        def reduce_deferred(unit: str, step: int) -> None:
            """Issue the previous backward's deferred reduce-scatters up to ``unit``'s last;
            step ``unit``'s optimizer once they have landed."""
            nonlocal t_compute
            while any(op.unit == unit for op in pending):
                op = pending.pop(0)
                issue(
                    Op("issue", remaining.pop(op.collective, op.seconds), op.collective, op.unit, op.kind),
                    ("d", step, op.collective),
                )
            t_compute = max([t_compute] + [ends[("d", step, op.collective)] for op in deferred_reductions if op.unit == unit])
            t_compute += optimizer_s.get(unit, 0.0)
            stepped.add(unit)

        def fill_idle_link(until: float, step: int) -> None:
            """Deferred reduce-scatters, in chunks of ``FILL_CHUNK_S``, wherever the link
            idles before ``until`` (a low-priority stream: a chunk starts only on an idle
            link, and a gather issued meanwhile waits for it to end)."""
            nonlocal t_link
            while pending and max(t_link, t_compute) < until:
                op = pending[0]
                start = max(t_link, t_compute)
                left = remaining.get(op.collective, op.seconds)
                piece = min(left, FILL_CHUNK_S)
                t_link = start + piece
                if left - piece <= 1e-12:
                    pending.pop(0)
                    ends[("d", step, op.collective)] = t_link
                    remaining.pop(op.collective, None)
                else:
                    remaining[op.collective] = left - piece

        remaining: dict = {}
        pending: list = []
        for step in range(steps):
            stepped: set = set()
            pending = list(deferred_reductions) if step > 0 else []
            # forward
            for i, op in enumerate(forward.ops):
                if i == forward.first_matmul:
                    starts.append(t_compute)
                if op.what == "issue":
                    if i in hoisted and step > 0:
                        continue  # issued in the previous backward's tail
                    if step > 0 and op.unit in deferred and op.unit not in stepped:
                        reduce_deferred(op.unit, step)
                    issue(op, ("f", step, op.collective))
                elif op.what == "wait":
                    t_compute = max(t_compute, ends[("f", step, op.collective)])
                else:
                    fill_idle_link(t_compute + op.seconds, step)
                    t_compute += op.seconds
            # backward (+ optimizer)
            for op in backward.ops if schedule == "in step" else backward_with_optimizer:
                if op.unit in deferred and (op.what == "optimizer" or op.kind in ("reduce_scatter", "all_reduce")):
                    continue  # reduced and stepped in the next forward
                if op.what == "issue":
                    issue(op, ("b", step, op.collective))
                elif op.what == "wait":
                    t_compute = max(t_compute, ends[("b", step, op.collective)])
                elif op.what == "optimizer":
                    t_compute += op.seconds
                    for i in sorted(hoisted):
                        if forward.ops[i].unit == op.unit:
                            issue(forward.ops[i], ("f", step + 1, forward.ops[i].collective))
                else:
                    t_compute += op.seconds
            if schedule == "in step":
                t_compute += total_optimizer
            for i in sorted(hoisted):  # a unit without a reduce-scatter of its own: at the boundary
                if ("f", step + 1, forward.ops[i].collective) not in ends:
                    issue(forward.ops[i], ("f", step + 1, forward.ops[i].collective))
        return starts[-1] - starts[-2]

    gather_order: dict[str, int] = {}
    for op in forward.ops:
        if op.what == "issue" and op.kind == "all_gather":
            gather_order.setdefault(op.unit, len(gather_order))
    reduced = {op.unit for op in backward.ops if op.what == "issue" and op.kind == "reduce_scatter"}
    gathered_last_first = sorted(reduced, key=lambda u: -gather_order.get(u, len(gather_order)))  # what is deferred
    deferred_by_k = {
        k: period("optimizer in backward", frozenset(gathered_last_first[:k])) for k in range(len(gathered_last_first) + 1)
    }
    best_k = min(deferred_by_k, key=lambda k: (deferred_by_k[k], k))
    held = reduced_bytes_by_unit(backward_graph)

    # The chain: the units whose reduce-scatters are issued after the backward's last matmul
    # (their gradients come from it or from later work) and whose gathers the forward issues
    # before its first matmul; those reduce-scatters and gathers.
    last_reductions = [op for op in backward.ops[backward.last_matmul :] if op.what == "issue" and op.kind != "all_gather"]
    first_gathers = [op for op in forward.ops[: forward.first_matmul] if op.what == "issue" and op.kind == "all_gather"]
    chain_units = {op.unit for op in last_reductions} & {op.unit for op in first_gathers}
    chain = sum(op.seconds for op in first_gathers + last_reductions if op.unit in chain_units)
    compute = sum(op.seconds for p in (forward, backward) for op in p.ops if op.what == "compute")
    # Compute from the forward's first matmul to the backward's last: none of it can run while
    # the chain is on the link (the optimizer and the work outside that span can).
    span = sum(op.seconds for op in forward.ops[forward.first_matmul :] if op.what == "compute") + sum(
        op.seconds for op in backward.ops[: backward.last_matmul + 1] if op.what == "compute"
    )
    communication = sum(op.seconds for p in (forward, backward) for op in p.ops if op.what == "issue")
    return AcrossSteps(
        period("in step"),
        period("optimizer in backward"),
        period("across steps"),
        compute,
        total_optimizer,
        communication,
        forward.gathered_bytes_before_first_matmul,
        chain,
        max(compute + total_optimizer, span + chain, communication),
        deferred_by_k[best_k],
        best_k,
        sum(held.get(u, 0) for u in gathered_last_first[:best_k]),
    )
