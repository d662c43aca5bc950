"""FSDP2's private state as torch's own code reads it, for our units.

Our units have no FSDP2 state (``FSDPState``); torch's code that takes any ``FSDPModule``
and then reads that state finds this view of the unit instead, as ``fully_shard.state(module)``
(torch's composable-API registry) and as ``module._get_fsdp_state()``:

- ``torch.distributed.pipelining``: a schedule runs every micro-batch's backward with
  gradient sync off (``set_requires_gradient_sync(False)``), then, at its ``REDUCE_GRAD``
  action (``_PipelineStageBase.perform_reduce_grad``), torch 2.13's turns sync back on and
  calls FSDP2's internal ``post_backward()`` on every parameter group of
  ``fully_shard.state(stage)``, then its root's ``_root_post_backward_final_callback()``
  (torch 2.15's calls the public ``finalize_backward()``; ours:
  :func:`finish_gradient_accumulation` on every unit). Here the "parameter group" reduces
  what the unit accumulated (:func:`reduce_accumulated`), and the final callback has
  nothing left to wait for (every reduction here finishes inside its backward). torch
  2.15's schedules also compare the stages' ``_comm_ctx`` by identity
  (``defer_reduce_grad_wait`` refuses stages that share one).
- ``torch.distributed.fsdp.register_fsdp_forward_method(module, name)`` wraps the method in
  the state's ``_pre_forward`` / ``_post_forward``: here the method runs as a sharded
  forward, as :func:`fsdp_compile.register_fsdp_forward_method` makes it run
  (``transformers.Trainer`` calls torch's, for ``generate``).
- ``torch.distributed.fsdp.share_comm_ctx(modules)`` hands the first state's ``_comm_ctx``
  to the others (there are no side streams here; the assignment is kept, as on FSDP2's).

- Code written against FSDP2 that inspects its state (upstream's tests; torchtitan's chunked
  loss asks whether the head is gathered): ``_is_root``, ``_state_ctx.all_states`` (one per
  unit) and, from every module of a unit, ``_fsdp_param_group`` (``None`` without
  parameters): ``_module_fqn``, ``fsdp_params`` (``_param_fqn``, ``sharded_param``),
  ``mesh_info`` (the groups), ``is_unsharded``. Read-only.

Anything else of FSDP2's state raises, naming the module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from fsdp_compile._eager_buckets import regather_key
from fsdp_compile._eager_collectives import gather_bucket_with_grad_sync
from fsdp_compile._fsdp_state import forward_context
from fsdp_compile.base.compat import set_composable_state, torchs_fully_shard
from fsdp_compile.base.execution_mode import execution_mode
from fsdp_compile.runtime.collectives import GradAccumulation, gather_with_grad_sync

if TYPE_CHECKING:
    from fsdp_compile._fsdp_state import FSDPUnit


_VIEW_KEY = "_fsdp_compile_fsdp2_state_view"


def register_fsdp2_state_view(module: nn.Module, unit: FSDPUnit) -> None:
    """Make torch's ``fully_shard.state(module)`` (and ``module._get_fsdp_state()``) answer
    for ``unit``."""
    set_composable_state(module, torchs_fully_shard(), _UnitStateView(module, unit))


def fsdp2_state_view(module: nn.Module) -> _UnitStateView:
    """The view :func:`register_fsdp2_state_view` made for ``module``."""
    return module.__dict__[_VIEW_KEY]


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
    """FSDP2's ``FSDPParamGroup`` as pipelining uses it (``post_backward``), and what code
    written against FSDP2 reads of it: ``fsdp_params`` (each with ``_param_fqn`` and
    ``sharded_param``), ``_module_fqn``, ``mesh_info`` and ``is_unsharded``. Read-only."""

    def __init__(self, unit: FSDPUnit) -> None:
        self.unit = unit

    def post_backward(self) -> None:
        finish_gradient_accumulation(self.unit)

    @property
    def _module_fqn(self) -> str:
        """The unit's modules' paths from the outermost sharded module, as FSDP2's (``", "``-joined)."""
        return ", ".join(self.unit.module_fqns)

    @property
    def fsdp_params(self) -> list[_ParamView]:
        return [_ParamView(p) for p in self.unit.params]

    @property
    def mesh_info(self) -> _MeshInfoView:
        return _MeshInfoView(self.unit)

    @property
    def is_unsharded(self) -> bool:
        """Whether the unit's parameters are gathered now: held by ``unshard()``, kept after a
        backward (``set_reshard_after_backward(False)``) or after a forward that does not reshard."""
        kept = self.unit.eager.forward_kept if self.unit.eager is not None else {}
        return any(p.still_gathered() is not None or p in kept for p in self.unit.params)


