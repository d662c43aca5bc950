"""Eager reduce-scatters, waited on one unit later (FSDP2's post-backward overlap).

An eager backward issues a bucket's reduce-scatter when the bucket's gradients are
ready and goes on with the next unit's backward; the reduction is waited on just before
the next bucket issues its own (keeping at most ``config.reduce_scatter_depth`` in
flight, as FSDP2 frees the last reduce-scatter's buffer before it makes the next) or
when the backward ends, whichever comes first. Its result then reaches the sharded
parameters through autograd itself, a small backward from the shards the forward
read (``to_local`` and the moves to the compute device and dim), so accumulation into
``.grad``, the DTensor wrapping and the parameters' hooks are exactly those of an
undeferred step. The forward passes the gathered bucket's shards detached, so the
main backward reaches the parameters only that way.

A backward that raises leaves its reductions unfinished; they are waited on and
dropped (their gradients never reach ``.grad``) by the next backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fsdp_compile import config
from fsdp_compile._compat import queue_end_of_backward_callback, running_backward_id
from fsdp_compile.runtime.unit_collectives import ReduceScatterInFlight


def defers_reduction(shards: list[torch.Tensor]) -> bool:
    """Whether a bucket gathered from ``shards`` now reduces its gradients deferred."""
    return config.eager_overlap and torch.is_grad_enabled() and any(s.requires_grad for s in shards)


# ------------------------------------------------------------- end of backward

_at_end: list[Callable[[], None]] = []
_queued_for: int | None = None  # the backward whose end runs ``_at_end``


def call_at_end_of_backward(fn: Callable[[], None]) -> bool:
    """Run ``fn`` once when the running backward ends (once per backward however often
    it is asked); False, and nothing queued, outside a backward."""
    global _queued_for
    backward = running_backward_id()
    if backward is None:
        return False
    if _queued_for != backward:
        _at_end.clear()
        queue_end_of_backward_callback(_run_at_end)
        _queued_for = backward
    if fn not in _at_end:
        _at_end.append(fn)
    return True


def _run_at_end() -> None:
    global _queued_for
    _queued_for = None
    fns = list(_at_end)
    _at_end.clear()
    for fn in fns:
        fn()


# ------------------------------------------------------------ the reductions


@dataclass(eq=False)
class _PendingReduction:
    backward: int | None
    shards: list[torch.Tensor]  # what the forward read, with autograd to the parameters
    reduction: ReduceScatterInFlight


class _PendingReductions:
    """The running backward's reduce-scatters not yet waited on, oldest first."""

    def __init__(self) -> None:
        self.pending: list[_PendingReduction] = []

    def deliverer(self, shards: list[torch.Tensor]) -> Callable[[Callable[[], ReduceScatterInFlight]], None]:
        """What the bucket gathered from ``shards`` calls in backward with the function
        that issues its reduce-scatter."""
        return lambda issue: self.add(shards, issue)

    def add(self, shards: list[torch.Tensor], issue: Callable[[], ReduceScatterInFlight]) -> None:
        """Issue a reduction (``issue()``) once at most ``depth - 1`` are left in flight:
        the oldest are finished first, so their buffers are freed before the new one is
        made (compiled steps keep the same bound, ``passes.pinning``)."""
        backward = running_backward_id()
        stale = [p for p in self.pending if p.backward != backward]
        if stale:  # left by a backward that raised
            self.pending = [p for p in self.pending if p.backward == backward]
            for p in stale:
                p.reduction.wait()
        # Outside a plain backward (create_graph, or none running) nothing waits later.
        depth = config.reduce_scatter_depth if not torch.is_grad_enabled() and call_at_end_of_backward(self.finish_all) else 0
        while self.pending and len(self.pending) >= depth:
            self._finish(self.pending.pop(0))
        self.pending.append(_PendingReduction(backward, shards, issue()))
        if depth == 0:
            self._finish(self.pending.pop())

    def finish_all(self) -> None:
        while self.pending:
            self._finish(self.pending.pop(0))

    @staticmethod
    def _finish(pending: _PendingReduction) -> None:
        grads = pending.reduction.wait()
        # retain_graph: a backward run twice over the same graph reduces twice.
        torch.autograd.backward(pending.shards, grads, retain_graph=True)


pending_reductions = _PendingReductions()
