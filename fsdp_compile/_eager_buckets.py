"""Eager buckets of :class:`~fsdp_compile.FSDPParam` objects: what a unit's parameters share to
go out in one collective, and the bucketed gathers of eager code (FSDP2's pre-forward
all-gather of a unit, its pre-backward re-gather, their prefetches), on top of
:mod:`fsdp_compile._eager_collectives`. Compiled steps bucket in
:mod:`fsdp_compile.passes.bucketing` instead; ``FSDPParam`` itself only knows how to
gather one parameter."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fsdp_compile._eager_collectives import (
    AllGatherInFlight,
    gather_bucket_with_grad_sync,
    issue_all_gather_bucket,
)
from fsdp_compile._eager_collectives import bucket_key as _collective_bucket_key
from fsdp_compile._eager_reduce import defers_reduction
from fsdp_compile._fsdp_state import forward_context, warn_gathered_in_broken_graph
from fsdp_compile._low_precision import gather_extension_params
from fsdp_compile.base.compat import NO_ANNOTATION, annotating, fx_annotate, local_tensor_of
from fsdp_compile.runtime.vocabulary import Role

if TYPE_CHECKING:
    from fsdp_compile._fsdp_param import FSDPParam


def bucket_key(fsdp_param: FSDPParam) -> tuple | None:
    """What eager code buckets the parameter's collectives by with others of its unit
    (:func:`gather_bucket`), or ``None`` if it gathers on its own: replicated, still
    gathered, or accumulating HSDP's partial reductions. Gradient accumulation buckets as
    FSDP2's: micro-batches without sync gather the unit at once (their gradients go to
    the accumulators), and the synced one reduce-scatters the unit at once, accumulated
    gradients included."""
    unit = fsdp_param.unit
    if fsdp_param.extension:
        return None  # (an extension parameter's own hooks decide what its all-gather moves)
    accumulator, partial = fsdp_param._grad_accumulator, fsdp_param._partial_accumulator
    if not unit.requires_gradient_sync and accumulator is None and fsdp_param.sharded_param.requires_grad:
        return None
    if partial is not None and (not unit.requires_all_reduce or partial.grad is not None):
        return None
    key = regather_key(fsdp_param)
    return None if key is None else (*key, unit.requires_gradient_sync, fsdp_param.still_gathered() is not None)


def regather_key(fsdp_param: FSDPParam) -> tuple | None:
    """What eager backward buckets the parameter's re-gather by (see :func:`bucket_key`)."""
    if fsdp_param.extension:
        return None
    return _collective_bucket_key(fsdp_param.spec, fsdp_param.sharded_param)


def gather_bucket(fsdp_params: list[FSDPParam], in_flight: AllGatherInFlight | None = None) -> None:
    """Gather ``fsdp_params`` (sharded, of one :func:`bucket_key`) with one
    all-gather, with autograd (one reduce-scatter in the backward, waited on one unit
    later: see ``fsdp_compile._eager_reduce``): eager code's :meth:`FSDPParam.gather`
    for a bucket. ``in_flight``: their all-gather, issued ahead by
    :func:`issue_bucket_gather` (a prefetch) from unchanged shards."""
    if forward_context.in_broken_graph():
        warn_gathered_in_broken_graph(fsdp_params[0])
    kept = [p.still_gathered() for p in fsdp_params]
    fulls = bucket_fulls_with_grad(fsdp_params, in_flight, None if kept[0] is None else kept)
    for fsdp_param, full in zip(fsdp_params, fulls, strict=True):
        fsdp_param._note_gathered(full)


