"""Human-readable views of a scheduled graph: a collectives table and timelines
(pure functions of a graph and its :class:`~fsdp_compile.passes.cost_model.Simulation`),
and writing them into ``fsdp_compile.debug``'s dump folders.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.fx as fx

from fsdp_compile.base import dumps
from fsdp_compile.passes.cost_model import Simulation, simulate
from fsdp_compile.runtime.vocabulary import WAIT, aten, collective_kind, is_call, is_view, positions, tag_of


def _compute_between(graph: fx.Graph, issue: fx.Node, wait: fx.Node | None) -> list[str]:
    names, inside = [], False
    for node in graph.nodes:
        if node is issue:
            inside = True
            continue
        if node is wait:
            break
        if inside and is_call(node) and tag_of(node) is None and collective_kind(node) is None:
            if not is_view(node) and node.target is not WAIT:
                names.append(node.name)
    return names


def collectives_table(graph: fx.Graph, sim: Simulation) -> str:
    """Markdown: one row per collective in issue order."""
    position = positions(graph)
    by_name = {n.name: n for n in graph.nodes}
    rows = [
        f"# Collectives ({sim.profile}, modelled)",
        "",
        f"step {sim.step_s * 1e3:.3f} ms, compute {sim.compute_s * 1e3:.3f} ms, communication "
        f"{sim.communication_s * 1e3:.3f} ms, exposed {sim.exposed_s * 1e3:.3f} ms "
        f"(overlap {sim.overlap_fraction:.0%}), peak live {sim.peak_bytes / 2**20:.1f} MiB",
        "",
        "| # | kind | unit | parameters | dtype | bytes | bucket | issue @ | wait @ | compute between | est. time (us) | exposed (us) | overlap |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows += [_collective_row(i, t, by_name[t.name], graph, position) for i, t in enumerate(sim.collectives)]
    if sim.notes:
        rows += ["", *(f"Note: {n}." for n in sim.notes)]
    return "\n".join(rows) + "\n"


def _collective_row(i: int, t, node: fx.Node, graph: fx.Graph, position: dict) -> str:
    tag = tag_of(node)
    wait = next((u for u in node.users if u.target is WAIT), None)
    between = _compute_between(graph, node, wait)
    params = tag.param_fqn if tag else ("(tensor parallel)" if t.unit == "TP" else "(not ours)")
    if len(params) > 60:
        params = params[:57] + "..."
    duration = t.end_s - t.start_s
    overlap = 1 - t.exposed_s / duration if duration else 1.0
    dtype = _payload_dtype(node.args[0]) if isinstance(node.args[0], fx.Node) else "?"
    shown = ", ".join(between[:3]) + (", ..." if len(between) > 3 else "")
    return (
        f"| {i} | {t.kind} | {tag.unit_label if tag else t.unit} | {params} | {dtype} | {t.bytes} "
        f"| {tag.bucket_size if tag else 1} | {position[node]} | {position[wait] if wait else '-'} "
        f"| {len(between)}{f' ({shown})' if between else ''} "
        f"| {duration * 1e6:.1f} | {t.exposed_s * 1e6:.1f} | {overlap:.0%} |"
    )


def _dtype_of(node: fx.Node) -> str | None:
    val = node.meta.get("val")
    return str(val.dtype).replace("torch.", "") if val is not None and hasattr(val, "dtype") else None


def _payload_dtype(sent: fx.Node) -> str:
    """The dtype a collective sends; for the bytes of a low-precision parameter's gather
    (``uint8`` views of its pre hook's inputs, concatenated), also what they are views of,
    e.g. ``uint8 (int8+float32+uint8)``."""
    dtype = _dtype_of(sent)
    if dtype != "uint8":
        return dtype or "?"
    parts = sent.args[0] if sent.target is aten.cat.default else [sent]
    sources = []
    for part in parts:
        while isinstance(part, fx.Node) and _dtype_of(part) == "uint8" and is_view(part) and isinstance(part.args[0], fx.Node):
            part = part.args[0]
        sources.append(_dtype_of(part) if isinstance(part, fx.Node) else None)
    if all(s in (None, "uint8") for s in sources):
        return "uint8"
    return f"uint8 ({'+'.join(s or '?' for s in sources)})"


def timeline_chrome_trace(sim: Simulation) -> str:
    """Chrome trace JSON (Perfetto, chrome://tracing): compute and communication lanes."""
    events = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"simulated step ({sim.profile})"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "compute"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "communication"}},
    ]
    for name, start, end in sim.compute_spans:
        events.append({"name": name, "ph": "X", "pid": 0, "tid": 0, "ts": start * 1e6, "dur": (end - start) * 1e6})
    for t in sim.collectives:
        events.append(
            {
                "name": f"{t.kind} {_owner(t)}",
                "ph": "X",
                "pid": 0,
                "tid": 1,
                "ts": t.start_s * 1e6,
                "dur": (t.end_s - t.start_s) * 1e6,
                "args": {"bytes": t.bytes, "exposed_us": t.exposed_s * 1e6},
            }
        )
        if t.exposed_s:
            events.append(
                {
                    "name": f"waiting for {t.kind} {_owner(t)}",
                    "ph": "X",
                    "pid": 0,
                    "tid": 0,
                    "ts": (t.end_s - t.exposed_s) * 1e6,
                    "dur": t.exposed_s * 1e6,
                    "cname": "terrible",
                }
            )
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, indent=0)


