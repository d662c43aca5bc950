"""``fully_shard``: FSDP2's API, with parameter access that ``torch.compile`` can trace.

How a parameter read becomes an all-gather: every module that directly holds a
managed parameter gets its class swapped to a subclass with one ``property``
per managed name. Outside a sharded forward the property returns the
registered sharded ``nn.Parameter(DTensor)``; inside one it returns
``FSDPParam.gather(...)``, the full tensor. The module passed to
``fully_shard`` becomes ``FSDP<Orig>`` (subclassing :class:`FSDPModule`), whose
``forward`` opens the forward context. There are no hooks and no
``torch._dynamo.disable``: Dynamo traces all of this into the graph.
"""

from __future__ import annotations

import types
import warnings
import weakref
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor

from fsdp_compile import _eager
from fsdp_compile._fsdp2_state_view import fsdp2_state_view, register_fsdp2_state_view
from fsdp_compile._fsdp2_tuning import FSDP2TuningMethods
from fsdp_compile._fsdp_init import (
    _SHARDED_AS,
    FSDP2AssertionError,
    _as_module_list,
    _check_param_types,
    _check_same_params_on_all_ranks,
    _collect_owned_params,
    _default_mesh,
    _reject_unsupported_options,
    _resolve_reshard_size,
    _unit_name,
    _validate_mesh,
    check_one_mesh_per_group,
)
from fsdp_compile._fsdp_param import FSDPParam, ParamState
from fsdp_compile._fsdp_state import (
    FRAME_NAMING,
    NESTED_NAMING,
    FSDPUnit,
    ShardDevices,
    compute_device,
    forward_context,
)
from fsdp_compile._local_shard_optimizer import install_default_local_step
from fsdp_compile._mixed_precision import cast_inputs, cast_output
from fsdp_compile._spmd_types import outside_type_checker, type_checker
from fsdp_compile._tensor_parallel import data_parallel_sub_mesh
from fsdp_compile.base.compat import (
    allow_side_effects,
    in_backward_recompute,
    is_compiled_module,
    never_a_frame_of_its_own,
    units_entered_in_this_trace,
)
from fsdp_compile.base.execution_mode import ExecutionMode, execution_mode
from fsdp_compile.passes.registration import install_passes
from fsdp_compile.runtime.process_groups import DataParallelMesh


@torch.compiler.disable  # raised in eager code: Dynamo does not trace it
def _refuse_parameters_on_meta(unit: FSDPUnit) -> None:
    fqns = [p.fqn for p in unit.params_on_meta]
    raise RuntimeError(
        f"fully_shard: {type(unit.modules[0]).__name__} {unit.fqn or '(the root)'!r} has parameters on the meta device: "
        f"{', '.join(map(repr, fqns))}. Materialize them before the first forward, as with FSDP2: "
        "model.to_empty(device=...), then initialize them (reset_parameters() on each module, or load a checkpoint). "
        f"(FSDP2: FSDP parameters should be materialized from meta device before training, but the following were "
        f"still on meta device: {fqns})"
    )


