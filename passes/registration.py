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

import functools
import hashlib
import logging
import os
import re
import time
import warnings

import torch.fx as fx

from fsdp_compile.base import config, dumps
from fsdp_compile.base.compat import (
    CustomGraphPass,
    current_compile_attempt,
    current_recompile_reason,
    dynamo_graph_break_counts,
    get_joint_custom_pass,
    get_post_grad_custom_post_pass,
    group_backend,
    group_rank,
    register_torch_log,
    set_joint_custom_pass,
    set_post_grad_custom_post_pass,
    watch_dynamo_frame_compiles,
)
from fsdp_compile.passes.backward_tags import restore_backward_tags
from fsdp_compile.passes.cache_keys import make_graph_cache_keys_stable
from fsdp_compile.passes.checkpointing import save_random_ops_in_checkpointed_regions
from fsdp_compile.passes.consistency import insert_consistency_check
from fsdp_compile.passes.pinning import pin_schedule
from fsdp_compile.passes.report import write_graph_report, write_joint_record
from fsdp_compile.passes.reshard import regather_from_post_forward_shards, tag_reshard_after_forward
from fsdp_compile.passes.schedule import bucket_cap_bytes, schedule_collectives
from fsdp_compile.passes.transport import lower_to_all_to_all
from fsdp_compile.runtime.vocabulary import graph_name, our_collectives, unit_names_in

log = logging.getLogger("fsdp_compile.passes")

#: ``(graph name, "joint" | "post_grad", seconds)`` for every graph our passes ran on in
#: this process, in order (what a compile spends in our passes; benchmarks.step_time sums it).
pass_seconds: list[tuple[str, str, float]] = []


def _record_pass_time(graph: fx.Graph, stage: str, start: float) -> None:
    seconds = time.perf_counter() - start
    pass_seconds.append((graph_name(graph), stage, seconds))
    log.debug("%s: our %s passes took %.3f s", graph_name(graph), stage, seconds)


def fsdp_joint_pass(gm: fx.GraphModule, joint_inputs) -> fx.GraphModule:
    """Our joint-graph passes, in order."""
    start = time.perf_counter()
    _warn_if_recompile(gm)
    _warn_if_graph_break(gm.graph)
    restore_backward_tags(gm.graph)  # (torch < 2.13 drops them)
    if unit_names_in(gm.graph):
        save_random_ops_in_checkpointed_regions(gm)  # before our tags: only a checkpoint's are seen
    if config.reshard_pass:
        tag_reshard_after_forward(gm)
        regather_from_post_forward_shards(gm)
    write_joint_record(gm)
    _record_pass_time(gm.graph, "joint", start)
    return gm


def fsdp_post_grad_pass(graph: fx.Graph) -> None:
    """Our post-grad passes, in order: bucketing, reordering, the cross-rank check,
    (with ``config.gloo_all_to_all``) the gloo transport, pinning the order."""
    if not our_collectives(graph):
        return
    start = time.perf_counter()
    _warn_if_graph_break(graph)
    restore_backward_tags(graph)  # (no-op: the joint pass restored them, where it ran)
    config.validate()
    folder = dumps.begin_graph(graph_name(graph).split()[0])
    dumps.record_graph(folder, "0_input", graph)
    cap = bucket_cap_bytes(graph) if config.bucketing else None
    schedule_collectives(graph, cap, lambda stage: dumps.record_graph(folder, stage, graph))
    write_graph_report(folder, graph, config.hardware_profile)
    log.debug("%s: %d collective(s) after our passes", graph_name(graph), len(our_collectives(graph)))
    check = insert_consistency_check(graph) if config.check_collective_consistency else None
    if config.gloo_all_to_all:
        lower_to_all_to_all(graph, lambda group_name: group_backend(group_name) == "gloo", group_rank)
        dumps.record_graph(folder, "2b_transport", graph)
    # Always: fixes the collective order (and any overlap) against Inductor's own reordering.
    pin_schedule(graph, config.reduce_scatter_depth, first=check)
    dumps.record_graph(folder, "3_pinned", graph)
    _record_pass_time(graph, "post_grad", start)


#: Dynamo's graph-break counts (it counts per process, by reason) when the frame now
#: being compiled started; ``None`` while no frame is (a backward compiled lazily).
_breaks_at_frame_start: dict[str, int] | None = None
#: The counts when :func:`_warn_if_graph_break` last looked.
_breaks_last_seen: dict[str, int] = {}