def timeline_svg(sim: Simulation, width: int = 1200) -> str:
    """A static picture: compute lane (grey; red where it waits), communication lane (blue)."""
    total = max(sim.step_s, 1e-12)
    scale = (width - 120) / total
    lane_h, top = 28, 30

    def x(t: float) -> float:
        return 110 + t * scale

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top + 3 * lane_h + 40}" font-family="sans-serif" font-size="11">',
        f'<text x="10" y="18">{sim.profile} (modelled): step {sim.step_s * 1e3:.2f} ms, exposed communication '
        f"{sim.exposed_s * 1e3:.2f} ms, overlap {sim.overlap_fraction:.0%}</text>",
        f'<text x="10" y="{top + 18}">compute</text>',
        f'<text x="10" y="{top + lane_h + 18}">communication</text>',
    ]
    for _, start, end in sim.compute_spans:
        parts.append(
            f'<rect x="{x(start):.2f}" y="{top}" width="{max((end - start) * scale, 0.5):.2f}" height="{lane_h - 6}" fill="#9e9e9e"/>'
        )
    for t in sim.collectives:
        w = max((t.end_s - t.start_s) * scale, 0.5)
        parts.append(
            f'<rect x="{x(t.start_s):.2f}" y="{top + lane_h}" width="{w:.2f}" height="{lane_h - 6}" fill="#1e88e5" stroke="white">'
            f"<title>{t.kind} {_owner(t)}: {t.bytes} bytes, exposed {t.exposed_s * 1e6:.1f} us</title></rect>"
        )
        if t.exposed_s:
            parts.append(
                f'<rect x="{x(t.end_s - t.exposed_s):.2f}" y="{top}" width="{max(t.exposed_s * scale, 0.5):.2f}" height="{lane_h - 6}" fill="#e53935">'
                f"<title>waiting for {t.kind} {_owner(t)}</title></rect>"
            )
    legend_y = top + 2 * lane_h + 20
    parts += [
        f'<rect x="110" y="{legend_y - 10}" width="12" height="12" fill="#9e9e9e"/><text x="126" y="{legend_y}">compute</text>',
        f'<rect x="200" y="{legend_y - 10}" width="12" height="12" fill="#e53935"/><text x="216" y="{legend_y}">waiting (exposed communication)</text>',
        f'<rect x="420" y="{legend_y - 10}" width="12" height="12" fill="#1e88e5"/><text x="436" y="{legend_y}">collective on the link</text>',
        "</svg>",
    ]
    return "\n".join(parts) + "\n"


# ------------------------------------------------------------ dump folders


def write_joint_record(gm: fx.GraphModule) -> None:
    """``joint_<k>.md``: the reshard pass's decision for each all-gather of one joint graph."""
    path = dumps.next_joint_file()
    if path is None:
        return
    lines = ["| node | role | unit | parameter | recompute |", "|---|---|---|---|---|"]
    for node in gm.graph.nodes:
        tag = tag_of(node)
        if tag is None or collective_kind(node) != "all_gather":
            continue
        lines.append(
            f"| {node.name} | {tag.role.value} | {tag.unit_label} | {tag.param_fqn} "
            f"| {node.meta.get('recompute', 'partitioner default (save)')} |"
        )
    path.write_text("\n".join(lines) + "\n")


def write_graph_report(folder: Path | None, graph: fx.Graph, profile: str) -> None:
    """``collectives.md``, ``timeline.json`` and ``timeline.svg`` for the final order."""
    if folder is None:
        return
    sim = simulate(graph, profile)
    (folder / "collectives.md").write_text(collectives_table(graph, sim))
    (folder / "timeline.json").write_text(timeline_chrome_trace(sim))
    (folder / "timeline.svg").write_text(timeline_svg(sim))


def _owner(t) -> str:
    """A timeline label: the unit ("(root)"), or "TP" for tensor parallelism's collectives."""
    return t.unit or "(root)"
