"""FX graph passes over the collectives our runtime emits, and their registration."""

from fsdp_compile.passes.registration import install_passes
from fsdp_compile.passes.reshard import regather_from_post_forward_shards, tag_reshard_after_forward

__all__ = ["install_passes", "regather_from_post_forward_shards", "tag_reshard_after_forward"]