class FSDPModule(FSDP2TuningMethods, TorchFSDPModule):
    """Mixin of every module passed to :func:`fully_shard` (class ``FSDP<Orig>``).

    ``isinstance(m, FSDPModule)`` tells sharded units apart, as with FSDP2. It subclasses
    torch's ``torch.distributed.fsdp.FSDPModule``, so the checks other stacks make
    (torchtitan, accelerate, ``transformers.Trainer``, pipelining) see our units too and
    call our methods: every public method of torch's class is overridden here (a test
    holds that), and FSDP2's internal state (``_get_fsdp_state``) is a view of the unit that
    gives torch's own code what it reads of it and refuses the rest by name.
    As FSDP2's, constructing the class again (``Sequential[0:2]``) builds the original
    class (torch's ``__new__``, with this class's ``_orig_cls_mro_index``).
    """

    _fsdp_unit: FSDPUnit

    def __deepcopy__(self, memo):
        raise AssertionError(
            f"FSDP does not support deepcopy ({type(self).__name__} is sharded by fsdp_compile.fully_shard). Please use "
            "state dict for serialization, or deep-copy the model before sharding it."
        )

    @never_a_frame_of_its_own
    def forward(self, *args, **kwargs):
        if self._fsdp_unit.params_on_meta:
            _refuse_parameters_on_meta(self._fsdp_unit)
        # The outermost unit called from a compiled call's eager code (the frame
        # torch.compile was given, or Dynamo gave up on the frame above it) runs the
        # compiled path, which Dynamo then compiles as a frame of its own.
        # Activation checkpointing's recompute (in backward, outside the units around
        # the forward) takes the path its forward took: it must save the same tensors.
        mode = execution_mode()
        if mode is ExecutionMode.TRACED:
            return self._forward_compiled(*args, **kwargs)
        if mode is ExecutionMode.BETWEEN_GRAPHS:
            unit = self._fsdp_unit
            if in_backward_recompute() and unit.compiled_path_between_graphs is not None:
                compiled = unit.compiled_path_between_graphs
            else:
                compiled = forward_context.depth == 0
                unit.compiled_path_between_graphs = compiled
            if compiled:
                return self._forward_compiled(*args, **kwargs)
        return self._forward_eager(mode, *args, **kwargs)

    def _forward_compiled(self, *args, **kwargs):
        """The traced forward: straight-line code, no ``try`` or ``with`` around the
        user's forward, and no collective before it. A graph break inside the user's
        forward then splits the step where it splits the unsharded model (Dynamo
        cannot resume inside a ``try`` block; it would skip this frame and compile
        every call below it as a graph of its own), and the part of this frame
        before the call holds no op (but the inputs' mixed-precision cast), so it is
        no graph of its own. Parameters are gathered where they are first read. The
        context's Python state changes are allowed inside activation-checkpointing
        regions (they are not replayed by a compiled backward, which never runs Python)."""
        unit = self._fsdp_unit
        policy = unit.mp_policy
        args, kwargs = cast_inputs(policy, args, kwargs)
        mode = execution_mode()
        naming = _naming_in_graph(unit) if mode is ExecutionMode.TRACED else None
        renamed = naming is not None
        if renamed:
            allow_side_effects(setattr, unit, "traced_naming", naming)
        if mode is ExecutionMode.TRACED:
            self.__dict__["_fsdp_refuse_stand_ins_when_traced"]()
        allow_side_effects(forward_context.enter, mode, naming)
        output = super().forward(*args, **kwargs)
        allow_side_effects(forward_context.exit)
        if renamed:
            allow_side_effects(setattr, unit, "traced_naming", None)
        return cast_output(policy, output)

    @never_a_frame_of_its_own
    def _forward_eager(self, mode: ExecutionMode, *args, **kwargs):
        """Plain eager, or eager code inside a compiled call (see ``fsdp_compile._eager``)."""
        args, kwargs, reshard_hooks = _eager.pre_forward(self._fsdp_unit, mode, args, kwargs)
        try:
            if reshard_hooks is None:
                output = super().forward(*args, **kwargs)
            else:
                with reshard_hooks:
                    output = super().forward(*args, **kwargs)
        finally:
            with outside_type_checker():
                _eager.post_forward(self._fsdp_unit)
        with outside_type_checker():
            _eager.zero_unused_gradients_after_backward(self._fsdp_unit, output)
        return _eager.cast_output_outside_dynamo(self._fsdp_unit.mp_policy, output)

    def _get_fsdp_state(self):
        """Not FSDP2's state: a view of this unit with what torch's own code reads of it
        (pipelining, ``register_fsdp_forward_method``, ``share_comm_ctx``); any other
        attribute raises, naming this module (``fsdp_compile._fsdp2_state_view``)."""
        if not isinstance(self, FSDPModule):
            raise RuntimeError(f"{type(self).__name__} is not sharded: it has no FSDP state")
        return fsdp2_state_view(self)

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """FSDP2's private switch for async all-gathers on its streams; accepted, changes nothing
        (no side streams here: compiled graphs and eager code issue collectives in program order)."""

    def _apply(self, fn, *args, **kwargs):
        # ``to_empty``, ``.to(...)``, ``.float()``: new local tensors for the sharded
        # parameters; the views the gathers read follow (see [Note: plain graph inputs]).
        # torch swaps a DTensor parameter's contents with a new one's (``swap_tensors``),
        # its ``__dict__`` too: what we keep there (the optimizer hook's reference to the
        # FSDPParam, the gradient hooks) is put back.
        kept = _attributes_of_sharded_params(self)
        result = super(TorchFSDPModule, self)._apply(fn, *args, **kwargs)  # (torch's reaches for FSDP2's state)
        _restore_attributes_of_sharded_params(kept)
        return result

    def unshard(self, async_op: bool = False) -> "UnshardHandle | None":
        """Gather this unit's parameters and keep them gathered until :meth:`reshard` or an
        optimizer step over them (e.g. for generation outside the compiled training step;
        FSDP2 reshards them in backward: either way the next read after the step gathers the
        stepped values). While held,
        reading a parameter anywhere returns the full tensor and forwards gather
        nothing; a grad-enabled forward reads them with autograd, so backward reduces
        their gradients as FSDP2's (one forward/backward per chunk of a loss, 1F1B
        micro-batches). They stay gathered after forward whatever
        ``reshard_after_forward`` says (FSDP2 reshards after that forward and gathers
        again in backward): same numbers, no second all-gather. A collective: every
        rank must call it."""
        for fsdp_param in self._fsdp_unit.params:
            fsdp_param.hold()
        return UnshardHandle() if async_op else None

    def reshard(self) -> None:
        """Free the parameters gathered by :meth:`unshard`, or kept since a forward
        (``reshard_after_forward=False``; what autograd saved stays)."""
        for fsdp_param in self._fsdp_unit.params:
            fsdp_param.release()
        _eager.forget_kept(self._fsdp_unit)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Gradient accumulation without communication, as FSDP2's.

        ``False``: backward passes reduce nothing; each parameter's unsharded
        gradient accumulates locally. The next backward with ``True``
        reduce-scatters everything accumulated. Under ``torch.compile`` the two
        modes are separate graphs (compiled once each), not a recompile per step.
        As FSDP2's, it sets :meth:`set_requires_all_reduce` to the same value.
        """
        for unit in units_in(self, recurse):
            unit.requires_gradient_sync = unit.requires_all_reduce = requires_gradient_sync
            if not requires_gradient_sync:
                for fsdp_param in unit.params:
                    fsdp_param.prepare_gradient_accumulation()

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` (compiled graphs holding these units recompile)."""
        if not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(f"set_reshard_after_forward({reshard_after_forward!r}): only True/False are supported")
        for unit in units_in(self, recurse):
            unit.update(reshard_after_forward=reshard_after_forward, reshard_to=None)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False``: parameters stay gathered after backward, and the next forward reads
        them without an all-gather (FSDP2's; between gradient-accumulation micro-batches,
        trading memory for communication). The next forward after ``True`` is set again
        still reads them, then frees them. An optimizer step over them drops them (the
        next forward gathers the stepped values; FSDP2 would compute with the old ones):
        set ``True`` for the last micro-batch before stepping, as with FSDP2.

        Kept parameters live from the forward that gathered them (so units that reshard
        after forward do not re-gather in backward). Under ``torch.compile`` each mode
        (gathering or reading kept parameters; keeping or not) is a graph of its own,
        compiled once."""
        if not isinstance(reshard_after_backward, bool):
            raise TypeError(f"set_reshard_after_backward({reshard_after_backward!r}): pass True or False")
        for unit in units_in(self, recurse):
            unit.update(reshard_after_backward=reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Issue the all-gathers of ``modules`` when this unit's forward starts (FSDP2's
        explicit forward prefetch), instead of the default one-unit-ahead prefetch;
        a later call replaces the list (``[]``: back to the default).

        Compiled graphs: a hint to the reordering pass; each listed unit's all-gather
        is issued right before this unit's all-gather is waited on, so it overlaps
        this unit's forward. It overrides ``prefetch_depth`` and ``max_inflight_bytes``
        for those units and is ignored (logged) where the listed unit's all-gather
        comes before this unit's. Changing hints recompiles graphs holding these units.
        Eager runs (``config.eager_overlap``): the listed units' all-gathers are issued
        once this unit is gathered, in the order given.
        """
        self._set_prefetches("forward", self._prefetch_targets("set_modules_to_forward_prefetch", modules))

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Issue the backward all-gathers (re-gathers after ``reshard_after_forward``) of
        ``modules`` when this unit's backward starts (eager: when it re-gathers), instead
        of the default one-unit-ahead prefetch; see :meth:`set_modules_to_forward_prefetch`."""
        self._set_prefetches("backward", self._prefetch_targets("set_modules_to_backward_prefetch", modules))

    def _set_prefetches(self, direction: str, units: list[FSDPUnit]) -> None:
        me, by = self._fsdp_unit, f"{direction}_prefetched_by"
        for unit in getattr(me, f"{direction}_prefetches"):
            if getattr(unit, by) is me:
                unit.update(**{by: None})
        setattr(me, f"{direction}_prefetches", units)
        for unit in units:
            unit.update(**{by: me})

    def _prefetch_targets(self, method: str, modules) -> list[FSDPUnit]:
        units = []
        for m in modules:
            if not isinstance(m, FSDPModule):
                raise ValueError(
                    f"{method}: {type(m).__name__} is not a sharded module; pass modules that fully_shard was applied to"
                )
            if m._fsdp_unit is self._fsdp_unit:
                raise ValueError(f"{method}: a unit cannot prefetch itself ({type(m).__name__})")
            units.append(m._fsdp_unit)
        return units

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide gradients by ``factor`` instead of averaging over the data-parallel
        group, with FSDP2's arithmetic (float32 / bfloat16: a sum of gradients
        pre-multiplied by ``1 / factor``; float16 or ``set_force_sum_reduction_for_comms``:
        a sum, divided before and after: :func:`fsdp_compile.runtime.collectives.gradient_reduction`)."""
        if factor <= 0:
            raise ValueError(f"set_gradient_divide_factor({factor}): the factor must be positive")
        for unit in units_in(self, recurse=False):
            unit.update(gradient_divide_factor=float(factor))

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None] | None, *, stream=None) -> None:
        """FSDP2's: call ``hook(reduce_output)`` on this unit's reduced gradients after the
        reduce-scatter (native HSDP: after the all-reduce over the replicate dimension),
        before the division by the group size and the cast to the parameters' dtype.
        ``reduce_output`` is a flat tensor in the reduce dtype that the hook changes in
        place: e.g. ``dist.all_reduce`` over the replicas of a 1-D FSDP group (torchft's
        pattern). Eager: once per bucket (one per dtype, as FSDP2's per unit); compiled:
        once per parameter, on its reduced shard, inside the graph as an opaque call, so a
        hook that is not elementwise (a norm of the whole unit) sees a different split.
        ``stream``: an accelerator stream to run it on; with native HSDP it raises
        ``ValueError``, as FSDP2. ``None`` removes the hook."""
        from fsdp_compile.runtime.collectives import PostReduceHook

        units = list(units_in(self, recurse=False))
        if any(p.dp_mesh is not unit.dp_mesh for unit in units for p in unit.params):
            raise ValueError(
                f"set_all_reduce_hook on {type(self).__name__}: not supported with multiple param groups (from "
                "per-param mesh via shard_placement_fn), as FSDP2: the hook would be ambiguous across groups with "
                "different meshes"
            )
        if stream is not None and any(unit.dp_mesh.replicate_dim is not None for unit in units):
            raise ValueError("stream cannot be set when using native HSDP")
        if hook is not None and not callable(hook):
            raise TypeError(f"set_all_reduce_hook on {type(self).__name__}: the hook must be callable, got {type(hook).__name__}")
        for unit in units:
            unit.update(all_reduce_hook=None if hook is None else PostReduceHook.of(hook, stream))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in FSDP2 too: use :meth:`set_gradient_divide_factor`."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated, use set_gradient_divide_factor instead",
            FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Include zero gradients for parameters that got none in backward, as FSDP2's.

        Needed when ranks use different parameters of a unit (experts that run only
        on the tokens routed to them, a branch on the data): with ``False`` (the
        default, as FSDP2) a parameter without a gradient is left out of the unit's
        reduce-scatter and keeps ``.grad`` ``None``, as in an unsharded model, so
        ranks that disagree issue different collectives. Each rank must still use some
        parameter of the unit's bucket (the router, another expert): a bucket no
        parameter of which got a gradient on a rank is not reduced there. Eager: after a
        synced backward through the unit's forward, an unused parameter has a zero
        gradient, as FSDP2's (an optimizer with momentum or weight decay then steps it),
        on a shard group of one rank too. A compiled step runs the same graph on every
        rank (checked on its first run), so a parameter is unused on every rank or on
        none; there it keeps ``.grad`` ``None`` (FSDP2: zeros)."""
        for unit in units_in(self, recurse):
            unit.reduce_scatter_unused_params = bool(reduce_scatter_unused_params)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP gradient accumulation with reduce-scatters but no all-reduce, as FSDP2's.

        ``False``: backward passes reduce-scatter each gradient over the shard dimension
        but do not all-reduce it over the replicate dimension; the local shard's
        reduce-scattered gradient accumulates (not in ``.grad``). The next backward with
        ``True`` adds it before all-reducing, and ``.grad`` gets the sum over every
        micro-batch. Costs a shard-sized buffer, unlike :meth:`set_requires_gradient_sync`
        (``False``), which keeps the unsharded gradient and communicates nothing. Units
        with nothing to all-reduce (1-D meshes) change nothing, as FSDP2's. Under
        ``torch.compile`` the modes are separate graphs (compiled once each)."""
        for unit in units_in(self, recurse):
            unit.requires_all_reduce = bool(requires_all_reduce)
            if not requires_all_reduce:
                for fsdp_param in unit.params:
                    if fsdp_param.reduce_group_names:
                        fsdp_param.prepare_partial_reduction()

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: wait on and drop whatever it
        left in flight (eager reduce-scatters, prefetched all-gathers and re-gathers), as
        FSDP2's. Their gradients are lost; restart a gradient-accumulation sequence. Call
        it on the root unit (the module the last ``fully_shard`` call was applied to).
        (The next eager forward does the same by itself.)"""
        if not self._fsdp_unit.is_root:
            raise RuntimeError(f"reset_iter_state: call it on the root sharded module, not on {type(self).__name__}")
        self._fsdp_unit.eager.reset()


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``; the gather has already completed."""

    def wait(self) -> None:
        return None


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """FSDP2's ``share_comm_ctx`` (one set of CUDA streams for several roots, e.g. pipeline
    stages): accepted for the same modules and changes nothing, as no side streams are
    used here (compiled graphs and eager code issue collectives in program order)."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"share_comm_ctx expects modules passed to fully_shard, got {type(module).__name__}")


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (e.g. ``generate``) read parameters gathered, like ``forward``.

    ``module`` must have been passed to :func:`fully_shard`.
    """
    if not isinstance(module, FSDPModule):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} is not sharded; call fully_shard first")
    method = getattr(type(module), method_name, None)
    if method is None:
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")

    def sharded_method(self, *args, **kwargs):
        forward_context.enter(execution_mode())
        try:
            return method(self, *args, **kwargs)
        finally:
            forward_context.exit()

    setattr(module, method_name, sharded_method.__get__(module))


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn=None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims=None,
):
    """Shard ``module``'s parameters over ``mesh`` along dim 0, as FSDP2's ``fully_shard``.

    Call it on each block, then on the root: each call makes one sharding unit
    that owns the parameters in its subtree not owned by an earlier call.
    The module's class becomes ``FSDP<Orig>``; it is returned for chaining.

    Every check that can fail runs before the only collectives this issues
    (a small cross-rank comparison of parameter names, shapes and dtypes,
    which then fails on every rank alike), so bad input never leaves some
    ranks waiting in a collective that others never join.

    Args:
        module: the module, or a list of modules forming one unit.
        mesh: a 1-D ``DeviceMesh`` (FSDP), or a 2-D one with
            ``mesh_dim_names`` whose dims are (replicate, shard) (HSDP: shard
            over dim 1, all-reduce gradients over dim 0); defaults to all ranks
            of the default process group on the parameters' device type.
        shard_placement_fn: ``parameter -> Shard(dim) | None`` as FSDP2's: shard that
            parameter along ``dim`` instead of dim 0 (``None``: dim 0); uneven
            splits are padded like dim 0's.
        reshard_after_forward: ``True`` frees gathered parameters after
            forward (re-gathered in backward); ``False`` keeps them; ``None``
            means ``True`` except for the root unit; an int ``n`` (dividing the
            shard group's size) keeps a shard over groups of ``n`` consecutive
            ranks after forward and re-gathers over those groups in backward
            (FSDP2's; e.g. the ranks of one node). Not with tensor parallelism.
        mp_policy: mixed precision as FSDP2's: parameters gathered in
            ``param_dtype``, gradients reduced in ``reduce_dtype``, floating
            forward inputs cast to ``param_dtype`` (``cast_forward_inputs``) and
            outputs to ``output_dtype``; sharded parameters and gradients keep
            their own dtype.
        offload_policy: ``CPUOffloadPolicy()`` keeps sharded parameters,
            gradients (and so optimizer state) on the CPU and copies each shard
            to the mesh's device right before its all-gather.
        ignored_params: parameters left unsharded and unmanaged.
        dp_mesh_dims: FSDP2's SPMD mesh (``DataParallelMeshDims(shard="dp", replicate=None)``):
            ``mesh`` is the full mesh, every parameter is a ``DTensor`` on it with
            ``Replicate()`` on the named dims, modules compute on ``DTensor``s of it, and
            FSDP shards over ``shard`` (all-reducing over ``replicate``, HSDP); several
            dims of either are flattened into one, as FSDP2 does (e.g. ``("dp_shard", "cp")``).
    """
    spmd = None
    if dp_mesh_dims is not None:
        mesh, spmd = _spmd_sub_mesh(module, mesh, dp_mesh_dims, reshard_after_forward)
    options = (reshard_after_forward, shard_placement_fn, mp_policy, offload_policy, ignored_params)
    return _shard_as_one_unit(module, mesh, *options, shard=True, spmd=spmd)


