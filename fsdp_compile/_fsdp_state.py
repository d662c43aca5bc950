"""FSDPUnit (what one ``fully_shard`` call manages) and the forward context.

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

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy


@dataclass
class FSDPUnit:
    """The parameters one ``fully_shard(module)`` call shards, and its options."""

    modules: list  # the module(s) passed to fully_shard
    mesh: DeviceMesh
    reshard_after_forward: bool | None
    params: list = field(default_factory=list)  # list[FSDPParam]
    is_root: bool = True
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    requires_gradient_sync: bool = True
    gradient_divide_factor: float | None = None  # None: average over the group
    # Path of each module from the outermost sharded module ("" for the root
    # itself); rewritten when a parent is sharded later.
    module_fqns: list = field(default_factory=list)
    dp_mesh: object = None  # runtime.process_groups.DataParallelMesh; built from mesh if None
    offload: "ShardPlacement" = None  # where shards live and where they are computed on
    # The units whose forward / backward issues this unit's all-gather
    # (FSDPModule.set_modules_to_forward_prefetch / _backward_prefetch hints).
    forward_prefetched_by: "FSDPUnit | None" = field(default=None, repr=False)
    backward_prefetched_by: "FSDPUnit | None" = field(default=None, repr=False)
    # Set once a graph break made this unit gather in eager code (warned once per unit).
    warned_eager_gather: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        from fsdp_compile.runtime.process_groups import DataParallelMesh

        if not self.module_fqns:
            self.module_fqns = [""] * len(self.modules)
        if self.dp_mesh is None:
            self.dp_mesh = DataParallelMesh(self.mesh)
        if self.offload is None:
            self.offload = ShardPlacement(compute_device(self.mesh), offload_to_cpu=False)

    @property
    def module(self) -> nn.Module:
        return self.modules[0]

    @property
    def fqn(self) -> str:
        return self.module_fqns[0]

    def set_module_fqn(self, module: nn.Module, fqn: str) -> None:
        index = next(i for i, m in enumerate(self.modules) if m is module)
        self.module_fqns[index] = fqn

    def resolved_reshard_after_forward(self) -> bool:
        """FSDP2's rule: ``None`` means True for non-root units and False for the root."""
        if self.reshard_after_forward is None:
            return not self.is_root
        return self.reshard_after_forward


def compute_device(mesh: DeviceMesh) -> torch.device:
    """The device the mesh's ranks compute on (for CPU meshes, the CPU)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


@dataclass
class ShardPlacement:
    """Where sharded parameters (and so their gradients and optimizer state) are
    stored, and where they are computed on: FSDP2's ``CPUOffloadPolicy``.

    With offload the shard lives on the CPU (pinned when ``pin_memory`` and an
    accelerator are present) and is copied to ``compute_device`` right before
    its all-gather; the gradient comes back to the CPU through the copy's
    autograd. When both are the same device, nothing is copied, so no copy
    appears in the compiled graph.
    """

    compute_device: torch.device
    offload_to_cpu: bool
    pin_memory: bool = False

    @property
    def storage_device(self) -> torch.device:
        return torch.device("cpu") if self.offload_to_cpu else self.compute_device

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


class _ForwardContext:
    """Process-wide stack of running sharded forwards and what each gathered.

    A parameter's full tensor is cached in the innermost running sharded
    forward that read it, and dropped when that forward returns: a weight read
    twice inside one unit is gathered once, while in eager mode a unit's
    gathered weights do not outlive its forward (FSDP2's memory profile). A
    read outside the owning unit's forward (weight reuse, ties across units)
    gathers again; its gradient then arrives through two reduce-scatters.
    """

    def __init__(self) -> None:
        self.frames: list[list] = []  # per running sharded forward: its gathered FSDPParams
        self.frame_compiled: list[bool] = []  # per running sharded forward: entered inside a compiled graph
        # Eager only: storage address of each cached full tensor -> its
        # FSDPParam, for the saved-tensor hooks that reshard after forward.
        # An entry lives exactly as long as the cached tensor it names, so
        # its address cannot be reused by another tensor meanwhile.
        self.gathered_storage: dict[int, object] = {}

    @property
    def depth(self) -> int:
        return len(self.frames)

    def enter(self, compiled: bool | None = None) -> None:
        """Open a sharded forward; ``compiled``: it runs in a compiled step (default:
        whether Dynamo is tracing it)."""
        self.frames.append([])
        self.frame_compiled.append(torch.compiler.is_compiling() if compiled is None else compiled)

    def exit(self) -> None:
        self.frame_compiled.pop()
        for fsdp_param in self.frames.pop():
            fsdp_param.drop_unsharded()

    def in_broken_graph(self) -> bool:
        """Eager code running inside a sharded forward that a compiled graph entered:
        Dynamo broke the graph there."""
        return not torch.compiler.is_compiling() and any(self.frame_compiled)

    def note_gathered(self, fsdp_param, full: torch.Tensor) -> None:
        self.frames[-1].append(fsdp_param)
        if not torch.compiler.is_compiling() and full.numel() > 0:
            self.gathered_storage[full.untyped_storage().data_ptr()] = fsdp_param

    def forget_storage(self, full: torch.Tensor) -> None:
        if not torch.compiler.is_compiling() and full.numel() > 0:
            self.gathered_storage.pop(full.untyped_storage().data_ptr(), None)

    def eager_reshard_hooks(self):
        """Saved-tensor hooks that make eager autograd re-gather instead of keeping.

        Autograd saves the full weight (or a view of it, e.g. ``W.t()``) for
        the backward of ops like ``mm``. For a unit with
        ``reshard_after_forward=True`` we save a small handle instead and
        all-gather again when backward unpacks it, as FSDP2 does. Compiled
        runs get the same effect from the reshard pass on the joint graph.
        """
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor):
        if type(t) is not torch.Tensor or t.numel() == 0 or not self.gathered_storage:
            return t
        fsdp_param = self.gathered_storage.get(t.untyped_storage().data_ptr())
        if fsdp_param is None or not fsdp_param.unit.resolved_reshard_after_forward():
            return t
        slot = fsdp_param.regather_slot()
        slot.pending += 1
        return _Regather(slot, t.size(), t.stride(), t.storage_offset())


@dataclass
class RegatherSlot:
    """One parameter's re-gathered tensor, shared by every saved view of it in
    one backward and dropped once the last of them is unpacked."""

    fsdp_param: object
    pending: int = 0
    full: torch.Tensor | None = None


@dataclass
class _Regather:
    slot: RegatherSlot
    size: torch.Size
    stride: tuple
    storage_offset: int


def _unpack(packed):
    if not isinstance(packed, _Regather):
        return packed
    slot = packed.slot
    if slot.full is None:
        slot.full = slot.fsdp_param.regather()
    # The re-gathered tensor has the original layout, so the saved view is
    # rebuilt from its size, stride and offset.
    view = slot.full.as_strided(packed.size, packed.stride, packed.storage_offset)
    slot.pending -= 1
    if slot.pending == 0:
        slot.full = None
    return view


forward_context = _ForwardContext()
