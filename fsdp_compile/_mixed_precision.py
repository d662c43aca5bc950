"""FSDP2's input and output casting under a ``MixedPrecisionPolicy`` (the parameters'
own casting happens in their all-gather, see ``runtime.collectives``)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_compile.base.compat import tree_map


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


def param_dtype_for(policy: MixedPrecisionPolicy, param: torch.Tensor) -> torch.dtype | None:
    """The dtype ``param`` is gathered and computed in under ``policy``: ``param_dtype``,
    unless the policy's ``param_dtype_override_fn`` (torch 2.15) returns the parameter's own
    dtype for it (e.g. to keep a norm or a router in fp32 under bf16). As FSDP2, the
    function may return only ``None``, ``param_dtype`` or the parameter's dtype, and must
    answer alike on every rank. A parameter that is not floating-point (an integer
    lookup table) keeps its dtype (``None``), as in FSDP2."""
    if not param.is_floating_point():
        return None
    override_fn = getattr(policy, "param_dtype_override_fn", None)
    if override_fn is None:
        return policy.param_dtype
    dtype = override_fn(param)
    if dtype is None:
        return policy.param_dtype
    if not isinstance(dtype, torch.dtype) or dtype not in (policy.param_dtype, param.dtype):
        raise ValueError(
            f"param_dtype_override_fn returned {dtype!r} for a parameter of shape {tuple(param.shape)} and "
            f"dtype {param.dtype}; return None, param_dtype ({policy.param_dtype}) or the parameter's own dtype"
        )
    return dtype