def _spmd_sub_mesh(module, mesh, dp_mesh_dims, reshard_after_forward):
    """The data-parallel mesh ``dp_mesh_dims`` names in ``mesh`` and the SPMD layout, after
    FSDP2's refusal of an int ``reshard_after_forward`` there (before any collective)."""
    name = _unit_name(_as_module_list(module))
    if type(reshard_after_forward) is int:
        raise NotImplementedError(
            f"fully_shard({name}): reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims); "
            "pass True or False"
        )
    return data_parallel_sub_mesh(mesh, dp_mesh_dims, name)


def _fsdp2_state(module: nn.Module):
    """``fully_shard.state(module)``, as torch's ``fully_shard`` (a composable API) has it:
    the unit's view of FSDP2's state (``fsdp_compile._fsdp2_state_view``), ``None`` for a
    module ``fully_shard`` was not applied to. torch 2.13's pipelining calls it on the
    ``fully_shard`` it imported, which is ours when a stack's switch ran first."""
    return fsdp2_state_view(module) if isinstance(module, FSDPModule) else None


fully_shard.state = _fsdp2_state


def replicate(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
):
    """Replicate ``module``'s parameters over a 1-D ``mesh`` (DDP), as torch's
    ``torch.distributed._composable.replicate_with_fsdp.replicate``.

    Every rank keeps the whole parameter (a ``Replicate()`` DTensor); backward
    all-reduces (averages) each gradient, traced into the compiled graph like
    our all-gathers. Mixed precision, offload and gradient accumulation work
    as with :func:`fully_shard`. The module's class becomes ``FSDP<Orig>``.
    """
    return _shard_as_one_unit(module, mesh, False, None, mp_policy, offload_policy, ignored_params, shard=False)


