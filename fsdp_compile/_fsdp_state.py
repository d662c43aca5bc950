"""FSDPUnit (what one ``fully_shard`` call manages), where its shards live, and the
forward context.

A parameter attribute read returns the full tensor only while some sharded
module's forward is running ("the forward context"); anywhere else (init code,
printing, the optimizer) it returns the sharded ``DTensor``, as FSDP2 does.
The gathered tensors of one forward are cached on their :class:`FSDPParam`
so a weight read twice (weight reuse, tied weights) is gathered once, and the
cache is dropped when the outermost sharded forward returns. Under
``torch.compile`` Dynamo traces these Python-state updates like any other
side effect; nothing of them survives into the next step.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_compile.base.compat import called_through_compiled_wrapper, never_a_frame_of_its_own
from fsdp_compile.base.execution_mode import ExecutionMode, execution_mode
from fsdp_compile.runtime.process_groups import DataParallelMesh

if TYPE_CHECKING:
    from fsdp_compile._fsdp_param import FSDPParam
    from fsdp_compile.runtime.collectives import PostReduceHook


def compute_device(mesh: DeviceMesh) -> torch.device:
    """The device the mesh's ranks compute on (for CPU meshes, the CPU)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


@dataclass(frozen=True)
class ShardDevices:
    """Where sharded parameters (and so their gradients and optimizer state) are
    stored, and where they are computed on: FSDP2's ``CPUOffloadPolicy``.

    With ``offload_to_cpu`` the shard lives on the CPU (pinned when
    ``pin_memory`` and an accelerator are present) and is copied to
    ``compute_device`` right before its all-gather; the gradient comes back to
    the CPU through the copy's autograd. When both are the same device,
    nothing is copied, so no copy appears in the compiled graph.
    """

    compute_device: torch.device
    offload_to_cpu: bool = False
    pin_memory: bool = False

    def to_storage(self, t: torch.Tensor) -> torch.Tensor:
        """A shard as created at ``fully_shard`` time, moved to its storage device
        (meta shards stay on meta until ``to_empty``)."""
        if t.device.type == "meta" or not self.offload_to_cpu:
            return t
        t = t.to("cpu")
        if self.pin_memory and self.compute_device.type != "cpu":
            t = t.pin_memory()
        return t

    def to_compute(self, t: torch.Tensor) -> torch.Tensor:
        """The shard on the compute device (identity unless offloaded elsewhere)."""
        if t.device == self.compute_device or t.device.type == "meta":
            return t
        return t.to(self.compute_device, non_blocking=self.pin_memory)


#: ``FSDPUnit.traced_naming`` of a unit named relative to itself.
FRAME_NAMING = "frame"
#: ``FSDPUnit.traced_naming`` of a unit nested directly in a unit named relative to itself.
NESTED_NAMING = "nested"


#: The ``FSDPUnit`` fields its parameters' collective specs are built from
#: (``FSDPParam.refresh_spec``): :meth:`FSDPUnit.update` rebuilds the specs when one changes.
SPEC_OPTIONS = frozenset(
    {
        "reshard_after_forward",
        "reshard_to",
        "reshard_after_backward",
        "gradient_divide_factor",
        "force_sum_reduction_for_comms",
        "all_reduce_hook",
        "forward_prefetched_by",
        "backward_prefetched_by",
        "mp_policy",
        "is_root",
        "name_in_parent",
        "module_fqns",
    }
)


