"""Traceable collective ops, the graph vocabulary they write, and mesh helpers; eager and
compiled runs execute the same ops."""

from fsdp_compile.runtime.collectives import CollectiveSpec, ShardLayout, gather_with_grad_sync
from fsdp_compile.runtime.vocabulary import CollectiveTag, Role, tag_of

__all__ = ["CollectiveSpec", "CollectiveTag", "Role", "ShardLayout", "gather_with_grad_sync", "tag_of"]