def _shard_as_one_unit(
    module, mesh, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy, ignored_params, *, shard, spmd=None
):
    # Our passes join torch.compile's pipeline when the first module is sharded, not at import;
    # again at every call: torch._dynamo.reset() forgets part of it (see install_passes).
    install_passes()
    install_default_local_step()
    modules = _as_module_list(module, "fully_shard" if shard else "replicate")
    _reject_unsupported_options(mesh, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy)
    for m in modules:
        if isinstance(m, FSDPModule):
            raise FSDP2AssertionError(
                f"fully_shard was already applied to this {type(m).__name__}; apply it once per module. (FSDP2: Each "
                "distinct composable distributed API can only be applied to a module once.)"
            )
    if not dist.is_initialized() and mesh is None:
        raise RuntimeError(
            "fully_shard needs torch.distributed: call torch.distributed.init_process_group() first (or pass mesh=)"
        )
    mesh = mesh if mesh is not None else _default_mesh(modules)
    _validate_mesh(mesh, modules, offload_policy, shard)

    unit = FSDPUnit(
        modules=modules,
        mesh=mesh,
        dp_mesh=DataParallelMesh(mesh, shard=shard, spmd=spmd),
        devices=ShardDevices(
            compute_device(mesh),
            offload_to_cpu=isinstance(offload_policy, CPUOffloadPolicy),
            pin_memory=getattr(offload_policy, "pin_memory", False),
        ),
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        eager=_eager.EagerState(),
    )
    owned, placements = _collect_owned_params(modules, ignored_params or set(), unit, shard_placement_fn)
    check_one_mesh_per_group(placements, unit, _unit_name(modules))
    unit.update(reshard_after_forward=_resolve_reshard_size(reshard_after_forward, unit.dp_mesh, owned, _unit_name(modules)))
    _check_param_types(owned, placements, unit)
    _check_same_params_on_all_ranks(owned, mesh, _unit_name(modules))

    # -- nothing below may fail on one rank only --
    if type(unit.reshard_after_forward) is int:
        unit.update(reshard_to=unit.dp_mesh.post_forward_group(unit.reshard_after_forward))
    _install_params(unit, owned, placements)
    for m in modules:
        _make_unit(m, unit)
    return module


