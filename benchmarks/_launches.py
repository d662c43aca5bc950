"""Counting a profiled step's CPU-side calls (``torch.profiler`` events): collective
issues, ops inside and outside the compiled graphs, and (on a GPU) kernel launches.
Shared by ``benchmarks.breakdown`` and ``benchmarks.gpu``; imports nothing from torch."""

from __future__ import annotations


def is_wait(name: str) -> bool:
    return name in ("_c10d_functional::wait_tensor", "c10d::wait")


def has_ancestor(event, match) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if match(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def in_graph(event) -> bool:
    return has_ancestor(event, lambda name: name in ("CompiledFunction", "CompiledFunctionBackward"))


def is_op(name: str) -> bool:
    return name.startswith(("aten::", "prims::", "fsdp_compile::", "_c10d_functional::", "c10d::"))


def is_collective(name: str) -> bool:
    return name.startswith(("_c10d_functional::", "c10d::")) and not is_wait(name)


def is_kernel_launch(name: str) -> bool:
    """A CUDA runtime or driver call that launches work: a kernel, or a whole CUDA graph."""
    return name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def launches(events: list) -> dict:
    """CPU-side calls in a profiled step, every thread (autograd may run the backward
    on one of its own): collective issues; ops the compiled graphs call (the outermost
    op events inside them: extern kernels and our ops; Inductor's fused kernels are
    no op events); ops outside the graphs (optimizer, loss, gradient accumulation);
    kernel launches (CUDA runtime events: present only where the profiler recorded
    CUDA activity)."""
    outermost = [e for e in events if is_op(e.name) and not has_ancestor(e, is_op)]
    return {
        "collective calls": sum(1 for e in events if is_collective(e.name) and not has_ancestor(e, is_collective)),
        "ops in graphs": sum(1 for e in outermost if in_graph(e)),
        "ops outside graphs": sum(1 for e in outermost if not in_graph(e)),
        "kernel launches": sum(1 for e in events if is_kernel_launch(e.name)),
    }
