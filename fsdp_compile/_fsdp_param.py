"""FSDPParam: one parameter's sharded storage and its traceable unshard.

The sharded ``DTensor`` (``Shard(0)`` on a 1-D mesh, ``torch.chunk`` layout)
*is* the ``nn.Parameter`` registered on the owning module, so
``named_parameters()``, ``state_dict()``, optimizers, ``clip_grad_norm_`` and
DCP see exactly what they see with FSDP2. Reading the attribute during a
sharded forward returns the full tensor through
:func:`fsdp_compile.runtime.collectives.all_gather_shard` instead.

0-dim parameters cannot be split along dim 0; they are kept whole on every
rank (a ``Replicate()`` DTensor) and their gradient is all-reduced.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_compile._compat import outside_dispatch_modes
from fsdp_compile._fsdp_state import RegatherSlot, forward_context
from fsdp_compile.runtime.collectives import (
    ShardLayout,
    collective_annotation,
    all_gather_shard,
    replicate_with_grad_sync,
)


class FSDPParam:
    """Sharded storage and unshard recipe for one ``nn.Parameter``.

    Attributes:
        local_fqn: the parameter's name relative to its unit's module.
        fqn: its name relative to the outermost sharded module (the root).
        sharded_param: the registered ``nn.Parameter`` wrapping a ``DTensor``.
        layout: the dim-0 split (``None`` for a 0-dim parameter, which is replicated).
        unit: the :class:`~fsdp_compile._fsdp_state.FSDPUnit` that owns it.
    """

    def __init__(self, param: nn.Parameter, local_fqn: str, mesh: DeviceMesh, unit, module_index: int = 0) -> None:
        self.local_fqn = local_fqn
        self.module_index = module_index  # which of the unit's modules the name is relative to
        self.unit = unit
        self.mesh = mesh
        dp = unit.dp_mesh
        self.orig_dtype = param.dtype
        data = param.detach()
        if data.ndim == 0 or not dp.shards:
            self.layout = None  # replicated: gradient all-reduced
            local = data.clone()
        else:
            self.layout = ShardLayout(tuple(data.shape), dp.shard_world_size, dp.shard_rank, dp.shard_group_name)
            start = min(dp.shard_rank * self.layout.rows_per_rank, data.shape[0])
            local = data.narrow(0, start, self.layout.local_rows).clone()
        self.replicate_group_name = dp.replicate_group_name
        self.allreduce_group_names = dp.reduce_group_names(sharded_dim0=self.layout is not None)
        local = unit.offload.to_storage(local)
        dtensor = DTensor.from_local(
            local,
            mesh,
            dp.placements(sharded_dim0=self.layout is not None),
            run_check=False,
            shape=data.shape,
            stride=_contiguous_stride(data.shape),
        )
        self.sharded_param = nn.Parameter(dtensor, requires_grad=param.requires_grad)
        # Carry over attributes users hang on parameters (e.g. ``_no_weight_decay``).
        for key, value in vars(param).items():
            if not key.startswith("_fsdp"):
                setattr(self.sharded_param, key, value)
        self._unsharded: torch.Tensor | None = None
        self._regather_slot: RegatherSlot | None = None
        self._grad_accumulator: torch.Tensor | None = None
        self.held: torch.Tensor | None = None  # gathered by FSDPModule.unshard()
        self.owner: tuple[nn.Module, str] | None = None  # first module registering it, and the name

    def hold_unsharded(self) -> None:
        if self.held is None:
            self.held = self.full_without_autograd()

    def full_without_autograd(self) -> torch.Tensor:
        """The full tensor on the compute device, in the policy's ``param_dtype``,
        outside autograd (gathered unless the parameter is replicated)."""
        if self.layout is not None:
            return self.regather()
        full = self.unit.offload.to_compute(self.sharded_param.to_local().detach())
        param_dtype = self.unit.mp_policy.param_dtype
        return full if param_dtype is None else full.to(param_dtype)

    def release_unsharded(self) -> None:
        self.held = None

    def prepare_gradient_accumulation(self) -> None:
        """Create the leaf that collects this parameter's unsharded gradient while
        gradient sync is off (``FSDPModule.set_requires_gradient_sync(False)``).

        A zero-strided expand of one element: it costs no memory itself; its
        ``.grad`` (full size, in the parameter's dtype) is what autograd fills,
        as FSDP2 keeps unsharded gradients. The next synced backward adds it
        before the reduce-scatter; a hook on the sharded parameter then drops it.
        """
        if self._grad_accumulator is not None or not self.sharded_param.requires_grad:
            return
        local = self.sharded_param.to_local()
        with torch.no_grad():
            seed = torch.zeros((), dtype=local.dtype, device=local.device)
        self._grad_accumulator = seed.expand(self.sharded_param.shape).requires_grad_()
        self.sharded_param.register_post_accumulate_grad_hook(self._drop_accumulated_grad)

    def _drop_accumulated_grad(self, _param) -> None:
        # Autograd runs this hook in no-sync backward passes too (with no
        # gradient for the shard); only a synced pass has consumed the pending sum.
        if self._grad_accumulator is not None and self.unit.requires_gradient_sync:
            self._grad_accumulator.grad = None

    def unshard(self, sharded_param: nn.Parameter) -> torch.Tensor:
        """The full tensor; gathered once, then reused until the innermost running
        sharded forward returns (see :class:`~fsdp_compile._fsdp_state._ForwardContext`).

        ``sharded_param`` is passed in (rather than read from ``self``) so that
        Dynamo sees it come from the module's ``_parameters`` and lifts it as a
        graph input with a stable source.
        """
        if self._unsharded is not None:
            return self._unsharded
        unit = self.unit
        annotation = collective_annotation(
            "unshard",
            self.fqn,
            unit.fqn,
            unit.resolved_reshard_after_forward(),
            None if unit.forward_prefetched_by is None else unit.forward_prefetched_by.fqn,
            None if unit.backward_prefetched_by is None else unit.backward_prefetched_by.fqn,
        )
        if forward_context.in_broken_graph():
            warn_graph_break(self)
        local = self.unit.offload.to_compute(sharded_param.to_local())
        policy = self.unit.mp_policy
        accumulator = None if self.unit.requires_gradient_sync else self._grad_accumulator
        pending = self._grad_accumulator.grad if accumulator is None and self._grad_accumulator is not None else None
        gather = replicate_with_grad_sync if self.layout is None else all_gather_shard
        factor = self.unit.gradient_divide_factor
        full = gather(
            local,
            self.allreduce_group_names if self.layout is None else self.layout,
            annotation,
            reduce_op="avg" if factor is None else "sum",
            grad_scale=None if factor is None else 1.0 / factor,
            param_dtype=policy.param_dtype,
            reduce_dtype=policy.reduce_dtype,
            pending=pending,
            accumulator=accumulator,
            **({} if self.layout is None else {"replicate_group_name": self.replicate_group_name}),
        )
        self._unsharded = full
        forward_context.note_gathered(self, full)
        return full

    def regather(self) -> torch.Tensor:
        """Eager backward: the full tensor again, without autograd (see ``eager_reshard_hooks``)."""
        annotation = collective_annotation("regather", self.fqn, self.unit.fqn, True)
        with torch.no_grad():
            return all_gather_shard(
                self.unit.offload.to_compute(self.sharded_param.to_local()), self.layout, annotation, param_dtype=self.unit.mp_policy.param_dtype
            )

    def regather_for_recompute(self) -> torch.Tensor:
        """The full tensor for an activation-checkpointing recompute in eager backward.

        The recomputed ops only refill saved tensors (gradients flow through the
        original forward's graph), but they must save what the original saved,
        which depends on whether the weight requires grad: hence a fresh leaf. The
        gather runs outside selective checkpointing's recompute mode, which only
        accepts the ops its region ran in forward."""
        with outside_dispatch_modes():
            full = self.full_without_autograd()
        return full.detach().requires_grad_(self.sharded_param.requires_grad)

    def regather_slot(self) -> RegatherSlot:
        """The slot shared by all saved views of this parameter in the current forward."""
        if self._regather_slot is None or self._regather_slot.pending == 0:
            self._regather_slot = RegatherSlot(self)
        return self._regather_slot

    @property
    def unsharded(self) -> torch.Tensor | None:
        """The full tensor gathered in the running sharded forward, if any."""
        return self._unsharded

    @property
    def fqn(self) -> str:
        prefix = self.unit.module_fqns[self.module_index]
        return f"{prefix}.{self.local_fqn}" if prefix else self.local_fqn

    def drop_unsharded(self) -> None:
        if self._unsharded is not None:
            forward_context.forget_storage(self._unsharded)
        self._unsharded = None

    def __repr__(self) -> str:
        return f"FSDPParam({self.fqn!r}, shape={tuple(self.sharded_param.shape)}, unit={self.unit.fqn!r})"


def warn_graph_break(fsdp_param: FSDPParam) -> None:
    """Once per unit: its parameters are gathered in eager code between compiled graphs."""
    if fsdp_param.unit.warned_eager_gather:
        return
    fsdp_param.unit.warned_eager_gather = True
    unit = fsdp_param.unit.fqn or "(root)"
    warnings.warn(
        f"fsdp_compile: graph break inside the sharded forward of unit {unit!r}: parameter "
        f"{fsdp_param.fqn!r} is gathered in eager code between compiled graphs, so its collectives "
        "cannot be bucketed or overlapped. TORCH_LOGS=graph_breaks shows where Dynamo broke; "
        "fsdp_compile.debug.dump(DIR) writes each graph and its collectives.",
        stacklevel=3,
    )


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))
