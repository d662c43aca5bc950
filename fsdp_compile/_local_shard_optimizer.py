"""An optimizer step over local shards: the same update, without ``DTensor`` dispatch.

A sharded parameter is a ``DTensor``, and so are its gradient and the optimizer state
``torch.optim`` creates for it (``zeros_like(param)``). Every op of the update then goes
through ``DTensor``'s dispatch: sharding propagation, unwrapping and re-wrapping, a few
tens of microseconds an op. An elementwise update (Adam, SGD, ...) of a ``Shard`` or
``Replicate`` parameter is the same arithmetic on each rank's local tensor, so
:func:`step_on_local_shards` makes ``optimizer.step()`` run on the local tensors:

* before the step, each group whose parameters and gradients are all ``DTensor``s with
  ``Shard``/``Replicate`` placements (the same for parameter and gradient) gets, in
  place of each parameter, its local tensor, with the local gradient as ``.grad``; ``optimizer.state`` is keyed by those, its ``DTensor`` entries
  unwrapped to their local tensors (the same storage: in-place updates land in them);
* after the step (also when it raises), the parameters and the state come back: an
  entry the step created (the first step's ``exp_avg``, ...) is wrapped as a ``DTensor``
  with its parameter's mesh and placements, as ``zeros_like(param)`` would have made it.

Outside the update nothing changes: ``optimizer.state`` holds ``DTensor``s keyed by the
``DTensor`` parameters, so ``state_dict()``, ``load_state_dict()`` and DCP's
``get_optimizer_state_dict`` see what they would without it, and so do the step's pre and
post hooks (an optimizer with hooks swaps after its last pre hook and back before its
first post hook) and a closure passed to ``step`` (it runs between a swap back and a swap
again). The numbers are bitwise
those of the ``DTensor`` step: the same ops on the same local tensors.

Only optimizers whose update is elementwise per parameter are accepted (a norm, a
row/column statistic or an orthogonalization of a sharded tensor needs the whole
tensor): see :data:`ELEMENTWISE_OPTIMIZERS`.

It is the default for the optimizers users build on our parameters: the first
``fully_shard`` registers one global optimizer step pre-hook (:func:`install_default_local_step`)
that, at an optimizer's first step, applies :func:`step_on_local_shards` to it if it is
of one of those classes and steps a parameter of ours (``config.local_shard_optimizer_step``,
read then). That first step runs on the ``DTensor``s (a pre-hook could not undo its swap
if the step raised); every later one on the local tensors. Other optimizers, FSDP2's
parameters' among them, are left alone.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from fsdp_compile.base import compat
from fsdp_compile.base.compat import local_tensor_of

__all__ = ["step_on_local_shards", "ELEMENTWISE_OPTIMIZERS"]

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "NAdam", "RAdam", "RMSprop", "Rprop", "ASGD")
    if hasattr(torch.optim, name)
)
"""The ``torch.optim`` classes whose update of a parameter is elementwise (each element's
new value depends only on the same element of the parameter, its gradient and its state,
plus scalars), so that it gives the same result on each shard as on the whole tensor."""

_LOCAL_STEP_ATTRIBUTE = "_fsdp_compile_steps_on_local_shards"
#: Set on the optimizer by the default hook once it has decided for it: its parameters that are ours.
_DECIDED_ATTRIBUTE = "_fsdp_compile_local_step_decided"
#: Set on every sharded parameter ``fully_shard`` registers: its :class:`FSDPParamRef`.
SHARDED_PARAM_ATTRIBUTE = "_fsdp_compile_sharded_param"


class FSDPParamRef:
    """A weak reference to a sharded parameter's ``FSDPParam``, kept on the parameter.
    ``copy.deepcopy`` keeps it as it is and ``pickle`` makes it a dead one, so a parameter
    (a whole model) still copies and saves as before."""

    __slots__ = ("_ref", "__weakref__")

    def __init__(self, fsdp_param=None) -> None:
        self._ref = None if fsdp_param is None else weakref.ref(fsdp_param)

    def __call__(self):
        return None if self._ref is None else self._ref()

    def __deepcopy__(self, memo) -> FSDPParamRef:
        return self

    def __reduce__(self):
        return (FSDPParamRef, ())


_default_hook = None


def install_default_local_step() -> None:
    """Register (once, at the first ``fully_shard``, never at import) the global optimizer
    step pre-hook (:func:`_before_optimizer_step`)."""
    global _default_hook
    if _default_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _default_hook = register_optimizer_step_pre_hook(_before_optimizer_step)


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Before every step of every optimizer: at its first, decide whether it steps on
    local shards from its second on (see the module docstring), and note which of its
    parameters are ours; at each, drop the full tensors of ours that ``unshard()`` or
    ``set_reshard_after_backward(False)`` keep, which the step is about to make stale (the
    next read gathers the new values; FSDP2 reshards in backward, and a full tensor kept
    across the step computed silently with the old parameters)."""
    ours = optimizer.__dict__.get(_DECIDED_ATTRIBUTE)
    if ours is None:
        ours = optimizer.__dict__[_DECIDED_ATTRIBUTE] = _fsdp_params_of(optimizer)
        from fsdp_compile.base import config

        if config.local_shard_optimizer_step and ours and type(optimizer) in ELEMENTWISE_OPTIMIZERS:
            step_on_local_shards(optimizer)
    for ref in ours:
        fsdp_param = ref()
        if fsdp_param is not None and (fsdp_param.held is not None or fsdp_param.kept is not None):
            fsdp_param.release()
    return None


