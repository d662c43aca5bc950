"""``torch.compile`` backends for tests: our passes without Inductor's code generation.

``"inductor_passes"`` runs what Inductor runs up to its post-grad passes
(decompositions, joint-graph passes, our reshard-after-forward tagging, the
min-cut partitioner, Inductor's post-grad passes and ours: bucketing,
reordering, pinning, the gloo transport), then runs the resulting forward and
backward graphs op by op instead of generating and compiling C++ for them.

What it checks is what our passes do to a graph: every bucketed, reordered,
re-gathered collective runs for real, and the numbers must come out as under
Inductor (the graphs hold the same decomposed ops; only Inductor's fusion and
its kernels' rounding are missing). What it does not check is Inductor's code
generation for our graphs; the suite keeps that under real ``"inductor"`` in
the parity, real-model, schedule and tensor-parallel tests. On this suite's
2-core machine a first Inductor compile of a small model spends most of its
time compiling C++ (64 s cold against 9 s warm for one test), which is why
feature tests whose subject is not code generation use this backend.

``"aot_eager_passes"`` is Dynamo's ``aot_eager`` (no decompositions) with our joint
pass before the min-cut partitioner and our post-grad passes after it: the graphs
hold eager's own ops, bucketed, reordered, re-gathered and pinned as under Inductor,
so a 2-rank run is bitwise equal to eager (over more ranks a bucketed reduce-scatter
may sum in another order than eager's), at ``aot_eager``'s compile cost. Tests whose
subject is our front-end and passes compile once with it instead of twice (``aot_eager``
for the bitwise check, ``inductor_passes`` for the passes).

Registered by name only in test processes (the pytest plugin and every rank of
a :class:`~fsdp_compile.testing.RankPool`): importing ``fsdp_compile`` registers
nothing.
"""

from __future__ import annotations

INDUCTOR_PASSES = "inductor_passes"
AOT_EAGER_PASSES = "aot_eager_passes"


def inductor_passes(gm, example_inputs):
    """A ``torch.compile`` backend: Inductor's pipeline through the post-grad passes, the
    graphs then run as they are. AOTAutograd's cache is off for these graphs: what this
    backend produces is not Inductor's compiled code and must never be loaded as such."""
    import torch._functorch.config as functorch_config

    from fsdp_compile.testing._torch_internals import compile_fx_up_to_post_grad

    with functorch_config.patch(enable_autograd_cache=False):
        return compile_fx_up_to_post_grad()(gm, example_inputs)


def aot_eager_passes(gm, example_inputs):
    """A ``torch.compile`` backend: ``aot_eager`` (no decompositions, the graphs run op
    by op) with our joint pass before the partitioner and our post-grad passes after
    it. The graphs hold the ops eager runs, bucketed, reordered and re-gathered as under
    Inductor, so on 2 ranks the numbers must be bitwise eager's: one compile checks what
    ``aot_eager`` and ``inductor_passes`` check apart, except our passes on Inductor's
    decomposed graphs. (A graph without a backward, under ``no_grad``, gets the
    post-grad passes only, as under Inductor: the joint pass tags what a backward re-gathers.)"""
    from fsdp_compile.passes.registration import fsdp_joint_pass, fsdp_post_grad_pass, install_passes
    from fsdp_compile.testing._torch_internals import aot_eager_with_passes

    # As fully_shard does: the watch on frame compiles that attributes graph breaks (our
    # passes warn of them), which torch._dynamo.reset() drops, and FSDP_COMPILE_DUMP.
    install_passes()
    return aot_eager_with_passes(fsdp_joint_pass, fsdp_post_grad_pass)(gm, example_inputs)


def register_test_backends() -> None:
    """Idempotent: make ``torch.compile(..., backend="inductor_passes")`` and
    ``backend="aot_eager_passes"`` resolve in this process."""
    from fsdp_compile.testing._torch_internals import register_dynamo_backend

    register_dynamo_backend(INDUCTOR_PASSES, inductor_passes)
    register_dynamo_backend(AOT_EAGER_PASSES, aot_eager_passes)
