"""``assert_parity``: does my compiled sharded model train like eager and like the reference?

    from fsdp_compile.testing import assert_parity

    assert_parity(my_models.build, my_data.batch, my_losses.mse, shard_fn=my_models.shard)

starts ``world_size`` CPU ranks (gloo) itself, trains every variant on the same
global batches (each rank its slice of dim 0) and compares the full parameters
and the global loss after every optimizer step against the reference. The
callables run on the ranks, so they must be importable module-level functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


class ParityError(AssertionError):
    """A variant drifted from the reference: names the step, the parameter and the gap."""


@dataclass
class ParityReport:
    """Largest gap to the reference per variant (loss and parameters, all steps)."""

    max_param_gap: dict[str, float] = field(default_factory=dict)
    max_loss_gap: dict[str, float] = field(default_factory=dict)
    #: Graphs each compiled variant compiled over all steps (recompiles included);
    #: ``"unsharded"``: the unsharded model under the same ``torch.compile`` call.
    graphs: dict[str, int] = field(default_factory=dict)


def _default_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _train_variant(model_fn, shard_fn, batch_fn, loss_fn, optimizer_fn, variant: str, steps: int, compile_kwargs: dict) -> dict:
    """Train one variant; ``"unsharded"`` only counts the unsharded model's graphs (Dynamo's
    alone: ``eager`` backend) on the local batch slices (no parity: its batch is not the
    global one)."""
    import torch.distributed as dist

    from fsdp_compile.testing._tensors import full_parameters, global_mean
    from fsdp_compile.testing._torch_internals import compile_counter, reset_dynamo

    reset_dynamo()  # no graph reused from another variant's model
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = model_fn()
    sharded = variant != "reference"
    if variant == "fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        shard_fn(model, torch_fully_shard)
    elif variant.startswith("ours"):
        from fsdp_compile import fully_shard

        shard_fn(model, fully_shard)
    backend = "eager" if variant == "unsharded" else variant.split(":", 1)[1] if ":" in variant else None
    compiled = variant == "unsharded" or backend not in (None, "eager")
    counter = compile_counter(backend) if compiled else None
    run = model if counter is None else torch.compile(model, backend=counter, **compile_kwargs)
    opt = optimizer_fn(model.parameters())
    losses, params = [], []
    for step in range(steps):
        inputs, targets = batch_fn(step)
        args = inputs if isinstance(inputs, tuple) else (inputs,)  # several inputs: each split by batch
        if sharded:
            args, targets = tuple(a.chunk(world_size)[rank] for a in args), targets.chunk(world_size)[rank]
        loss = loss_fn(run(*args), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if variant == "unsharded":
            continue
        losses.append(global_mean(loss) if sharded else loss.item())
        params.append(full_parameters(model))
    return {"losses": losses, "params": params, "graphs": None if counter is None else counter.frame_count}


def _train_all(model_fn, shard_fn, batch_fn, loss_fn, optimizer_fn, variants, steps, compile_kwargs) -> dict:
    return {v: _train_variant(model_fn, shard_fn, batch_fn, loss_fn, optimizer_fn, v, steps, compile_kwargs) for v in variants}


def _shard_root_only(model, fully_shard) -> None:
    fully_shard(model)


def assert_parity(
    model_fn: Callable[[], torch.nn.Module],
    batch_fn: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    shard_fn: Callable = _shard_root_only,
    optimizer_fn: Callable = _default_optimizer,
    world_size: int = 2,
    steps: int = 3,
    backends: tuple[str, ...] = ("eager", "aot_eager", "inductor"),
    reference: str = "single_process",
    rtol: float = 1e-5,
    atol: float = 1e-6,
    compile_kwargs: dict | None = None,
    check_graph_count: bool = False,
    pool=None,
) -> ParityReport:
    """Train ``fsdp_compile`` variants (one per backend) and compare them with ``reference``.

    Args:
        model_fn: builds the unsharded model, identically on every rank (seed inside).
        batch_fn: ``step -> (inputs, targets)``, the *global* batch (same on every rank);
            ``inputs`` may be a tuple of tensors (each split by batch, passed positionally).
        loss_fn: ``(output, targets) -> loss`` (a mean over the local batch).
        shard_fn: ``(model, fully_shard) -> None`` applies the given ``fully_shard``
            (ours, or torch's for ``reference="fsdp2"``) to the model's units.
        reference: ``"single_process"`` (the unsharded model on the global batch)
            or ``"fsdp2"`` (torch's FSDP2 with the same ``shard_fn``).
        compile_kwargs: extra ``torch.compile`` arguments (e.g. ``fullgraph=True``) for
            every compiled variant.
        check_graph_count: also compile the unsharded model with the same call and
            fail if a compiled variant of ours compiles more graphs than it (graph
            breaks are Dynamo's, so the unsharded model is compiled with the
            ``eager`` backend: same graphs, no code generation).
        pool: a running :class:`RankPool` to reuse; by default one is started and closed.

    Raises:
        ParityError: naming the first step and parameter (or the loss) that differs
            beyond ``rtol``/``atol``, and the size of the gap.
    """
    if reference not in ("single_process", "fsdp2"):
        raise ValueError(f"reference={reference!r}: expected 'single_process' or 'fsdp2'")
    reference_variant = "reference" if reference == "single_process" else "fsdp2"
    variants = [reference_variant, *(f"ours:{b}" for b in backends)]
    if check_graph_count:
        variants.append("unsharded")
    args = (model_fn, shard_fn, batch_fn, loss_fn, optimizer_fn, variants, steps, compile_kwargs or {})
    results = _run_on_ranks(pool, world_size, _train_all, *args)
    report = ParityReport(graphs={v: r["graphs"] for v, r in results.items() if r["graphs"] is not None})
    for variant in variants[1:]:
        if variant == "unsharded":
            continue
        if check_graph_count and report.graphs.get(variant, 0) > report.graphs["unsharded"]:
            raise ParityError(
                f"{variant}: compiled {report.graphs[variant]} graphs over {steps} steps, the unsharded model "
                f"{report.graphs['unsharded']}: sharding added graph breaks or recompiles "
                "(TORCH_LOGS=graph_breaks,recompiles shows where)"
            )
        _compare(variant, results[variant], results[reference_variant], reference, report, rtol, atol)
    return report


def _run_on_ranks(pool, world_size: int, fn, *args):
    """Rank 0's result of ``fn(*args)`` run on every rank of ``pool`` (by default a pool
    of ``world_size`` ranks started and closed here)."""
    from fsdp_compile.testing._rank_pool import RankPool

    own_pool = pool is None
    pool = pool or RankPool(world_size)
    try:
        return pool.run(fn, *args)[0]
    finally:
        if own_pool:
            pool.close()


def _compare(variant: str, got: dict, expected: dict, reference: str, report: ParityReport, rtol: float, atol: float) -> None:
    """Record ``variant``'s largest gaps in ``report``; raise at the first loss or parameter
    beyond ``rtol``/``atol``."""
    report.max_loss_gap[variant] = max(abs(a - b) for a, b in zip(got["losses"], expected["losses"], strict=True))
    report.max_param_gap[variant] = 0.0
    for step, (a, b) in enumerate(zip(got["losses"], expected["losses"], strict=True)):
        if abs(a - b) > atol + rtol * abs(b):
            raise ParityError(f"{variant}: loss at step {step} is {a!r}, {reference} has {b!r} (gap {abs(a - b):.3g})")
        for fqn, ref_value in expected["params"][step].items():
            value = got["params"][step][fqn]
            gap = (value - ref_value).abs().max().item() if value.numel() else 0.0
            report.max_param_gap[variant] = max(report.max_param_gap[variant], gap)
            if not torch.allclose(value, ref_value, rtol=rtol, atol=atol):
                raise ParityError(
                    f"{variant}: parameter {fqn!r} after step {step} differs from {reference} by up to "
                    f"{gap:.3g} (rtol={rtol}, atol={atol})"
                )
