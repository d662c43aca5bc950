"""Read the schedule of collectives out of Inductor's generated Python wrapper code.

The wrapper's ``call`` function runs kernels and collectives in order, so the
lines between a collective's issue (``bufN = ..._c10d_functional.X(...)``) and
its ``wait_tensor(bufN)`` are exactly what overlaps it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_ISSUE = re.compile(
    r"^\s*(buf\w+) = torch\.ops\._c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor|all_to_all_single)\.default\("
)
_KINDS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}
_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((buf\w+)\)")
# A buffer's size, from the assert Inductor writes after the op that made it:
# ``assert_size_stride(bufN, (sizes), (strides), op)`` in torch 2.13; in 2.15 an
# extern op's output (collectives included) gets ``assert_tensor_metadata(bufN,
# (sizes), (strides), dtype, op)`` instead (inputs keep ``assert_size_stride``).
_SIZE = re.compile(r"^\s*(?:assert_size_stride|assert_tensor_metadata)\((buf\w+), \(([\d, ]*)\)")
_COMPUTE = re.compile(r"^\s*(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+)\(")


@dataclass
class ScheduledCollective:
    kind: str  # "all_gather" | "reduce_scatter" | "all_to_all" (``config.gloo_all_to_all``)
    buffer: str
    output_numel: int = 0
    issue_line: int = 0
    wait_line: int | None = None
    compute_between: list[str] = field(default_factory=list)


def collectives_in_output_code(code: str) -> list[ScheduledCollective]:
    """Our kind of collectives in one Inductor output module, in issue order."""
    body = _call_body(code)
    found: list[ScheduledCollective] = []
    open_: dict[str, ScheduledCollective] = {}
    for i, line in enumerate(body):
        if m := _ISSUE.match(line):
            c = ScheduledCollective(_KINDS[m.group(2)], m.group(1), issue_line=i)
            found.append(c)
            open_[c.buffer] = c
        elif m := _SIZE.match(line):
            if m.group(1) in open_ and not open_[m.group(1)].output_numel:
                numel = 1
                for s in m.group(2).replace(" ", "").strip(",").split(","):
                    numel *= int(s) if s else 1
                open_[m.group(1)].output_numel = numel
        elif m := _WAIT.search(line):
            c = open_.pop(m.group(1), None)
            if c is not None:
                c.wait_line = i
        elif m := _COMPUTE.match(line):
            for c in open_.values():
                c.compute_between.append(m.group(1))
    return found


def _call_body(code: str) -> list[str]:
    lines = code.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"^\s*def call\(", line)), None)
    if start is None:
        return []
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = []
    for line in lines[start + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line)
    return body