def _install_params(unit: FSDPUnit, owned: list, placements: list) -> None:
    """Register a sharded parameter for each of ``owned`` in its module: a new
    :class:`FSDPParam` of ``unit``, or the existing one of a parameter another unit (or
    another module of this one) already shards."""
    by_original: dict[int, FSDPParam] = {}
    for (owner, name, param, fqn, module_index), (shard_dim, own_mesh) in zip(owned, placements, strict=True):
        fsdp_param = getattr(param, _SHARDED_AS, None)
        if fsdp_param is None:
            fsdp_param = by_original.get(id(param))
        if fsdp_param is None:
            fsdp_param = FSDPParam(param, fqn, unit, module_index, shard_dim, own_mesh)
            by_original[id(param)] = fsdp_param
            unit.params.append(fsdp_param)
            setattr(param, _SHARDED_AS, fsdp_param)
        _install_managed_param(owner, name, fsdp_param)


def _make_unit(module: nn.Module, unit: FSDPUnit) -> None:
    """Turn ``module`` into an ``FSDP<Orig>`` of ``unit``."""
    if is_compiled_module(module) and "forward" in module.__dict__:
        # torch.compile(block) before fully_shard (torchtitan's order): the compiled call
        # is an instance attribute that would hide our forward; ours calls it instead.
        # (Into __dict__: an OptimizedModule forwards attribute writes to _orig_mod.)
        module.__dict__["_fsdp_compiled_forward"] = module.__dict__.pop("forward")
    _swap_class(module, is_unit=True)
    module._fsdp_unit = unit
    module.__dict__["_fsdp_refuse_stand_ins_when_traced"] = _stand_in_refusal(unit)
    register_fsdp2_state_view(module, unit)  # fully_shard.state(m) and m._get_fsdp_state(), for torch's code
    # load_state_dict swaps the parameters' contents too where torch.__future__'s
    # swap_module_params_on_conversion is on (as Module._apply always does for DTensors).
    module.register_load_state_dict_pre_hook(_before_loading_state_dict)
    module.register_load_state_dict_post_hook(_after_loading_state_dict)
    _adopt_nested_units(module, unit)


