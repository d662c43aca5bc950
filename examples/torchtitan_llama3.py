"""torchtitan's Llama 3 debug model sharded by torchtitan's own FSDP function, with our
``fully_shard`` switched in by one line, against torch's FSDP2 in the same run.

    pip install torchtitan==0.3.0      # not a dependency of this project, not run by CI
    python examples/torchtitan_llama3.py [--steps 5] [--compile none|model|blocks] [--ac none|full|selective]
                                         [--with-unsharded]

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


def _build(kind: str, compile_mode: str, ac: str = "none"):
    import torchtitan.distributed.fsdp as titan_fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torchtitan.models.llama3 import model_registry

    import fsdp_compile

    _causal_sdpa_for_flex_attention()
    # The one-line switch (and back, for the FSDP2 run in the same process).
    titan_fsdp.fully_shard = fsdp_compile.fully_shard if kind == "ours" else torch_fully_shard
    config = model_registry("debugmodel", attn_backend="flex").model
    with torch.device("meta"):
        model = config.build()
    if ac != "none":
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

        policy = FullAC if ac == "full" else SelectiveAC
        policy(policy.Config()).apply(model)
    if compile_mode == "blocks":
        for layer_id, block in model.layers.named_children():
            model.layers.register_module(layer_id, torch.compile(block))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    if kind != "unsharded":
        titan_fsdp.apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
        titan_fsdp.disable_fsdp_gradient_division(model)
    if kind == "fsdp2":  # FSDP2's factor-1.0 reduce-scatter is a PREMUL_SUM, which gloo lacks
        for module in model.modules():
            if isinstance(module, torch.distributed.fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    return torch.compile(model) if compile_mode == "model" else model, model


def _train(kind: str, compile_mode: str, steps: int, ac: str = "none") -> dict:
    torch._dynamo.reset()
    run, model = _build(kind, compile_mode, ac)
    return train_steps(run, model, steps)


def train_steps(run, model, steps: int, vocab: int = 2048) -> dict:
    """``steps`` AdamW steps of ``run`` (``model`` or its compiled wrapper) on random tokens,
    a different batch per rank, the loss summed over tokens and divided by the global token
    count, as torchtitan's trainer does: the losses (summed over ranks) and step times."""
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4)
    losses, times = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        tokens = torch.randint(0, vocab, (2, 65), generator=gen)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.shape[1]).expand_as(inputs)  # one document per row
        masks = model.get_attention_masks(positions=positions)  # torchtitan's flex mask, as its trainer builds it
        start = time.perf_counter()
        logits = run(inputs, positions, masks)
        global_tokens = torch.tensor(labels.numel(), dtype=torch.float32)
        dist.all_reduce(global_tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / global_tokens
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return {"losses": losses, "first_step_s": times[0], "steady_s": sorted(times[1:])[len(times[1:]) // 2] if steps > 1 else None}


def _rank_main(rank: int, port: int, kind: str, compile_mode: str, steps: int, ac: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    result = _train(kind, compile_mode, steps, ac)
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
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    kinds = ("unsharded", "fsdp2", "ours") if args.with_unsharded else ("fsdp2", "ours")
    r = run_each_kind(kinds, _rank_main, lambda kind: (kind, args.compile, args.steps, args.ac), 2, "torchtitan")
    report(r, kinds, args.compile, f"torchtitan llama3 debugmodel, 2 gloo ranks, compile={args.compile}, ac={args.ac}")


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
