"""Install our graph passes into torch.compile's pipeline, chained with the user's.

Two slots:

* joint graph (``torch._functorch.config.joint_custom_pass``, one callable):
  reshard-after-forward tagging, before AOTAutograd partitions forward from
  backward. We wrap whatever is there, so a user's pass set before importing
  fsdp_compile still runs (set after: call :func:`install_passes` again).
* post-grad graphs, forward and backward (Inductor's
  ``post_grad_custom_post_pass``, which takes a list): bucketing, then
  reordering. We append ours to the list, keeping the user's passes.

Graphs without our annotations pass through both unchanged. The post-grad
passes run under Inductor only; ``aot_eager`` runs the traced graph as is.
"""

from __future__ import annotations

import logging

import torch.fx as fx

from fsdp_compile import config
from fsdp_compile._compat import (
    CustomGraphPass,
    get_joint_custom_pass,
    get_post_grad_custom_post_pass,
    hash_of_files,
    set_joint_custom_pass,
    set_post_grad_custom_post_pass,
)
from fsdp_compile.passes.bucketing import bucket_collectives
from fsdp_compile import debug
from fsdp_compile.passes.consistency import graph_name, insert_consistency_check
from fsdp_compile.passes.graph_utils import our_collectives
from fsdp_compile.passes.pinning import pin_schedule
from fsdp_compile.passes.reordering import reorder_for_overlap
from fsdp_compile.passes.reshard import tag_reshard_after_forward

log = logging.getLogger("fsdp_compile.passes")


def fsdp_joint_pass(gm: fx.GraphModule, joint_inputs) -> fx.GraphModule:
    """Our joint-graph passes, in order."""
    if config.reshard_pass:
        tag_reshard_after_forward(gm)
    debug.record_joint(gm)
    return gm


def fsdp_post_grad_pass(graph: fx.Graph) -> None:
    """Our post-grad passes, in order: bucketing, reordering, the cross-rank check,
    pinning the order."""
    if not our_collectives(graph):
        return
    config.validate()
    folder = debug.begin_graph(graph_name(graph).split()[0])
    debug.record_graph(folder, "0_input", graph)
    if config.bucketing:
        cap = int(config.bucket_cap_mb * 2**20) if config.bucket_mode == "cap" else None
        if config.bucket_mode == "auto":
            from fsdp_compile.passes.cost_model import choose_bucket_cap

            cap = choose_bucket_cap(graph, config.hardware_profile)
        buckets = bucket_collectives(graph, cap)
        debug.record_graph(folder, "1_bucketing", graph)
    if config.reorder:
        reorder_for_overlap(
            graph,
            prefetch_depth=config.prefetch_depth,
            reduce_scatter_depth=config.reduce_scatter_depth,
            max_inflight_bytes=config.max_inflight_bytes,
        )
        debug.record_graph(folder, "2_reordering", graph)
    debug.write_report(folder, graph, config.hardware_profile)
    log.debug("%s: %d collective(s) after our passes", graph_name(graph), len(our_collectives(graph)))
    check = insert_consistency_check(graph) if config.check_collective_consistency else None
    # Always: fixes the collective order (and any overlap) against Inductor's own reordering.
    pin_schedule(graph, config.reduce_scatter_depth, first=check)
    debug.record_graph(folder, "3_pinned", graph)


class _ChainedJointPass:
    """Runs the pass that was installed before us, then ours."""

    def __init__(self, previous) -> None:
        self.previous = previous

    def __call__(self, gm: fx.GraphModule, joint_inputs) -> fx.GraphModule:
        if self.previous is not None:
            gm = self.previous(gm, joint_inputs)
        return fsdp_joint_pass(gm, joint_inputs)


class FSDPPostGradPass(CustomGraphPass):
    """Inductor post-grad pass; its uuid covers our pass code and config, so
    Inductor's caches never reuse a graph compiled under other settings."""

    def __call__(self, graph: fx.Graph) -> None:
        fsdp_post_grad_pass(graph)

    def uuid(self):
        import os

        here = os.path.dirname(__file__)
        files = tuple(sorted(os.path.join(here, f) for f in os.listdir(here) if f.endswith(".py")))
        return hash_of_files(files, repr(sorted(config.snapshot().items())))


_POST_GRAD_PASS = FSDPPostGradPass()


def install_passes() -> None:
    """Idempotent: make sure each of our passes is in its chain exactly once."""
    current = get_joint_custom_pass()
    if not isinstance(current, _ChainedJointPass):
        set_joint_custom_pass(_ChainedJointPass(current))
    post = get_post_grad_custom_post_pass()
    passes = list(post) if isinstance(post, (list, tuple)) else ([] if post is None else [post])
    if not any(isinstance(p, FSDPPostGradPass) for p in passes):
        set_post_grad_custom_post_pass(passes + [_POST_GRAD_PASS])