def _attributes_of_sharded_params(module: nn.Module) -> list[tuple[FSDPParam, dict]]:
    """What each sharded parameter of ``module``'s unit carries (our references and hooks),
    before something that may swap its contents (``swap_tensors`` swaps ``__dict__`` too)."""
    return [(fsdp_param, dict(vars(fsdp_param.sharded_param))) for fsdp_param in module._fsdp_unit.params]


def _restore_attributes_of_sharded_params(kept: list[tuple[FSDPParam, dict]]) -> None:
    for fsdp_param, attributes in kept:
        fsdp_param.after_swap(attributes)


def _before_loading_state_dict(module: nn.Module, *args) -> None:
    module.__dict__["_fsdp_attributes_before_load"] = _attributes_of_sharded_params(module)


def _after_loading_state_dict(module: nn.Module, incompatible_keys) -> None:
    _restore_attributes_of_sharded_params(module.__dict__.pop("_fsdp_attributes_before_load", []))


def _adopt_nested_units(module: nn.Module, unit: FSDPUnit) -> None:
    """The units already sharded inside ``module`` (now part of ``unit``) are no longer
    roots: they are named from ``module`` and share ``unit``'s eager state."""
    for prefix, sub in module.named_modules():
        if isinstance(sub, FSDPModule) and sub is not module:
            if sub._fsdp_unit.name_in_parent is None and sub is sub._fsdp_unit.modules[0]:
                sub._fsdp_unit.update(name_in_parent=prefix)  # the first (nearest) unit enclosing it
            sub._fsdp_unit.update(is_root=False)
            sub._fsdp_unit.eager = unit.eager  # one eager state per root
            sub._fsdp_unit.set_module_fqn(sub, prefix)


# ------------------------------------------------------------- class swapping

_CLASS_CACHE: dict[tuple, type] = {}


def _install_managed_param(owner: nn.Module, name: str, fsdp_param: FSDPParam) -> None:
    """Register the sharded parameter under ``name`` and route reads through a property."""
    owner._parameters[name] = fsdp_param.sharded_param
    fsdp_param.registrations.append((owner, name))
    if fsdp_param.owner is None:
        fsdp_param.owner = (owner, name)
    if "_fsdp_params" not in owner.__dict__:
        owner.__dict__["_fsdp_params"] = {}
    owner.__dict__["_fsdp_params"][name] = fsdp_param
    _swap_class(owner, is_unit=isinstance(owner, FSDPModule))


@never_a_frame_of_its_own
def _naming_in_graph(unit: FSDPUnit) -> str | int | None:
    """How ``unit``'s collectives are named in the graph Dynamo is tracing (its
    ``FSDPUnit.traced_naming``); call it only while tracing.

    Units that no unit of ours encloses in the graph are named by their place in it: the
    first, unless it is the root, relative to itself (a block compiled on its own: every
    such block then traces the same graph, which Dynamo compiles once, as for the
    unsharded blocks); later root units (whose parent was not sharded, all named "") by
    their order. A unit directly inside a block named relative to itself is named
    relative to that block. Reads only values equal across identical blocks (flags, the
    running forwards' namings; the trace's own count is a constant), so it adds no guard
    that tells blocks apart."""
    if not forward_context.traced_in_this_graph():  # none encloses it in the graph
        order = units_entered_in_this_trace()
        if order == 0 and not unit.is_root:
            return FRAME_NAMING
        if order > 0 and unit.is_root:
            return order
        return None
    if forward_context.frame_namings[-1] == FRAME_NAMING and unit.name_in_parent is not None:
        return NESTED_NAMING
    return None


class _CompiledModuleForward:
    """The ``forward`` under ``FSDPModule``'s in a sharded ``torch.compile(module)`` result
    (an ``OptimizedModule``): its compiled call, taken from the instance where
    ``torch.compile`` put it. Our forward gathers the unit around it, eagerly, as
    FSDP2's hooks do; the compiled block then reads gathered tensors, so every block
    runs the same graph."""

    def forward(self, *args, **kwargs):
        return self.__dict__["_fsdp_compiled_forward"](*args, **kwargs)


