"""torchtitan's DeepSeek-V3 MoE debug model with expert parallelism, sharded by torchtitan's
own parallelize function, with our ``fully_shard`` switched in by one line, against
torch's FSDP2 in the same run.

    pip install torchtitan==0.3.0      # not a dependency of this project, not run by CI
    python examples/torchtitan_moe.py [--steps 4] [--compile none|model|blocks] [--backend inductor|aot_eager]
                                      [--spmd-backend partial_dtensor|spmd_types]

On 4 CPU ranks (gloo, started here), for each of FSDP2 and ours: torchtitan's deepseek_v3
``debugmodel`` (6 layers, the first dense, then 5 MoE layers of 8 routed experts, top-3,
and 2 shared experts; dim 256, vocabulary 2048, MLA with flex attention) built on the
meta device, then parallelized by torchtitan's ``parallelize_deepseekv3`` with
``ParallelDims(dp_shard=4, ep=2)`` (the ``partial_dtensor`` backend, torchtitan's
``fsdp``/``efsdp``/``ep`` meshes built by its ``build_mesh``): its ``model.parallelize``
shards the routed experts over the ``ep`` mesh (``Shard(0)`` DTensors, all-to-all token
dispatch by ``AllToAllTokenDispatcher``), then its ``apply_fsdp_to_decoder`` calls
``fully_shard`` on the embedding, ``[norm, lm_head]``, each block and the root, each MoE
block with a ``shard_placement_fn`` returning torch's ``ShardPlacementResult``: the
routed experts over the ``efsdp`` mesh (size 2), everything else over ``fsdp`` (size
4); gradient division off, explicit forward/backward prefetching, as torchtitan sets
them for EP. Materialized with ``to_empty`` and torchtitan's ``init_states``, then trained
with AdamW on random tokens (a different batch per rank), the loss summed over tokens
and divided by the global token count, as torchtitan's trainer does. ``--compile
model``: ``torch.compile`` of the whole model after sharding (``--backend``), with
``capture_scalar_outputs`` on as torchtitan's ``apply_compile`` sets it for the
data-dependent EP split sizes; ``blocks``: torchtitan's own ``apply_compile`` (through its
``CompileConfig``), each block compiled with ``fullgraph=True`` before sharding. Prints
both losses per step and fails if eager losses are not bitwise equal. ``--spmd-backend
spmd_types`` (torchtitan's default; torch 2.15's FSDP2 for the comparison): plain local
parameters typed by ``spmd_types``, the experts' ``ShardPlacementResult`` carrying the
expert mesh's ``dp_mesh_dims`` (torch's ``_get_mesh_info``), the forward in torchtitan's
spmd context with typed inputs (``examples/torchtitan_llama3.py``'s loop); gloo takes only
equal chunks in ``all_to_all``, so spmd_types' uneven token dispatch is shimmed onto
``all_to_all_single`` (``_uneven_all_to_all_on_gloo``).

The switch, for a user of torchtitan::

    import fsdp_compile, torchtitan.distributed.fsdp
    torchtitan.distributed.fsdp.fully_shard = fsdp_compile.fully_shard

What is shimmed: FlexAttention has no backward on CPU, so its call
(``FlexAttention.compiled_flex_attn``) runs causal SDPA instead: the same attention for
the one-document-per-row mask used here (``get_attention_masks`` is still called, as
torchtitan's trainer does). torchtitan picks its device type at import
(``torchtitan.tools.utils.device_type``, ``"cuda"`` when no accelerator is found), so
``torchtitan.distributed.parallel_dims.device_type`` is set to ``"cpu"`` for
``build_mesh``'s ``init_device_mesh``. torchtitan's model, parallelize, EP, FSDP and init
code run as they are (the experts' ``torch._grouped_mm`` in bf16 and the all-to-all
dispatch both run on CPU/gloo); its trainer (data loader, checkpointer, metrics, and the
MoE load-balancing optimizer hook that updates ``expert_bias_E``) is replaced by the loop
here; its trainer's ``set_spmd_backend`` call is made here. Both sides set
``set_force_sum_reduction_for_comms(True)`` on every ``FSDPModule`` (FSDP2's
reduce-scatter with a divide factor of 1.0 is a ``PREMUL_SUM``, which gloo does not
have). torchtitan 0.3.0 imports ``triton`` at import: ``pip install triton`` on a
CPU-only machine too.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import types

import torch
import torch.distributed as dist

WORLD_SIZE, EP = 4, 2


def _uneven_all_to_all_on_gloo() -> None:
    """The CPU shim for the spmd_types dispatcher: gloo's ``all_to_all`` takes only equal
    chunks, so spmd_types' uneven token dispatch goes through ``all_to_all_single`` (one
    flat buffer, split sizes per rank) instead; the same exchange."""
    import spmd_types._dist as spmd_dist

    def all_to_all(output_chunks, input_chunks, group=None, async_op=False):
        flat_in = torch.cat([t.reshape(-1) for t in input_chunks])
        flat_out = flat_in.new_empty(sum(t.numel() for t in output_chunks))
        out_sizes, in_sizes = [t.numel() for t in output_chunks], [t.numel() for t in input_chunks]
        dist.all_to_all_single(flat_out, flat_in, out_sizes, in_sizes, group=group)
        for chunk, piece in zip(output_chunks, flat_out.split(out_sizes), strict=True):
            chunk.copy_(piece.view_as(chunk))

    spmd_dist.dist = types.SimpleNamespace(**{**vars(dist), "all_to_all": all_to_all})


def _build(kind: str, compile_mode: str, backend: str, spmd_backend: str = "partial_dtensor"):
    import torchtitan.distributed.fsdp as titan_fsdp
    import torchtitan.distributed.parallel_dims as titan_parallel_dims
    import torchtitan.distributed.utils as titan_dist_utils
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.deepseek_v3 import model_registry, parallelize_deepseekv3
    from torchtitan_llama3 import _causal_sdpa_for_flex_attention  # (this folder: the same shim)

    import fsdp_compile

    _causal_sdpa_for_flex_attention()
    titan_parallel_dims.device_type = "cpu"  # the CPU shim (see the module docstring)
    # The one-line switch (and back, for the FSDP2 run in the same process).
    titan_fsdp.fully_shard = fsdp_compile.fully_shard if kind == "ours" else torch_fully_shard
    if spmd_backend == "spmd_types":
        _uneven_all_to_all_on_gloo()
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=WORLD_SIZE, expert_parallel_degree=EP, spmd_backend=spmd_backend
    )
    titan_dist_utils.set_spmd_backend(parallelism.spmd_backend)  # as torchtitan's trainer does
    parallel_dims = ParallelDims.from_config(parallelism, WORLD_SIZE)
    parallel_dims.build_mesh()
    config = model_registry("debugmodel", attn_backend="flex").model
    # As torchtitan's trainer does (it passes its whole config; only ``parallelism`` is read
    # here): sets each module config's sharding config, the EP placements of the experts.
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = config.build()
    parallelize_deepseekv3(
        model,
        parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32"),
        parallelism=parallelism,
        # ``blocks``: torchtitan's own ``apply_compile`` (each block, ``fullgraph=True``, before FSDP).
        compile_config=CompileConfig(enable=compile_mode == "blocks", components=["model"], backend=backend),
        ac_config=None,
        dump_folder=tempfile.gettempdir(),
    )
    # FSDP2's factor-1.0 reduce-scatter is a PREMUL_SUM, which gloo lacks; ours accepts the
    # same call, so both sides reduce by SUM.
    for module in model.modules():
        if isinstance(module, FSDPModule) or hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    if spmd_backend == "spmd_types":
        model.parallel_dims = parallel_dims  # (train_steps runs the forward in its spmd context)
    if compile_mode != "model":
        return model, model
    # As torchtitan's ``apply_compile`` sets it: the EP dispatch's split sizes (``tolist``) are
    # data-dependent.
    torch._dynamo.config.capture_scalar_outputs = True
    return torch.compile(model, backend=backend), model


def _train(kind: str, compile_mode: str, backend: str, steps: int, spmd_backend: str = "partial_dtensor") -> dict:
    from torchtitan_llama3 import train_steps  # (this folder: the same training loop)

    torch._dynamo.reset()
    run, model = _build(kind, compile_mode, backend, spmd_backend)
    return train_steps(run, model, steps)


def _rank_main(rank: int, port: int, kind: str, compile_mode: str, backend: str, steps: int, spmd_backend: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    result = _train(kind, compile_mode, backend, steps, spmd_backend)
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--compile", choices=("none", "model", "blocks"), default="none")
    p.add_argument("--backend", choices=("inductor", "aot_eager"), default="inductor")
    p.add_argument("--spmd-backend", choices=("partial_dtensor", "spmd_types"), default="partial_dtensor")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from torchtitan_llama3 import report, run_each_kind  # (this folder: the same runner)

    kinds = ("fsdp2", "ours")
    r = run_each_kind(
        kinds,
        _rank_main,
        lambda kind: (kind, args.compile, args.backend, args.steps, args.spmd_backend),
        WORLD_SIZE,
        "torchtitan_moe",
    )
    backend = f", backend={args.backend}" if args.compile != "none" else ""
    title = (
        f"torchtitan deepseek_v3 debugmodel, {WORLD_SIZE} gloo ranks, dp_shard={WORLD_SIZE}, ep={EP}, "
        f"spmd_backend={args.spmd_backend}, compile={args.compile}{backend}"
    )
    report(r, kinds, args.compile, title)


if __name__ == "__main__":
    main()