@dataclass(eq=False)
class FSDPUnit:
    """The parameters one ``fully_shard(module)`` call shards, and its options.

    Options that the traced collectives depend on (names, resharding, prefetch
    hints, the gradient divide factor: :data:`SPEC_OPTIONS`) are baked into each
    parameter's :class:`~fsdp_compile.runtime.collectives.CollectiveSpec`, which is
    rebuilt by :meth:`update`, through which they are written (compiled graphs guard on
    the specs and recompile).
    """

    modules: list[nn.Module]  # the module(s) passed to fully_shard
    mesh: DeviceMesh
    dp_mesh: DataParallelMesh
    devices: ShardDevices
    reshard_after_forward: bool | int | None  # None: True unless this is the root unit; int: see reshard_to
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    params: list[FSDPParam] = field(default_factory=list)
    is_root: bool = True
    requires_gradient_sync: bool = True
    # False (HSDP): reduce-scatter gradients but do not all-reduce them over the replicate
    # dimension yet (FSDP2's set_requires_all_reduce); set_requires_gradient_sync sets both.
    requires_all_reduce: bool = True
    # False: gathered parameters stay gathered after backward, for the next forward
    # (FSDP2's set_reshard_after_backward; e.g. between gradient-accumulation micro-batches).
    reshard_after_backward: bool = True
    gradient_divide_factor: float | None = None  # None: average over the group
    # FSDP2's set_force_sum_reduction_for_comms: reductions are sums, the division
    # done by the gradient's own ops (runtime.collectives.gradient_reduction).
    force_sum_reduction_for_comms: bool = False
    # FSDP2's set_all_reduce_hook: called on the reduced gradients, in place, after the
    # reduce-scatter (HSDP: the all-reduce), before the post-division.
    all_reduce_hook: PostReduceHook | None = field(default=None, repr=False)
    # FSDP2's set_reduce_scatter_unused_params: eager backward reduces a zero gradient
    # for a parameter that got none on this rank (ranks that used different parameters
    # then still issue the same reduce-scatter); False: such a parameter is left out
    # of the reduction and its ``.grad`` stays ``None``, as in an unsharded model.
    reduce_scatter_unused_params: bool = False
    # Whether this unit's last forward called from a compiled call's eager code took the
    # compiled path (``FSDPModule.forward``): activation checkpointing's recompute of that
    # forward, in backward, takes the same path, so that it records the same saved tensors.
    compiled_path_between_graphs: bool | None = None
    # Path of each module from the outermost sharded module ("" for the root
    # itself); rewritten when a parent is sharded later.
    module_fqns: list[str] = field(default_factory=list)
    # The units whose forward / backward issues this unit's all-gather
    # (FSDPModule.set_modules_to_forward_prefetch / _backward_prefetch hints).
    forward_prefetched_by: FSDPUnit | None = field(default=None, repr=False)
    backward_prefetched_by: FSDPUnit | None = field(default=None, repr=False)
    # The units this unit's forward / backward prefetches (the same hints, from this side).
    forward_prefetches: list[FSDPUnit] = field(default_factory=list, repr=False)
    backward_prefetches: list[FSDPUnit] = field(default_factory=list, repr=False)
    # reshard_after_forward=<int>: the smaller group a shard is kept over after forward,
    # as (group name, group size, this rank's index in it); see CollectiveTag.reshard_to.
    reshard_to: tuple[str, int, int] | None = None
    # When this unit's forward was the outermost sharded one: the units the last such eager
    # forward gathered, in order (what the eager forward prefetch follows; see _eager).
    eager_forward_order: list[FSDPUnit] = field(default_factory=list, repr=False)
    # Set once a graph break made this unit gather in eager code (warned once per unit).
    warned_eager_gather: bool = field(default=False, repr=False)
    # This unit's path from the unit that first enclosed it (the nearest, as units are
    # sharded bottom-up); None while it is a root.
    name_in_parent: str | None = field(default=None, repr=False)
    # How the collectives of this unit's parameters are named while Dynamo traces its
    # forward as a unit no unit of ours encloses in the graph (see
    # ``FSDPModule._forward_compiled``): None, by their full names (``FSDPParam.spec``);
    # ``FRAME_NAMING``, relative to the unit (``FSDPParam.frame_spec``: a block compiled
    # on its own, so identical blocks trace identical graphs, compiled once); an int k,
    # as the k-th root unit of the graph (root units whose parent was not sharded all
    # have the name "", and would otherwise be bucketed as one unit); ``NESTED_NAMING``,
    # relative to the enclosing ``FRAME_NAMING`` unit (``FSDPParam.nested_frame_spec``).
    traced_naming: str | int | None = field(default=None, repr=False)
    # What eager steps keep between calls (``fsdp_compile._eager.EagerState``), one per root,
    # shared by every unit under it; set by fully_shard.
    eager: object = field(default=None, repr=False)
    # The parameters whose local shard is on the meta device (``fully_shard`` of a model
    # built on ``meta``, not materialized yet): a forward refuses to run, naming them,
    # before it issues any collective. Kept by ``FSDPParam.refresh_local_view``, which
    # runs whenever a local shard is replaced (``to_empty``, ``.to(...)``).
    params_on_meta: tuple = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if not self.module_fqns:
            self.module_fqns = [""] * len(self.modules)
        object.__setattr__(self, "_built", True)  # from here on, spec options go through update()

    def update(self, **fields) -> None:
        """Set fields; if one of :data:`SPEC_OPTIONS` is among them, rebuild every parameter's
        collective spec from the new values (those fields are written through here only)."""
        for name, value in fields.items():
            if not hasattr(self, name):
                raise AttributeError(f"FSDPUnit has no field {name!r}")
            object.__setattr__(self, name, value)
        if SPEC_OPTIONS.intersection(fields):
            self._rebuild_specs()

    def __setattr__(self, name: str, value) -> None:
        # A spec option written directly would leave every parameter's spec stale.
        if name in SPEC_OPTIONS and "_built" in self.__dict__:
            raise AttributeError(
                f"FSDPUnit.{name} is baked into its parameters' collective specs: set it with "
                f"unit.update({name}=...), which rebuilds them"
            )
        object.__setattr__(self, name, value)

    @property
    def fqn(self) -> str:
        return self.module_fqns[0]

    def note_on_meta(self, fsdp_param, on_meta: bool) -> None:
        """Record whether ``fsdp_param``'s local shard is on the meta device."""
        others = tuple(p for p in self.params_on_meta if p is not fsdp_param)
        self.params_on_meta = (*others, fsdp_param) if on_meta else others

    def set_module_fqn(self, module: nn.Module, fqn: str) -> None:
        index = next(i for i, m in enumerate(self.modules) if m is module)
        self.module_fqns[index] = fqn
        self._rebuild_specs()
        for unit in (*self.forward_prefetches, *self.backward_prefetches):  # their hints name this unit
            unit._rebuild_specs()

    def resolved_reshard_after_forward(self) -> bool:
        """FSDP2's rule: ``None`` means True for non-root units and False for the root;
        an int (resharding to a smaller group) frees the gathered tensor too."""
        if self.reshard_after_forward is None:
            return not self.is_root
        return bool(self.reshard_after_forward)

    def frees_gathered_after_forward(self) -> bool:
        """Whether a forward's gathered parameters are freed until backward gathers them
        again: resharding after forward, and not keeping them after backward anyway."""
        return self.resolved_reshard_after_forward() and self.reshard_after_backward

    def _rebuild_specs(self) -> None:
        """Rebuild every parameter's collective spec from the unit's options (eager code
        only: it runs when :meth:`update` changes one of :data:`SPEC_OPTIONS`)."""
        for fsdp_param in self.params:
            fsdp_param.refresh_spec()


