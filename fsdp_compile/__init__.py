"""fsdp-compile: FSDP (ZeRO-3) built into ``torch.compile``.

``torch.compile(fully_shard(model))`` gives one graph per step in which every
all-gather and reduce-scatter is a functional collective that our FX passes
can schedule. The API mirrors ``torch.distributed.fsdp.fully_shard`` (FSDP2).
"""

from torch.distributed.fsdp import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy

from fsdp_compile import config, debug  # noqa: F401  (fsdp_compile.config.<option>, fsdp_compile.debug.dump)
from fsdp_compile._fsdp2_tuning import GradientReductionHandle
from fsdp_compile._fsdp_param import FSDPParam
from fsdp_compile._fully_shard import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    replicate,
    share_comm_ctx,
)
from fsdp_compile._local_shard_optimizer import step_on_local_shards

# Nothing here changes torch: our graph passes, the cache-key correction, the log alias
# and FSDP_COMPILE_DUMP take effect at the first fully_shard / replicate
# (fsdp_compile.passes.registration.install_passes).

__all__ = [
    "fully_shard",
    "replicate",
    "FSDPModule",
    "FSDPParam",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "UnshardHandle",
    "GradientReductionHandle",
    "step_on_local_shards",
]
