"""Functions that run on every rank of the pool (module-level so they pickle)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_compile.testing import full_parameters, global_mean
from tests.models import batch, build, loss_fn

COMPILE_BACKENDS = {"ours-eager": None, "ours-aot_eager": "aot_eager", "ours-inductor": "inductor", "fsdp2": None}


MIXED_PRECISION = {
    None: None,
    "bf16": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16-reduce-bf16": dict(param_dtype=torch.bfloat16),
}


def _shard_model(variant: str, units, mp: str | None = None, layout: str = "fsdp") -> None:
    """Shard ``units`` bottom-up. ``layout``: ``fsdp`` (1-D mesh), ``hsdp`` (2 x world/2
    mesh, replicate x shard), ``ddp`` (``replicate``) or ``offload`` (``CPUOffloadPolicy``)."""
    if variant == "reference":
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    if variant == "fsdp2":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp_compile import fully_shard, replicate
    policy = MixedPrecisionPolicy(**(MIXED_PRECISION[mp] or {}))
    kwargs = {}
    if layout == "hsdp":
        shape = (2, dist.get_world_size() // 2)
        kwargs["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    elif layout == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    apply = replicate if layout == "ddp" else fully_shard
    for unit in units:
        apply(unit, mp_policy=policy, **kwargs)


def train(name: str, variant: str, steps: int = 3, with_eval: bool = False, mp: str | None = None, layout: str = "fsdp") -> dict:
    """Train ``name`` for ``steps`` SGD steps under ``variant``; the full parameters after each.

    ``reference`` is one unsharded model on the global batch (computed on every
    rank, without communication); the others shard it over the pool's ranks and
    feed each rank its slice of the same global batch.
    """
    from torch._dynamo.testing import CompileCounterWithBackend

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, units = build(name)
    _shard_model(variant, units, mp, layout)
    backend = COMPILE_BACKENDS.get(variant)
    counter = CompileCounterWithBackend(backend) if backend else None
    run = torch.compile(model, backend=counter, fullgraph=True) if counter else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sharded = variant != "reference"

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(world_size)[rank] if sharded else t

    record: dict = {"loss": [], "params": [], "buffers": [], "eval_out": None}

    def train_step(step: int) -> None:
        x, y = batch(name, step)
        loss = loss_fn(name, run(local(x)), local(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        record["loss"].append(global_mean(loss) if sharded else loss.item())
        record["params"].append(full_parameters(model))
        record["buffers"].append({fqn: b.detach().clone() for fqn, b in model.named_buffers()})

    for step in range(steps):
        train_step(step)
    if with_eval:
        model.eval()
        x, _ = batch(name, 99)
        with torch.no_grad():
            out = run(local(x))
        if sharded:
            pieces = [torch.empty_like(out) for _ in range(world_size)]
            dist.all_gather(pieces, out.contiguous())
            out = torch.cat(pieces)
        record["eval_out"] = out
        model.train()
        train_step(steps)
    record["frames"] = counter.frame_count if counter else None
    return record


def train_all(name: str, variants: list[str], steps: int = 3, with_eval: bool = False, mp: str | None = None, layout: str = "fsdp") -> dict:
    return {v: train(name, v, steps, with_eval, mp, layout) for v in variants}


def compiled_collective_dtypes(mp: str) -> dict:
    """Dtypes of the captured collectives' inputs in the forward and backward graphs."""
    from fsdp_compile._compat import c10d_functional
    from fsdp_compile.testing import GraphCapture, collective_nodes

    model, units = build("mlp")
    _shard_model("ours", units, mp)
    capture = GraphCapture()
    x, y = batch("mlp", 0)
    torch.compile(model, backend=capture)(x).sum().backward()
    (fw,), (bw,) = capture.forward_graphs, capture.backward_graphs
    dtypes = lambda g, op: sorted({str(n.args[0].meta["val"].dtype) for n in collective_nodes(g, op)})  # noqa: E731
    return {
        "forward_all_gather": dtypes(fw, c10d_functional.all_gather_into_tensor),
        "backward_reduce_scatter": dtypes(bw, c10d_functional.reduce_scatter_tensor),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }
