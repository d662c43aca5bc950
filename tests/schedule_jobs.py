"""Rank-side: compile a 4-unit model with Inductor and return its output code."""

from __future__ import annotations

import torch
import torch.distributed as dist


def compiled_step_code(
    config_changes: dict, n_layers: int = 4, dim: int = 32, prefetch: dict | None = None, inductor_overlap: bool = True
) -> dict:
    """``prefetch``: {"forward" | "backward": {layer index: [layer indices]}} hints.
    ``inductor_overlap=False`` turns off Inductor's own compute/communication overlap
    (see ``_compat.inductor_comm_overlap_flags``), leaving only what our passes do."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from fsdp_compile import config, fully_shard
    from fsdp_compile._compat import inductor_comm_overlap_flags
    from fsdp_compile._fully_shard import managed_params
    from fsdp_compile.testing.models import MLPStack

    torch.manual_seed(0)
    model = MLPStack(dim=dim, n_layers=n_layers, bias=True)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    for direction, hints in (prefetch or {}).items():
        for i, targets in hints.items():
            setter = getattr(model.layers[i], f"set_modules_to_{direction}_prefetch")
            setter([model.layers[t] for t in targets])
    x = torch.randn(4, dim)
    inductor_changes = {} if inductor_overlap else {flag: False for flag in inductor_comm_overlap_flags()}
    with config.patch(**config_changes), inductor_config.patch(inductor_changes):
        compiled = torch.compile(model, fullgraph=True)
        _, codes = run_and_get_code(lambda: compiled(x).sum().backward())
    layouts = {p.fqn: (p.layout.padded_numel, p.layout.world_size) for p in managed_params(model)}
    assert dist.get_world_size() == 2
    return {"codes": codes, "layouts": layouts, "inductor_overlap_flags": inductor_comm_overlap_flags()}
