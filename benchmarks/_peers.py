"""Peers of fsdp_compile that the benchmarks compare against, on the newest torch:

* **Inductor's own collective bucketing and overlap scheduling**
  (``torch/_inductor/fx_passes/overlap_scheduling.py``, switched on by
  ``torch._inductor.config.aten_distributed_optimizations.enable_overlap_scheduling``);
* **SimpleFSDP** (torchtitan's ``experiments/graph_trainer``): every parameter is a
  ``Shard(0)`` DTensor, and reading it as a module attribute all-gathers it in the
  graph with DTensor's own ``redistribute`` (its gradient is reduce-scattered by
  ``redistribute``'s backward); compiled with Inductor's
  ``manual_overlap_bucketing`` (``fx_passes/overlap_manual_scheduling.py``), one
  bucket per transformer block, as torchtitan's ``transformer_block_bucketing``
  pass does. :func:`simple_fsdp` below is a small re-implementation of that idea,
  not torchtitan's code (torchtitan is not a dependency).

Both need ``triton`` importable (torch 2.15 with triton runs them on CPU; the torch
2.13 CPU build has no triton): :func:`unavailable_reason` says why they cannot run.
Everything here is benchmark-only, so the private torch APIs it touches stay in this
file (the library's own are in ``fsdp_compile/base/compat.py``). Every torch import is
local, so this module imports on any torch.

Inductor options are set with ``torch._inductor.config.patch`` around the peer's
own steps only (:func:`inductor_options`), never by assignment: assigning
``post_grad_custom_post_pass`` would replace fsdp_compile's passes too.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

from benchmarks import _models


def unavailable_reason() -> str | None:
    """``None`` when the peers can run here, else why not (one sentence, no full stop)."""
    import importlib.util

    import torch

    needs = "Inductor's collective bucketing/overlap scheduling and manual_overlap_bucketing (SimpleFSDP) need"
    if importlib.util.find_spec("triton") is None:
        return f"{needs} `triton` importable (newest torch); torch {torch.__version__} here has no triton"
    try:
        import torch._inductor.config as inductor_config
        from torch._inductor.fx_passes.bucketing import deduplicate_wait_tensors  # noqa: F401
        from torch._inductor.fx_passes.overlap_manual_scheduling import manual_overlap_bucketing  # noqa: F401
        from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing  # noqa: F401

        inductor_config.aten_distributed_optimizations.enable_overlap_scheduling  # noqa: B018
        inductor_config.aten_distributed_optimizations.pre_bucketing_fsdp_collectives  # noqa: B018
    except (ImportError, AttributeError) as e:
        return f"{needs} a newer torch than {torch.__version__} ({e})"
    return None


def skip_line(what: str) -> str | None:
    """The one line printed instead of the peers' rows, or ``None`` if they run."""
    reason = unavailable_reason()
    return None if reason is None else f"Skipped {what}: {reason}."