def bucket_fulls_with_grad(
    fsdp_params: list[FSDPParam], in_flight: AllGatherInFlight | None = None, kept: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The full tensors (dim 0 first) of a bucket, gathered with one all-gather
    (``in_flight``, or ``kept``: already gathered), whose gradients are reduced with one
    reduce-scatter (:func:`gather_bucket`)."""
    first = fsdp_params[0]
    shards = [p._gather_input(p.sharded_param) for p in fsdp_params]
    specs = [p.spec for p in fsdp_params]
    with fx_annotate(first.spec.tag.as_meta()) if annotating() else NO_ANNOTATION:
        if not first.unit.requires_gradient_sync and shards[0].requires_grad and torch.is_grad_enabled():
            accumulators = [p._grad_accumulator for p in fsdp_params]
            return gather_bucket_with_grad_sync(
                [s.detach() for s in shards], specs, in_flight, accumulators=accumulators, kept=kept
            )
        pendings = [None if p._grad_accumulator is None else p.claim_accumulated(p._grad_accumulator) for p in fsdp_params]
        state = first.unit.eager
        deliver = state.reductions.deliverer(shards) if defers_reduction(shards) else None
        # (Deferred reductions only: compiled autograd, which needs them off, traces the backward.)
        shared = state.shared_reduction(fsdp_params) if deliver is not None else None
        fulls = gather_bucket_with_grad_sync(
            [s.detach() for s in shards] if deliver is not None else shards,
            specs,
            in_flight,
            deliver,
            first.unit.reduce_scatter_unused_params,
            pendings,
            kept=kept,
            shared=shared,
        )
        if shared is not None and fulls[0].grad_fn is not None:
            shared.register(fulls[0].grad_fn)
        return fulls


def issue_bucket_gather(fsdp_params: list[FSDPParam], role: Role = Role.UNSHARD) -> AllGatherInFlight:
    """Issue the all-gather of ``fsdp_params`` (sharded, of one bucket key) without
    waiting for it: eager prefetch, for :func:`gather_bucket` (``Role.UNSHARD``) or
    :func:`gather_bucket_without_autograd` (``Role.REGATHER``) to wait on later."""
    first = fsdp_params[0]
    with torch.no_grad(), fx_annotate(first.spec.tag.as_meta(role)) if annotating() else NO_ANNOTATION:
        shards = [p._gather_input(p.sharded_param) for p in fsdp_params]
        return issue_all_gather_bucket(shards, [p.layout for p in fsdp_params], first.spec.param_dtype)


def shard_versions(fsdp_params: list[FSDPParam]) -> tuple[int, ...]:
    """Version counters of the parameters' shards: an in-place update through the
    parameter (the optimizer) or through its local tensor changes one of them, which
    makes an all-gather issued before it stale."""
    with torch.no_grad():
        return tuple(v for p in fsdp_params for v in (p.sharded_param._version, p.sharded_param.to_local()._version))


def gather_bucket_without_autograd(
    fsdp_params: list[FSDPParam], in_flight: AllGatherInFlight | None = None
) -> list[torch.Tensor]:
    """:meth:`FSDPParam.gather_without_autograd` for a bucket of one :func:`regather_key`;
    ``in_flight``: its all-gather, issued ahead by :func:`issue_bucket_gather`."""
    fulls = gather_bucket_raw_without_autograd(fsdp_params, in_flight)
    return [p._for_compute(full) for p, full in zip(fsdp_params, fulls, strict=True)]


def gather_bucket_raw_without_autograd(
    fsdp_params: list[FSDPParam], in_flight: AllGatherInFlight | None = None
) -> list[torch.Tensor]:
    """:func:`gather_bucket_without_autograd`'s tensors as the all-gather returns them
    (dim 0 first, in ``param_dtype``)."""
    if in_flight is None:
        in_flight = issue_bucket_gather(fsdp_params, Role.REGATHER)
    with torch.no_grad():
        return in_flight.wait()


def gather_extension_bucket(fsdp_params: list[FSDPParam]) -> None:
    """Gather a unit's parameters that use FSDP2's all-gather extension (``_low_precision``)
    with one ``uint8`` all-gather per shard group, as FSDP2 gathers a unit."""
    groups: dict[tuple, list[FSDPParam]] = {}
    for fsdp_param in fsdp_params:
        groups.setdefault((fsdp_param.layout.group_name, fsdp_param.layout.world_size), []).append(fsdp_param)
    for group in groups.values():
        sources = [local_tensor_of(p.sharded_param) for p in group]
        for fsdp_param, full in zip(group, gather_extension_params(group, sources), strict=True):
            fsdp_param.note_gathered_extension(full)
