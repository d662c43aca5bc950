"""torchtitan's Llama 3 debug model sharded by torchtitan's own FSDP function, with our
``fully_shard`` switched in by one line, against torch's FSDP2 in the same run.

    pip install torchtitan==0.3.0      # not a dependency of this project, not run by CI
    python examples/torchtitan_llama3.py [--steps 5] [--compile none|model|blocks] [--ac none|full|selective]
                                         [--with-unsharded] [--spmd-backend partial_dtensor|spmd_types [--tp 2] [--sp]]

On 2 CPU ranks (gloo, started here), for each of FSDP2 and ours: torchtitan's
``debugmodel`` (6 layers, dim 256, vocabulary 2048, flex attention) built on the meta
device, sharded by ``torchtitan.distributed.fsdp.apply_fsdp_to_decoder`` (the embedding,
each block, ``[norm, lm_head]`` and the root, each a unit), its gradient division turned
off by torchtitan's ``disable_fsdp_gradient_division`` (an ``isinstance(m, FSDPModule)``
loop), materialized with ``to_empty`` and torchtitan's ``init_states``, then trained with
AdamW on random tokens (a different batch per rank), the loss summed over tokens and
divided by the global token count, as torchtitan's trainer does. ``--compile model``:
``torch.compile`` of the whole model after sharding; ``blocks``: each block compiled
before sharding (torchtitan's ``apply_compile`` order). ``--ac full|selective``:
torchtitan's own activation checkpointing (``FullAC`` / ``SelectiveAC``: each block in
``checkpoint_wrapper``), applied first, as its trainer does. Prints both losses per step and
the first step's time (each kind in new processes, from an empty Inductor cache), and
fails if eager losses are not bitwise equal. ``--with-unsharded`` also times the model
without FSDP, compiled the same way: what the same ``torch.compile`` call costs without
sharding.

``--spmd-backend spmd_types`` (torchtitan's default; torch 2.15's FSDP2 for the comparison:
2.13's does not read spmd_types): its parameters are plain local tensors typed by
``spmd_types``, laid out by torchtitan's ``Module.parallelize`` on its ``ParallelDims``,
sharded by ``apply_fsdp_to_decoder`` with the ``dp_mesh_dims`` of torchtitan's
``resolve_fsdp_mesh``, and the forward runs in torchtitan's spmd context with its inputs
typed (``annotate_input_spmd_types``) and its loss (vocabulary-parallel with ``--tp``).
``--tp 2`` adds tensor parallelism (4 ranks), ``--sp`` sequence parallelism;
``SPMD_TYPECHECK=1`` turns on spmd_types' type checker for the model's forward (eager only).

The switch, for a user of torchtitan::

    import fsdp_compile, torchtitan.distributed.fsdp
    torchtitan.distributed.fsdp.fully_shard = fsdp_compile.fully_shard

What is shimmed: FlexAttention has no backward on CPU, so its call
(``FlexAttention.compiled_flex_attn``) runs causal SDPA instead: the same attention for
the one-document-per-row mask used here (``get_attention_masks`` is still called, as
torchtitan's trainer does). torchtitan's model, FSDP and init code run as they are; its
trainer (data loader, checkpointer, metrics) is replaced by the loop here. FSDP2's side
sets ``set_force_sum_reduction_for_comms(True)`` (its reduce-scatter with a divide factor
of 1.0 is a ``PREMUL_SUM``, which gloo does not have). torchtitan
0.3.0 imports ``triton`` at import: ``pip install triton`` on a CPU-only machine too.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _causal_sdpa_for_flex_attention() -> None:
    """The CPU shim (see the module docstring)."""
    from torchtitan.models.common.attention import FlexAttention

    def causal_sdpa(
        q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_aux=None, kernel_options=None
    ):
        assert score_mod is None and (return_aux is None or not return_aux.lse)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa), None

    FlexAttention.compiled_flex_attn = staticmethod(causal_sdpa)


def _build(kind: str, compile_mode: str, ac: str = "none", layout: tuple = ("partial_dtensor", 1, False)):
    import torchtitan.distributed.fsdp as titan_fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torchtitan.models.llama3 import model_registry

    import fsdp_compile

    _causal_sdpa_for_flex_attention()
    # The one-line switch (and back, for the FSDP2 run in the same process).
    titan_fsdp.fully_shard = fsdp_compile.fully_shard if kind == "ours" else torch_fully_shard
    config = model_registry("debugmodel", attn_backend="flex").model
    spmd_backend, tp, sp = layout
    if spmd_backend == "spmd_types":
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(config, enable_sp=sp)
    with torch.device("meta"):
        model = config.build()
    parallel_dims = _parallelize_as_torchtitan(model, tp) if spmd_backend == "spmd_types" else None
    if ac != "none":
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

        policy = FullAC if ac == "full" else SelectiveAC
        policy(policy.Config()).apply(model)
    if compile_mode == "blocks":
        for layer_id, block in model.layers.named_children():
            model.layers.register_module(layer_id, torch.compile(block))
    if parallel_dims is None:
        mesh, dp_mesh_dims = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",)), None
    else:
        from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh

        mesh, dp_mesh_dims = resolve_fsdp_mesh(parallel_dims)
    if kind != "unsharded":
        titan_fsdp.apply_fsdp_to_decoder(
            model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False, dp_mesh_dims=dp_mesh_dims
        )
        titan_fsdp.disable_fsdp_gradient_division(model)
    if kind == "fsdp2":  # FSDP2's factor-1.0 reduce-scatter is a PREMUL_SUM, which gloo lacks
        for module in model.modules():
            if isinstance(module, torch.distributed.fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    if parallel_dims is not None:
        model.parallel_dims = parallel_dims  # (for train_steps)
    return torch.compile(model) if compile_mode == "model" else model, model


def _parallelize_as_torchtitan(model, tp: int):
    """torchtitan's spmd_types layout, as its trainer makes it: ``ParallelDims`` (its mesh
    on CPU here), the backend set, and the model's own ``parallelize`` (typed local tensors)."""
    import torchtitan.distributed.parallel_dims as titan_parallel_dims
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as titan_dist_utils
    from torchtitan.distributed.full_dtensor import validate_config

    titan_dist_utils.set_spmd_backend("spmd_types")
    parallel_dims = ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=1, tp=tp, pp=1, ep=1, world_size=dist.get_world_size(), spmd_backend="spmd_types"
    )
    titan_parallel_dims.device_type = "cpu"  # (torchtitan builds its mesh on its accelerator)
    parallel_dims.build_mesh()
    validate_config(parallel_dims, model)
    model.parallelize(parallel_dims)
    return parallel_dims


