"""Lightning's ``ModelParallelStrategy`` trains with our ``fully_shard`` exactly as with torch's
FSDP2, as README.md ("Training stacks") documents: Lightning calls the user's code to shard
(Fabric's ``parallelize_fn(model, device_mesh)``, ``LightningModule.configure_model``), so the
switch is that code's import, and Lightning's own FSDP2 code then has to find our units
(``no_backward_sync`` sets ``set_requires_gradient_sync(False)`` on every ``isinstance(m,
FSDPModule)``; checkpoints go through DCP's ``get_model_state_dict`` / ``set_state_dict``).

On the suite's 2 gloo CPU ranks (Lightning uses the pool's process group: with ``LOCAL_RANK``
set it launches nothing and initialises nothing), a 3-block MLP language model, AdamW:

- Fabric: 3 steps of 2 micro-batches, the first under ``fabric.no_backward_sync``, then
  ``fabric.clip_gradients`` (max norm 0.5, so it clips), eager and compiled (``aot_eager``:
  eager's arithmetic), then a DCP checkpoint by ``fabric.save``; each side then loads the
  *other's* checkpoint (model and optimizer) and takes one more step;
- the ``Trainer``: one epoch, 6 batches per rank, ``accumulate_grad_batches=2`` (3 optimizer steps).

Losses and gradient norms must be equal (``==``), final parameters ``torch.equal``, every
unit an ``fsdp_compile.FSDPModule`` in our run. Nothing of Lightning is shimmed.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("lightning")

_EXAMPLES = str(pathlib.Path(__file__).resolve().parents[1] / "examples")
if _EXAMPLES not in sys.path:  # (the ranks import this module too)
    sys.path.insert(0, _EXAMPLES)
import lightning_fsdp as example  # noqa: E402  (its model, sharding and LightningModule)

STEPS, VOCAB = 3, example.VOCAB


def _shard(model: nn.Module, mesh, kind: str) -> nn.Module:
    """The user's ``parallelize_fn``: one unit per block, then the root."""
    return example.shard(model, mesh, kind, tp=1)


@contextlib.contextmanager
def _lightning_on_pool_ranks():
    """``LOCAL_RANK`` set (Lightning then treats the processes as launched for it) and
    ``os.environ`` restored after."""
    import torch.distributed as dist

    environ = dict(os.environ)
    os.environ.update(LOCAL_RANK=str(dist.get_rank()), NODE_RANK="0", LOCAL_WORLD_SIZE=str(dist.get_world_size()))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)


def _tokens(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))


def _units(model: nn.Module) -> dict:
    """The sharded modules' names in the user's model (without ``torch.compile``'s and
    Fabric's wrappers), and which of them are ours."""
    from torch.distributed.fsdp import FSDPModule

    import fsdp_compile

    def name(n: str) -> str:
        n = n.removeprefix("_orig_mod.").removeprefix("_orig_mod")
        return n.removeprefix("_forward_module.").removeprefix("_forward_module")

    return {
        "fsdp2": sorted(name(n) for n, m in model.named_modules() if isinstance(m, FSDPModule)),
        "ours": sorted(name(n) for n, m in model.named_modules() if isinstance(m, fsdp_compile.FSDPModule)),
    }


