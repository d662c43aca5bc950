"""Rank-side functions for the HSDP / replicate (DDP) / CPU-offload tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.models import batch, build, loss_fn
from tests.parity_jobs import _shard_model


def _capturing_backend(graphs: list):
    """aot_eager that also keeps the forward and backward graphs it compiles."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=min_cut_rematerialization_partition)


def _collectives(gm) -> list[tuple[str, str, int]]:
    """(op, group name, world size or -1) of every functional collective, in graph order."""
    out = []
    for node in gm.graph.nodes:
        target = getattr(node.target, "_opname", "")
        if node.op == "call_function" and str(node.target).startswith("_c10d_functional.") and target != "wait_tensor":
            size = node.args[-2] if isinstance(node.args[-2], int) else -1
            out.append((target, node.args[-1], size))
    return out


def placements_and_graph(layout: str) -> dict:
    """Shard the small Llama with ``layout``, run one compiled step; report the
    parameters' placements and devices, the gradients' and optimizer state's
    devices, the mesh groups and the compiled graphs' collectives and copies."""
    from fsdp_compile._compat import group_name_of

    model, units = build("llama")
    _shard_model("ours", units, None, layout)
    graphs: list = []
    run = torch.compile(model, backend=_capturing_backend(graphs), fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batch("llama", 0)
    rank, world = dist.get_rank(), dist.get_world_size()
    loss_fn("llama", run(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    opt.step()
    dp = model._fsdp_unit.dp_mesh
    groups = {"shard": dp.shard_group_name, "replicate": dp.replicate_group_name}
    mesh = dp.mesh
    assert all(group_name_of(mesh.get_group(n)) == groups[n] for n in mesh.mesh_dim_names or [])
    device_copies = [
        str(n.target)
        for gm in graphs
        for n in gm.graph.nodes
        if n.op == "call_function"
        and (n.target is torch.ops.prims.device_put.default or (n.target is torch.ops.aten._to_copy.default and "device" in n.kwargs))
    ]
    return {
        "placements": {fqn: [str(pl) for pl in p.placements] for fqn, p in model.named_parameters()},
        "param_devices": {p.to_local().device.type for p in model.parameters()},
        "grad_devices": {p.grad.to_local().device.type for p in model.parameters()},
        "state_devices": {t.device.type for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.ndim > 0},
        "groups": groups,
        "forward": _collectives(graphs[0]),
        "backward": _collectives(graphs[1]),
        "device_copies": device_copies,
    }