class _ParamView:
    """FSDP2's ``FSDPParam``: its path from the outermost sharded module and its sharded parameter."""

    def __init__(self, fsdp_param) -> None:
        self._param_fqn = fsdp_param.fqn
        self.sharded_param = fsdp_param.sharded_param


class _MeshInfoView:
    """FSDP2's ``FSDPMeshInfo`` / ``HSDPMeshInfo``: the data-parallel mesh and its groups."""

    def __init__(self, unit: FSDPUnit) -> None:
        dp = unit.dp_mesh
        self.mesh = dp.mesh
        self.shard_mesh_dim, self.replicate_mesh_dim = dp.shard_dim, dp.replicate_dim
        if dp.shard_dim is not None:
            self.shard_process_group = dp.mesh.get_group(dp.shard_dim)
            self.shard_mesh_size = dp.mesh.size(dp.shard_dim)
            self.shard_mesh_rank = self.shard_process_group.rank()
        if dp.replicate_dim is not None:
            self.replicate_process_group = dp.mesh.get_group(dp.replicate_dim)
            self.replicate_mesh_size = dp.mesh.size(dp.replicate_dim)
            self.replicate_mesh_rank = self.replicate_process_group.rank()


class _StateContextView:
    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    def all_states(self) -> list[_UnitStateView]:
        """Every unit's view under this module (pipelining reduces them all)."""
        from fsdp_compile._fully_shard import FSDPModule

        views, units = [], set()
        for m in self.module.modules():
            if isinstance(m, FSDPModule) and id(m._fsdp_unit) not in units:  # one per unit, as FSDP2's states
                units.add(id(m._fsdp_unit))
                views.append(fsdp2_state_view(m._fsdp_unit.modules[0]))  # the one holding its group
        return views


class NoStreams:
    """A unit's communication context: there are no side streams here, but each unit has
    its own until ``share_comm_ctx`` gives several one, as in FSDP2."""


class _UnitStateView:
    """FSDP2's ``FSDPState`` as torch's code uses it: pipelining (``_state_ctx.all_states``,
    ``_fsdp_param_groups``, ``_root_post_backward_final_callback``, ``_comm_ctx``),
    ``register_fsdp_forward_method`` (``_pre_forward``, ``_post_forward``) and
    ``share_comm_ctx`` (``_comm_ctx``, ``_lazy_init``); and, read-only, what code written
    against FSDP2 inspects (``_is_root``, ``_fsdp_param_group``, ``_modules_to_run_forward``). Any other attribute
    raises."""

    def __init__(self, module: nn.Module, unit: FSDPUnit) -> None:
        self._module = module
        self._unit = unit
        self._state_ctx = _StateContextView(module)
        self._comm_ctx = NoStreams()
        module.__dict__[_VIEW_KEY] = self

    @property
    def _fsdp_param_groups(self) -> list[_ParamGroupView]:
        """As FSDP2's: one group where the unit has parameters, listed by its first module's
        state only (pipelining reduces every state's groups: once per unit)."""
        unit = self._unit
        return [_ParamGroupView(unit)] if self._module is unit.modules[0] and unit.params else []

    @property
    def _is_root(self) -> bool:
        """Whether the unit is the outermost sharded one (FSDP2 decides it at lazy init; here
        ``fully_shard`` of an enclosing module decides it)."""
        return self._unit.is_root

    @property
    def _modules_to_run_forward(self) -> set:
        """FSDP2's (torch 2.15) modules of a grouped unit still to run in the current forward:
        none outside a forward (a unit here has no partial-forward state to finish)."""
        return set()

    @property
    def _fsdp_param_group(self) -> _ParamGroupView | None:
        """The unit's parameter group, for each of its modules (FSDP2's one state per
        ``fully_shard``); ``None`` for a unit without parameters, as FSDP2's."""
        return _ParamGroupView(self._unit) if self._unit.params else None

    def _root_post_backward_final_callback(self) -> None:
        """Nothing to wait for: each reduction finished inside its backward."""

    def _lazy_init(self) -> None:
        """FSDP2 initializes its state at the first forward; ``fully_shard`` here did it all."""

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A registered forward method starts: its parameter reads are gathered as in ``forward``."""
        forward_context.enter(execution_mode())
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output):
        """The registered method returned: what it gathered is dropped, as after ``forward``."""
        forward_context.exit()
        return output

    def __getattr__(self, name: str):
        module = self.__dict__.get("_module")  # (absent while unpickling)
        if module is None or name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"{type(module).__name__} is sharded by fsdp_compile.fully_shard, which has no FSDP2 internal "
            f"state attribute {name!r} (torch.distributed.fsdp._fully_shard's FSDPState): torch's pipelining, "
            "register_fsdp_forward_method and share_comm_ctx find what they read of it; use the public "
            "FSDPModule methods for the rest."
        )
