"""fsdp-compile: FSDP (ZeRO-3) built into ``torch.compile``.

``torch.compile(fully_shard(model))`` gives one graph per step in which every
all-gather and reduce-scatter is a functional collective that our FX passes
can schedule. The API mirrors ``torch.distributed.fsdp.fully_shard`` (FSDP2).
"""

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from fsdp_compile import debug
from fsdp_compile._compat import register_torch_log
from fsdp_compile._fsdp_param import FSDPParam
from fsdp_compile._fully_shard import (
    FSDPModule,
    GradientReductionHandle,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    replicate,
    share_comm_ctx,
)
from fsdp_compile.passes.registration import install_passes

install_passes()
register_torch_log("fsdp_compile", "fsdp_compile")
debug._dump_from_environment()

__all__ = [
    "fully_shard",
    "replicate",
    "FSDPModule",
    "FSDPParam",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "UnshardHandle",
    "GradientReductionHandle",
]
