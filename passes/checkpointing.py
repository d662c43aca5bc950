"""Activation checkpointing inside a compiled sharded model: keep torch 2.13's
partitioner off a path it gets wrong.

When a checkpointed region (``torch.utils.checkpoint``, full or selective)
recomputes an op that draws random numbers (anything tagged
``nondeterministic_seeded``: dropout, and SDPA even with ``dropout_p=0``),
AOTAutograd saves the RNG state for the backward and appends it to the
forward's outputs *after* the non-tensor values saved for the backward; the
``DeviceMesh`` objects that DTensor parameters bring are such values, so the
saved-tensor bookkeeping goes wrong ("expected all tensors_saved_with_vc_check
to be Tensors"). Saving those ops' outputs instead of recomputing them avoids
the RNG-state path entirely.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from fsdp_compile.base.compat import CheckpointPolicy, is_backward_node
from fsdp_compile.runtime.vocabulary import is_aten_kernel

log = logging.getLogger("fsdp_compile.passes.checkpointing")


def save_random_ops_in_checkpointed_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """Retag recomputed random ops (and their tuple outputs) ``MUST_SAVE``.

    Invariant: only ``meta["recompute"]`` of forward nodes that a checkpoint
    already tagged changes, and only for ``nondeterministic_seeded`` ops and
    the ``getitem`` nodes reading their results; nodes, edges and values are
    unchanged (a saved output equals what recomputation with the restored RNG
    state would give). Costs the memory of those outputs (for SDPA: the
    attention output and its log-sum-exp per layer).
    """
    retagged = []
    for node in gm.graph.nodes:
        if not is_aten_kernel(node) or is_backward_node(node) or "recompute" not in node.meta:
            continue
        if torch.Tag.nondeterministic_seeded not in node.target.tags:
            continue
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        for user in node.users:
            if user.target is operator.getitem and "recompute" in user.meta:
                user.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        retagged.append(node.name)
    if retagged:
        log.debug("saved instead of recomputed (random ops in checkpointed regions): %s", ", ".join(retagged))
    return gm
