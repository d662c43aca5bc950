"""FSDPParam: one parameter's sharded storage and its traceable unshard.

The sharded ``DTensor`` (``Shard(0)`` on a 1-D mesh, ``torch.chunk`` layout)
*is* the ``nn.Parameter`` registered on the owning module, so
``named_parameters()``, ``state_dict()``, optimizers, ``clip_grad_norm_`` and
DCP see exactly what they see with FSDP2. Reading the attribute during a
sharded forward returns the full tensor through
:func:`fsdp_compile.runtime.collectives.gather_with_grad_sync` instead.

0-dim parameters cannot be split along dim 0; they are kept whole on every
rank (a ``Replicate()`` DTensor) and their gradient is all-reduced.
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_compile._fsdp_state import FRAME_NAMING, NESTED_NAMING, forward_context, warn_gathered_in_broken_graph
from fsdp_compile._local_shard_optimizer import SHARDED_PARAM_ATTRIBUTE, FSDPParamRef
from fsdp_compile._low_precision import (
    gather_extension_with_grad,
    has_all_gather_extension,
    is_other_subclass,
    pre_all_gather_arity,
    shard_extension_param,
    side_tensors,
    traced_gather,
    with_gradient_reduction,
)
from fsdp_compile._mixed_precision import param_dtype_for
from fsdp_compile._param_hooks import route_forward_hooks_to_local_shard
from fsdp_compile._spmd_types import typed_as_dtensor
from fsdp_compile._tensor_parallel import TensorParallelSpec, spmd_mesh, spmd_param_layout
from fsdp_compile.base.compat import (
    NO_ANNOTATION,
    alias_of_local_tensor,
    annotating,
    fsdp2_reduces_in_original_dtype,
    functorch_transforms_active,
    fx_annotate,
    in_backward_recompute,
    local_tensor_of,
    mark_as_parameter_input,
)
from fsdp_compile.base.execution_mode import ExecutionMode, execution_mode
from fsdp_compile.runtime.collectives import (
    NO_ACCUMULATION,
    CollectiveSpec,
    GradAccumulation,
    ShardLayout,
    gather_op,
    gather_post_forward_shard,
    gather_with_grad_sync,
    gradient_reduction,
    post_forward_shard,
)
from fsdp_compile.runtime.vocabulary import FRAME_UNIT, CollectiveTag, Role

if TYPE_CHECKING:
    from fsdp_compile._fsdp_state import FSDPUnit
    from fsdp_compile.runtime.process_groups import DataParallelMesh


class ParamState(enum.Enum):
    """Which tensor a read of the parameter returns (FSDP2's ``ShardedState``)."""

    #: Only the shard exists: reads outside a sharded forward get the sharded parameter.
    SHARDED = "sharded"
    #: Gathered (with autograd) in a running sharded forward; dropped when it returns.
    GATHERED = "gathered"
    #: Gathered by ``FSDPModule.unshard()``, until ``reshard()``: reads outside a sharded
    #: forward get the full tensor (no autograd); a grad-enabled sharded forward reads it
    #: with autograd (its gradient reduced back into the shard) without gathering again.
    HELD = "held"


def _requires_grad_followers(fsdp_param: FSDPParam):
    """``(follow, follow_when_traced)``: a function that makes ``fsdp_param.local_view``
    again if the sharded parameter's ``requires_grad`` changed since it was made (see
    [Note: traced reads without the DTensor]), and the same function as Dynamo calls it:
    once, at trace time, its result a constant (``torch.compiler.assume_constant_result``:
    no guard, nothing in the graph). Each holds the parameter weakly."""
    ref = weakref.ref(fsdp_param)

    def follow() -> None:
        param = ref()
        if param is not None and param.local_view.requires_grad != param.sharded_param.requires_grad:
            param.refresh_local_view()

    def follow_when_traced() -> None:
        follow()

    return follow, torch.compiler.assume_constant_result(follow_when_traced)


class FSDPParam:
    """Sharded storage and unshard recipe for one ``nn.Parameter``.

    Attributes:
        local_fqn: the parameter's name relative to its unit's module.
        fqn: its name relative to the outermost sharded module (the root).
        sharded_param: the registered ``nn.Parameter`` wrapping a ``DTensor``.
        layout: the dim-0 split (``None`` for a 0-dim parameter, which is replicated).
        tensor_parallel: how tensor parallelism laid the parameter out before
            (``None`` for a plain parameter); FSDP then shards its local tensor.
        spec: how its collectives run (:class:`~fsdp_compile.runtime.collectives.CollectiveSpec`).
        state / gathered: the :class:`ParamState` and, unless ``SHARDED``, the full tensor.
        held / held_raw: while ``HELD`` (``FSDPModule.unshard()``), the full tensor reads get
            (no autograd), and the gathered tensor (dim 0 first) that forwards read with
            autograd instead of gathering (``None`` for an all-gather-extension parameter,
            whose forwards gather again).
        kept: the full tensor kept from the last forward for the next one
            (``set_reshard_after_backward(False)``), else ``None``.
        unit: the :class:`~fsdp_compile._fsdp_state.FSDPUnit` that owns it.
        owner: the first module registering it, and the name it has there.
    """

    def __init__(
        self,
        param: nn.Parameter,
        local_fqn: str,
        unit: FSDPUnit,
        module_index: int = 0,
        shard_dim: int = 0,
        dp_mesh: DataParallelMesh | None = None,
    ) -> None:
        self.local_fqn = local_fqn
        self.module_index = module_index  # which of the unit's modules the name is relative to
        self.unit = unit
        # The mesh it is sharded over: the unit's, or its own (``shard_placement_fn``'s
        # ``ShardPlacementResult``: torchtitan's routed experts over ``efsdp``).
        dp = self.dp_mesh = dp_mesh if dp_mesh is not None else unit.dp_mesh
        data_parallel_dims = () if dp.spmd is None else dp.spmd.data_parallel_dims
        self.spmd_typing, param = typed_as_dtensor(param, local_fqn, dp.spmd)  # (spmd_types: see there)
        tp = self.tensor_parallel = TensorParallelSpec.of(param, data_parallel_dims) if isinstance(param, DTensor) else None
        data = (param if tp is None else param.to_local()).detach()
        self.shard_dim = shard_dim
        # [Note: complex parameters] Collectives move a complex parameter as its real view
        # (a trailing dim of 2; FSDP2's c10d calls do the same): the layout is the real
        # view's, a gather reads ``view_as_real`` of the shard and the module reads
        # ``view_as_complex`` of the gathered tensor; autograd converts the gradient back.
        self.is_complex = data.is_complex()
        # The dtype it is gathered and computed in (per parameter: param_dtype_override_fn).
        self.param_dtype = param_dtype_for(unit.mp_policy, param)
        # FSDP2's all-gather extension (a tensor subclass that gathers itself: see ``_low_precision``),
        # or a subclass awaiting it (its class name; sharded as one with it, its hooks must come
        # before its first gather: :meth:`notice_late_extension`); the hooks' arity, traced
        # gather and the local tensor that gather reads.
        self.extension: bool = has_all_gather_extension(data)
        self.awaits_extension: str | None = type(data).__name__ if is_other_subclass(data) else None
        self.pre_all_gather_arity: int | None = None
        self.traced_extension_gather = self.extension_source = None
        self.layout, local = self._shard(data, shard_dim)
        self.reduce_group_names = dp.reduce_group_names(sharded=self.layout is not None)
        self.sharded_param = self._first_sharded_param(param, local, data.ndim)
        self._follow_requires_grad, self.follow_requires_grad_when_traced = _requires_grad_followers(self)
        self.local_view: torch.Tensor  # see [Note: plain graph inputs]
        self.refresh_local_view()
        self.state = ParamState.SHARDED
        self.gathered: torch.Tensor | None = None
        self.held: torch.Tensor | None = None
        self.held_raw: torch.Tensor | None = None
        self._held_version: tuple[int, int, int] | None = None  # :meth:`_shard_version` when ``held`` was gathered
        # With set_reshard_after_backward(False): the full tensor (dim 0 first, no autograd)
        # the next forward reads instead of gathering.
        self.kept: torch.Tensor | None = None
        self._grad_accumulator: torch.Tensor | None = None
        # What the last grad-enabled gather claimed of each accumulator's sum (claim_accumulated).
        self._claimed_sum = self._claimed_partial_sum = None
        # HSDP with set_requires_all_reduce(False): the leaf collecting the reduce-scattered,
        # not yet all-reduced, gradient (FSDP2's partial reduce output).
        self._partial_accumulator: torch.Tensor | None = None
        self.owner: tuple[nn.Module, str] | None = None
        #: Every (module, name) that registers :attr:`sharded_param` (several for a shared weight).
        self.registrations: list[tuple[nn.Module, str]] = []
        self.refresh_spec()
        self._choose_read_paths()

    def _choose_read_paths(self) -> None:
        """Which shortcuts a read of this parameter may take (set once, at ``__init__``)."""
        moved_dim = bool(self.shard_dim) and self.layout is not None
        tp = self.tensor_parallel
        # Whether the gathered tensor (dim 0 first) is what the module reads: no dim moved
        # back, no tensor-parallel DTensor around it (see :meth:`_for_compute`).
        self._reads_gathered_as_is = not moved_dim and tp is None and not self.is_complex
        # Whether a traced gather reads :attr:`local_view` itself: nothing to move to the
        # compute device, no shard dim to move first.
        self._reads_local_view_as_is = not self.unit.devices.offload_to_cpu and not moved_dim and not self.is_complex
        # Whether a traced read of this trainable parameter needs nothing but
        # :attr:`local_view` (see [Note: traced reads without the DTensor]).
        plain = not self.extension and not self.awaits_extension
        self.traced_read_needs_local_view_only = self._reads_local_view_as_is and tp is None and plain

    def _first_sharded_param(self, param: nn.Parameter, local: torch.Tensor, ndim: int) -> nn.Parameter:
        """The ``nn.Parameter(DTensor)`` over ``local`` that stands for ``param`` from now on,
        with the attributes users hang on parameters (e.g. ``_no_weight_decay``)."""
        unit, tp, dp = self.unit, self.tensor_parallel, self.dp_mesh
        sharded = ndim != 0 and dp.shards
        if dp.spmd is not None:
            mesh, placements = spmd_param_layout(dp.spmd, dp.mesh, tp, self.shard_dim, sharded)
        else:
            mesh = dp.mesh if tp is None else spmd_mesh(dp.mesh, tp)
            placements = dp.placements(
                sharded=sharded,
                shard_dim=self.shard_dim,
                tp_placements=() if tp is None else tp.placements,
                tp_shards=1 if tp is None else tp.shards_on(self.shard_dim),
            )
        dtensor = DTensor.from_local(
            unit.devices.to_storage(local),
            mesh,
            placements,
            run_check=False,
            shape=param.shape,
            stride=_contiguous_stride(param.shape),
        )
        sharded = nn.Parameter(dtensor, requires_grad=param.requires_grad)
        for key, value in vars(param).items():
            if not key.startswith("_fsdp"):
                setattr(sharded, key, value)
        setattr(sharded, SHARDED_PARAM_ATTRIBUTE, FSDPParamRef(self))  # (the optimizer step pre-hook's)
        route_forward_hooks_to_local_shard(sharded, self.local_fqn)
        return sharded

    def adopt(self, param: nn.Parameter) -> None:
        """Make ``param``, assigned to the parameter's name after ``fully_shard``
        (``module.weight = nn.Parameter(...)``, ``load_state_dict(sd, assign=True)``), the
        sharded parameter, as FSDP2's lazy init does: a ``DTensor`` with this parameter's
        mesh, placements and shape is taken as it is (its local tensor is this rank's
        shard: what ``distribute_tensor`` of the full tensor gives); a plain tensor of the
        full shape is sharded. Anything else raises, naming the parameter."""
        old = self.sharded_param
        if isinstance(param, DTensor):
            if (param.device_mesh, tuple(param.placements), param.shape) != (old.device_mesh, tuple(old.placements), old.shape):
                raise ValueError(
                    f"fully_shard: the DTensor assigned to {self.fqn!r} has mesh {param.device_mesh}, placements "
                    f"{tuple(param.placements)} and shape {tuple(param.shape)}; the sharded parameter has "
                    f"{old.device_mesh}, {tuple(old.placements)} and {tuple(old.shape)}. Assign a DTensor laid out as "
                    "model.state_dict() gives it (distribute_tensor(full, p.device_mesh, p.placements)), or the full tensor"
                )
            local = self.unit.devices.to_storage(local_tensor_of(param))
            if local is not local_tensor_of(param):
                param = self._sharded_param_over(local, param.requires_grad)
        elif self.tensor_parallel is None and not self.extension and param.shape == old.shape and param.dtype == old.dtype:
            param = self._sharded_param_over(self._shard(param.detach(), self.shard_dim)[1], param.requires_grad)
        else:
            raise ValueError(
                f"fully_shard: a {type(param).__name__} of shape {tuple(param.shape)} and dtype {param.dtype} was assigned "
                f"to the sharded parameter {self.fqn!r} ({tuple(old.shape)}, {old.dtype}); assign the full tensor "
                "or a DTensor laid out as model.state_dict() gives it"
            )
        self._install(param, old)

    def _sharded_param_over(self, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """A new sharded parameter over ``local`` (this rank's shard), laid out as the current one."""
        old = self.sharded_param
        dtensor = DTensor.from_local(
            self.unit.devices.to_storage(local),
            old.device_mesh,
            old.placements,
            run_check=False,
            shape=old.shape,
            stride=old.stride(),
        )
        return nn.Parameter(dtensor, requires_grad=requires_grad)

    def _install(self, param: nn.Parameter, old: nn.Parameter) -> None:
        """Register ``param`` (an ``nn.Parameter(DTensor)`` laid out as ``old``) as the sharded
        parameter in every module that registers ``old``."""
        for key, value in vars(old).items():
            if key not in vars(param) and key != "register_post_accumulate_grad_hook":
                setattr(param, key, value)
        route_forward_hooks_to_local_shard(param, self.local_fqn)
        self.sharded_param = param
        for module, name in self.registrations:
            module._parameters[name] = param
        if self._grad_accumulator is not None or self._partial_accumulator is not None:
            param.register_post_accumulate_grad_hook(self._drop_consumed_accumulations)
        self.refresh_local_view()

    def _shard(self, data: torch.Tensor, shard_dim: int) -> tuple[ShardLayout | None, torch.Tensor]:
        """This rank's shard of ``data`` and its layout. A tensor subclass with FSDP2's
        all-gather extension, or awaiting it, keeps its subclass (see ``_low_precision``)."""
        dp = self.dp_mesh
        if not self.extension and not self.awaits_extension:
            if self.is_complex:
                layout, local = _split(torch.view_as_real(data), shard_dim, dp)
                return layout, torch.view_as_complex(local)
            return _split(data, shard_dim, dp)
        if self.tensor_parallel is not None:
            raise NotImplementedError(
                f"fully_shard: parameter {self.local_fqn!r} is a {type(data).__name__} inside a tensor-parallel DTensor"
            )
        local = shard_extension_param(data, dp.shard_world_size, dp.shard_rank)
        if self.extension:
            self.pre_all_gather_arity = pre_all_gather_arity(self.local_fqn, local)
            self.traced_extension_gather = traced_gather(self)
        return ShardLayout(tuple(data.shape), dp.shard_world_size, dp.shard_rank, dp.shard_group_name), local

    @property
    def fqn(self) -> str:
        prefix = self.unit.module_fqns[self.module_index]
        return f"{prefix}.{self.local_fqn}" if prefix else self.local_fqn

    def refresh_spec(self) -> None:
        """Rebuild :attr:`spec` from the unit's current options (it runs whenever one of ``_fsdp_state.SPEC_OPTIONS`` is written)."""
        unit = self.unit
        dp = self.dp_mesh
        replicas = 1 if dp.replicate_dim is None else dp.mesh.size(dp.replicate_dim)
        # The dtype gradients are reduced in, FSDP2's: the policy's; else the gradient's
        # (torch 2.13), or the parameter's original one, the gradient upcast (2.15).
        policy_reduce_dtype = unit.mp_policy.reduce_dtype
        if policy_reduce_dtype is None and self.param_dtype is not None and fsdp2_reduces_in_original_dtype():
            policy_reduce_dtype = self.sharded_param.dtype
        reduce_dtype = policy_reduce_dtype or self.param_dtype or self.sharded_param.dtype
        arithmetic = gradient_reduction(
            reduce_dtype, dp.shard_world_size, replicas, unit.gradient_divide_factor, unit.force_sum_reduction_for_comms
        )
        # A replicated parameter's gradient is all-reduced over the shard group first:
        # that all-reduce stands for the reduce-scatter.
        ops = [arithmetic.all_reduce_op] * len(self.reduce_group_names)
        if self.layout is None and ops and dp.shard_group_name == self.reduce_group_names[0]:
            ops[0] = arithmetic.reduce_op
        self.spec = CollectiveSpec(
            layout=self.layout,
            tag=CollectiveTag(
                Role.UNSHARD,
                self.fqn,
                unit.fqn,
                unit.frees_gathered_after_forward(),
                None if unit.forward_prefetched_by is None else unit.forward_prefetched_by.fqn,
                None if unit.backward_prefetched_by is None else unit.backward_prefetched_by.fqn,
                reshard_to=unit.reshard_to if unit.frees_gathered_after_forward() else None,
            ),
            reduce_group_names=self.reduce_group_names,
            reduce_op=arithmetic.reduce_op,
            reduce_group_ops=tuple(ops),
            grad_scale=arithmetic.premultiply,
            grad_predivide=arithmetic.predivide,
            grad_postdivide=arithmetic.postdivide,
            param_dtype=self.param_dtype,
            reduce_dtype=policy_reduce_dtype,
            post_reduce_hook=None if unit.all_reduce_hook is None else unit.all_reduce_hook.key,
        )
        # The same collectives, named relative to the unit: what a compiled frame of this
        # unit's own traces (see ``FSDPUnit.traced_naming``); prefetch hints name
        # other units, which are not in that graph.
        relative = self.local_fqn if len(unit.modules) == 1 else f"{self.module_index}.{self.local_fqn}"
        self.frame_spec = self._renamed_spec(relative, FRAME_UNIT)
        # Nested directly in such a unit: named relative to that unit.
        nested = unit.name_in_parent
        self.nested_frame_spec = None if nested is None else self._renamed_spec(f"{nested}.{relative}", f"{FRAME_UNIT}.{nested}")

    def _renamed_spec(self, param_fqn: str, unit_fqn: str) -> CollectiveSpec:
        """:attr:`spec` with the tag's names replaced (and no prefetch hints)."""
        tag = dataclasses.replace(
            self.spec.tag, param_fqn=param_fqn, unit_fqn=unit_fqn, forward_prefetched_by=None, backward_prefetched_by=None
        )
        return dataclasses.replace(self.spec, tag=tag)

    def gather(self, sharded_param: nn.Parameter, mode: ExecutionMode | None = None) -> torch.Tensor:
        """The full tensor, with autograd (its gradient is reduced back into the shard);
        gathered once, then reused until the innermost running sharded forward returns
        (see :class:`~fsdp_compile._fsdp_state._ForwardContext`). ``mode``: the caller's
        :func:`execution_mode` (asked here if not given).

        ``sharded_param`` is passed in (rather than read from ``self``) so that
        Dynamo sees it come from the module's ``_parameters`` and lifts it as a
        graph input with a stable source.
        """
        if self.state is ParamState.HELD:
            self.drop_held_if_stale()
        if self.state is ParamState.GATHERED or (self.state is ParamState.HELD and not self.held_read_needs_grad()):
            return self.gathered
        # (Traced at every parameter read: each call below is one more function Dynamo
        # inlines, so the compiled path skips what cannot apply there.)
        traced = (mode or execution_mode()) is ExecutionMode.TRACED
        if not traced and forward_context.in_broken_graph():
            warn_gathered_in_broken_graph(self)
        if self.awaits_extension and not self.extension:
            self.notice_late_extension()  # raises unless its hooks came
        if self.extension:
            return self._note_gathered(self._gather_with_extension(sharded_param, traced))
        if (
            traced
            and self._reads_local_view_as_is
            and (sharded_param is None or self.local_view.requires_grad == sharded_param.requires_grad)
        ):
            local = self.local_view  # the common traced case: what _gather_input returns, in fewer steps
        else:
            local = self._gather_input(sharded_param)
        spec, key = self._traced_spec()
        kept = self.still_gathered()
        direct = not traced and functorch_transforms_active()
        full = gather_with_grad_sync(local, spec, self._accumulation(), kept, key=key, direct=direct)
        return self._note_gathered(full)

    def gather_traced(self) -> torch.Tensor:
        """:meth:`gather` as Dynamo traces it for a trainable parameter read by a traced
        sharded forward (``_fully_shard._read_traced`` checks the rest): the same graph, in
        one inlined call. Every read of every compile traces this (under half the
        bytecode of :meth:`gather`'s general path), so anything it does not handle goes
        there: a parameter gathered or held already, gradient accumulation, a tensor kept
        since the last forward, a replicated (0-dim) or one-rank parameter."""
        if (
            self.state is not ParamState.SHARDED
            or self._grad_accumulator is not None
            or self._partial_accumulator is not None
            or self.kept is not None
            or not self.unit.reshard_after_backward
            or self.spec.layout is None
        ):
            return self.gather(None, ExecutionMode.TRACED)
        # :meth:`_traced_spec`'s choice, inlined: one more call here is 7% more bytecode
        # for Dynamo to trace in every compile (5,534 instructions against 5,154 on the
        # tests' 2-layer Llama).
        naming = self.unit.traced_naming
        if naming is None:
            key = self.spec.key
        elif naming == FRAME_NAMING:
            key = self.frame_spec.key
        elif naming == NESTED_NAMING:
            key = self.nested_frame_spec.key
        else:
            key = _spec_key_as_root(self, naming)
        full = gather_op(self.local_view, key)
        self.gathered = full if self._reads_gathered_as_is else self._for_compute(full)
        self.state = ParamState.GATHERED
        forward_context.frames[-1].append(self)  # the innermost running forward drops it when it returns
        return self.gathered

    def gather_replacement(self, replacement: DTensor) -> torch.Tensor:
        """The full tensor of ``replacement``, a ``DTensor`` laid out as this parameter that
        code put in the module's ``_parameters`` in its place (``torch.func.functional_call``,
        ``torch.nn.utils.stateless``): the forward computes with it, as with FSDP2. Gathered
        at each read with autograd, its gradient reduced into ``replacement`` (gradient sync
        as configured, no accumulation); never cached, so no state of this parameter (and no
        backward re-gather, which reads this parameter's shard) ever holds it."""
        local = self._as_gather_input(alias_of_local_tensor(replacement))
        spec, key = self._traced_spec()
        full = gather_with_grad_sync(local, spec, NO_ACCUMULATION, None, key=key, direct=functorch_transforms_active())
        return self._for_compute(full)

    def _traced_spec(self) -> tuple[CollectiveSpec, str | None]:
        """The spec this parameter's collectives carry in the graph being traced, named as
        its unit is named there (``FSDPUnit.traced_naming``: from the root, relative to a
        unit compiled on its own or to the one it is nested in); and, for the ``order``-th
        root unit of a graph holding several, the key its unit is renamed to (else ``None``)."""
        naming = self.unit.traced_naming
        if naming == FRAME_NAMING:
            return self.frame_spec, None
        if naming == NESTED_NAMING:
            return self.nested_frame_spec, None
        return self.spec, None if naming is None else _spec_key_as_root(self, naming)

    def still_gathered(self) -> torch.Tensor | None:
        """The full tensor (dim 0 first) a forward reads instead of gathering: held by
        ``unshard()``, or kept since the last forward (``set_reshard_after_backward(False)``)."""
        return self.kept if self.held_raw is None else self.held_raw

    def held_read_needs_grad(self) -> bool:
        """Whether a sharded forward's read of the held tensor needs autograd (FSDP2's
        unsharded parameters are leaves whose gradients are reduced after backward)."""
        return torch.is_grad_enabled() and self.sharded_param.requires_grad

    def notice_late_extension(self) -> None:
        """Shard as an all-gather extension parameter from now on if its local tensor (or
        the tensor's class) got FSDP2's hooks after ``fully_shard`` (FSDP2 reads them off
        the local tensor at each gather); eager code calls this before each unit's gather."""
        local = local_tensor_of(self.sharded_param)
        if self.extension:
            return
        if not has_all_gather_extension(local):
            if self.awaits_extension:
                raise NotImplementedError(
                    f"fully_shard: parameter {self.fqn!r} is a {self.awaits_extension}, a tensor subclass without FSDP2's "
                    "all-gather extension (fsdp_pre_all_gather / fsdp_post_all_gather) at its first gather; gathering "
                    "it would silently treat it as a plain tensor. Define the extension on the subclass, set it on each "
                    "shard's local tensor before the first forward, convert the parameter to a plain tensor, or pass it "
                    "in ignored_params"
                )
            return
        if self.tensor_parallel is not None or self.layout is None or self.shard_dim or self.unit.reshard_to is not None:
            raise NotImplementedError(
                f"fully_shard: parameter {self.fqn!r} got FSDP2's all-gather extension after fully_shard; it is "
                "supported for plain parameters sharded on dim 0 (no tensor parallelism, no reshard_after_forward=<int>)"
            )
        self.pre_all_gather_arity = pre_all_gather_arity(self.fqn, local)
        self.traced_extension_gather = traced_gather(self)
        self.extension = True
        self.traced_read_needs_local_view_only = False
        self.refresh_local_view()

    def _gather_with_extension(self, sharded_param: nn.Parameter, traced: bool) -> torch.Tensor:
        """The post hook's compute tensor (see ``_low_precision``); a trainable parameter's
        gradient is reduced as any other's."""
        if traced:
            if not has_all_gather_extension(type(self.extension_source)):
                raise NotImplementedError(
                    f"fully_shard: parameter {self.fqn!r}: FSDP2's all-gather hooks set on the tensor itself (not its "
                    "class) run in eager code only; define them on the tensor's class to compile its gather"
                )
            side = side_tensors(local_tensor_of(self.sharded_param))
            carrier = self._gradient_carrier(self.local_view)
            return self.traced_extension_gather(self.extension_source, side, carrier, *self._accumulation())
        return gather_extension_with_grad(self, local_tensor_of(sharded_param), self._gradient_carrier(), self._accumulation())

    def note_gathered_extension(self, full: torch.Tensor) -> torch.Tensor:
        """Record ``full``, this extension parameter's compute tensor gathered with others
        of its unit (eager code), with its gradient reduction attached."""
        return self._note_gathered(with_gradient_reduction(self, full, self._gradient_carrier(), self._accumulation()))

    def _gradient_carrier(self, traced_view: torch.Tensor | None = None) -> torch.Tensor | None:
        """What carries a gradient back to the sharded parameter (``None``: none is needed)."""
        if not (self.sharded_param.requires_grad and torch.is_grad_enabled()):
            return None
        return traced_view if traced_view is not None else self.sharded_param.to_local()

    def _accumulation(self) -> GradAccumulation:
        """Where this parameter's gradient goes besides its reduction, by the unit's sync
        and all-reduce modes (see :class:`~fsdp_compile.runtime.collectives.GradAccumulation`)."""
        if self._grad_accumulator is None and self._partial_accumulator is None:
            return NO_ACCUMULATION  # the common case, in few traced steps
        pending = accumulator = partial_pending = partial_accumulator = None
        if self._grad_accumulator is not None:
            if self.unit.requires_gradient_sync:
                pending = self.claim_accumulated(self._grad_accumulator)
            else:
                accumulator = self._grad_accumulator
        if self._partial_accumulator is not None:
            if self.unit.requires_all_reduce:
                partial_pending = self.claim_accumulated(self._partial_accumulator)
            else:
                partial_accumulator = self._partial_accumulator
        return GradAccumulation(pending, accumulator, partial_pending, partial_accumulator)

    def claim_accumulated(self, leaf: torch.Tensor) -> torch.Tensor | None:
        """What ``leaf`` (an accumulator) collected while sync was off, for the gather that
        adds it to its reduction, taken off the leaf when that gather's backward will run
        (grad mode, a trainable parameter), so that it is added once however often the
        parameter is gathered before that backward: two forwards, or a forward that leaves
        a unit's module out and a call of that module by itself (upstream's chunked-head
        accumulation), each added it, a silent double count. Traced, the take is a side
        effect Dynamo replays after the graph (a later gather in the same step reads
        ``None``: a graph without the sum, compiled once)."""
        if not (torch.is_grad_enabled() and self.sharded_param.requires_grad):
            return leaf.grad
        name = "_claimed_sum" if leaf is self._grad_accumulator else "_claimed_partial_sum"
        claimed = getattr(self, name)
        if claimed is not None and not torch.compiler.is_compiling() and in_backward_recompute():
            # An eager activation-checkpointing recompute refills what its forward saved (the
            # gradients flow through that forward's graph): what that forward claimed.
            return claimed
        pending = leaf.grad
        setattr(self, name, pending)
        if pending is not None:
            leaf.grad = None
        return pending

    def _note_gathered(self, full: torch.Tensor) -> torch.Tensor:
        """Record ``full`` (dim 0 first, with autograd) as this forward's gathered tensor."""
        kept = None if self.unit.reshard_after_backward or self.held_raw is not None else full.detach()
        if kept is not None or self.kept is not None:  # traced: no store to replay after the graph
            self.kept = kept
        self.gathered = full if self._reads_gathered_as_is else self._for_compute(full)
        self.state = ParamState.GATHERED
        forward_context.frames[-1].append(self)  # the innermost running forward drops it when it returns
        return self.gathered

    def gather_without_autograd(self) -> torch.Tensor:
        """The full tensor on the compute device in ``param_dtype``, outside autograd
        (eager code only: ``unshard()``, eager backward's re-gather)."""
        if self.extension:
            with torch.no_grad():
                return gather_extension_with_grad(self, local_tensor_of(self.sharded_param), None)
        return self._for_compute(self._gather_raw_without_autograd())

    def _gather_raw_without_autograd(self) -> torch.Tensor:
        """The gathered tensor as the all-gather returns it (dim 0 first, in ``param_dtype``)."""
        spec = dataclasses.replace(self.spec, tag=dataclasses.replace(self.spec.tag, role=Role.REGATHER))
        with torch.no_grad():
            return gather_with_grad_sync(self._gather_input(self.sharded_param), spec)

    def post_forward_shard(self) -> torch.Tensor:
        """This rank's block of the gathered tensor kept after forward when the unit
        reshards to a smaller group (eager code: the saved-tensor hooks)."""
        _, size, index = self.unit.reshard_to
        full = self.gathered.movedim(self.shard_dim, 0) if self.shard_dim else self.gathered
        if self.is_complex:
            full = torch.view_as_real(full)
        with torch.no_grad():
            return post_forward_shard(full, self.layout, size, index)

    def gather_post_forward_shard(self, post: torch.Tensor) -> torch.Tensor:
        """The full tensor again from :meth:`post_forward_shard`'s blocks, gathered over the
        smaller group (eager backward)."""
        name, size, _ = self.unit.reshard_to
        with torch.no_grad(), fx_annotate(self.spec.tag.as_meta(Role.REGATHER)) if annotating() else NO_ANNOTATION:
            return self._for_compute(gather_post_forward_shard(post, self.layout, name, size))

    def after_swap(self, attributes: dict) -> None:
        """After ``Module._apply`` (``.to(...)``, ``to_empty``, ``.float()``) or
        ``load_state_dict`` over the parameter's module: the parameter it registers now
        (torch swaps a ``DTensor`` parameter's contents in place, ``__dict__`` included,
        with ``swap_tensors``, or registers a new one) gets back the attributes the sharded
        parameter had (``attributes``, which the swap left on the discarded tensor), and
        the gathers read its current local tensor."""
        module, name = self.registrations[0]
        current = module._parameters[name]
        if current is not self.sharded_param:
            self.sharded_param = current
            for other, other_name in self.registrations[1:]:
                other._parameters[other_name] = current
        for key, value in attributes.items():
            if key not in vars(current) and key != "register_post_accumulate_grad_hook":  # (bound to the old tensor)
                setattr(current, key, value)
        if "register_post_accumulate_grad_hook" not in vars(current):
            route_forward_hooks_to_local_shard(current, self.local_fqn)
        self.refresh_local_view()

    # [Note: plain graph inputs] A traced gather reads :attr:`local_view`: an alias of the
    # sharded parameter's local tensor (its ``detach()``, made once and kept, with an
    # autograd edge that hands the gradient back as the parameter's ``DTensor`` gradient,
    # as ``to_local()``'s does). Rules it keeps:
    # * it shares the local tensor's storage, so in-place writes (optimizer steps,
    #   checkpoint loads) show through it;
    # * it is no autograd view, so in-place writes to the parameter never make autograd
    #   rebuild its ``grad_fn``, and its edge saves nothing, so every backward runs it;
    # * the sharded ``DTensor`` is then no input of a compiled graph: AOTAutograd sees
    #   plain tensors only and needs no subclass handling.
    # [Note: traced reads without the DTensor] A traced read of a trainable parameter (no
    # tensor parallelism, no all-gather extension) touches neither the sharded ``DTensor``
    # nor ``module._parameters``, so Dynamo installs no guard on the ``DTensor`` (its spec,
    # its mesh, its aliases) at every call. The one fact it needs from the ``DTensor``,
    # whether it requires a gradient, :attr:`local_view` mirrors
    # (:func:`_requires_grad_followers` makes a new view at trace time, or in the backward
    # of a parameter frozen since the last trace; the new view then fails Dynamo's guard
    # on the view's ``requires_grad`` and recompiles, one step later, as unsharded). A
    # frozen parameter's read still goes through the ``DTensor``. Tensor-parallel reads go
    # through the ``DTensor`` too (see ``_fully_shard._read_managed``).
    def refresh_local_view(self) -> None:
        """Make :attr:`local_view` an alias of :attr:`sharded_param`'s current local tensor
        again (after ``to_empty``, ``.to(...)`` or anything else that replaced it)."""
        if self.extension:  # what a traced gather's hooks read (see [Note: side tensors of a traced gather])
            self.extension_source = local_tensor_of(self.sharded_param).detach()
        with torch.enable_grad():  # its autograd edge to the sharded parameter is the point
            self.local_view = alias_of_local_tensor(self.sharded_param, self._follow_requires_grad)
        mark_as_parameter_input(self.local_view)
        self.unit.note_on_meta(self, self.local_view.is_meta)

    def _local_shard(self, sharded_param: nn.Parameter) -> torch.Tensor:
        """The local tensor the gather reads. Traced: :attr:`local_view` (see [Note: plain
        graph inputs]), or ``to_local()`` where the parameter was frozen or unfrozen since.
        Eager: a fresh alias (:func:`alias_of_local_tensor`, not ``to_local()``, whose
        backward compiled autograd cannot trace), whose autograd node is as new as the
        gather's, so autograd accumulates each gradient (and runs its hooks) as soon as it
        is reduced."""
        if execution_mode() is ExecutionMode.TRACED:
            view = self.local_view
            return view if view.requires_grad == sharded_param.requires_grad else sharded_param.to_local()
        local = local_tensor_of(sharded_param)
        if self.local_view.data_ptr() != local.data_ptr() or self.local_view.shape != local.shape:
            self.refresh_local_view()  # replaced since (a compiled step would read a stale alias)
        return alias_of_local_tensor(sharded_param)

    def _gather_input(self, sharded_param: nn.Parameter) -> torch.Tensor:
        """The local shard on the compute device, its shard dim first (a complex one as its
        real view)."""
        return self._as_gather_input(self._local_shard(sharded_param))

    def _as_gather_input(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (a local shard of this parameter's layout) as a gather reads it."""
        local = self.unit.devices.to_compute(local)
        if self.shard_dim and self.layout is not None:
            local = local.movedim(self.shard_dim, 0)
        return torch.view_as_real(local) if self.is_complex else local

    def _for_compute(self, full: torch.Tensor) -> torch.Tensor:
        """What the module's forward reads: the gathered tensor with its dims in place, as
        the TP ``DTensor`` it was before sharding if tensor parallelism made it one."""
        if self.is_complex:
            full = torch.view_as_complex(full)
        if self.shard_dim and self.layout is not None:
            full = full.movedim(0, self.shard_dim)
        if self.tensor_parallel is None:
            return full
        full = self.tensor_parallel.wrap(full)
        return full if self.spmd_typing is None else self.spmd_typing.local(full)

    def drop_gathered(self) -> None:
        """The running sharded forward that gathered this parameter returns (a held one
        is held again)."""
        if self.state is ParamState.GATHERED:
            held = self.held is not None
            self.state, self.gathered = (ParamState.HELD, self.held) if held else (ParamState.SHARDED, None)

    def hold(self) -> None:
        """Keep the full tensor until :meth:`release` (``FSDPModule.unshard()``); gather it
        again if the shard changed since it was gathered (:meth:`drop_held_if_stale`)."""
        self.drop_held_if_stale()
        if self.held is None:
            self._held_version = self._shard_version()
            # Plain tensors even under torch.inference_mode(): a later forward with autograd
            # reads them (an inference tensor cannot be saved for its backward).
            with torch.inference_mode(False):
                if self.extension:
                    self.held = self.gather_without_autograd()
                else:
                    self.held_raw = self._gather_raw_without_autograd()
                    self.held = self._for_compute(self.held_raw)
            if self.state is ParamState.SHARDED:
                self.state, self.gathered = ParamState.HELD, self.held

    def drop_held_if_stale(self) -> None:
        """Release the tensor :meth:`hold` gathered if the shard changed since (an optimizer
        step, a state-dict load, an in-place edit), so that the next read gathers the new
        values. FSDP2 reshards after every backward, so its next ``unshard()`` or forward
        gathers them; ours holds across a backward, and a held tensor read after the
        optimizer step computed silently with the old parameters. (Eager code only: a
        traced read takes the held tensor as a graph input.)"""
        if self.held is not None and not torch.compiler.is_compiling() and self._shard_version() != self._held_version:
            self.release()

    def _shard_version(self) -> tuple[int, int, int]:
        """Changes whenever the shard's values may have: an in-place op on the ``DTensor``
        (bumps its own version counter, not its local tensor's: ``DTensor`` dispatch runs
        below autograd), one on the local tensor (the local-shard optimizer step), or a new
        local tensor (``to_empty``, ``load_state_dict(assign=True)``)."""
        local = local_tensor_of(self.sharded_param)
        return id(local), self.sharded_param._version, local._version

    def release(self) -> None:
        """Free what :meth:`hold` and ``set_reshard_after_backward(False)`` kept (FSDP2's
        ``reshard()`` frees every unsharded parameter)."""
        self.held = self.held_raw = self.kept = None
        if self.state is ParamState.HELD:
            self.state, self.gathered = ParamState.SHARDED, None

    def prepare_gradient_accumulation(self) -> None:
        """Create the leaf that collects this parameter's unsharded gradient while
        gradient sync is off (``FSDPModule.set_requires_gradient_sync(False)``): its
        ``.grad`` (full size, in the parameter's dtype) is what autograd fills, as FSDP2
        keeps unsharded gradients. The next synced backward adds it before the
        reduce-scatter; a hook on the sharded parameter then drops it."""
        if self._grad_accumulator is None and self.sharded_param.requires_grad:
            local = self.sharded_param.to_local()
            if self.is_complex:  # accumulated as the gathered real view (see [Note: complex parameters])
                local = torch.view_as_real(local)
            # The gathered tensor's shape: the shard dim first, this rank's tensor-parallel
            # piece (the layout's); a replicated parameter's is its local tensor's.
            shape = local.shape if self.layout is None else self.layout.full_shape
            self._grad_accumulator = self._accumulation_leaf(shape, local.dtype, local.device)

    def prepare_partial_reduction(self) -> None:
        """Create the leaf that collects this parameter's reduce-scattered gradient while
        the all-reduce over the replicate dimension is off (HSDP,
        ``FSDPModule.set_requires_all_reduce(False)``): its ``.grad`` (the local shard's
        size, in the reduction's dtype) is what autograd fills; the next backward with the
        all-reduce on adds it before all-reducing, and the same hook then drops it."""
        if self._partial_accumulator is None and self.sharded_param.requires_grad:
            with torch.no_grad():
                local = self._gather_input(self.sharded_param)
            dtype = self.spec.reduce_dtype or self.spec.param_dtype or local.dtype
            self._partial_accumulator = self._accumulation_leaf(local.shape, dtype, local.device)

    def _accumulation_leaf(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A leaf whose ``.grad`` autograd accumulates: a zero-strided expand of one element
        (no memory of its own). The first one hooks :meth:`_drop_consumed_accumulations`."""
        if self._grad_accumulator is None and self._partial_accumulator is None:
            self.sharded_param.register_post_accumulate_grad_hook(self._drop_consumed_accumulations)
        with torch.no_grad():
            seed = torch.zeros((), dtype=dtype, device=device)
        return seed.expand(shape).requires_grad_()

    def _drop_consumed_accumulations(self, _param) -> None:
        # Autograd runs this hook in no-sync / no-all-reduce backward passes too (with
        # no gradient for the shard); only a pass that reduced has consumed a pending sum.
        if self._grad_accumulator is not None and self.unit.requires_gradient_sync:
            self._grad_accumulator.grad = None
            self._claimed_sum = None
        if self._partial_accumulator is not None and self.unit.requires_all_reduce:
            self._partial_accumulator.grad = None
            self._claimed_partial_sum = None

    def __repr__(self) -> str:
        return f"FSDPParam({self.fqn!r}, shape={tuple(self.sharded_param.shape)}, unit={self.unit.fqn!r})"


@torch.compiler.assume_constant_result
def _spec_key_as_root(fsdp_param: FSDPParam, order: int) -> str:
    """The key of ``fsdp_param``'s spec with its unit named ``(root <order>)``: the
    ``order``-th root unit entered in one traced graph (``FSDPUnit.traced_naming``).
    Built while Dynamo traces (which bakes the key in, guarding on the parameter's
    identity: such a graph holds those units only)."""
    spec = fsdp_param.spec
    return dataclasses.replace(spec, tag=dataclasses.replace(spec.tag, unit_fqn=f"(root {order})")).key


def _split(data: torch.Tensor, shard_dim: int, dp) -> tuple[ShardLayout | None, torch.Tensor]:
    """This rank's shard of ``data`` (a copy) along ``shard_dim`` over ``dp``'s shard group,
    and its layout; ``None`` and the whole tensor where it is replicated (0-dim, or no
    shard group), its gradient all-reduced. A shard group of one rank holds the whole
    tensor too: its all-gather and reduce-scatter would be copies, so there are none (the
    ``DTensor`` keeps its ``Shard`` placement, as FSDP2's)."""
    if data.ndim == 0 or not dp.shards or dp.shard_world_size == 1:
        return None, data.clone(memory_format=torch.contiguous_format)  # (the DTensor's stride is contiguous)
    # The runtime splits dim 0; another shard dim is moved there and back.
    moved = data.movedim(shard_dim, 0)
    layout = ShardLayout(tuple(moved.shape), dp.shard_world_size, dp.shard_rank, dp.shard_group_name)
    start = min(dp.shard_rank * layout.rows_per_rank, moved.shape[0])
    local = moved.narrow(0, start, layout.local_rows).movedim(0, shard_dim)
    return layout, local.clone(memory_format=torch.contiguous_format)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))
