"""Train a small Llama-style model with ``torch.compile(fully_shard(model))``.

    python examples/train.py                 # starts 2 CPU ranks itself (gloo)
    python examples/train.py --tp 2          # FSDP + tensor parallelism: 4 CPU ranks, (dp=2, tp=2)
    torchrun --nproc-per-node 8 examples/train.py --dim 1024 --layers 16   # GPUs: NCCL
    python examples/train.py --steps 3 --dump dump/  # every compile stage + collectives report
    python examples/train.py --bf16 --steps 5 --save ckpt/ && python examples/train.py --resume ckpt/
    python examples/train.py --float8        # torchao float8 training, float8 all-gathers (emulated on CPU)

Each decoder layer is one sharding unit and the root holds the embeddings,
final norm and (tied) output projection, as with FSDP2. Synthetic tokens that follow a fixed rule (so the loss falls);
rank 0 prints the loss and step time of every step.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _launch import run_on_ranks

TORCHAO_MISSING = "--float8 needs torchao: pip install -e '.[torchao]'"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--compile-backend", default="inductor", help="inductor | aot_eager | eager (no compile)")
    p.add_argument("--world-size", type=int, help="CPU ranks to start when not under torchrun (default: 2, or 2 x --tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: a (world / tp, tp) mesh, TP inside each layer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump", metavar="DIR", help="write every compile stage and a collectives report (fsdp_compile.debug.dump)")
    p.add_argument("--bf16", action="store_true", help="mixed precision: bf16 parameters/gathers, fp32 gradient reduction")
    p.add_argument(
        "--activation-checkpointing",
        choices=["full", "selective"],
        help="torch.utils.checkpoint inside each decoder layer (selective: matmul outputs saved)",
    )
    p.add_argument(
        "--float8",
        action="store_true",
        help="torchao float8 training of the decoder layers' linears, with float8 all-gathers "
        "(emulated matmuls unless on CUDA sm89+; needs pip install -e '.[torchao]')",
    )
    p.add_argument("--save", metavar="DIR", help="save model + optimizer with DCP after the last step")
    p.add_argument("--resume", metavar="DIR", help="resume model + optimizer + step from a --save checkpoint")
    args = p.parse_args(argv)
    if args.float8 and args.tp > 1:
        p.error("--float8 with --tp is not supported (fsdp_compile shards float8 weights with FSDP only)")
    if args.float8 and importlib.util.find_spec("torchao") is None:
        p.error(TORCHAO_MISSING)
    if args.world_size is None:
        args.world_size = 2 * args.tp
    return args


def tensor_parallel(model, tp: int, device: torch.device):
    """Tensor parallelism inside each decoder layer on the "tp" dimension of a
    (world / tp, tp) mesh (torchtitan's plan); returns the "dp" dimension, which
    fully_shard then shards over."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world_size = dist.get_world_size()
    if world_size % tp:
        raise ValueError(f"--tp {tp} does not divide the {world_size} ranks")
    mesh = init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    plan = {
        **{f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    return mesh["dp"]


def float8_training(model, device: torch.device) -> list[str]:
    """torchao float8 training (tensorwise dynamic scaling) of the linears inside the
    decoder layers, before sharding: their weights become float8 weight wrappers, whose
    FSDP2 all-gather extension gathers float8 bytes and their scale. Returns the names
    of the converted linears."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ImportError(TORCHAO_MISSING) from e
    # Real float8 matmuls (torch._scaled_mm) need CUDA sm89+ (Ada, Hopper); elsewhere
    # torchao emulates them (casts to float8 and back, matmul in high precision).
    emulate = not (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9))
    world_size = dist.get_world_size()
    converted, skipped = [], []

    def in_layers(module, fqn: str) -> bool:
        if not fqn.startswith("layers."):
            return False
        # float8 matmuls need both weight dims to be multiples of 16 (torchao's own
        # filter skips the others); fully_shard needs float8 weights' rows to split evenly.
        rows, cols = module.weight.shape
        keep = rows % 16 == 0 and cols % 16 == 0 and rows % world_size == 0
        (converted if keep else skipped).append(fqn)
        return keep

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=in_layers)
    if dist.get_rank() == 0:
        mode = "emulated" if emulate else "float8 matmuls"
        why = f", {len(skipped)} kept in high precision (dims not multiples of 16, e.g. {skipped[0]})" if skipped else ""
        print(f"float8 ({mode}): {len(converted)} linears converted{why}", flush=True)
    return converted


def synthetic_tokens(batch: int, length: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Random starts, then a fixed rule (next = 3 * prev + 1 mod vocab): learnable, so the loss falls."""
    tokens = torch.empty(batch, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=generator)
    for t in range(1, length):
        tokens[:, t] = (3 * tokens[:, t - 1] + 1) % vocab
    return tokens


def train(args: argparse.Namespace) -> list[float]:
    if args.dump:
        import fsdp_compile.debug

        with fsdp_compile.debug.dump(args.dump):
            return _train(args)
    return _train(args)


def _train(args: argparse.Namespace) -> list[float]:
    from fsdp_compile import MixedPrecisionPolicy, fully_shard, step_on_local_shards
    from fsdp_compile.testing.models import Llama, LlamaConfig

    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        ffn_dim=args.dim * 8 // 3,
        max_seq_len=args.seq_len,
        activation_checkpointing=args.activation_checkpointing or False,
    )
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = Llama(cfg).to(device)
    if args.float8:
        float8_training(model, device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else MixedPrecisionPolicy()
    dp_mesh, dp_rank = None, rank
    if args.tp > 1:
        dp_mesh = tensor_parallel(model, args.tp, device)
        dp_rank = dp_mesh.get_local_rank()
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    step_fn = model if args.compile_backend == "eager" else torch.compile(model, backend=args.compile_backend)
    # AdamW's update on each rank's local shards: the same numbers, without DTensor dispatch per op.
    opt = step_on_local_shards(torch.optim.AdamW(model.parameters(), lr=args.lr))
    first_step = load_checkpoint(args.resume, model, opt) if args.resume else 0
    # FSDP2's float8 recipe: after each optimizer step, the float8 weights' scales for the
    # next all-gathers from the updated shards, in one all-reduce of every weight's amax
    # (instead of one all-reduce per weight in each gather), eager or compiled.
    precompute_scales = args.float8
    if precompute_scales:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)  # the first step's gathers too

    losses, step_times = [], []
    for step in range(first_step, first_step + args.steps):
        # Each (step, rank) has its own batch, so a resumed run sees the same data.
        # (Ranks of one tensor-parallel group share their batch.)
        data = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 7919 + dp_rank)
        tokens = synthetic_tokens(args.batch_size, args.seq_len + 1, cfg.vocab_size, data).to(device)
        start = time.perf_counter()
        logits = step_fn(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if precompute_scales:
            precompute_float8_dynamic_scale_for_fsdp(model)
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        reported /= world_size
        elapsed = time.perf_counter() - start
        losses.append(reported.item())
        step_times.append(elapsed)
        if rank == 0:
            first = step == first_step
            note = " (includes compilation)" if first and args.compile_backend != "eager" else ""
            n_tokens = args.batch_size * args.seq_len * world_size // args.tp
            # The compiling step says nothing about the steps after it: leave it out.
            timed = step_times[1:] if args.compile_backend != "eager" else step_times
            remaining = first_step + args.steps - step - 1
            eta = f"{sorted(timed)[len(timed) // 2] * remaining:6.1f} s" if timed else "   n/a" if remaining else "   0.0 s"
            print(
                f"step {step:3d}  loss {losses[-1]:.4f}  step time {elapsed * 1000:8.1f} ms  "
                f"{n_tokens / elapsed:9.0f} tokens/s  ETA {eta}{note}",
                flush=True,
            )
    if args.save:
        save_checkpoint(args.save, model, opt, first_step + args.steps)
    return losses


def save_checkpoint(path: str, model, opt, next_step: int) -> None:
    """Model + optimizer (sharded, DCP) and the step to resume from."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(next_step)}, checkpoint_id=path)
    if dist.get_rank() == 0:
        print(f"saved checkpoint to {path} (resume at step {next_step})", flush=True)


def load_checkpoint(path: str, model, opt) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step = int(state["step"])
    if dist.get_rank() == 0:
        print(f"resumed from {path} at step {step}", flush=True)
    return step


def main(argv=None) -> None:
    args = parse_args(argv)
    print(f"compile backend: {args.compile_backend}", flush=True)
    run_on_ranks(train, args, args.world_size)


if __name__ == "__main__":
    sys.exit(main())