class _ForwardContext(threading.local):
    """This thread's stack of running sharded forwards and what each gathered (one per
    thread: ranks run as threads of one process each have their own; a
    ``threading.local``, whose attributes Dynamo reads as an object's).

    A parameter's full tensor is cached in the innermost running sharded
    forward that read it, and dropped when that forward returns: a weight read
    twice inside one unit is gathered once, while in eager mode a unit's
    gathered weights do not outlive its forward (FSDP2's memory profile). A
    read outside the owning unit's forward (weight reuse, ties across units)
    gathers again; its gradient then arrives through two reduce-scatters.
    """

    def __init__(self) -> None:
        self.frames: list[list[FSDPParam]] = []  # per running sharded forward: what it gathered
        # Per running sharded forward: the mode its forward started in (see ``_execution_mode``).
        self.frame_modes: list[ExecutionMode] = []
        # Per running sharded forward: its unit's traced naming (``FSDPUnit.traced_naming``);
        # None for forwards that are not traced.
        self.frame_namings: list[str | int | None] = []
        # Per running sharded forward: its root's eager state (``FSDPUnit.eager``), for eager
        # forwards; None for traced ones.
        self.frame_owners: list[object | None] = []

    @property
    def depth(self) -> int:
        return len(self.frames)

    def enter(self, mode: ExecutionMode, naming: str | int | None = None, owner: object | None = None) -> None:
        """A sharded forward starts in ``mode``; ``naming``: its unit's traced naming (traced
        forwards); ``owner``: its root's eager state (eager forwards)."""
        self.frames.append([])
        self.frame_modes.append(mode)
        self.frame_namings.append(naming)
        self.frame_owners.append(owner)

    def exit(self) -> None:
        """The innermost sharded forward returns: drop what it gathered."""
        self.frame_modes.pop()
        self.frame_namings.pop()
        self.frame_owners.pop()
        for fsdp_param in self.frames.pop():
            fsdp_param.drop_gathered()

    def exit_all_owned_by(self, owner: object) -> None:
        """Close what an aborted step of ``owner``'s root left open: its eager forwards, and
        traced forwards entered above them (a compiled step enters and exits its units in
        the Python state it replays after each graph; an exception between two graphs of
        one step leaves them open). Forwards of other roots running below stay."""
        while self.frame_owners and self.frame_owners[-1] in (owner, None):
            self.exit()
        if owner in self.frame_owners:
            raise RuntimeError(
                "reset_iter_state: another sharded model's forward is still running inside this one's; "
                "reset the innermost model first"
            )

    def traced_in_this_graph(self) -> bool:
        """Whether a running sharded forward was entered by traced code: by the graph Dynamo
        is tracing, or by an earlier graph of this step that broke inside that forward.
        Forwards entered by eager code are not."""
        return any(mode is ExecutionMode.TRACED for mode in self.frame_modes)

    @never_a_frame_of_its_own
    def in_broken_graph(self) -> bool:
        """Eager code running inside a sharded forward that a compiled call entered:
        Dynamo broke the graph there."""
        return execution_mode() is not ExecutionMode.TRACED and any(m is not ExecutionMode.EAGER for m in self.frame_modes)

    def gathered_params(self) -> Iterator[FSDPParam]:
        """The parameters gathered by the running sharded forwards."""
        for frame in self.frames:
            yield from frame


