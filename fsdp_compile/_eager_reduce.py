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

A backward may run inside another (reentrant activation checkpointing): reductions
are finished oldest first whichever backward issued them, and each backward's end
finishes all that are left. A backward that raises leaves its reductions unfinished;
the next eager forward waits on and drops them (their gradients never reach ``.grad``).
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from fsdp_compile._eager_collectives import ReduceScatterInFlight
from fsdp_compile.base import config
from fsdp_compile.base.compat import (
    in_compiled_autograd,
    queue_end_of_backward_callback,
    running_backward_id,
    will_run_in_this_backward,
)


def defers_reduction(shards: list[torch.Tensor]) -> bool:
    """Whether a bucket gathered from ``shards`` now reduces its gradients deferred."""
    return config.eager_overlap and torch.is_grad_enabled() and any(s.requires_grad for s in shards)


# ------------------------------------------------------------- end of backward

#: Per running backward (its graph task id), what to call when it ends. A backward
#: can run inside another (reentrant activation checkpointing runs one per
#: checkpointed region): each has its own list. Keyed by autograd's own backward, which
#: may run through several sharded models: what is queued is each root's own call.
#: Backwards of other threads (ranks as threads of one process) share the table, so a
#: root only ever removes its own calls (:func:`forget_end_of_backward_calls`).
_at_end: dict[int, list[Callable[[], None]]] = {}
_at_end_lock = threading.Lock()


def call_at_end_of_backward(fn: Callable[[], None]) -> bool:
    """Run ``fn`` once when the running backward ends (once per backward however often
    it is asked); False, and nothing queued, outside a backward or under compiled
    autograd (which traces the backward instead of running it)."""
    backward = running_backward_id()
    if backward is None or in_compiled_autograd():
        return False
    with _at_end_lock:
        fns = _at_end.get(backward)
        if fns is None:
            fns = _at_end[backward] = []
            queue_end_of_backward_callback(lambda: _run_at_end(backward))
        if fn not in fns:
            fns.append(fn)
    return True


def _run_at_end(backward: int) -> None:
    with _at_end_lock:
        fns = _at_end.pop(backward, [])
    for fn in fns:
        fn()


def forget_end_of_backward_calls(owner: object) -> None:
    """Forget the calls bound to ``owner`` (its methods) that backwards which raised left
    queued; every other call stays, whichever thread's backward queued it (a forward on
    one thread-rank used to clear another's running backward's calls, so its last
    reduce-scatters never reached ``.grad``: a silent wrong step)."""
    with _at_end_lock:
        for backward, fns in list(_at_end.items()):
            fns[:] = [fn for fn in fns if getattr(fn, "__self__", None) is not owner]
            if not fns:
                del _at_end[backward]


# ------------------------------------------------------------ the reductions


class SharedReduction:
    """One bucket's gradients from every forward since its last backward, reduced once.

    Two forwards before one backward (a loss summed over two calls of the model, a
    module called twice) gather a bucket twice, each gather its own autograd node. As
    FSDP2's unsharded parameters accumulate both uses' gradients before its one
    post-backward reduce-scatter, each node hands its gradients here: the running
    backward's last node of the bucket to execute gets their sum and reduces it, the
    others reduce nothing. Which nodes will execute is asked of autograd itself when
    the first one arrives (a forward whose output never reaches this loss is not waited
    for), per backward (a reentrant checkpoint's inner backward counts its own)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names  # the bucket's parameters, for an error
        self._nodes: list[weakref.ref] = []
        self._reduced = False  # a backward reduced since the last forward registered a node
        self._arrivals: dict[int, list] = {}  # per backward: [nodes expected, arrived, summed grads]

    def register(self, node) -> None:
        """A forward gathered the bucket; ``node`` is its gather's autograd node."""
        if self._reduced:  # a new step: the nodes of the last one are done with
            self._nodes, self._reduced = [], False
        self._nodes = [ref for ref in self._nodes if ref() is not None]
        self._nodes.append(weakref.ref(node))

    def arrive(self, grads: tuple) -> tuple | None:
        """The gradients of one gather's outputs (``None`` where unused); their sum with
        the earlier arrivals' if this is the last expected in the running backward, else
        ``None`` (held here)."""
        backward = running_backward_id()
        if backward is None:
            return grads
        entry = self._arrivals.get(backward)
        if entry is None:
            nodes = [n for n in (ref() for ref in self._nodes) if n is not None]
            expected = max(1, sum(will_run_in_this_backward(n) for n in nodes))
            entry = self._arrivals[backward] = [expected, 0, None]
            call_at_end_of_backward(functools.partial(self._check_reduced, backward))
        entry[1] += 1
        total = entry[2]
        entry[2] = (
            grads
            if total is None
            else tuple(g if t is None else t if g is None else t + g for t, g in zip(total, grads, strict=True))
        )
        if entry[1] < entry[0]:
            return None
        del self._arrivals[backward]
        self._reduced = True
        return entry[2]

    def _check_reduced(self, backward: int) -> None:
        """End of a backward: a sum still held would be gradients silently lost."""
        entry = self._arrivals.pop(backward, None)
        if entry is not None:
            raise RuntimeError(
                f"fsdp_compile: the gradients of {', '.join(self.names)} from {entry[1]} of {entry[0]} "
                "forwards reached the end of the backward without being reduced (autograd did not run "
                "every gather it said it would); please report this with the model, and set "
                "fsdp_compile.config.eager_overlap = False to reduce once per forward meanwhile"
            )


