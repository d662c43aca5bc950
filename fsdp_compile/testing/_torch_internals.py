"""What ``torch.compile`` backends, test processes and benchmarks need of torch's private
API, in one place (the library's own is in :mod:`fsdp_compile.base.compat`). Nothing
here is used by the library: only by ``fsdp_compile.testing``, ``tests/`` and
``benchmarks/``. Each name is listed with the torch file it comes from (torch 2.13).
"""

from __future__ import annotations

import torch

__all__ = [
    "compile_fx_up_to_post_grad",
    "aot_eager_with_passes",
    "control_deps_runs_eagerly",
    "register_dynamo_backend",
    "reset_dynamo",
    "compile_counter",
    "aot_autograd_backend",
    "register_fake_process_group",
    "compile_in_this_process",
    "skip_side_effect_messages",
    "inductor_comm_overlap_flags",
]


def compile_fx_up_to_post_grad():
    """A ``torch.compile`` backend running Inductor's pipeline (decompositions, joint
    passes, partitioner, post-grad passes) but no code generation: the graphs run
    as they are (benchmarks/scale.py traces models far larger than this machine
    on fake tensors). Copies what torch/_inductor/compile_fx.py's
    ``compile_fx_inner`` does before lowering (torch 2.13 internals)."""
    from functorch.compile import make_boxed_func
    from torch._inductor.compile_fx import _recursive_post_grad_passes, compile_fx, fake_tensor_prop, view_to_reshape
    from torch._inductor.virtualized import V

    def up_to_post_grad(gm, example_inputs, **kwargs):
        view_to_reshape(gm)
        with torch.no_grad():
            fake_mode = fake_tensor_prop(gm, example_inputs)
        with V.set_fake_mode(fake_mode):
            _recursive_post_grad_passes(gm, is_inference=kwargs.get("is_inference", False))
        return make_boxed_func(gm)

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=up_to_post_grad)

    return backend


def aot_eager_with_passes(joint_pass, graph_pass):
    """A ``torch.compile`` backend: Dynamo's ``aot_eager`` (AOTAutograd without
    decompositions, the min-cut partitioner, the graphs run op by op) with
    ``joint_pass(joint_gm, joint_inputs)`` run on the joint graph before the
    partitioner and ``graph_pass(graph)`` on the forward and the backward graph after
    it, where Inductor runs its joint and post-grad custom passes
    (torch/_dynamo/backends/debugging.py ``aot_eager``; torch 2.13 internals)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition(joint, joint_inputs, **kwargs):
        joint = joint_pass(joint, joint_inputs) or joint
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def compile_graph(gm, example_inputs):
        graph_pass(gm.graph)
        return boxed_nop(gm, example_inputs)

    return aot_autograd(
        fw_compiler=compile_graph,
        bw_compiler=compile_graph,
        partition_fn=partition,
        keep_inference_input_mutations=True,
    )


def control_deps_runs_eagerly() -> bool:
    """torch/_inductor/fx_passes/control_dependencies.py: whether ``control_deps`` (our
    pinning pass wraps nodes in it) has an eager kernel, so a pinned graph runs op by op
    (``fsdp_compile.testing``'s ``inductor_passes``); torch 2.11's has only Inductor's lowering."""
    from torch._inductor.fx_passes.control_dependencies import control_deps

    return bool(getattr(control_deps, "py_kernels", None))


def register_dynamo_backend(name: str, compiler_fn) -> None:
    """torch/_dynamo/backends/registry.py: make ``torch.compile(backend=name)`` resolve to
    ``compiler_fn`` in this process; idempotent (the registry refuses a name twice)."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if _COMPILER_FNS.get(name) is not compiler_fn:
        _COMPILER_FNS.pop(name, None)
        register_backend(compiler_fn=compiler_fn, name=name)


def reset_dynamo() -> None:
    """torch/_dynamo/__init__.py: forget every compiled frame and Dynamo's per-code state."""
    torch._dynamo.reset()


class _GraphCounter:
    """A ``torch.compile`` backend that runs ``backend`` and counts (``frame_count``) and
    keeps (``graphs``) the graphs it compiled. A graph whose compilation raised is not
    counted: with ``dynamic=True`` AOTAutograd can ask Dynamo to restart its analysis
    (scalar tensorification, torch/fx/passes/_tensorify_python_scalars.py), and Dynamo then
    hands the backend the frame again; torch/_dynamo/testing.py's
    ``CompileCounterWithBackend`` counted that frame twice under ``aot_eager`` and Inductor
    but once under ``eager``."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.frame_count = 0
        self.graphs: list = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo import lookup_backend

        compiled = lookup_backend(self.backend)(gm, example_inputs)
        self.frame_count += 1
        self.graphs.append(gm)
        return compiled


def compile_counter(backend) -> _GraphCounter:
    """A backend that runs ``backend`` and counts the graphs it compiled (see :class:`_GraphCounter`)."""
    return _GraphCounter(backend)


def aot_autograd_backend(forward_compiler, backward_compiler, partitioner: str):
    """torch/_dynamo/backends/common.py + torch/_functorch/partitioners.py: an
    AOTAutograd backend with the given graph compilers and partitioner
    (``"min_cut"``, Inductor's, or ``"default"``, ``aot_eager``'s)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    partition_fn = min_cut_rematerialization_partition if partitioner == "min_cut" else default_partition
    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler, partition_fn=partition_fn)