def _swap_class(module: nn.Module, *, is_unit: bool) -> None:
    cls = type(module)
    orig = getattr(cls, "_fsdp_orig_class", cls)
    names = tuple(sorted(module.__dict__.get("_fsdp_params", {})))
    key = (orig, is_unit, names, "_fsdp_compiled_forward" in module.__dict__)
    new_cls = _CLASS_CACHE.get(key)
    if new_cls is None:
        attrs = {name: _managed_param_property(name) for name in names}
        attrs["_fsdp_orig_class"] = orig
        if names:
            attrs["register_parameter"] = _register_parameter_adopting(orig)
        attrs["__module__"] = orig.__module__
        if is_unit:
            attrs["_forward_compiled"] = _own_code_copy(FSDPModule._forward_compiled, orig.__name__)
            runs_compiled = "_fsdp_compiled_forward" in module.__dict__
            bases = (FSDPModule, _CompiledModuleForward, orig) if runs_compiled else (FSDPModule, orig)
            new_cls = type(f"FSDP{orig.__name__}", bases, attrs)
            new_cls._orig_cls_mro_index = new_cls.__mro__.index(orig)  # for torch's FSDPModule.__new__
        else:
            # Non-unit owners keep their name so that printing the model looks as before.
            new_cls = type(orig.__name__, (orig,), attrs)
        _CLASS_CACHE[key] = new_cls
    module.__class__ = new_cls


def _register_parameter_adopting(orig: type):
    """``register_parameter`` of a module holding managed parameters: a parameter assigned
    to a managed name (``module.weight = nn.Parameter(...)``, ``load_state_dict(sd,
    assign=True)``, both of which register through it) becomes the sharded parameter
    (:meth:`FSDPParam.adopt`), as FSDP2's lazy init makes it; other names as before."""

    def register_parameter(self, name: str, param) -> None:
        fsdp_param = self.__dict__.get("_fsdp_params", {}).get(name)
        if fsdp_param is None or param is None:
            return orig.register_parameter(self, name, param)
        if param is not fsdp_param.sharded_param:
            fsdp_param.adopt(param)

    return register_parameter


