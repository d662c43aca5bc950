"""How the code running right now executes: traced into a graph, plain eager, or
eager between the graphs of a compiled call.

Every decision that depends on it (take the traced or the eager forward, read the
parameter through Dynamo or around it, warn about a gather that a graph break left in
eager code) asks :func:`execution_mode`, once, where it starts, and passes the answer
on; a sharded forward records its mode in the forward context (``_fsdp_state``). It is
a property of the code point, not of a unit: an eager forward can call a compiled
submodule, whose parameter reads are then traced.
"""

from __future__ import annotations

import enum

import torch

from fsdp_compile.base.compat import inside_compiled_call, never_a_frame_of_its_own


class ExecutionMode(enum.Enum):
    #: Dynamo is tracing this code into a graph (AOTAutograd then traces that graph).
    TRACED = "traced"
    #: Plain eager code: no ``torch.compile``d call is running around it.
    EAGER = "eager"
    #: Eager code inside a ``torch.compile``d call: Dynamo fell back to eager for this
    #: frame (a graph break above it, or a frame it skips), and compiles the frames it calls.
    BETWEEN_GRAPHS = "between graphs"


@never_a_frame_of_its_own  # called from eager code inside a compiled call, Dynamo would trace it as a frame: TRACED
def execution_mode() -> ExecutionMode:
    """The mode of the calling code (under Dynamo a constant of the trace: no guard)."""
    if torch.compiler.is_compiling():
        return ExecutionMode.TRACED
    return ExecutionMode.BETWEEN_GRAPHS if inside_compiled_call() else ExecutionMode.EAGER
