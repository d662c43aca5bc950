"""Gradient hooks that a module's forward registers on its own parameters.

Under FSDP2 a module's forward finds the *unsharded* parameter in
``module._parameters``: a plain tensor (or the tensor-parallel ``DTensor``) whose
gradient is the full, not yet reduce-scattered one. Code that registers a
post-accumulate-grad hook from there, such as ``transformers``' tensor-parallel
style ``replicated_with_grad_allreduce`` (Qwen3's and Gemma3's per-head norms:
``dist.all_reduce(param.grad, group=tp_group)``), gets that plain tensor.

Here the registered parameter is always the sharded ``DTensor`` (see
:mod:`fsdp_compile._fsdp_param`), and its gradient arrives after the
reduce-scatter, as a ``DTensor``, on which such a c10d call fails. So a hook
registered on a sharded parameter *while a sharded forward runs* (eagerly, or
from a compiled call, whose Dynamo-recorded registrations run right after its
graph) is called with the parameter's local shard, as an ``nn.Parameter`` over its
storage whose ``.grad`` is the local shard of the reduced gradient: in-place changes land in
the sharded gradient. For a hook linear in the gradient (an all-reduce over
another mesh dimension, a scale) that is FSDP2's result up to the order of the
sums: the reduction over data-parallel ranks simply comes first. Eager and
compiled runs call the hook at the same point, so they stay bitwise equal. (A hook
that communicated over the data-parallel group itself would mix shards of different
rows; FSDP already reduces over that group.)

Hooks registered outside any forward are registered as they are and see the
sharded parameter and its ``DTensor`` gradient, as with FSDP2.
"""

from __future__ import annotations

import functools
import sys
import types

import torch

from fsdp_compile._fsdp_state import forward_context
from fsdp_compile.base.compat import run_by_compiled_code
from fsdp_compile.base.execution_mode import ExecutionMode, execution_mode


def route_forward_hooks_to_local_shard(sharded_param: torch.nn.Parameter, fqn: str) -> None:
    """Make hooks registered on ``sharded_param`` from inside a sharded forward see its
    local shard (see the module docstring). Installs a per-parameter
    ``register_post_accumulate_grad_hook`` that registers through ``torch.Tensor``'s."""

    def register_post_accumulate_grad_hook(param: torch.Tensor, hook):
        # From a traced forward the registration is either traced through this attribute
        # (Dynamo inlines it) or recorded and replayed by the compiled frame's own code
        # right after its graph, through this attribute again.
        traced = execution_mode() is ExecutionMode.TRACED
        if traced or forward_context.depth or run_by_compiled_code(sys._getframe(1)):
            hook = _on_local_shard(hook, fqn)
        return torch.Tensor.register_post_accumulate_grad_hook(param, hook)

    sharded_param.register_post_accumulate_grad_hook = types.MethodType(register_post_accumulate_grad_hook, sharded_param)


def _on_local_shard(hook, fqn: str):
    def on_local_shard(param: torch.Tensor) -> None:
        _call_on_local_shard(hook, param, fqn=fqn)

    return functools.wraps(hook)(on_local_shard) if hasattr(hook, "__name__") else on_local_shard


def _call_on_local_shard(hook, param: torch.Tensor, *, fqn: str) -> None:
    grad = param.grad
    with torch.no_grad():
        # A parameter (as FSDP2's unsharded one is) over the local shard's storage.
        local = torch.nn.Parameter(param.to_local(), requires_grad=param.requires_grad)
        local_grad = grad.to_local() if grad is not None else None
    local.grad = local_grad
    try:
        hook(local)
        if local.grad is not local_grad:
            raise RuntimeError(
                f"A gradient hook registered on sharded parameter {fqn!r} during its forward replaced "
                "the gradient it was handed (its local shard's .grad); under fully_shard it must change "
                "it in place (e.g. dist.all_reduce(param.grad, group=...)), or be registered outside the "
                "forward, where it sees the sharded parameter and its DTensor gradient"
            )
    finally:
        local.grad = None