def _own_code_copy(fn, suffix: str):
    """``fn`` with a code object of its own. Dynamo keeps per-code state for the whole
    process (a frame it gave up on is skipped from then on); a copy per sharded class
    keeps that state per model class, as it is for the unsharded model's ``forward``."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{suffix}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__doc__, copy.__qualname__ = fn.__doc__, f"{fn.__qualname__}_{suffix}"
    return copy


def _managed_param_property(name: str) -> property:
    def read(self):
        if torch.compiler.is_compiling():
            return _read_traced(self, name)
        mode = execution_mode()
        if mode is ExecutionMode.BETWEEN_GRAPHS:
            return _read_managed_outside_dynamo(self, name, mode)
        if (spmd := type_checker()) is None:
            return _read_managed(self, name, mode)
        with spmd.no_typecheck():
            value = _read_managed(self, name, mode)
        typing = self._fsdp_params[name].spmd_typing
        return value if typing is None or isinstance(value, DTensor) else typing.annotate(value)

    read.__name__ = name
    never_a_frame_of_its_own(read)
    return property(read, doc=f"Sharded parameter {name!r}; the full tensor during a sharded forward.")


def _read_traced(module: nn.Module, name: str):
    """:func:`_read_managed` as Dynamo traces it: the first read of a trainable parameter
    in a traced sharded forward (the read every compile traces for every parameter) in
    few inlined calls (:meth:`FSDPParam.gather_traced`); every other read as before."""
    fsdp_param = module._fsdp_params[name]
    if fsdp_param.state is ParamState.SHARDED and forward_context.frames and fsdp_param.traced_read_needs_local_view_only:
        fsdp_param.follow_requires_grad_when_traced()
        if fsdp_param.local_view.requires_grad:  # see [Note: traced reads without the DTensor]
            return allow_side_effects(fsdp_param.gather_traced)
    return _read_managed(module, name, ExecutionMode.TRACED)


def _read_managed(module: nn.Module, name: str, mode: ExecutionMode):
    """A managed parameter's value: the full tensor inside a sharded forward (or while
    held by ``unshard()``), else the sharded ``nn.Parameter``.

    Code that runs a module on its parameters' local tensors swaps each ``DTensor``
    parameter in ``module._parameters`` for its ``to_local()`` around the module's forward
    (``transformers``' tensor-parallel MoE experts do). Under FSDP2 the registered
    parameter there is the unsharded one, so the module computes with the gathered
    parameter's local tensor; a read that finds the registered entry swapped for a plain
    tensor during a sharded forward returns just that. Only tensor-parallel parameters
    are swapped so: a traced read of any other trainable parameter reads neither the
    entry nor the ``DTensor`` (see ``_fsdp_param``'s [Note: traced reads without the
    DTensor])."""
    fsdp_param = module._fsdp_params[name]
    if mode is not ExecutionMode.TRACED and forward_context.frames:
        registered = module._parameters.get(name)
        if _replaces_the_sharded_param(fsdp_param, registered):
            return fsdp_param.gather_replacement(registered)
    state = fsdp_param.state
    if state is ParamState.HELD and mode is not ExecutionMode.TRACED:
        fsdp_param.drop_held_if_stale()
        state = fsdp_param.state
    if state is ParamState.GATHERED or (state is ParamState.HELD and not forward_context.frames):
        # Gathered already. Checked before computing with the sharded DTensor, so a
        # checkpointed region (a subgraph under compile) takes only this plain tensor.
        # (Held by unshard() and read in a sharded forward: gathered below, with autograd,
        # from the held tensor.)
        if mode is not ExecutionMode.TRACED and state is ParamState.GATHERED:
            _eager.note_read(fsdp_param)
        return _local_if_swapped(fsdp_param.gathered, module._parameters[name])
    if mode is ExecutionMode.TRACED and forward_context.frames and fsdp_param.traced_read_needs_local_view_only:
        fsdp_param.follow_requires_grad_when_traced()
        if fsdp_param.local_view.requires_grad:  # see [Note: traced reads without the DTensor]
            return allow_side_effects(fsdp_param.gather, None, mode)
    param = module._parameters[name]
    if not forward_context.frames:  # no sharded forward running
        if mode is not ExecutionMode.TRACED and in_backward_recompute():
            # Eager activation checkpointing inside a unit: backward re-runs the
            # checkpointed region outside the unit's forward; it needs the values only.
            return _eager.gather_for_recompute(fsdp_param)
        return param
    if param is not fsdp_param.sharded_param:
        # Swapped for its local tensor: gather from the sharded parameter itself.
        return _local_if_swapped(allow_side_effects(fsdp_param.gather, fsdp_param.sharded_param, mode), param)
    # Caching the gathered tensor is a side effect, allowed inside an activation-
    # checkpointing region (e.g. checkpoint(layer) around a sharded layer).
    return allow_side_effects(fsdp_param.gather, param, mode)


def _replaces_the_sharded_param(fsdp_param: FSDPParam, registered) -> bool:
    """Whether ``registered``, found in the module's ``_parameters`` where the sharded parameter
    was registered, during a sharded forward, is a stand-in the forward must compute with
    (``torch.func.functional_call`` and ``torch.nn.utils.stateless`` put one there): a
    ``DTensor`` laid out as the sharded parameter. ``False`` for no entry and for a tensor-parallel
    parameter's own local tensor (see :func:`_read_managed`); anything else raises,
    naming the parameter, rather than computing with the sharded parameter instead."""
    sharded = fsdp_param.sharded_param
    if registered is sharded:
        return False
    if isinstance(registered, DTensor):
        if (
            registered.shape == sharded.shape
            and registered.device_mesh == sharded.device_mesh
            and registered.placements == sharded.placements
        ):
            return True
        what = f"a DTensor of shape {tuple(registered.shape)} with placements {registered.placements} on {registered.device_mesh}"
    elif registered is None or (fsdp_param.tensor_parallel is not None and isinstance(registered, torch.Tensor)):
        return False  # no entry (read as before), or the tensor-parallel parameter's local tensor
    else:
        what = (
            f"a {type(registered).__name__} of shape {tuple(registered.shape)}"
            if isinstance(registered, torch.Tensor)
            else repr(registered)
        )
    raise NotImplementedError(
        f"fsdp_compile: parameter {fsdp_param.fqn!r} was replaced in its module's _parameters by {what} (e.g. by "
        "torch.func.functional_call) and read in a sharded forward. A stand-in must be laid out as the sharded "
        f"parameter: a DTensor of shape {tuple(sharded.shape)} with placements {sharded.placements} on its mesh (e.g. "
        "derived from the model's own parameters, as `p.detach() * 2`)"
    )


def _stand_in_refusal(unit: FSDPUnit):
    """A function, run by Dynamo once while it traces ``unit``'s forward (its result a
    constant: no guard, nothing in the graph), that raises if a parameter of the unit has a
    stand-in (:func:`_replaces_the_sharded_param`): a traced read gathers the sharded
    parameter without looking (see ``_fsdp_param``'s [Note: traced reads without the
    DTensor]). A stand-in put there after the graph was traced is not seen: eager code only."""
    ref = weakref.ref(unit)

    def refuse() -> bool:
        unit = ref()
        for fsdp_param in unit.params if unit is not None else ():
            for owner, name in fsdp_param.registrations:
                if _replaces_the_sharded_param(fsdp_param, owner._parameters.get(name)):
                    raise NotImplementedError(
                        f"fsdp_compile: parameter {fsdp_param.fqn!r} has a stand-in in its module's _parameters (e.g. "
                        "torch.func.functional_call) while torch.compile traces it; compiled sharded forwards read "
                        "the sharded parameter. Call the model without torch.compile there (eager forwards compute "
                        "with the stand-in)"
                    )
        return True

    return torch.compiler.assume_constant_result(refuse)


def _local_if_swapped(full: torch.Tensor, registered: torch.Tensor) -> torch.Tensor:
    """``full``, or its local tensor where the registered entry (the sharded ``DTensor``
    unless swapped) was swapped for a plain tensor (see :func:`_read_managed`)."""
    if isinstance(registered, DTensor):
        return full
    return full.to_local() if isinstance(full, DTensor) else full


# Reads from eager code between the graphs of a compiled step that broke run outside
# Dynamo: a gather there would otherwise be compiled as a graph of its own.
_read_managed_outside_dynamo = torch.compiler.disable(_read_managed)


def units_in(module: nn.Module, recurse: bool = True) -> list[FSDPUnit]:
    """The sharding units of ``module`` (and, with ``recurse``, of its subtree), each once."""
    units: list[FSDPUnit] = []
    for m in module.modules() if recurse else [module]:
        unit = getattr(m, "_fsdp_unit", None)
        if isinstance(m, FSDPModule) and unit is not None and all(u is not unit for u in units):
            units.append(unit)
    return units


def managed_params(module: nn.Module) -> Iterable[FSDPParam]:
    """The FSDPParams of every unit in ``module``'s subtree (each once)."""
    for unit in units_in(module):
        yield from unit.params