@contextlib.contextmanager
def quiet_cpu_estimates():
    """Inductor's roofline estimates log "No accelerator available for TFLOPS
    estimation" (and DRAM bandwidth) for every compute node on a machine without
    a GPU; those estimates are 0 and the benchmarks say so in their text."""
    logger = logging.getLogger("torch._inductor.utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# --------------------------------------------------------------------------- #
# Cost estimates for Inductor's overlap scheduler from fsdp_compile's cost model


def cost_model_estimator(profile) -> Callable:
    """``custom_runtime_estimation(node, override_size) -> ms | None`` for Inductor's
    overlap scheduler, from fsdp_compile's cost model on ``profile`` (a name or a
    ``HardwareProfile``). Inductor's own compute estimates are a GPU roofline: 0 on
    a machine without an accelerator, so without this the scheduler sees no compute
    to hide communication behind. ``override_size`` (bytes of input + output of a
    bucket; 0 asks for the fixed latency) is converted to the buffer our model charges."""
    from fsdp_compile.passes.cost_model import collective_kind, collective_seconds, compute_seconds, get_profile

    profile = get_profile(profile) if isinstance(profile, str) else profile
    notes: set = set()

    def estimate(node, override_size=None):
        kind = collective_kind(node)
        if kind is not None:
            world = node.args[-2] if kind != "all_reduce" else 2
            if override_size is None:
                return collective_seconds(node, profile, notes, world) * 1e3
            if kind == "all_reduce":
                buffer = override_size / 2  # input + output of the same size
            else:
                buffer = override_size * world / (world + 1)  # gathered/full buffer + one shard
            return profile.collective_seconds(kind, int(buffer), world) * 1e3
        if node.op == "call_function":
            return compute_seconds(node, profile, notes) * 1e3
        return None

    return estimate


def overlap_schedule(gm, profile, *, pre_bucketing: bool = True):
    """Inductor's overlap scheduler with collective bucketing on ``gm`` (in place), as
    ``enable_overlap_scheduling`` + ``collective_bucketing`` run it, but without the
    ordering dependencies (the graph's node order is the schedule, for our simulator)
    and with :func:`cost_model_estimator`'s estimates. ``pre_bucketing``: Inductor's
    default first merges FSDP collectives into buckets sized by its NCCL model."""
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing

    with quiet_cpu_estimates():
        schedule_overlap_bucketing(
            gm,
            collective_bucketing=True,
            insert_overlap_deps=False,
            compute_estimator="analytical",  # "benchmark" (the default) times kernels on a GPU
            custom_runtime_estimation=cost_model_estimator(profile),
            pre_bucketing_fsdp_collectives=pre_bucketing,
        )
    return gm


def manual_bucketing(gm, plans, *, insert_overlap_deps: bool = False):
    """``manual_overlap_bucketing`` on ``gm`` (in place): one bucket per entry of
    ``plans``, each bucket's all-gathers prefetched during the previous one and its
    reduce-scatters waited during the next.

    Waits on the same collective are merged first (``deduplicate_wait_tensors``,
    which Inductor runs right after the custom post-grad passes): with tied
    embeddings, CSE leaves one all-gather with two waits, which the bucketer rejects."""
    from torch._inductor.fx_passes.bucketing import deduplicate_wait_tensors
    from torch._inductor.fx_passes.overlap_manual_scheduling import manual_overlap_bucketing

    deduplicate_wait_tensors(gm.graph)
    manual_overlap_bucketing(gm, module_bucket_plans=plans, insert_overlap_deps=insert_overlap_deps)
    return gm


def _has_waits(graph) -> bool:
    import torch

    return bool(graph.find_nodes(op="call_function", target=torch.ops._c10d_functional.wait_tensor.default))


def _manual_pass(plans):
    """An Inductor post-grad pass running :func:`manual_bucketing` with ordering
    dependencies (what torchtitan installs), keyed for Inductor's caches."""
    from fsdp_compile.base.compat import CustomGraphPass, hash_of_files

    class ManualOverlapBucketingPass(CustomGraphPass):
        def __call__(self, graph) -> None:
            if _has_waits(graph):  # compute-only copies (world size 1) have no collective
                manual_bucketing(graph.owning_module, plans, insert_overlap_deps=True)

        def uuid(self):
            return hash_of_files((__file__,), repr(plans))

    return ManualOverlapBucketingPass()


#: Inductor options torchtitan's graph_trainer sets next to its bucketing passes.
_TORCHTITAN_OPTIONS = {
    "allow_buffer_reuse": False,
    "reorder_for_peak_memory": False,
    "reorder_for_compute_comm_overlap": False,
}


def inductor_options(pass_name: str, model=None) -> dict:
    """Options for ``torch._inductor.config.patch`` while a peer compiles.

    ``"manual"``: ``manual_overlap_bucketing`` with ``benchmarks._models.bucket_plans``
    as the (only) post-grad custom pass, as torchtitan's inductor backend does.
    ``"auto"``: Inductor's overlap scheduling with collective bucketing
    (``aten_distributed_optimizations``), analytical estimates (the default,
    ``"benchmark"``, times kernels on a GPU): on CPU its compute estimates are 0."""
    if pass_name == "manual":
        return {"post_grad_custom_post_pass": _manual_pass(_models.bucket_plans(model)), **_TORCHTITAN_OPTIONS}
    if pass_name == "auto":
        return {
            "aten_distributed_optimizations.enable_overlap_scheduling": True,
            "aten_distributed_optimizations.collective_bucketing": True,
            "aten_distributed_optimizations.compute_estimator": "analytical",
            **_TORCHTITAN_OPTIONS,
        }
    raise ValueError(f"unknown peer pass {pass_name!r}")


# --------------------------------------------------------------------------- #
# SimpleFSDP-style sharding (own code; the idea of torchtitan's simple_fsdp.py)


def _all_gather(shard):
    """The full parameter from its ``Shard(0)`` DTensor: DTensor's all-gather,
    traced into the graph; the gradient (``Partial``) goes back through
    ``redistribute``'s backward as a reduce-scatter (averaged, as FSDP)."""
    from torch.distributed.tensor import Partial, Replicate

    return shard.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial("avg")])


def _recompute_gathers():
    """Selective checkpointing: recompute the gather (collective, wait, views) in the
    backward instead of saving the full parameter (``reshard_after_forward=True``)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(lambda ctx, op, *args, **kwargs: CheckpointPolicy.MUST_RECOMPUTE)


def _gathered(shard, reshard: bool):
    if not reshard:
        return _all_gather(shard)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(_all_gather, shard, use_reentrant=False, context_fn=_recompute_gathers)


_classes: dict = {}


def _root_forward(self, *args, **kwargs):
    """The root's forward, a code object of its own: Dynamo marks a frame's code to
    be skipped when it gives up on it (as it does on FSDP2's root forward, whose hooks
    are ``torch._dynamo.disable``-d), and the other setups compile the same model class."""
    return self._simple_fsdp_base.forward(self, *args, **kwargs)


def _sharded_class(cls: type, names: tuple[str, ...], root: bool) -> type:
    key = (cls, names, root)
    if key not in _classes:
        attrs = {
            name: property(lambda self, name=name: _gathered(self._parameters[name], self._simple_fsdp_reshard))
            for name in names
        }
        if root:
            attrs.update(forward=_root_forward, _simple_fsdp_base=cls)
        _classes[key] = type(f"SimpleFSDP{cls.__name__}", (cls,), attrs)
    return _classes[key]


def simple_fsdp(model, mesh, reshard_after_forward: Callable[[str], bool]):
    """Shard every parameter of ``model`` over the 1-D ``mesh`` (``Shard(0)``
    DTensors under the original names; tied parameters stay tied) and make reading
    it as an attribute return the all-gathered tensor. ``reshard_after_forward(fqn)``
    says, per module, whether its gathered parameters are recomputed in the backward
    (True) or saved from the forward (False). Returns ``model``."""
    import torch.nn as nn
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded: dict[int, nn.Parameter] = {}
    for fqn, module in list(model.named_modules()):
        names = tuple(name for name, p in module._parameters.items() if p is not None)
        if not names and module is not model:
            continue
        for name in names:
            p = module._parameters[name]
            if id(p) not in sharded:
                sharded[id(p)] = nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]), requires_grad=p.requires_grad)
            module._parameters[name] = sharded[id(p)]
        module._simple_fsdp_reshard = bool(reshard_after_forward(fqn))
        module.__class__ = _sharded_class(type(module), names, root=module is model)
    return model
