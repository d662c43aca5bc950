"""FSDP2's input and output casting under a ``MixedPrecisionPolicy`` (the parameters'
own casting happens in their all-gather, see ``runtime.collectives``)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_compile._compat import tree_map


def _cast_floating(tree, dtype: torch.dtype):
    """Floating-point tensors in ``tree`` cast to ``dtype``."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def cast_inputs(policy: MixedPrecisionPolicy, args, kwargs):
    """A sharded forward's inputs, in ``param_dtype`` when ``cast_forward_inputs``."""
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        return _cast_floating((args, kwargs), policy.param_dtype)
    return args, kwargs


def cast_output(policy: MixedPrecisionPolicy, output):
    """A sharded forward's output, in ``output_dtype`` if the policy sets one."""
    return output if policy.output_dtype is None else _cast_floating(output, policy.output_dtype)