def register_fake_process_group() -> None:
    """torch/testing/_internal/distributed/fake_pg.py registers backend "fake"."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401


def compile_in_this_process(threads: int = 1) -> None:
    """torch/_inductor/config.py ``compile_threads``: Inductor compiles kernels in this
    process, on ``threads`` threads, instead of in a pool of worker subprocesses
    (several hundred MB each, per process that compiles).

    On more than one thread each C++ kernel's compiler runs from a thread of a
    ``ThreadPoolExecutor`` (async_compile.py ``AsyncCompile.pool``; the pool of worker
    subprocesses is Triton's only). Ranks of one machine compile the same kernels and
    each kernel's build holds a file lock: on one thread a rank waits for the lock of
    the kernel another rank is building, so they build one kernel at a time between
    them, in lock-step; on two they build two. The worker-subprocess pool stays off:
    ``TORCH_WARM_POOL=0`` stops Dynamo's Inductor backend from starting it, and
    ``worker_start_method="fork"`` makes a daemonic process (a ``RankPool`` rank) refuse
    it (``_process_pool_allowed``). A torch without that check compiles on one thread.
    """
    import os

    import torch._inductor.async_compile as async_compile
    import torch._inductor.config as inductor_config

    if threads > 1 and hasattr(async_compile, "_process_pool_allowed"):
        os.environ["TORCH_WARM_POOL"] = "0"
        inductor_config.worker_start_method = "fork"
        inductor_config.compile_threads = threads
    else:
        inductor_config.compile_threads = 1


def skip_side_effect_messages() -> None:
    """torch/_dynamo/config.py ``side_effect_replay_policy = "silent"``: Dynamo stops
    formatting a message, with the user's stack, for every object a graph mutates (it
    builds them whether or not ``TORCH_LOGS=side_effects`` is on; a sharded forward
    mutates each parameter's record). Test processes only: the messages cost a few
    percent of every compile."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.side_effect_replay_policy = "silent"


def inductor_comm_overlap_flags() -> dict[str, bool]:
    """torch/_inductor/config.py: the Inductor flags that make its scheduler move
    collectives and waits to overlap compute by itself, with their current values
    (patch them with ``torch._inductor.config.patch``). torch 2.13 has only
    ``reorder_for_compute_comm_overlap`` (off by default); torch 2.15 adds
    ``aten_distributed_optimizations.enable_simple_overlap``, on by default
    (``comms.simple_overlap``: each collective moves earlier past nodes it does not
    depend on and each wait later past nodes not using it, by adjacent swaps; a
    collective never passes a collective, a wait never a wait, and no swap may raise
    the estimated peak memory)."""
    import torch._inductor.config as inductor_config

    flags = {"reorder_for_compute_comm_overlap": bool(inductor_config.reorder_for_compute_comm_overlap)}
    distributed = getattr(inductor_config, "aten_distributed_optimizations", None)
    if distributed is not None and hasattr(distributed, "enable_simple_overlap"):
        flags["aten_distributed_optimizations.enable_simple_overlap"] = bool(distributed.enable_simple_overlap)
    return flags
