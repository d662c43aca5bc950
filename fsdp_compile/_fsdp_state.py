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

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh


@dataclass
class FSDPUnit:
    """The parameters one ``fully_shard(module)`` call shards, and its options."""

    modules: list  # the module(s) passed to fully_shard
    mesh: DeviceMesh
    reshard_after_forward: bool | None
    params: list = field(default_factory=list)  # list[FSDPParam]
    is_root: bool = True
    # Path of each module from the outermost sharded module ("" for the root
    # itself); rewritten when a parent is sharded later.
    module_fqns: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.module_fqns:
            self.module_fqns = [""] * len(self.modules)

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


class _ForwardContext:
    """Process-wide: how deep we are in sharded forwards, and what was gathered."""

    def __init__(self) -> None:
        self.depth = 0
        self.gathered: list = []  # FSDPParams whose full tensor is cached

    def enter(self) -> None:
        self.depth += 1

    def exit(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            for fsdp_param in self.gathered:
                fsdp_param.drop_unsharded()
            self.gathered.clear()


forward_context = _ForwardContext()
