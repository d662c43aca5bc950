"""What compiling costs per sharded parameter, and what a restarted job compiles again.

    python -m benchmarks.compile_cost [--layers 24] [--quick]

A stack of ``Linear(64, 64)`` layers, each ``fully_shard``ed, then the root (a ``fake``
world of 2, as rank 0: no communication). Every measurement runs in a new Python
process: Dynamo's state and its compile timers are per process.

* Dynamo: ``torch.compile(backend="eager", fullgraph=True)`` (Dynamo alone), its
  ``bytecode_tracing`` time per parameter for the unsharded stack, for the unsharded
  stack with a trivial ``autograd.Function`` around each parameter read (what a
  design whose gather is an autograd function Dynamo traces pays at least; ours is
  one op to Dynamo), and for ours.
* A restart: the sharded stack compiled with Inductor in one process, then again in
  a new one, sharing an Inductor cache directory that is empty at the start:
  AOTAutograd's and the FX-graph cache's misses and hits and the compile time of each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from benchmarks._common import benchmark_parser, one_thread_per_rank, table_header

SETUPS = {
    "unsharded": "unsharded",
    "autograd-function": "unsharded, a trivial autograd.Function around each parameter read",
    "ours": "fsdp_compile",
}


def _passthrough_linear():
    """``nn.Linear`` whose forward reads its parameters through an identity
    ``autograd.Function`` (what Dynamo must trace at least, per read, for a gather that
    is an autograd function)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Passthrough(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    class PassthroughLinear(nn.Linear):
        def forward(self, x):
            return F.linear(x, Passthrough.apply(self.weight), Passthrough.apply(self.bias))

    return PassthroughLinear


def measure(setup: str, layers: int, backend: str) -> dict:
    """In this (new) process: compile one step of the stack under ``setup``; Dynamo's and
    Inductor's timers and Inductor's cache counters."""
    import time

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch._dynamo.utils import compile_times, counters

    from fsdp_compile.testing._torch_internals import register_fake_process_group

    register_fake_process_group()
    dist.init_process_group("fake", rank=0, world_size=2)
    torch.manual_seed(0)
    linear = _passthrough_linear() if setup == "autograd-function" else nn.Linear
    model = nn.Sequential(*[linear(64, 64) for _ in range(layers)])
    if setup == "ours":
        from fsdp_compile import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    start = time.perf_counter()
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 64)).sum().backward()
    first_step = time.perf_counter() - start
    names, values = compile_times(repr="csv", aggregate=True)
    timers = {name: float(value) for name, value in zip(names, values, strict=True)}
    inductor = counters["inductor"]
    return {
        "params": sum(1 for _ in model.parameters()),
        "first_step_s": first_step,
        "dynamo_s": timers.get("bytecode_tracing", 0.0),
        "inductor_s": timers.get("compile_fx_inner", 0.0),
        "misses": inductor.get("fxgraph_cache_miss", 0),
        "hits": inductor.get("fxgraph_cache_hit", 0),
        "aot_hits": counters["aot_autograd"].get("autograd_cache_hit", 0),
        "aot_misses": counters["aot_autograd"].get("autograd_cache_miss", 0),
        "aot_bypasses": counters["aot_autograd"].get("autograd_cache_bypass", 0),
    }


def _in_a_new_process(setup: str, layers: int, backend: str, cache_dir: str | None = None) -> dict:
    env = dict(os.environ)
    if cache_dir is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    code = f"import json; from benchmarks.compile_cost import measure; print(json.dumps(measure({setup!r}, {layers}, {backend!r})))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"compile_cost: {setup} ({backend}) failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = benchmark_parser(__doc__, quick_help="8 layers (16 parameters) instead of 24")
    p.add_argument("--layers", type=int, default=24)
    args = p.parse_args(argv)
    one_thread_per_rank()
    layers = 8 if args.quick else args.layers

    print(f"\nDynamo per parameter: {layers} x Linear(64, 64), backend='eager', fullgraph, a new process each\n")
    print(table_header("setup", "parameters", "Dynamo tracing (s)", "per parameter (ms)"))
    for setup, label in SETUPS.items():
        r = _in_a_new_process(setup, layers, "eager")
        print(f"| {label} | {r['params']} | {r['dynamo_s']:.2f} | {1000 * r['dynamo_s'] / r['params']:.1f} |")

    print("\nA restarted job: the sharded stack compiled with Inductor, then again in a new process (one cache directory, empty at the start)\n")
    print(table_header("process", "AOTAutograd cache miss / hit / bypass", "FX-graph cache misses", "hits", "Inductor compile (s)", "first step (s)"))
    with tempfile.TemporaryDirectory(prefix="compile_cost_cache_") as cache_dir:
        for label in ("first", "restarted"):
            r = _in_a_new_process("ours", layers, "inductor", cache_dir)
            aot = f"{r['aot_misses']} / {r['aot_hits']} / {r['aot_bypasses']}"
            print(f"| {label} | {aot} | {r['misses']} | {r['hits']} | {r['inductor_s']:.2f} | {r['first_step_s']:.2f} |")
    print(
        "\nThe restarted process should find every graph in both caches (fsdp_compile keys "
        "DeviceMesh inputs without their per-process _hash; Dynamo's graph holds the gather op, "
        "whose argument names its whole spec). Only Dynamo runs again."
    )


if __name__ == "__main__":
    main()