def _train(kind: str, compile_mode: str, steps: int, ac: str = "none", layout: tuple = ("partial_dtensor", 1, False)) -> dict:
    torch._dynamo.reset()
    run, model = _build(kind, compile_mode, ac, layout)
    return train_steps(run, model, steps)


def train_steps(run, model, steps: int, vocab: int = 2048) -> dict:
    """``steps`` AdamW steps of ``run`` (``model`` or its compiled wrapper) on random tokens,
    a different batch per rank, the loss summed over tokens and divided by the global token
    count, as torchtitan's trainer does: the losses (summed over ranks) and step times."""
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4)
    parallel_dims = getattr(model, "parallel_dims", None)  # torchtitan's spmd_types layout, if any
    tp = 1 if parallel_dims is None else parallel_dims.tp
    dp_rank = dist.get_rank() // tp  # (its mesh puts tp last)
    losses, times = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + dp_rank)
        tokens = torch.randint(0, vocab, (2, 65), generator=gen)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.shape[1]).expand_as(inputs)  # one document per row
        masks = model.get_attention_masks(positions=positions)  # torchtitan's flex mask, as its trainer builds it
        start = time.perf_counter()
        with _spmd_context(parallel_dims):
            if parallel_dims is not None:
                from torchtitan.distributed.spmd_types import annotate_input_spmd_types

                extra = {"positions": positions, "attention_masks": masks}
                inputs, labels, extra = annotate_input_spmd_types(parallel_dims, inputs, labels, extra)
                positions, masks = extra["positions"], extra["attention_masks"]
            logits = run(inputs, positions, masks)
            global_tokens = torch.tensor(labels.numel() * dist.get_world_size() // tp, dtype=torch.float32)
            with _outside_type_checker(parallel_dims):  # (the model's forward is what is checked)
                loss = _loss(logits, labels, vocab, parallel_dims) / global_tokens
                loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / tp)  # (each tp rank holds the same loss)
    return {"losses": losses, "first_step_s": times[0], "steady_s": sorted(times[1:])[len(times[1:]) // 2] if steps > 1 else None}


def _loss(logits, labels, vocab: int, parallel_dims):
    """The summed cross entropy; torchtitan's own (vocabulary-parallel with TP) under spmd_types."""
    if parallel_dims is None:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(logits, labels, global_vocab_size=vocab)


def _spmd_context(parallel_dims):
    """torchtitan's spmd context (its current mesh; the type checker with SPMD_TYPECHECK=1)."""
    import contextlib

    if parallel_dims is None:
        return contextlib.nullcontext()
    from torchtitan.distributed import utils as titan_dist_utils

    checking = os.environ.get("SPMD_TYPECHECK") == "1"
    return titan_dist_utils.get_spmd_context(parallel_dims=parallel_dims, spmd_typechecking=checking)()


def _outside_type_checker(parallel_dims):
    import contextlib

    if parallel_dims is None:
        return contextlib.nullcontext()
    import spmd_types

    return spmd_types.no_typecheck()


def _rank_main(rank: int, port: int, kind: str, compile_mode: str, steps: int, ac: str, layout, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2 * layout[1])
    result = _train(kind, compile_mode, steps, ac, layout)
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--compile", choices=("none", "model", "blocks"), default="none")
    p.add_argument("--ac", choices=("none", "full", "selective"), default="none")
    p.add_argument(
        "--with-unsharded",
        action="store_true",
        help="also time the same model without FSDP, compiled the same way (its own replica per rank, no gradient "
        "sync: its losses are not comparable, only its step times)",
    )
    p.add_argument("--spmd-backend", choices=("partial_dtensor", "spmd_types"), default="partial_dtensor")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (spmd_types only; 2 x tp ranks)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (spmd_types, with --tp)")
    args = p.parse_args()
    if args.spmd_backend == "partial_dtensor" and (args.tp > 1 or args.sp):
        p.error("--tp and --sp go with --spmd-backend spmd_types")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    kinds = ("unsharded", "fsdp2", "ours") if args.with_unsharded else ("fsdp2", "ours")
    layout = (args.spmd_backend, args.tp, args.sp)
    nprocs = 2 * args.tp
    r = run_each_kind(kinds, _rank_main, lambda kind: (kind, args.compile, args.steps, args.ac, layout), nprocs, "torchtitan")
    title = f"torchtitan llama3 debugmodel, {nprocs} gloo ranks, spmd_backend={args.spmd_backend}, tp={args.tp}"
    report(r, kinds, args.compile, f"{title}{', sp' if args.sp else ''}, compile={args.compile}, ac={args.ac}")


def run_each_kind(kinds, rank_main, rank_args, nprocs: int, prefix: str) -> dict:
    """Rank 0's result of ``rank_main(rank, port, *rank_args(kind), queue)`` on ``nprocs`` spawned
    gloo ranks, per kind, each in new processes with an empty Inductor cache (neither compiles
    from the other's)."""
    ctx = mp.get_context("spawn")
    r = {}
    for i, kind in enumerate(kinds):
        with tempfile.TemporaryDirectory(prefix=f"{prefix}_{kind}_") as cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
            queue = ctx.SimpleQueue()
            port = 29000 + (os.getpid() + i) % 1000
            mp.start_processes(rank_main, args=(port, *rank_args(kind), queue), nprocs=nprocs, start_method="spawn")
            r[kind] = queue.get()
    return r


def report(r: dict, kinds, compile_mode: str, title: str) -> None:
    """Both losses per step, each kind's step times; eager losses must be bitwise equal."""
    print(f"\n{title}\n")
    print("| step | FSDP2 loss | ours loss | difference |\n|---|---|---|---|")
    for step, (a, b) in enumerate(zip(r["fsdp2"]["losses"], r["ours"]["losses"], strict=True)):
        print(f"| {step} | {a:.6f} | {b:.6f} | {abs(a - b):.2e} |")
    for kind in kinds:
        steady = r[kind]["steady_s"]
        print(f"{kind}: first step {r[kind]['first_step_s']:.2f} s, steady step {steady:.3f} s" if steady else kind)
    if compile_mode == "none":
        assert r["fsdp2"]["losses"] == r["ours"]["losses"], "eager losses differ from FSDP2's"


if __name__ == "__main__":
    main()
