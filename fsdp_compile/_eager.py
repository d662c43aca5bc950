"""The eager path: what runs when no graph is being traced.

A compiled step needs none of this: its graph gathers each parameter where it
is first read, and the reshard pass makes the backward re-gather. Eager runs
(and the eager code between the graphs of a compiled step that broke) instead
gather a unit when its forward starts, as FSDP2's pre-forward does, and reshard
after forward with saved-tensor hooks: autograd saves a small handle in place
of a gathered weight, and backward gathers it again when it unpacks the handle.
Everything here runs outside Dynamo (``torch.compiler.disable``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fsdp_compile._compat import outside_dispatch_modes, saved_tensors_hooks_active
from fsdp_compile._fsdp_param import FSDPParam, ParamState, gather_bucket, gather_bucket_without_autograd
from fsdp_compile._fsdp_state import forward_context
from fsdp_compile._mixed_precision import cast_inputs, cast_output

if TYPE_CHECKING:
    from fsdp_compile._fsdp_state import FSDPUnit


@torch.compiler.disable
def pre_forward(unit: FSDPUnit, inside_compiled_call: bool, args, kwargs):
    """Cast the inputs, open the forward context and gather the whole unit (FSDP2's
    pre-forward); returns the inputs and the saved-tensor hooks that reshard after
    forward, or ``None``.

    Inside a compiled step that fell back to eager here (the user's own graph
    break), the user's forward is then compiled as a frame of its own, as it is
    unsharded; gathering inside it would tag each unit's graph with the unit (one
    recompile per unit), so the unit is gathered here, eagerly, as FSDP2 does, and
    a warning names it. Dynamo must not meet our saved-tensor hooks there."""
    args, kwargs = cast_inputs(unit.mp_policy, args, kwargs)
    forward_context.enter(compiled=inside_compiled_call)
    try:
        gather_unit(unit)
    except BaseException:
        forward_context.exit()
        raise
    # Resharding via saved-tensor hooks, unless other hooks already manage saved
    # tensors (activation checkpointing recomputes them anyway).
    outermost = (
        not inside_compiled_call
        and forward_context.depth == 1
        and torch.is_grad_enabled()
        and not saved_tensors_hooks_active()
    )
    return args, kwargs, reshard_after_forward_hooks() if outermost else None


@torch.compiler.disable
def post_forward() -> None:
    forward_context.exit()


cast_output_outside_dynamo = torch.compiler.disable(cast_output)


def gather_unit(unit: FSDPUnit) -> None:
    """Gather every parameter of the unit, as FSDP2 does: one all-gather per bucket of
    parameters that can share one (:meth:`FSDPParam.bucket_key`; most units: one),
    and one reduce-scatter per bucket in the backward. Reads inside the forward then
    hit the cache, so an activation-checkpointed region saves and recomputes the same ops."""
    to_gather = [p for p in unit.params if p.state is ParamState.SHARDED and p.owner is not None]
    for fsdp_param in to_gather:
        # A fresh gather starts a fresh re-gather slot: an earlier forward's slot lives on
        # only in its own autograd graph (a forward never followed by a backward leaves one
        # that was never unpacked; reusing it would serve a later backward its stale weight).
        _open_slots.pop(fsdp_param, None)
    for key, bucket in _buckets(to_gather, FSDPParam.bucket_key):
        if key is None or len(bucket) == 1:
            for fsdp_param in bucket:
                owner, name = fsdp_param.owner
                fsdp_param.gather(owner._parameters[name])
        else:
            gather_bucket(bucket)


def _buckets(fsdp_params: list[FSDPParam], key_of) -> list[tuple[tuple | None, list[FSDPParam]]]:
    """``fsdp_params`` grouped by ``key_of`` (first-seen order; ``None``: each alone)."""
    groups: dict = {}
    for i, fsdp_param in enumerate(fsdp_params):
        key = key_of(fsdp_param)
        groups.setdefault(key if key is not None else ("alone", i), (key, []))[1].append(fsdp_param)
    return list(groups.values())


def gather_for_recompute(fsdp_param: FSDPParam) -> torch.Tensor:
    """The full tensor for an activation-checkpointing recompute in eager backward.

    The recomputed ops only refill saved tensors (gradients flow through the
    original forward's graph), but they must save what the original saved,
    which depends on whether the weight requires grad: hence a fresh leaf. The
    gather runs outside selective checkpointing's recompute mode, which only
    accepts the ops its region ran in forward."""
    with outside_dispatch_modes():
        full = fsdp_param.gather_without_autograd()
    return full.detach().requires_grad_(fsdp_param.sharded_param.requires_grad)


# ------------------------------------------------------- reshard after forward


def _regather(slot: RegatherSlot) -> None:
    """Fill ``slot.full``, and with the same all-gather every other open slot of its
    unit that shares its bucket (FSDP2's pre-backward gathers the whole unit)."""
    fsdp_param = slot.fsdp_param
    key = fsdp_param.regather_key()
    bucket = [slot]
    if key is not None:
        bucket += [
            other
            for other in _open_slots.values()
            if other is not slot
            and other.full is None
            and other.post_forward_shard is None
            and other.fsdp_param.unit is fsdp_param.unit
            and other.fsdp_param.regather_key() == key
        ]
    if len(bucket) == 1:
        slot.full = fsdp_param.gather_without_autograd()
        return
    for other, full in zip(bucket, gather_bucket_without_autograd([s.fsdp_param for s in bucket])):
        other.full = full


@dataclass
class RegatherSlot:
    """One parameter's re-gathered tensor, shared by every saved view of it in
    one backward and dropped once the last of them is unpacked.

    One slot per forward gather (``gather_unit`` closes the previous one): the
    saved views hold it, so a slot whose graph is dropped unused goes with it."""

    fsdp_param: FSDPParam
    pending: int = 0
    full: torch.Tensor | None = None
    #: ``reshard_after_forward=<int>``: the block kept after forward to re-gather from
    #: over the smaller group (``None``: re-gather from the shard).
    post_forward_shard: torch.Tensor | None = None


@dataclass
class _SavedView:
    """What autograd keeps in place of a saved view of a gathered parameter."""

    slot: RegatherSlot
    size: torch.Size
    stride: tuple
    storage_offset: int


_open_slots: dict[FSDPParam, RegatherSlot] = {}


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
    storage = t.untyped_storage().data_ptr()
    for fsdp_param in forward_context.gathered_params():
        full = fsdp_param.gathered
        if type(full) is torch.Tensor and full.numel() > 0 and full.untyped_storage().data_ptr() == storage:
            return fsdp_param
    return None


def _pack(t: torch.Tensor):
    if type(t) is not torch.Tensor or t.numel() == 0:
        return t
    fsdp_param = _gathered_param_of(t)
    if fsdp_param is None or not fsdp_param.unit.frees_gathered_after_forward():
        return t
    slot = _open_slots.get(fsdp_param)
    if slot is None or slot.pending == 0:
        slot = _open_slots[fsdp_param] = RegatherSlot(fsdp_param)
        if fsdp_param.unit.reshard_to is not None:
            slot.post_forward_shard = fsdp_param.post_forward_shard()
    slot.pending += 1
    return _SavedView(slot, t.size(), t.stride(), t.storage_offset())


def _unpack(packed):
    if not isinstance(packed, _SavedView):
        return packed
    slot = packed.slot
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
        if _open_slots.get(slot.fsdp_param) is slot:
            del _open_slots[slot.fsdp_param]
    return view


