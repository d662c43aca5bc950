"""What ``torch.distributed.pipelining`` asks of FSDP2 at its gradient-reduction step.

torch 2.15's schedules call the public ``finalize_backward()`` (ours:
:func:`finish_gradient_accumulation` on every unit); torch 2.13's reach into FSDP2's state:

A pipeline schedule runs every micro-batch's backward with gradient sync off
(``set_requires_gradient_sync(False)``), then, at its ``REDUCE_GRAD`` action
(``_PipelineStageBase.perform_reduce_grad``), turns sync back on and calls FSDP2's
internal ``post_backward()`` on every parameter group of ``fully_shard.state(stage)``,
then its root's ``_root_post_backward_final_callback()``: the accumulated gradients are
reduced without another backward of the model. Our units have no FSDP2 state, so each
registers this view of itself as its ``fully_shard.state``: its "parameter group"
reduces what the unit accumulated (:func:`reduce_accumulated`), and the final callback
has nothing left to wait for (every reduction here finishes inside its backward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from fsdp_compile._eager_buckets import regather_key
from fsdp_compile._eager_collectives import gather_bucket_with_grad_sync
from fsdp_compile.base.compat import set_composable_state, torchs_fully_shard
from fsdp_compile.runtime.collectives import GradAccumulation, gather_with_grad_sync

if TYPE_CHECKING:
    from fsdp_compile._fsdp_state import FSDPUnit


def register_pipelining_view(module: nn.Module, unit: FSDPUnit) -> None:
    """Make torch's ``fully_shard.state(module)`` answer pipelining's questions for ``unit``."""
    set_composable_state(module, torchs_fully_shard(), _UnitStateView(module, unit))


def reduce_accumulated(unit: FSDPUnit) -> None:
    """Reduce the gradients ``unit`` accumulated with gradient sync off into its sharded
    parameters' ``.grad`` now, one reduce-scatter per bucket: the synced backward's own
    autograd functions, run on a zero gradient plus the accumulated one (read from the
    kept tensor, so nothing is gathered). Needs gradient sync on."""
    pending = [p for p in unit.params if p._grad_accumulator is not None and p._grad_accumulator.grad is not None]
    buckets: dict[tuple | None, list] = {}
    for fsdp_param in pending:
        buckets.setdefault(regather_key(fsdp_param), []).append(fsdp_param)
    fulls = []
    with torch.enable_grad():
        for key, bucket in buckets.items():
            sums = [p._grad_accumulator.grad for p in bucket]
            shards = [p._gather_input(p.sharded_param) for p in bucket]
            if key is None or len(bucket) == 1:
                fulls += [
                    gather_with_grad_sync(s, p.spec, GradAccumulation(pending=g), kept=g)
                    for s, p, g in zip(shards, bucket, sums, strict=True)
                ]
            else:
                fulls += gather_bucket_with_grad_sync(shards, [p.spec for p in bucket], pendings=sums, kept=sums)
    if fulls:
        torch.autograd.backward(fulls, [torch.zeros_like(f) for f in fulls])


def finish_gradient_accumulation(unit: FSDPUnit) -> None:
    """With gradient sync on again, reduce what ``unit`` accumulated without it
    (:func:`reduce_accumulated`); then, as FSDP2's post-backward, free the parameters kept
    gathered (``set_reshard_after_backward(False)``) unless the unit keeps them. FSDP2's
    ``post_backward()`` (torch 2.13's pipelining) and ``finalize_backward()`` (2.15's)."""
    if not unit.requires_gradient_sync:
        return
    reduce_accumulated(unit)
    if unit.reshard_after_backward:
        for fsdp_param in unit.params:
            fsdp_param.kept = None


class _ParamGroupView:
    """FSDP2's ``FSDPParamGroup`` as pipelining uses it."""

    def __init__(self, unit: FSDPUnit) -> None:
        self.unit = unit

    def post_backward(self) -> None:
        finish_gradient_accumulation(self.unit)


class _StateContextView:
    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    def all_states(self) -> list[_UnitStateView]:
        """Every unit's view under this module (pipelining reduces them all)."""
        from fsdp_compile._fully_shard import FSDPModule

        return [m.__dict__["_fsdp_pipelining_view"] for m in self.module.modules() if isinstance(m, FSDPModule)]


class _UnitStateView:
    """FSDP2's ``FSDPState`` as pipelining uses it (``_state_ctx.all_states``,
    ``_fsdp_param_groups``, ``_root_post_backward_final_callback``)."""

    def __init__(self, module: nn.Module, unit: FSDPUnit) -> None:
        self._fsdp_param_groups = [_ParamGroupView(unit)] if module is unit.modules[0] else []
        self._state_ctx = _StateContextView(module)
        module.__dict__["_fsdp_pipelining_view"] = self

    def _root_post_backward_final_callback(self) -> None:
        """Nothing to wait for: each reduction finished inside its backward."""
