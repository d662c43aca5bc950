"""Traceable collective ops and mesh helpers; eager and compiled runs execute the same ops."""

from fsdp_compile.runtime.collectives import (
    ANNOTATION_KEY,
    ShardLayout,
    all_gather_shard,
    collective_annotation,
    replicate_with_grad_sync,
    tag_of,
)

__all__ = [
    "ANNOTATION_KEY",
    "ShardLayout",
    "all_gather_shard",
    "collective_annotation",
    "replicate_with_grad_sync",
    "tag_of",
]