def _fsdp_params_of(optimizer: torch.optim.Optimizer) -> tuple:
    """Weak references to the ``FSDPParam`` of each of ``optimizer``'s parameters that is ours."""
    refs = (getattr(p, SHARDED_PARAM_ATTRIBUTE, None) for g in optimizer.param_groups for p in g["params"])
    return tuple(ref for ref in refs if ref is not None)


def step_on_local_shards(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` update sharded (``DTensor``) parameters through their
    local tensors, skipping ``DTensor`` dispatch for every op of the update; returns
    ``optimizer`` (changed in place; calling it again does nothing).

    The update is bitwise the one ``optimizer`` makes on the ``DTensor``s, and its state
    is kept as ``DTensor``s keyed by the parameters between steps (state dicts and DCP are
    unchanged). Works for any ``DTensor`` parameter with ``Shard``/``Replicate``
    placements (``fully_shard``'s, torch's FSDP2's, tensor parallel ones); a group with a
    plain, ``Partial`` or differentiable-optimizer parameter steps as before.

    Raises ``TypeError`` for an optimizer whose update is not elementwise (see
    :data:`ELEMENTWISE_OPTIMIZERS`): on a shard it would compute something else.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"step_on_local_shards: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        names = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
        raise TypeError(
            f"step_on_local_shards: {type(optimizer).__module__}.{type(optimizer).__qualname__} is not one of the "
            f"optimizers whose update is elementwise ({names}); on a shard its update could differ from the whole "
            "tensor's (a norm or a row statistic needs every element). Step it on the DTensors as it is."
        )
    if getattr(optimizer, _LOCAL_STEP_ATTRIBUTE, False):
        return optimizer
    # The bound method, or an LR scheduler's wrapper of it.
    optimizer.step = _StepOnLocalShards(optimizer, optimizer.step)
    setattr(optimizer, _LOCAL_STEP_ATTRIBUTE, True)
    return optimizer


class _StepOnLocalShards:
    """``optimizer.step`` around the step it replaced: the swap to local tensors before,
    the swap back after (also when it raises). An object, not a closure, so that
    ``copy.deepcopy(optimizer)`` steps the copy (the bound method is rebound) and
    ``pickle`` works.

    It keeps the contract torch's LR schedulers hold ``optimizer.step`` to: it carries the
    mark of a scheduler's wrapper it replaced (``_wrapped_by_lr_sched``: else every
    ``scheduler.step()`` warns that the step was overridden), and a scheduler made after it
    wraps it as it wraps a bound method (through ``__func__``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, step_on_dtensors) -> None:
        self.optimizer = optimizer
        self.step_on_dtensors = step_on_dtensors
        if getattr(step_on_dtensors, "_wrapped_by_lr_sched", False):
            self._wrapped_by_lr_sched = True

    def __call__(self, *args, **kwargs):
        swap = _Swap(self.optimizer)
        args, kwargs = swap.closure_on_dtensors(args, kwargs)
        if any(hook is not _before_optimizer_step for hook in compat.optimizer_step_hooks(self.optimizer)):
            # The swap after the optimizer's last pre hook, the swap back before its first
            # post hook: every hook sees what it would see without the local step (a hook
            # clipping ``optimizer.param_groups``' gradients gets the whole norm).
            last_pre_hook = self.optimizer.register_step_pre_hook(swap.to_local)
            first_post_hook = compat.register_first_step_post_hook(self.optimizer, swap.back)
        else:
            last_pre_hook = first_post_hook = None
            swap.to_local()
        try:
            return self.step_on_dtensors(*args, **kwargs)
        finally:
            if last_pre_hook is not None:
                last_pre_hook.remove()
                first_post_hook.remove()
            swap.back()  # if the step raised

    @property
    def __func__(self):
        """What a scheduler binds to the optimizer and calls: this step (the optimizer it
        binds is this object's own)."""
        step = self

        def bound_step(optimizer: torch.optim.Optimizer, *args, **kwargs):
            return step(*args, **kwargs)

        return bound_step


class _Swap:
    """One step's swap of ``optimizer``'s parameters (and state) to local tensors and back;
    each method also serves as a step hook (``(optimizer, args, kwargs) -> None``)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.swapped = None  # what _swap_to_local swapped (None: nothing could step locally)
        self.updating = False  # between to_local and back: the update runs on the local tensors

    def to_local(self, *_hook_args) -> None:
        self.updating = True
        self.swapped = _swap_to_local(self.optimizer)

    def back(self, *_hook_args) -> None:
        self.updating = False
        self._undo()

    def _undo(self) -> None:
        if self.swapped is not None:
            swapped, self.swapped = self.swapped, None
            _swap_back(self.optimizer, swapped)

    def closure_on_dtensors(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``step``'s arguments, its closure (if any) made to run on the ``DTensor``s: it
        zeroes gradients and runs the backward on the model's parameters, which the local
        tensors stand in for only during the update."""
        closure = args[0] if args else kwargs.get("closure")
        if closure is None:
            return args, kwargs

        def on_dtensors():
            self._undo()
            try:
                return closure()
            finally:
                if self.updating:  # (the gradients the closure made can step locally now)
                    self.swapped = _swap_to_local(self.optimizer)

        if args:
            return (on_dtensors, *args[1:]), kwargs
        return args, {**kwargs, "closure": on_dtensors}


def _local_placements(placements) -> bool:
    return all(isinstance(p, (Shard, Replicate)) for p in placements)


def _localizable(group: dict) -> bool:
    """Whether every parameter of ``group`` with a gradient is a ``DTensor`` that can step
    on its local tensor: ``Shard``/``Replicate`` placements, a ``DTensor`` gradient with the
    same placements whose local tensor can be the local tensor's ``.grad`` (same shape,
    dtype and device), and no differentiable optimizer (its graph needs the ``DTensor``s)."""
    if group.get("differentiable", False):
        return False
    any_dtensor = False
    for param in group["params"]:
        if not isinstance(param, DTensor):
            return False
        grad = param.grad
        if grad is None:
            continue
        if not isinstance(grad, DTensor) or grad.placements != param.placements or not _local_placements(param.placements):
            return False
        local, local_grad = local_tensor_of(param), local_tensor_of(grad)
        if local_grad.shape != local.shape or local_grad.dtype != local.dtype or local_grad.device != local.device:
            return False  # not a valid ``.grad`` of the local tensor
        any_dtensor = True
    return any_dtensor


class _Swapped:
    """What :func:`_swap_to_local` changed, for :func:`_swap_back`."""

    __slots__ = ("state", "params_of_group", "local_of")

    def __init__(self, state, params_of_group, local_of):
        self.state = state  # the optimizer's own state mapping
        self.params_of_group = params_of_group  # {group index: its original params list}
        self.local_of = local_of  # [(DTensor param, its local stand-in)]


def _swap_to_local(optimizer: torch.optim.Optimizer) -> _Swapped | None:
    """Put local stand-ins for the ``DTensor`` parameters of every localizable group into
    ``optimizer.param_groups`` and a state keyed by them into ``optimizer.state``; returns
    what to undo (``None`` when no group is localizable)."""
    params_of_group: dict[int, list] = {}
    local_of: list[tuple[DTensor, torch.Tensor]] = []
    for index, group in enumerate(optimizer.param_groups):
        if not _localizable(group):
            continue
        params = group["params"]
        stand_ins = []
        for param in params:
            # The local tensor itself (no op to make a stand-in); its ``.grad`` is set for the
            # step only and is ``None`` again after it.
            local = local_tensor_of(param)
            if param.grad is not None:
                local.grad = local_tensor_of(param.grad)
            stand_ins.append(local)
            local_of.append((param, local))
        params_of_group[index] = params
        group["params"] = stand_ins
    if not local_of:
        return None
    state = optimizer.state
    local_state: defaultdict = defaultdict(dict)
    managed = {id(param) for param, _ in local_of}
    for key, value in state.items():  # other parameters' state, the same dicts
        if id(key) not in managed:
            local_state[key] = value
    for param, local in local_of:
        if param in state:
            local_state[local] = {k: local_tensor_of(v) if isinstance(v, DTensor) else v for k, v in state[param].items()}
    optimizer.state = local_state
    return _Swapped(state, params_of_group, local_of)


def _swap_back(optimizer: torch.optim.Optimizer, swapped: _Swapped | None) -> None:
    """Undo :func:`_swap_to_local`: the original parameters, and their state with every
    entry the step added or replaced wrapped like its parameter."""
    if swapped is None:
        return
    local_state = optimizer.state
    state = swapped.state
    for index, params in swapped.params_of_group.items():
        optimizer.param_groups[index]["params"] = params
    for param, local in swapped.local_of:
        local.grad = None
        stepped = local_state.get(local)
        if stepped is None:
            continue
        entries = state[param]
        for key, value in stepped.items():
            before = entries.get(key)
            if isinstance(before, DTensor) and local_tensor_of(before) is value:
                continue
            if (
                isinstance(value, torch.Tensor)
                and not isinstance(value, DTensor)
                and value.shape == local.shape
                and value.dim() > 0
            ):
                value = DTensor.from_local(
                    value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
                )
            entries[key] = value
    stand_ins = {id(local) for _, local in swapped.local_of}
    for key, value in local_state.items():  # state the step added for other parameters
        if id(key) not in stand_ins:
            state[key] = value
    optimizer.state = state
