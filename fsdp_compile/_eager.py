"""The eager path: what runs when no graph is being traced.

A compiled step needs none of this: its graph gathers each parameter where it
is first read, and the reshard pass makes the backward re-gather. Eager runs
(and the eager code between the graphs of a compiled step that broke) instead
gather a unit when its forward starts, as FSDP2's pre-forward does, and reshard
after forward with saved-tensor hooks: autograd saves a small handle in place
of a gathered weight, and backward gathers it again when it unpacks the handle.
Both gathers are prefetched, so communication overlaps compute as in a compiled
step: a forward issues the all-gather of the unit that came next in the last
forward before it computes its own, and a backward issues the re-gather of the
unit packed before the one it re-gathers (FSDP2's backward prefetch); units with
prefetch hints (``set_modules_to_forward_prefetch``) prefetch the units named instead,
and ``config.prefetch_depth`` / ``max_inflight_bytes`` bound the default prefetch
as they bound compiled steps'. Everything
here runs outside Dynamo (``torch.compiler.disable``).

Activation checkpointing re-runs a unit's forward in backward, where no saved tensor
holds its parameters: through the unit's hooks (composable ``checkpoint``, a
checkpoint around the unit's call) or around them (``checkpoint_wrapper`` around the
sharded module, a checkpoint inside its forward; see :func:`gather_for_recompute`).
Either way the unit is gathered once per bucket, from what its forward kept if it does
not reshard after forward, and the unit before it is prefetched, as FSDP2's
pre-backward does; the reads carry the gradient to the shards, which a reentrant
re-run's backward needs.

What a step leaves in flight between calls (prefetched all-gathers, re-gather slots and
prefetched re-gathers, deferred reduce-scatters) is kept per root, in the
:class:`EagerState` every unit of one root shares (``FSDPUnit.eager``), as FSDP2 keeps
it per root: two sharded models in one process (a teacher and a student, a policy and
its reference) never wait on, drop or serve each other's collectives, and
``reset_iter_state()`` on one leaves the other's alone.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fsdp_compile._eager_buckets import (
    bucket_fulls_with_grad,
    bucket_key,
    gather_bucket,
    gather_bucket_raw_without_autograd,
    gather_extension_bucket,
    issue_bucket_gather,
    regather_key,
    shard_versions,
)
from fsdp_compile._eager_reduce import (
    PendingReductions,
    SharedReduction,
    call_at_end_of_backward,
    forget_end_of_backward_calls,
)
from fsdp_compile._fsdp_param import FSDPParam, ParamState
from fsdp_compile._fsdp_state import forward_context
from fsdp_compile._mixed_precision import cast_inputs, cast_output
from fsdp_compile._spmd_types import outside_type_checker
from fsdp_compile.base import config
from fsdp_compile.base.compat import (
    is_functorch_wrapper,
    outside_recompute_modes,
    running_backward_id,
    saved_tensors_go_to_other_hooks,
    saved_tensors_hooks_active,
)
from fsdp_compile.base.execution_mode import ExecutionMode
from fsdp_compile.runtime.collectives import gather_with_grad_sync
from fsdp_compile.runtime.vocabulary import Role

if TYPE_CHECKING:
    from fsdp_compile._eager_collectives import AllGatherInFlight
    from fsdp_compile._fsdp_state import FSDPUnit


@torch.compiler.disable
def pre_forward(unit: FSDPUnit, mode: ExecutionMode, args, kwargs):
    """Cast the inputs, open the forward context and gather the whole unit (FSDP2's
    pre-forward); returns the inputs and the saved-tensor hooks that reshard after
    forward, or ``None``.

    Inside a compiled step that fell back to eager here (the user's own graph
    break), the user's forward is then compiled as a frame of its own, as it is
    unsharded; gathering inside it would tag each unit's graph with the unit (one
    recompile per unit), so the unit is gathered here, eagerly, as FSDP2 does, and
    a warning names it. Dynamo must not meet our saved-tensor hooks there."""
    args, kwargs = cast_inputs(unit.mp_policy, args, kwargs)
    state = unit.eager
    forward_context.enter(mode, owner=state)
    inside_compiled_call = mode is ExecutionMode.BETWEEN_GRAPHS
    state.forward_depth += 1
    if state.forward_depth == 1 and running_backward_id() is None:
        state.drop_left_by_a_backward_that_raised()
    try:
        with outside_type_checker():
            gather_unit(unit)
            if not inside_compiled_call and running_backward_id() is not None:  # a checkpointing re-run
                with outside_recompute_modes():
                    prefetch_before_recompute(unit)
            elif not inside_compiled_call:
                state.forward_prefetch.gathered(unit, state.forward_depth)
    except BaseException:
        post_forward(unit)
        raise
    # Resharding via saved-tensor hooks, unless other hooks already manage saved
    # tensors (activation checkpointing recomputes them anyway; another root's forward
    # running around this one packs for it).
    # Not in a recompute in backward (reentrant checkpointing): its backward follows at once,
    # with the unit gathered for it.
    outermost = (
        not inside_compiled_call
        and state.forward_depth == 1
        and torch.is_grad_enabled()
        and not saved_tensors_hooks_active()
        and running_backward_id() is None
    )
    return args, kwargs, reshard_after_forward_hooks() if outermost else None


@torch.compiler.disable
def post_forward(unit: FSDPUnit) -> None:
    forward_context.exit()
    state = unit.eager
    state.forward_depth -= 1
    state.forward_prefetch.returned(unit)
    if state.forward_depth == 0:
        state.forward_prefetch.outermost_returned()


cast_output_outside_dynamo = torch.compiler.disable(cast_output)


@torch.compiler.disable
def zero_unused_gradients_after_backward(unit: FSDPUnit, output) -> None:
    """FSDP2's ``set_reduce_scatter_unused_params(True)``: after a synced backward that
    reaches this forward's outputs, every parameter of the unit that requires a gradient
    and got none has a zero one (FSDP2 reduces zeros for it; so does our bucketed
    reduction over two or more ranks, which this leaves as it is). Where nothing else
    reduces them (a shard group of one rank, a parameter gathered on its own), the zeros
    are made here, so that an optimizer with momentum or weight decay steps them as FSDP2's."""
    if not (unit.reduce_scatter_unused_params and torch.is_grad_enabled() and running_backward_id() is None):
        return
    outputs = [t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outputs:
        return
    unit_ref = weakref.ref(unit)
    torch.autograd.graph.register_multi_grad_hook(
        outputs, lambda grads: call_at_end_of_backward(_zero_filler(unit_ref)), mode="any"
    )


def _zero_filler(unit_ref: weakref.ref):
    """The end-of-backward call that fills ``unit``'s missing gradients with zeros (one per
    unit, so a backward queues it once however many of its forwards it reaches)."""
    unit = unit_ref()
    if unit is None:
        return lambda: None
    filler = unit.__dict__.get("_zero_unused_gradients")
    if filler is None:

        def filler() -> None:
            if not unit.requires_gradient_sync:
                return
            with torch.no_grad():
                for fsdp_param in unit.params:
                    param = fsdp_param.sharded_param
                    if param.requires_grad and param.grad is None:
                        param.grad = torch.zeros_like(param)

        unit.__dict__["_zero_unused_gradients"] = filler
    return filler


def gather_unit(unit: FSDPUnit) -> None:
    """Gather every parameter of the unit, as FSDP2 does: one all-gather per bucket of
    parameters that can share one (:func:`~fsdp_compile._eager_buckets.bucket_key`; most units: one),
    and one reduce-scatter per bucket in the backward. Reads inside the forward then
    hit the cache, so an activation-checkpointed region saves and recomputes the same ops."""
    to_gather = _to_gather(unit)
    for fsdp_param in to_gather:
        # A fresh gather starts a fresh re-gather slot: an earlier forward's slot lives on
        # only in its own autograd graph (a forward never followed by a backward leaves one
        # that was never unpacked; reusing it would serve a later backward its stale weight).
        unit.eager.open_slots.pop(fsdp_param, None)
        fsdp_param.notice_late_extension()
    if to_gather:  # the gathered parameters' next slots are mates of a new gather
        gathered = set(to_gather)
        mates = unit.eager.slot_mates.pop(unit, {})
        unit.eager.slot_mates[unit] = {p: slot for p, slot in mates.items() if p not in gathered}
    extension = [p for p in to_gather if p.extension]
    if len(extension) > 1:
        gather_extension_bucket(extension)
    state = unit.eager
    in_backward = running_backward_id() is not None  # an activation-checkpointing recompute
    if in_backward:
        state.entering_backward_of(unit, recompute=True)
    for key, bucket in _buckets(to_gather, bucket_key):
        if key is not None and in_backward:
            with outside_recompute_modes():
                raws = _backward_gather(bucket)
            for fsdp_param, full in zip(bucket, bucket_fulls_with_grad(bucket, kept=raws), strict=True):
                fsdp_param._note_gathered(full)
            continue
        kept = _kept_since_an_earlier_forward(bucket) if key is not None else None
        if kept is not None:  # FSDP2's unit that does not reshard stays unsharded until its backward
            for fsdp_param, full in zip(bucket, bucket_fulls_with_grad(bucket, kept=kept), strict=True):
                fsdp_param._note_gathered(full)
            continue
        if key is not None:
            gather_bucket(bucket, state.forward_prefetch.take(bucket))
        else:
            for fsdp_param in bucket:
                owner, name = fsdp_param.owner
                fsdp_param.gather(owner._parameters[name])
    if not in_backward and not unit.frees_gathered_after_forward():
        _keep_for_backward(to_gather)
    if len(unit.modules) > 1:
        _keep_for_the_units_other_modules(unit)


def note_read(fsdp_param: FSDPParam) -> None:
    """An eager read of a gathered parameter: where saved tensors go to hooks not ours
    (activation checkpointing), the unit saves no gathered weight for its backward,
    which will gather it anew; the backward of the unit after it then prefetches it
    (:func:`_prefetch_regather_before`)."""
    unit = fsdp_param.unit
    if unit not in unit.eager.checkpointed and saved_tensors_go_to_other_hooks(_pack):
        unit.eager.checkpointed.add(unit)


def _keep_for_backward(gathered: list[FSDPParam]) -> None:
    """Keep what a forward gathered for a unit that does not reshard after forward, so
    that a recompute of the unit in backward (activation checkpointing, which saves none
    of it) reads it instead of gathering again, as FSDP2's unsharded parameters stay
    until the unit's backward (a reentrant checkpoint runs the forward without grad).
    Only trainable parameters read as gathered (a frozen one would outlive a backward
    that reduces nothing); dropped when the root's backward ends, or at the unit's next
    forward. Nothing under ``torch.inference_mode()``: no backward follows, and its
    inference tensors cannot serve a later forward with autograd (an evaluation between
    training steps)."""
    if torch.is_inference_mode_enabled():
        return
    state = gathered[0].unit.eager if gathered else None
    for fsdp_param in gathered:
        if (
            fsdp_param.state is ParamState.GATHERED
            and fsdp_param._reads_gathered_as_is
            and fsdp_param.sharded_param.requires_grad
        ):
            state.forward_kept[fsdp_param] = (fsdp_param.gathered.detach(), fsdp_param._shard_version())


def forget_kept(unit: FSDPUnit) -> None:
    """Drop what forwards kept of ``unit`` (``FSDPModule.reshard()``): its next forward gathers."""
    kept = unit.eager.forward_kept
    for fsdp_param in unit.params:
        kept.pop(fsdp_param, None)


def _kept_since_an_earlier_forward(bucket: list[FSDPParam]) -> list[torch.Tensor] | None:
    """What an earlier forward kept of ``bucket`` (:func:`_keep_for_backward`), if all of
    it is kept and no shard changed since (an optimizer step, a load): a second forward
    before the backward, or a module of the unit called by itself after a forward that
    left it out, gathers nothing, as FSDP2's unsharded parameters serve it."""
    forward_kept = bucket[0].unit.eager.forward_kept
    kept = [forward_kept.get(p) for p in bucket]
    if any(k is None or k[1] != p._shard_version() for k, p in zip(kept, bucket, strict=True)):
        return None
    return [k[0] for k in kept]


def _keep_for_the_units_other_modules(unit: FSDPUnit) -> None:
    """A unit of several modules (``fully_shard([norm, output])``) stays gathered until the
    forward around the one that gathered it returns, so that its other modules, run inside
    that forward, read it without another all-gather (FSDP2 gathers such a unit once; each
    module's forward gathered it again). Only inside an eager forward of the same root; a
    module of the unit called outside it gathers again."""
    frames, owners = forward_context.frames, forward_context.frame_owners
    if len(frames) < 2 or owners[-2] is not unit.eager:
        return
    kept = [p for p in frames[-1] if p.unit is unit]
    frames[-1][:] = [p for p in frames[-1] if p.unit is not unit]
    frames[-2].extend(kept)


def _to_gather(unit: FSDPUnit) -> list[FSDPParam]:
    """The parameters of ``unit`` a forward gathers now: sharded and registered, or held by
    ``unshard()`` and read with autograd (gathered from the held tensor, so that their
    gradients are reduced per bucket)."""
    return [
        p
        for p in unit.params
        if p.owner is not None
        and (
            p.state is ParamState.SHARDED or (p.state is ParamState.HELD and p.held_raw is not None and p.held_read_needs_grad())
        )
    ]


def _prefetchable_buckets(unit: FSDPUnit) -> list[list[FSDPParam]]:
    """The buckets of ``unit`` that can be gathered with one all-gather each, now (not
    those still gathered)."""
    return [
        bucket for key, bucket in _buckets(_to_gather(unit), bucket_key) if key is not None and bucket[0].still_gathered() is None
    ]


@dataclass(eq=False)
class _PrefetchedGather:
    """A bucket's all-gather issued ahead of its forward, and the shards' versions then."""

    params: tuple[FSDPParam, ...]
    versions: tuple[int, ...]
    in_flight: AllGatherInFlight


class _ForwardPrefetch:
    """Eager forward prefetch: while a unit computes, the next unit's all-gather runs.

    "Next" is the unit that came after this one in the last eager forward run from the
    same outermost unit (kept on it as ``eager_forward_order``), as long as this
    forward has followed that order so far: every rank runs the same code, so every
    rank issues the same collectives in the same order. A prefetched gather is used
    only if its bucket is unchanged and its shards were not written since (version
    counters); the rest are waited on and dropped when the outermost forward returns,
    so at most the running unit and the next one are gathered at a time (FSDP2's
    memory profile with prefetching)."""

    def __init__(self) -> None:
        self.outermost: FSDPUnit | None = None
        self.order: list[FSDPUnit] = []
        self.on_track = False
        self.in_flight: list[_PrefetchedGather] = []
        self.forwards = 0  # outermost eager forwards so far (an id for the running one)
        #: Units in the order their forwards returned, in the last forward from each outermost
        #: unit (most recent last): reversed, the order of their backwards.
        self.orders: dict[FSDPUnit, list[FSDPUnit]] = {}
        self.returned_order: list[FSDPUnit] = []
        #: Gathers issued in backward for the next activation-checkpointing recompute.
        self.for_backward: list[_PrefetchedGather] = []

    def gathered(self, unit: FSDPUnit, depth: int) -> None:
        """``unit`` was gathered by an eager forward, ``depth`` deep in its root's running
        forwards: record it, and prefetch the next (or the units
        ``unit.forward_prefetches`` names)."""
        if depth == 1:
            self.outermost, self.order, self.on_track = unit, [], True
            self.forwards += 1
        if self.outermost is None:
            return
        self.order.append(unit)
        last = self.outermost.eager_forward_order
        position = len(self.order)
        self.on_track = self.on_track and position <= len(last) and last[position - 1] is unit
        if not config.eager_overlap:
            return
        if unit.forward_prefetches:
            upcoming = unit.forward_prefetches
        elif self.on_track and position < len(last) and prefetch_fits(unit, last[position]):
            upcoming = [last[position]]
        else:
            upcoming = []
        for target in upcoming:
            for bucket in _prefetchable_buckets(target):
                if _kept_since_an_earlier_forward(bucket) is None:
                    self.issue(bucket)

    def take(self, bucket: list[FSDPParam]) -> AllGatherInFlight | None:
        """The prefetched all-gather of ``bucket`` if there is one and it is still valid."""
        params = tuple(bucket)
        for in_flight in (self.in_flight, self.for_backward):
            for i, prefetched in enumerate(in_flight):
                if prefetched.params == params:
                    del in_flight[i]
                    if prefetched.versions == shard_versions(bucket):
                        return prefetched.in_flight
                    prefetched.in_flight.wait()  # stale: a shard changed after the prefetch
                    return None
        return None

    def issue(self, bucket: list[FSDPParam], for_backward: bool = False) -> None:
        """Issue ``bucket``'s all-gather ahead of its use, unless it is in flight already."""
        if any(prefetched.params == tuple(bucket) for prefetched in (*self.in_flight, *self.for_backward)):
            return
        prefetched = _PrefetchedGather(tuple(bucket), shard_versions(bucket), issue_bucket_gather(bucket))
        (self.for_backward if for_backward else self.in_flight).append(prefetched)

    def returned(self, unit: FSDPUnit) -> None:
        """``unit``'s forward returned (not a recompute in backward)."""
        if self.outermost is not None:
            self.returned_order.append(unit)

    def unit_before(self, unit: FSDPUnit) -> FSDPUnit | None:
        """The unit whose forward returned just before ``unit``'s in the latest forward that
        ran it: the one whose backward comes next (FSDP2's backward prefetch order; for a
        unit nested in another, the one before the outer unit)."""
        for order in reversed(self.orders.values()):
            for i in range(len(order) - 1, 0, -1):
                if order[i] is unit:  # (a unit of several modules returns once per module)
                    return next((other for other in reversed(order[:i]) if other is not unit), None)
        return None

    def drop_for_backward(self) -> None:
        for_backward, self.for_backward = self.for_backward, []
        for prefetched in for_backward:
            prefetched.in_flight.wait()

    def outermost_returned(self) -> None:
        """The outermost sharded forward returned (or raised): its order is what the next
        forward from the same unit prefetches by."""
        if self.outermost is not None:
            self.outermost.eager_forward_order = self.order
            self.orders.pop(self.outermost, None)
            self.orders[self.outermost] = self.returned_order
        self.returned_order = []
        self.outermost, self.order = None, []
        self.drop_in_flight()

    def drop_in_flight(self) -> None:
        in_flight, self.in_flight = self.in_flight, []
        for prefetched in in_flight:
            prefetched.in_flight.wait()


@dataclass(eq=False)
class EagerState:
    """What eager steps of one root keep between calls (see the module docstring); every
    unit under the root shares it (``FSDPUnit.eager``)."""

    forward_prefetch: _ForwardPrefetch = field(default_factory=_ForwardPrefetch)
    #: Per parameter, the re-gather slot its saved views share (see :class:`RegatherSlot`).
    open_slots: dict[FSDPParam, RegatherSlot] = field(default_factory=dict)
    #: Per unit, the slots its last forward gather opened (:attr:`RegatherSlot.mates`).
    slot_mates: dict[FSDPUnit, dict[FSDPParam, RegatherSlot]] = field(default_factory=dict)
    #: Every slot with saved views still packed, of any forward, by creation order (a
    #: slot goes with the graph that holds it).
    live_slots: weakref.WeakValueDictionary[int, RegatherSlot] = field(default_factory=weakref.WeakValueDictionary)
    #: Prefetched re-gathers of the running backward, not yet used.
    regathers_in_flight: list[_RegatherInFlight] = field(default_factory=list)
    #: Deferred reduce-scatters of the running backward(s).
    reductions: PendingReductions = field(default_factory=PendingReductions)
    #: This root's eager sharded forwards running now.
    forward_depth: int = 0
    #: The running backward's gathered parameters (dim 0 first, no autograd) of the unit it
    #: is in (and the units that unit is nested in): one all-gather per bucket serves the
    #: re-gather of saved tensors and an activation-checkpointing recompute alike.
    backward_gathered: dict[FSDPParam, torch.Tensor] = field(default_factory=dict)
    #: What a recompute outside the unit's forward reads (:func:`gather_for_recompute`).
    recompute_reads: dict[FSDPParam, torch.Tensor] = field(default_factory=dict)
    #: Units whose forward a backward re-ran (activation checkpointing): what a backward prefetches for.
    recomputed: set[FSDPUnit] = field(default_factory=set)
    #: Units an eager forward read under saved-tensor hooks not ours (:func:`note_read`).
    checkpointed: set[FSDPUnit] = field(default_factory=set)
    #: What forwards gathered for units that do not reshard after forward, with the shard's
    #: version then (:func:`_keep_for_backward`).
    forward_kept: dict[FSDPParam, tuple[torch.Tensor, tuple]] = field(default_factory=dict)

    #: Units the running backward entered (:meth:`entering_backward_of`).
    entered: set[FSDPUnit] = field(default_factory=set)
    #: Per bucket (its parameters), the gathers of its forwards since its last backward,
    #: whose gradients are reduced once (:class:`SharedReduction`).
    shared_reductions: dict[tuple[FSDPParam, ...], SharedReduction] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.reductions.at_end_of_backward = self.drop_kept_after_reduction

    def shared_reduction(self, bucket: list[FSDPParam]) -> SharedReduction:
        """The :class:`SharedReduction` of the bucket of these parameters."""
        key = tuple(bucket)
        shared = self.shared_reductions.get(key)
        if shared is None:
            shared = self.shared_reductions[key] = SharedReduction([p.fqn for p in bucket])
        return shared

    def drop_kept_after_reduction(self) -> None:
        """A backward that reduced gradients of this root ended: drop what forwards kept for
        the units it entered (a reentrant recompute's backward: one unit; the others'
        are still to come), or, where it entered none, for all."""
        for fsdp_param in [p for p in self.forward_kept if not self.entered or p.unit in self.entered]:
            del self.forward_kept[fsdp_param]

    def end_recompute(self) -> None:
        """End of a backward: drop what it gathered for its units, prefetched for
        recomputes, or kept from the forward."""
        self.forward_kept.clear()
        self.drop_backward_gathers()

    def drop_backward_gathers(self) -> None:
        self.backward_gathered.clear()
        self.recompute_reads.clear()
        self.entered.clear()
        self.forward_prefetch.drop_for_backward()

    def entering_backward_of(self, unit: FSDPUnit, recompute: bool = False) -> None:
        """The backward reached ``unit`` (``recompute``: to re-run its forward): forget what
        it gathered for units ``unit`` is not nested in (at most the running unit stays
        gathered, as FSDP2 reshards each unit after its backward), and drop it all when
        the backward ends."""
        if recompute:
            self.recomputed.add(unit)
        for kept in (self.backward_gathered, self.recompute_reads):
            others = {p.unit for p in kept if p.unit is not unit}
            apart = {other for other in others if not _nested_in(unit, other)}
            for fsdp_param in [p for p in kept if p.unit in apart]:
                del kept[fsdp_param]
        if call_at_end_of_backward(self.end_recompute):
            self.entered.add(unit)

    def drop_regathers_in_flight(self) -> None:
        """End of a backward: wait on the prefetched re-gathers it did not use."""
        while self.regathers_in_flight:
            self.regathers_in_flight.pop().drop()

    def drop_left_by_a_backward_that_raised(self) -> None:
        """Between backwards nothing is in flight, unless a backward raised: wait on and
        drop what it left (its reduce-scatters, its prefetched re-gathers)."""
        self.reductions.drop_unfinished()
        self.drop_regathers_in_flight()
        self.drop_backward_gathers()
        forget_end_of_backward_calls(self)

    def reset(self) -> None:
        """What an aborted forward or backward of this root left: wait on and drop its
        collectives in flight, forget its re-gather slots and what its forwards kept, and
        close its forwards still open (``FSDPModule.reset_iter_state``)."""
        self.drop_left_by_a_backward_that_raised()
        self.forward_prefetch.drop_in_flight()
        self.open_slots.clear()
        self.slot_mates.clear()
        self.live_slots.clear()
        self.forward_kept.clear()
        forward_context.exit_all_owned_by(self)
        self.forward_depth = 0

    def in_flight(self) -> int:
        """How many things a step of this root left in flight or open (0 between steps)."""
        return (
            len(self.forward_prefetch.in_flight)
            + len(self.forward_prefetch.for_backward)
            + len(self.backward_gathered)
            + len(self.recompute_reads)
            + len(self.forward_kept)
            + len(self.entered)
            + len(self.regathers_in_flight)
            + len(self.reductions.pending)
            + len(self.open_slots)
            + self.forward_depth
        )


def prefetch_fits(running: FSDPUnit, upcoming: FSDPUnit) -> bool:
    """Whether the default prefetch of ``upcoming`` may run while ``running`` is gathered:
    ``config.prefetch_depth`` at least 1, and both units' gathered bytes within
    ``config.max_inflight_bytes`` (the bounds the reordering pass keeps in compiled steps;
    eager prefetches one unit ahead at most)."""
    if config.prefetch_depth < 1:
        return False
    limit = config.max_inflight_bytes
    return limit is None or _gathered_bytes(running) + _gathered_bytes(upcoming) <= limit


def _gathered_bytes(unit: FSDPUnit) -> int:
    # (A layout counts a complex parameter's real view: see [Note: complex parameters].)
    return sum(
        p.layout.padded_numel * p.layout.world_size * (p.spec.param_dtype or p.sharded_param.dtype.to_real()).itemsize
        for p in unit.params
        if p.layout is not None
    )


def _buckets(fsdp_params: list[FSDPParam], key_of) -> list[tuple[tuple | None, list[FSDPParam]]]:
    """``fsdp_params`` grouped by ``key_of`` (first-seen order; ``None``: each alone)."""
    groups: dict = {}
    for i, fsdp_param in enumerate(fsdp_params):
        key = key_of(fsdp_param)
        groups.setdefault(key if key is not None else ("alone", i), (key, []))[1].append(fsdp_param)
    return list(groups.values())


def gather_for_recompute(fsdp_param: FSDPParam) -> torch.Tensor:
    """The full tensor a recompute in eager backward reads outside the unit's forward:
    activation checkpointing around the unit (``checkpoint_wrapper``, whose re-run
    calls the wrapped module, not the sharded wrapper) or inside it, around a sub-module.

    The first such read gathers the whole unit, one all-gather per bucket (one the unit
    after it prefetched, or one the backward made already for its saved tensors), and
    prefetches the unit before it, as FSDP2's pre-backward does; the tensors serve every
    read of the unit until the backward moves to another unit (one it is not nested in)
    or ends. The reads carry autograd back to the shards, one reduce-scatter per bucket,
    as in forward: a reentrant recompute's graph is run backward and its gradients must
    reach the shards (they did not: every block's gradient was ``None``, silently); a
    non-reentrant one only refills saved tensors, and saves what the forward saved.

    The gathers run outside selective checkpointing's recompute mode, which only
    accepts the ops its region ran in forward."""
    state = fsdp_param.unit.eager
    read = state.recompute_reads.get(fsdp_param)
    if read is None:
        with outside_recompute_modes():
            _reads_for_recompute(fsdp_param.unit)
        read = state.recompute_reads[fsdp_param]
    return read


def _reads_for_recompute(unit: FSDPUnit) -> None:
    state = unit.eager
    state.entering_backward_of(unit, recompute=True)
    params = [p for p in unit.params if p.owner is not None and p not in state.recompute_reads]
    trains = torch.is_grad_enabled()
    for key, bucket in _buckets(params, regather_key):
        if key is None:
            for fsdp_param in bucket:
                state.recompute_reads[fsdp_param] = _read_alone(fsdp_param)
            continue
        raws = _backward_gather(bucket)
        if trains and any(p.sharded_param.requires_grad for p in bucket):
            raws = bucket_fulls_with_grad(bucket, kept=raws)
        for fsdp_param, raw in zip(bucket, raws, strict=True):
            state.recompute_reads[fsdp_param] = fsdp_param._for_compute(raw)
    prefetch_before_recompute(unit)


def _backward_gather(bucket: list[FSDPParam]) -> list[torch.Tensor]:
    """The full tensors (dim 0 first, no autograd) of a bucket of a unit the backward is
    in: gathered already in this backward, prefetched, or gathered now; kept for the rest
    of the unit's backward if a backward re-ran the unit's forward (a re-gather of saved
    tensors alone is dropped with its last saved view, as before)."""
    state = bucket[0].unit.eager
    for fsdp_param in bucket:  # a re-gather of its saved tensors prefetched
        slot = state.open_slots.get(fsdp_param)
        if fsdp_param not in state.backward_gathered and slot is not None and slot.prefetched is not None:
            slot.prefetched.land()
    raws = [state.backward_gathered.get(p) for p in bucket]
    if any(raw is None for raw in raws):
        raws = [state.forward_kept.get(p, (None,))[0] for p in bucket]
    if any(raw is None for raw in raws):
        raws = [p.still_gathered() for p in bucket]  # held by unshard(), or kept after backward
        if any(raw is None for raw in raws):
            raws = gather_bucket_raw_without_autograd(bucket, state.forward_prefetch.take(bucket))
    if bucket[0].unit in state.recomputed:
        state.backward_gathered.update(zip(bucket, raws, strict=True))
    return raws


def _read_alone(fsdp_param: FSDPParam) -> torch.Tensor:
    """A recompute's read of a parameter gathered alone (no bucket), with autograd to its
    shard where it trains."""
    if fsdp_param.extension:
        full = fsdp_param.gather_without_autograd()
        return full.detach().requires_grad_(fsdp_param.sharded_param.requires_grad)
    sharded = fsdp_param.sharded_param
    if not (sharded.requires_grad and torch.is_grad_enabled()):
        return fsdp_param._for_compute(fsdp_param._gather_raw_without_autograd())
    local = fsdp_param._gather_input(sharded)
    return fsdp_param._for_compute(gather_with_grad_sync(local, fsdp_param.spec, fsdp_param._accumulation()))


def _nested_in(unit: FSDPUnit, outer: FSDPUnit) -> bool:
    """Whether ``unit``'s modules lie inside ``outer``'s (or are them)."""
    inner = {id(m) for m in unit.modules}
    return any(id(m) in inner for module in outer.modules for m in module.modules())


def prefetch_before_recompute(unit: FSDPUnit) -> None:
    """``unit``'s forward runs again in backward (activation checkpointing): issue the
    all-gather of the unit whose backward comes next (the unit whose forward returned
    before ``unit``'s, or those ``unit`` names in ``backward_prefetches``), FSDP2's
    backward prefetch: the re-gather of its saved tensors if it saved any, else the
    gather of what it resharded after forward (its own recompute will read it). Waited
    on by its use, or at the end of the backward."""
    state = unit.eager
    if not config.eager_overlap:
        return
    if unit.backward_prefetches:
        targets = list(unit.backward_prefetches)
    else:
        before = state.forward_prefetch.unit_before(unit)
        targets = [before] if before is not None and prefetch_fits(unit, before) else []
    for target in targets:
        slots = [s for s in state.open_slots.values() if s.fsdp_param.unit is target]
        if slots:
            if call_at_end_of_backward(state.drop_regathers_in_flight):
                for first in slots:
                    if _needs_regather(first) and regather_key(first.fsdp_param) is not None:
                        _RegatherInFlight.issue(_regather_bucket(first))
        elif target.frees_gathered_after_forward():
            _prefetch_gather_in_backward(target)


def _prefetch_gather_in_backward(target: FSDPUnit) -> None:
    """Issue the all-gather a re-run of ``target``'s forward in this backward will read
    (buckets it has neither kept from its forward nor gathered already); waited on by
    that re-run, or at the end of the backward."""
    state = target.eager
    if not call_at_end_of_backward(state.end_recompute):
        return
    for bucket in _prefetchable_buckets(target):
        if not all(p in state.forward_kept or p in state.backward_gathered for p in bucket):
            state.forward_prefetch.issue(bucket, for_backward=True)


# ------------------------------------------------------- reshard after forward


def _regather(slot: RegatherSlot) -> None:
    """Fill ``slot.full``, and with the same all-gather every slot of the same gather
    (its mates) that shares its bucket (FSDP2's pre-backward gathers the whole unit); then
    prefetch the re-gather of the unit packed before it (FSDP2's backward prefetch)."""
    slot.fsdp_param.unit.eager.entering_backward_of(slot.fsdp_param.unit)
    if slot.prefetched is not None:
        slot.prefetched.land()
    else:
        bucket = _regather_bucket(slot)
        if len(bucket) == 1:
            slot.full = slot.fsdp_param.gather_without_autograd()
        else:
            fsdp_params = [s.fsdp_param for s in bucket]
            raws = _backward_gather(fsdp_params)
            if _root_saved_by_another_forward(slot):
                slot.fsdp_param.unit.eager.backward_gathered.update(zip(fsdp_params, raws, strict=True))
            for other, raw in zip(bucket, raws, strict=True):
                other.full = other.fsdp_param._for_compute(raw)
    _prefetch_regather_before(slot)


def _root_saved_by_another_forward(slot: RegatherSlot) -> bool:
    """Whether ``slot`` is the root's and another forward's slots of the root are still
    to be unpacked (several forwards before one backward): the re-gather then serves
    them too, until the backward ends, as FSDP2's root stays unsharded until its
    post-backward in the final callback."""
    unit = slot.fsdp_param.unit
    return unit.is_root and any(
        other.fsdp_param.unit is unit and other.mates is not slot.mates for other in list(unit.eager.live_slots.values())
    )


def _needs_regather(slot: RegatherSlot) -> bool:
    return slot.full is None and slot.post_forward_shard is None and slot.prefetched is None


def _regather_bucket(slot: RegatherSlot) -> list[RegatherSlot]:
    """The slots one all-gather fills with ``slot``: one per parameter of its unit that
    shares its :func:`~fsdp_compile._eager_buckets.regather_key`, in the unit's order, whether or not this
    rank saved it (FSDP2's pre-backward gathers the whole unit). The collective is then
    the same on every rank even where ranks used different parameters of the unit
    (experts run only on the tokens routed to them, a branch on the data); a parameter
    without a mate still to unpack gets a throwaway slot."""
    key = regather_key(slot.fsdp_param)
    if key is None:
        return [slot]
    mates = slot.mates or {}
    bucket = []
    for fsdp_param in slot.fsdp_param.unit.params:
        if fsdp_param is slot.fsdp_param:
            bucket.append(slot)
        elif fsdp_param.owner is not None and regather_key(fsdp_param) == key:
            other = mates.get(fsdp_param)
            useful = other is not None and other.pending > 0 and _needs_regather(other)
            bucket.append(other if useful else RegatherSlot(fsdp_param, forward=slot.forward))
    return bucket


def _prefetch_regather_before(slot: RegatherSlot) -> None:
    """Issue the re-gather of the gather whose live slot was packed last before ``slot`` in
    the same outermost forward (the unit whose backward comes next, when units run one
    after another), or of the units ``slot``'s unit names (``backward_prefetches``), in
    buckets, without waiting; the end of the backward waits on whatever was not used.
    (Slots of other forwards may belong to graphs that are never run backward, as FSDP2
    prefetches within one root's forward order.)

    Every rank packs and unpacks the same saved tensors in the same order, so every
    rank issues the same collectives in the same order."""
    unit = slot.fsdp_param.unit
    if not config.eager_overlap:
        return
    state = unit.eager
    # Units that saved no gathered weight (checkpointed: their backward re-runs their
    # forward, which will gather them): prefetch that gather.
    candidates = unit.backward_prefetches or [state.forward_prefetch.unit_before(unit)]
    rerun = [
        target
        for target in candidates
        if target is not None
        and target in state.checkpointed
        and target.frees_gathered_after_forward()
        and not any(other.fsdp_param.unit is target for other in state.open_slots.values())
        and (unit.backward_prefetches or prefetch_fits(unit, target))
    ]
    for target in rerun:
        _prefetch_gather_in_backward(target)
    if rerun and not unit.backward_prefetches:
        return
    # (Another gather of the same unit counts: a unit called twice is re-gathered for each call.)
    same_forward = [
        other for other in list(state.live_slots.values()) if other.forward == slot.forward and other.mates is not slot.mates
    ]
    if unit.backward_prefetches:  # in the list's order, as FSDP2 issues them
        order = unit.backward_prefetches
        targets = sorted(
            (other for other in same_forward if other.fsdp_param.unit in order),
            key=lambda other: order.index(other.fsdp_param.unit),
        )
    else:
        earlier = [other for other in same_forward if other.seq < slot.seq]
        latest = max(earlier, key=lambda other: other.seq) if earlier else None
        fits = latest is not None and prefetch_fits(unit, latest.fsdp_param.unit)
        # (The slots of the upcoming unit's gather that packed last: a unit called twice
        # has the slots of each call.)
        targets = [other for other in earlier if other.mates is latest.mates and _needs_regather(other)] if fits else []
    if not targets or not call_at_end_of_backward(unit.eager.drop_regathers_in_flight):
        return
    for first in targets:
        if _needs_regather(first) and regather_key(first.fsdp_param) is not None:
            _RegatherInFlight.issue(_regather_bucket(first))


@dataclass(eq=False)
class _RegatherInFlight:
    """A prefetched re-gather: one all-gather that fills ``slots`` once waited on."""

    slots: list[RegatherSlot]
    in_flight: AllGatherInFlight

    @staticmethod
    def issue(slots: list[RegatherSlot]) -> None:
        prefetched = _RegatherInFlight(slots, issue_bucket_gather([s.fsdp_param for s in slots], Role.REGATHER))
        for s in slots:
            s.prefetched = prefetched
        slots[0].fsdp_param.unit.eager.regathers_in_flight.append(prefetched)

    def land(self) -> None:
        """Wait, and fill every member slot."""
        state = self.slots[0].fsdp_param.unit.eager
        state.regathers_in_flight.remove(self)
        fsdp_params = [s.fsdp_param for s in self.slots]
        raws = gather_bucket_raw_without_autograd(fsdp_params, self.in_flight)
        if fsdp_params[0].unit in state.recomputed:
            state.backward_gathered.update(zip(fsdp_params, raws, strict=True))
        for s, raw in zip(self.slots, raws, strict=True):
            s.full, s.prefetched = s.fsdp_param._for_compute(raw), None

    def drop(self) -> None:
        """Wait, and fill nothing (the backward ended without using it)."""
        self.in_flight.wait()
        for s in self.slots:
            s.prefetched = None


@dataclass
class RegatherSlot:
    """One parameter's re-gathered tensor, shared by every saved view of it in
    one backward and dropped once the last of them is unpacked.

    One slot per forward gather (``gather_unit`` closes the previous one): the
    saved views hold it, so a slot whose graph is dropped unused goes with it."""

    fsdp_param: FSDPParam
    pending: int = 0
    #: Saved views packed (a retained graph's next backward unpacks them all again).
    packed: int = 0
    full: torch.Tensor | None = None
    #: Its re-gather, issued ahead by the backward of the unit after it.
    prefetched: _RegatherInFlight | None = None
    #: The outermost eager forward that packed it (``_ForwardPrefetch.forwards``).
    forward: int = 0
    #: Creation order (the order the forward packed its first view).
    seq: int = field(default_factory=itertools.count().__next__)
    #: ``reshard_after_forward=<int>``: the block kept after forward to re-gather from
    #: over the smaller group (``None``: re-gather from the shard).
    post_forward_shard: torch.Tensor | None = None
    #: The slots of the same forward gather of its unit, by parameter: one re-gather fills
    #: them together, whichever forward they came from (several before one backward).
    mates: dict[FSDPParam, RegatherSlot] | None = field(default=None, repr=False, compare=False)


@dataclass
class _SavedView:
    """What autograd keeps in place of a saved view of a gathered parameter."""

    slot: RegatherSlot
    size: torch.Size
    stride: tuple
    storage_offset: int


def reshard_after_forward_hooks():
    """Saved-tensor hooks that make eager autograd re-gather instead of keeping.

    Autograd saves the full weight (or a view of it, e.g. ``W.t()``) for the
    backward of ops like ``mm``. For a unit with ``reshard_after_forward=True``
    a small handle is saved instead and the weight all-gathered again when
    backward unpacks it, as FSDP2 does; with an int, the handle keeps this
    rank's block of the weight and backward all-gathers the blocks over the
    smaller group. Compiled runs get the same effect from the reshard pass on
    the joint graph.
    """
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


def _gathered_param_of(t: torch.Tensor) -> FSDPParam | None:
    """The parameter whose gathered tensor ``t`` is (or views), among those gathered
    by the running sharded forwards."""
    if is_functorch_wrapper(t) or not _has_storage(t):
        return None  # torch.func's tensors (a jvp's): kept, not resharded
    storage = t.untyped_storage().data_ptr()
    for fsdp_param in forward_context.gathered_params():
        full = fsdp_param.gathered
        if is_functorch_wrapper(full):  # under torch.func: kept, not resharded
            continue
        if type(full) is torch.Tensor and full.numel() > 0 and full.untyped_storage().data_ptr() == storage:
            return fsdp_param
    return None


def _has_storage(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage of its own (functorch)
        return False
    return True


# Autograd calls the hooks from eager code, which may run inside a compiled call (a block
# compiled on its own, where Dynamo fell back to eager around an op it skipped): Dynamo
# must not compile them, or what they call, as frames of their own (one graph per saved
# tensor's dtype, size and stride, until its recompile limit).
@torch.compiler.disable
def _pack(t: torch.Tensor):
    if type(t) is not torch.Tensor or t.numel() == 0:
        return t
    fsdp_param = _gathered_param_of(t)
    if (
        fsdp_param is None
        or fsdp_param.layout is None
        or fsdp_param.held is not None
        or not fsdp_param.unit.frees_gathered_after_forward()
    ):
        return t  # (layout None: the "gathered" tensor is the local one; held: unshard() keeps it)
    state = fsdp_param.unit.eager
    slot = state.open_slots.get(fsdp_param)
    if slot is None or slot.pending == 0:
        slot = state.open_slots[fsdp_param] = RegatherSlot(fsdp_param, forward=state.forward_prefetch.forwards)
        slot.mates = state.slot_mates.setdefault(fsdp_param.unit, {})
        slot.mates[fsdp_param] = state.live_slots[slot.seq] = slot
        if fsdp_param.unit.reshard_to is not None:
            slot.post_forward_shard = fsdp_param.post_forward_shard()
    slot.pending += 1
    slot.packed += 1
    return _SavedView(slot, t.size(), t.stride(), t.storage_offset())


def _rearm(slot: RegatherSlot) -> None:
    """Open ``slot`` and its mates, drained by an earlier backward over the same retained
    graph, for one more backward: one re-gather fills them again."""
    live = slot.fsdp_param.unit.eager.live_slots
    for mate in {id(m): m for m in [slot, *(slot.mates or {}).values()]}.values():
        if mate.pending == 0 and mate.packed > 0 and mate.full is None:
            mate.pending = mate.packed
            live[mate.seq] = mate


@torch.compiler.disable
def _unpack(packed):
    if not isinstance(packed, _SavedView):
        return packed
    slot = packed.slot
    if slot.pending == 0:  # a backward over a retained graph: its views are unpacked again
        _rearm(slot)
    if slot.full is None:
        if slot.post_forward_shard is None:
            _regather(slot)
        else:
            slot.full = slot.fsdp_param.gather_post_forward_shard(slot.post_forward_shard)
    # The re-gathered tensor has the original layout, so the saved view is
    # rebuilt from its size, stride and offset.
    view = slot.full.as_strided(packed.size, packed.stride, packed.storage_offset)
    slot.pending -= 1
    if slot.pending == 0:
        slot.full = slot.post_forward_shard = None
        slot.fsdp_param.unit.eager.live_slots.pop(slot.seq, None)
        open_slots = slot.fsdp_param.unit.eager.open_slots
        if open_slots.get(slot.fsdp_param) is slot:
            del open_slots[slot.fsdp_param]
    return view
