"""Install our graph passes into torch.compile's pipeline, chained with the user's.

The joint-graph slot (``torch._functorch.config.joint_custom_pass``) holds one
callable. We wrap whatever is there, so a user's pass set before or after
importing fsdp_compile still runs (set after: call :func:`install_passes`
again to re-chain). Graphs without our annotations pass through unchanged.
"""

from __future__ import annotations

import torch.fx as fx

from fsdp_compile._compat import get_joint_custom_pass, set_joint_custom_pass
from fsdp_compile.passes.reshard import tag_reshard_after_forward


def fsdp_joint_pass(gm: fx.GraphModule, joint_inputs) -> fx.GraphModule:
    """Our joint-graph passes, in order."""
    return tag_reshard_after_forward(gm)


class _ChainedJointPass:
    """Runs the pass that was installed before us, then ours."""

    def __init__(self, previous) -> None:
        self.previous = previous

    def __call__(self, gm: fx.GraphModule, joint_inputs) -> fx.GraphModule:
        if self.previous is not None:
            gm = self.previous(gm, joint_inputs)
        return fsdp_joint_pass(gm, joint_inputs)


def install_passes() -> None:
    """Idempotent: make sure our joint pass is in the chain exactly once."""
    current = get_joint_custom_pass()
    if isinstance(current, _ChainedJointPass):
        return
    set_joint_custom_pass(_ChainedJointPass(current))
