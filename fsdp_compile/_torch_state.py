"""What torch's own public FSDP2 functions read of a module's private state, for our units.

Two public functions of ``torch.distributed.fsdp`` take any ``FSDPModule`` (ours pass
that check) and then reach into FSDP2's private state, ``module._get_fsdp_state()``:

- ``register_fsdp_forward_method(module, name)`` wraps the method in the state's
  ``_pre_forward(module, args, kwargs)`` and ``_post_forward(module, args, output)``.
  ``transformers.Trainer`` calls torch's (``generate`` under FSDP2), so a user who
  switched only ``fully_shard`` gets torch's function with our units.
- ``share_comm_ctx(modules)`` hands the first state's ``_comm_ctx`` to the others and
  to their ``_fsdp_param_groups``; torch 2.15's pipeline schedules compare the stages'
  ``_comm_ctx`` by identity (``defer_reduce_grad_wait`` refuses stages that share one).

Our units have no FSDP2 state; ``_get_fsdp_state()`` returns :class:`TorchFSDPStateStandIn`,
which does for ours what those two functions need (the method runs as a sharded
forward, as :func:`fsdp_compile.register_fsdp_forward_method` makes it run; there are no
streams to share) and refuses any other attribute by name, before anything is changed.
"""

from __future__ import annotations

import torch.nn as nn

from fsdp_compile._fsdp_state import forward_context
from fsdp_compile.base.execution_mode import execution_mode


class NoStreams:
    """A unit's communication context: there are no side streams here, but each unit has
    its own until ``share_comm_ctx`` gives several one, as in FSDP2."""


class TorchFSDPStateStandIn:
    """The part of FSDP2's ``FSDPState`` that torch's public functions use, for the unit
    of ``module``: one per unit, kept on its first module, so that what those functions
    set on it (``_comm_ctx``) stays, as on FSDP2's state."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._comm_ctx = NoStreams()
        self._fsdp_param_groups = ()

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
        raise AttributeError(
            f"{type(self._module).__name__} is sharded by fsdp_compile.fully_shard, which has no FSDP2 internal "
            f"state attribute {name!r} (torch.distributed.fsdp._fully_shard's FSDPState): only what torch's "
            "register_fsdp_forward_method and share_comm_ctx read is provided. Use the public FSDPModule methods."
        )


_KEPT_AS = "_fsdp_compile_torch_state"


def torch_state_of(module: nn.Module, first_module_of_unit: nn.Module) -> TorchFSDPStateStandIn:
    """The unit's stand-in (made on first use, then kept on the unit's first module)."""
    state = first_module_of_unit.__dict__.get(_KEPT_AS)
    if state is None:
        state = TorchFSDPStateStandIn(module)
        first_module_of_unit.__dict__[_KEPT_AS] = state
    return state
