"""Lightning's ``ModelParallelStrategy`` (Fabric and ``Trainer``) with our ``fully_shard``
against torch's FSDP2, in the same run.

    pip install lightning       # not a dependency of this project, not run by CI
    python examples/lightning_fsdp.py [--api fabric|trainer|both] [--compile] [--tp 2]

Lightning calls the user's code to shard: Fabric's ``parallelize_fn(model, device_mesh)``,
``LightningModule.configure_model``. The switch is that code's import::

    from fsdp_compile import fully_shard      # was: from torch.distributed.fsdp import fully_shard

Lightning's own FSDP2 code then finds our units (``no_backward_sync`` sets
``set_requires_gradient_sync`` on every ``isinstance(m, FSDPModule)``; checkpoints go
through DCP's ``get_model_state_dict``). Each variant runs in new processes (2 CPU ranks,
gloo; ``--tp 2``: 4 ranks, a 2 x 2 ``data_parallel x tensor_parallel`` mesh, the blocks'
MLPs column/row-parallel first): a 3-block MLP language model, AdamW, 2 micro-batches per
step (the first under ``no_backward_sync`` in Fabric, ``accumulate_grad_batches=2`` in the
``Trainer``), ``clip_gradients`` in Fabric (not with ``--tp``: torch's ``clip_grad_norm_``
cannot stack norms of two meshes, FSDP2 as ours), a DCP checkpoint saved, then (Fabric)
FSDP2's checkpoint loaded into each (model and optimizer), one more step and a loss. ``--compile``:
``torch.compile(model, backend="aot_eager")`` after sharding (``model.compile`` in the
``Trainer``). Prints the losses side by side; exits non-zero unless they are bitwise equal.
Nothing is shimmed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, LAYERS = 64, 32, 3


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class LanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(DIM) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _fully_shard(which: str):
    if which == "ours":
        from fsdp_compile import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    return fully_shard


def shard(model: nn.Module, mesh, which: str, tp: int) -> nn.Module:
    """What a user's ``parallelize_fn`` / ``configure_model`` does: TP first, then FSDP per block."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    fully_shard = _fully_shard(which)
    if tp > 1:
        for block in model.layers:
            parallelize_module(block, mesh["tensor_parallel"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    for block in model.layers:
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def run_fabric(args) -> dict:
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    ranks, dp = 2 * args.tp, 2
    strategy = ModelParallelStrategy(
        lambda m, mesh: shard(m, mesh, args.which, args.tp), data_parallel_size=dp, tensor_parallel_size=args.tp
    )
    fabric = L.Fabric(accelerator="cpu", devices=ranks, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup(LanguageModel())
    if args.compile:
        model = torch.compile(model, backend="aot_eager")
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = torch.Generator().manual_seed(1)
    dp_rank = fabric.global_rank // args.tp
    losses = []
    for _ in range(4):
        for micro in range(2):
            tokens = torch.randint(0, VOCAB, (2 * dp, 8), generator=data)[2 * dp_rank : 2 * dp_rank + 2]
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
                fabric.backward(loss / 2)
        norm = fabric.clip_gradients(model, optimizer, max_norm=0.5) if args.tp == 1 else torch.tensor(0.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append([loss.item(), norm.item()])
    fabric.save(os.path.join(args.dir, f"fabric-{args.which}"), {"model": model, "optimizer": optimizer})
    fabric.barrier()
    # FSDP2's checkpoint (its own run wrote it first) loaded into either model
    fabric.load(os.path.join(args.dir, "fabric-fsdp2"), {"model": model, "optimizer": optimizer})
    for _ in range(2):  # a step from the loaded weights and optimizer state, then a loss
        tokens = torch.randint(0, VOCAB, (2 * dp, 8), generator=data)[2 * dp_rank : 2 * dp_rank + 2]
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "FSDP2's checkpoint loaded: step, then loss": loss.item(), "rank": fabric.global_rank}


def lightning_module(shard_model, compile_model: bool = False):
    """The ``LightningModule`` of the ``Trainer`` runs: :class:`LanguageModel`, sharded in
    ``configure_model`` by ``shard_model(model, device_mesh)``, the cross-entropy of each
    batch recorded in ``losses``, AdamW."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LanguageModel()
            self.losses: list[float] = []

        def configure_model(self) -> None:
            shard_model(self.model, self.device_mesh)
            if compile_model:
                self.model.compile(backend="aot_eager")

        def training_step(self, batch, index):
            (tokens,) = batch
            loss = F.cross_entropy(self.model(tokens).flatten(0, 1), tokens.flatten())
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Module()


def trainer_on_cpu_ranks(tp: int, **limits):
    """A ``Trainer`` over ``2 * tp`` CPU ranks (``ModelParallelStrategy``, data parallel 2),
    2 batches accumulated per step, nothing logged, saved or printed; ``limits``: its
    ``max_steps`` / ``max_epochs``."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    return L.Trainer(
        accelerator="cpu",
        devices=2 * tp,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=tp),
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **limits,
    )


def run_trainer(args) -> dict:

    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (32, 8), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=2)
    module = lightning_module(lambda model, mesh: shard(model, mesh, args.which, args.tp), args.compile)
    trainer = trainer_on_cpu_ranks(args.tp, max_steps=4)
    trainer.fit(module, loader)
    trainer.save_checkpoint(os.path.join(args.dir, f"trainer-{args.which}"))
    return {"losses": module.losses, "rank": trainer.global_rank}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--api", choices=["fabric", "trainer", "both"], default="both")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--tp", type=int, choices=[1, 2], default=1)
    parser.add_argument("--which", choices=["fsdp2", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.which:  # one variant, in Lightning's processes
        result = run_fabric(args) if args.api == "fabric" else run_trainer(args)
        if result.pop("rank") == 0:
            with open(args.out, "w") as f:
                json.dump(result, f)
        return
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for api in ["fabric", "trainer"] if args.api == "both" else [args.api]:
            results = {}
            for which in ["fsdp2", "ours"]:
                out = os.path.join(tmp, f"{api}-{which}.json")
                command = [
                    sys.executable,
                    __file__,
                    "--api",
                    api,
                    "--which",
                    which,
                    "--dir",
                    tmp,
                    "--out",
                    out,
                    "--tp",
                    str(args.tp),
                ]
                env = dict(os.environ, OMP_NUM_THREADS="1")
                subprocess.run(command + (["--compile"] if args.compile else []), check=True, env=env)
                with open(out) as f:
                    results[which] = json.load(f)
            print(f"\n{api}, {'compiled' if args.compile else 'eager'}, {2 * args.tp} ranks (tp={args.tp}): FSDP2 | ours")
            for step, (a, b) in enumerate(zip(results["fsdp2"]["losses"], results["ours"]["losses"], strict=True)):
                print(f"  step {step}: {a} | {b}")
            for key in results["ours"]:
                if key != "losses":
                    print(f"  {key}: {results['fsdp2'][key]} | {results['ours'][key]}")
            same = results["fsdp2"] == results["ours"]
            print("  bitwise equal" if same else "  DIFFERENT")
            failed |= not same
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