@dataclass(eq=False)
class _PendingReduction:
    shards: list[torch.Tensor]  # what the forward read, with autograd to the parameters
    reduction: ReduceScatterInFlight


class PendingReductions:
    """One root's reduce-scatters not yet waited on, oldest first (``EagerState.reductions``)."""

    def __init__(self) -> None:
        self.pending: list[_PendingReduction] = []
        #: Called too when a backward that reduced through this root ends.
        self.at_end_of_backward: Callable[[], None] | None = None

    def deliverer(self, shards: list[torch.Tensor]) -> Callable[[Callable[[], ReduceScatterInFlight], list[int]], None]:
        """What the bucket gathered from ``shards`` calls in backward with the function
        that issues its reduce-scatter and the indices of the shards it reduces."""
        return lambda issue, members: self.add([shards[i] for i in members], issue)

    def add(self, shards: list[torch.Tensor], issue: Callable[[], ReduceScatterInFlight]) -> None:
        """Issue a reduction (``issue()``) once at most ``depth - 1`` are left in flight:
        the oldest are finished first, so their buffers are freed before the new one is
        made (compiled steps keep the same bound, ``passes.pinning``). The oldest may be
        an enclosing backward's (reentrant checkpointing): it is finished all the same."""
        if in_compiled_autograd():
            raise RuntimeError(
                "fsdp_compile: an eager forward of a sharded unit was run backward under compiled "
                "autograd, which cannot defer its reduce-scatters; set "
                "fsdp_compile.config.eager_overlap = False before that forward, or torch.compile "
                "the model (its graphs carry their own collectives)"
            )
        # Outside a plain backward (create_graph, or none running) nothing waits later.
        depth = config.reduce_scatter_depth if not torch.is_grad_enabled() and call_at_end_of_backward(self.finish_all) else 0
        if depth and self.at_end_of_backward is not None:
            call_at_end_of_backward(self.at_end_of_backward)
        while self.pending and len(self.pending) >= depth:
            self._finish(self.pending.pop(0))
        self.pending.append(_PendingReduction(shards, issue()))
        if depth == 0:
            self._finish(self.pending.pop())

    def finish_all(self) -> None:
        while self.pending:
            self._finish(self.pending.pop(0))

    def drop_unfinished(self) -> None:
        """Wait on and drop what a backward that raised left unfinished (its gradients never
        reach ``.grad``), and forget its end-of-backward calls (this root's only): at an eager
        forward outside any backward, every reduction still pending is such a one."""
        pending, self.pending = self.pending, []
        for p in pending:
            p.reduction.wait()
        forget_end_of_backward_calls(self)

    @staticmethod
    def _finish(pending: _PendingReduction) -> None:
        grads = pending.reduction.wait()
        # retain_graph: a backward run twice over the same graph reduces twice.
        torch.autograd.backward(pending.shards, grads, retain_graph=True)