def _frame_compile_started() -> None:
    global _breaks_at_frame_start
    _breaks_at_frame_start = dynamo_graph_break_counts()


def _frame_compile_ended() -> None:
    global _breaks_at_frame_start
    _breaks_at_frame_start = None


def watch_frame_compiles() -> bool:
    """Idempotent: know where each Dynamo frame compile starts (``torch._dynamo.reset()``
    forgets it); returns whether it was known already."""
    return watch_dynamo_frame_compiles(_frame_compile_started, _frame_compile_ended)


def _warn_if_graph_break(graph: fx.Graph) -> None:
    """Dynamo broke the frame it is compiling, and this graph of that frame runs sharded
    units: name them. Only breaks counted since this frame's compile started are its own
    (not another model's, e.g. FSDP2's disabled hooks in a model compiled earlier);
    each is reported once. Right after ``torch._dynamo.reset()`` (which drops the
    watch on frame compiles) the breaks since the last look stand in, this once."""
    global _breaks_at_frame_start, _breaks_last_seen
    units = unit_names_in(graph)
    if not units:
        return
    counts = dynamo_graph_break_counts()
    if watch_frame_compiles():
        if _breaks_at_frame_start is None:
            return  # a lazily compiled backward: its forward's graph reported the frame
        since = _breaks_at_frame_start
        _breaks_at_frame_start = counts
    else:
        since = _breaks_last_seen
    _breaks_last_seen = counts
    new = [reason for reason, n in counts.items() if n > since.get(reason, 0)]
    if not new:
        return
    reasons = "; ".join(r.strip().splitlines()[0][:160] for r in new)
    warnings.warn(
        f"fsdp_compile: graph break in a compiled frame that runs the sharded unit(s) "
        f"{', '.join(repr(u or '(root)') for u in units)} ({reasons}). Collectives on either side "
        "of a break cannot be bucketed or overlapped together. TORCH_LOGS=graph_breaks shows where; "
        "fsdp_compile.debug.dump(DIR) writes each graph and its collectives.",
        stacklevel=2,
    )


def _warn_if_recompile(gm: fx.GraphModule) -> None:
    """A frame compiled again that holds sharded units, because of a guard on sharding state
    (our units' attributes, or a guard our code made): say which units, which guard, and
    where to look. A guard of the model's own (a module attribute such as a layer index,
    grad mode, an input's shape) recompiles the unsharded model as well, and FSDP2's: Dynamo
    reports those (``TORCH_LOGS=recompiles``), we say nothing."""
    attempt = current_compile_attempt()
    if attempt is None or not attempt[1]:
        return
    units = unit_names_in(gm.graph)
    if not units:
        return
    reason = current_recompile_reason()
    guard = reason.strip().splitlines()[0] if reason else ""
    if reason is not None and not _guard_on_sharding_state(guard):
        return
    warnings.warn(
        f"fsdp_compile: recompiling a graph (frame {attempt[0]}, compile #{attempt[1] + 1}) that holds "
        f"the sharded unit(s) {', '.join(repr(u or '(root)') for u in units)}"
        + (f", because of a guard on sharding state ({guard[:200]})" if guard else "")
        + ". Expected after the first switch of a set_requires_gradient_sync / set_requires_all_reduce / "
        "set_reshard_after_* mode; otherwise TORCH_LOGS=recompiles shows every guard that failed, and "
        "fsdp_compile.debug.dump(DIR) writes each compiled graph.",
        stacklevel=2,
    )


def _guard_on_sharding_state(guard: str) -> bool:
    """Whether a failed guard (Dynamo's line: the guard, then ``folder/file.py:line`` of the
    code that made it) is on our units' state: an attribute of ours, or made by a file of
    this package; an unreadable reason counts as ours. A tensor check failing on a shard's
    ``local_view`` (its ``requires_grad``, dtype, shape) is the parameter's own: the unsharded
    model checks the parameter the same way (freezing a layer recompiles it too)."""
    if _LOCAL_VIEW_TENSOR_CHECK.search(guard):
        return False
    if "Unable to find recompilation reasons" in guard or "._fsdp_" in guard:
        return True
    return _library_files_pattern().search(guard) is not None