forward_context = _ForwardContext()


def warn_gathered_in_broken_graph(fsdp_param: FSDPParam) -> None:
    """Once per unit: its parameters are gathered in eager code between compiled graphs."""
    unit = fsdp_param.unit
    if unit.warned_eager_gather:
        return
    unit.warned_eager_gather = True
    if any(_compiled_on_its_own(m) or called_through_compiled_wrapper(m) for m in unit.modules):
        # A unit compiled on its own (block.compile(), torch.compile(block) before or after
        # fully_shard: torchtitan's per-block compile) is gathered around its compiled frame
        # by design, as FSDP2's hooks gather it: no graph broke.
        return
    warnings.warn(
        f"fsdp_compile: graph break inside the sharded forward of unit {unit.fqn or '(root)'!r}: parameter "
        f"{fsdp_param.fqn!r} is gathered in eager code between compiled graphs, so its collectives "
        "cannot be bucketed or overlapped. TORCH_LOGS=graph_breaks shows where Dynamo broke; "
        "fsdp_compile.debug.dump(DIR) writes each graph and its collectives.",
        stacklevel=4,
    )


def _compiled_on_its_own(module: nn.Module) -> bool:
    """Whether ``module`` runs through a compiled call of its own (``module.compile()``, or a
    ``torch.compile(module)`` result that ``fully_shard`` was applied to)."""
    return getattr(module, "_compiled_call_impl", None) is not None or "_fsdp_compiled_forward" in module.__dict__