def _fabric(kind: str, compiled: bool):
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(lambda m, mesh: _shard(m, mesh, kind), data_parallel_size=2, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup(example.LanguageModel())
    if compiled:
        model = torch.compile(model, backend="aot_eager")
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return fabric, model, optimizer


def _fabric_step(fabric, model, optimizer, step: int, micros: int) -> list[float]:
    for micro in range(micros):
        tokens = _tokens(step, micro, fabric.global_rank)
        with fabric.no_backward_sync(model, enabled=micro < micros - 1):
            loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            fabric.backward(loss / micros)
    norm = fabric.clip_gradients(model, optimizer, max_norm=0.5)
    optimizer.step()
    optimizer.zero_grad()
    return [loss.item(), norm.item()]


def train_fabric(kind: str, compiled: bool, checkpoint: str) -> dict:
    from fsdp_compile.testing import full_parameters

    torch._dynamo.reset()
    with _lightning_on_pool_ranks():
        fabric, model, optimizer = _fabric(kind, compiled)
        losses = [_fabric_step(fabric, model, optimizer, step, micros=2) for step in range(STEPS)]
        fabric.save(checkpoint, {"model": model, "optimizer": optimizer})
        fabric.barrier()
        return {"losses": losses, "params": full_parameters(model), **_units(model)}


def resume_fabric(kind: str, checkpoint: str) -> dict:
    """A new model and optimizer, ``checkpoint`` loaded into both, one more step."""
    from fsdp_compile.testing import full_parameters

    with _lightning_on_pool_ranks():
        fabric, model, optimizer = _fabric(kind, compiled=False)
        fabric.load(checkpoint, {"model": model, "optimizer": optimizer})
        loss = _fabric_step(fabric, model, optimizer, STEPS, micros=1)
        return {"losses": [loss], "params": full_parameters(model), **_units(model)}


def train_trainer(kind: str) -> dict:
    import torch.distributed as dist

    from fsdp_compile.testing import full_parameters

    with _lightning_on_pool_ranks():
        torch.manual_seed(0)
        module = example.lightning_module(lambda model, mesh: _shard(model, mesh, kind))
        # the same sequences on each rank: Lightning's distributed sampler gives each rank half
        tokens = torch.cat(
            [_tokens(step, micro, r) for step in range(STEPS) for micro in range(2) for r in range(dist.get_world_size())]
        )
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=2)
        trainer = example.trainer_on_cpu_ranks(tp=1, max_epochs=1)
        trainer.fit(module, loader)
        return {"losses": module.losses, "params": full_parameters(module.model), **_units(module.model)}


def _assert_same(expected: list[dict], got: list[dict], steps: int) -> None:
    for rank, (e, g) in enumerate(zip(expected, got, strict=True)):
        assert len(e["losses"]) == steps, e["losses"]
        assert g["losses"] == e["losses"], f"rank {rank}: {g['losses']} != FSDP2's {e['losses']}"
        assert g["fsdp2"] == e["fsdp2"] == ["", "layers.0", "layers.1", "layers.2"], (e["fsdp2"], g["fsdp2"])
        assert e["ours"] == [] and g["ours"] == g["fsdp2"], "a run sharded with the other's fully_shard"
        differ = [n for n in e["params"] if not torch.equal(e["params"][n], g["params"][n])]
        assert e["params"].keys() == g["params"].keys() and not differ, f"rank {rank}: final parameters differ: {differ}"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fabric_model_parallel_strategy_trains_as_with_fsdp2(pool2, tmp_path, compiled):
    """Fabric, eager and compiled: the same losses, clipped gradient norms and parameters as
    FSDP2; then each side resumes from the other's DCP checkpoint and takes the same step."""
    expected = pool2.run(train_fabric, "fsdp2", compiled, str(tmp_path / "fsdp2"))
    got = pool2.run(train_fabric, "ours", compiled, str(tmp_path / "ours"))
    _assert_same(expected, got, STEPS)
    assert expected[0]["losses"][0][1] > 0.5, "the gradients were not clipped"
    if not compiled:
        _assert_same(
            pool2.run(resume_fabric, "fsdp2", str(tmp_path / "ours")),
            pool2.run(resume_fabric, "ours", str(tmp_path / "fsdp2")),
            1,
        )


def test_lightning_trainer_model_parallel_strategy_trains_as_with_fsdp2(pool2):
    expected = pool2.run(train_trainer, "fsdp2")
    got = pool2.run(train_trainer, "ours")
    _assert_same(expected, got, 2 * STEPS)