#: Dynamo's line for a failed tensor check on a sharded parameter's local view, e.g.
#: ``0/0: tensor 'self._modules['lin']._fsdp_params['weight'].local_view' requires_grad mismatch``.
_LOCAL_VIEW_TENSOR_CHECK = re.compile(r"tensor '.*\._fsdp_params\['\w+'\]\.local_view' \w+ mismatch")


@functools.cache
def _library_files_pattern() -> re.Pattern:
    """``folder/file.py`` of every module of this package (as Dynamo names a guard's code),
    not as the tail of a longer folder name (torch's ``fx_passes/bucketing.py``)."""
    import fsdp_compile.base
    import fsdp_compile.runtime

    base = os.path.dirname(os.path.abspath(fsdp_compile.base.__file__))
    folders = (
        os.path.dirname(base),
        base,
        os.path.dirname(os.path.abspath(__file__)),
        os.path.dirname(os.path.abspath(fsdp_compile.runtime.__file__)),
    )
    names = []
    for folder in folders:  # the front end's, the base's, ours, the runtime's
        names += [f"{os.path.basename(folder)}/{f}" for f in os.listdir(folder) if f.endswith(".py")]
    return re.compile(r"(?<![\w.])(?:" + "|".join(re.escape(n) for n in sorted(names)) + r"):\d+")


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
        settings = repr(sorted(config.snapshot().items())) + _rank_if_graphs_are_per_rank()
        return hashlib.sha256(_digest_of_sources() + settings.encode()).digest()


@functools.cache
def _digest_of_sources() -> bytes:
    """SHA-256 of our passes' and runtime's source files (the runtime's ops are opaque
    nodes in the graphs Inductor caches), read once per process, when this module is
    imported (below), with the code it loads. Read at each compile, as it was, the key
    followed the files rather than the code that ran: edited while a job ran, the
    job's ranks stored the old code's graphs under the new code's key, and the next run
    loaded them as its own."""
    import fsdp_compile.runtime

    digest = hashlib.sha256()
    for directory in (os.path.dirname(__file__), os.path.dirname(fsdp_compile.runtime.__file__)):
        for name in sorted(f for f in os.listdir(directory) if f.endswith(".py")):
            with open(os.path.join(directory, name), "rb") as source:
                digest.update(name.encode() + b"\0" + source.read())
    return digest.digest()


def _rank_if_graphs_are_per_rank() -> str:
    """The global rank, where the gloo transport may make a rank's graph its own (an
    all-gather sends a rank nothing of its own: ``lower_to_all_to_all``), so that ranks
    sharing a cache directory never load each other's graphs; empty otherwise."""
    import torch.distributed as dist

    if not config.gloo_all_to_all or not dist.is_initialized():
        return ""
    return f" rank {dist.get_rank()}"


_digest_of_sources()  # now, with the code this process loaded
_POST_GRAD_PASS = FSDPPostGradPass()
#: Whether the once-per-process part of :func:`install_passes` ran.
_log_and_dump_set_up = False


def install_passes() -> None:
    """Idempotent: make sure each of our passes is in its chain exactly once (and that
    graphs with DTensor parameters get the same Inductor cache key in every process,
    ``TORCH_LOGS="+fsdp_compile"`` is known, ``FSDP_COMPILE_DUMP`` is honoured).
    Runs at every ``fully_shard`` / ``replicate``, never at import (a process that
    imports the package and shards nothing compiles as without it), and again each
    time because ``torch._dynamo.reset()`` drops the watch on frame compiles that
    attributes graph breaks to the frame that broke."""
    global _log_and_dump_set_up
    if not _log_and_dump_set_up:
        _log_and_dump_set_up = True
        register_torch_log("fsdp_compile", "fsdp_compile")
        dumps.dump_from_environment()
    make_graph_cache_keys_stable()
    watch_frame_compiles()
    current = get_joint_custom_pass()
    if not isinstance(current, _ChainedJointPass):
        set_joint_custom_pass(_ChainedJointPass(current))
    post = get_post_grad_custom_post_pass()
    passes = list(post) if isinstance(post, (list, tuple)) else ([] if post is None else [post])
    if not any(isinstance(p, FSDPPostGradPass) for p in passes):
        set_post_grad_custom_post_pass(passes + [_POST_GRAD_PASS])
