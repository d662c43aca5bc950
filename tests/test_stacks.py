"""Training stacks that call ``fully_shard`` for you train with ours exactly as with
torch's FSDP2 when only the name they call is switched, as README.md documents
(``torch.distributed.fsdp.fully_shard = fsdp_compile.fully_shard``, restored after):

- accelerate's FSDP2 plugin: ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
  fsdp_version=2, auto_wrap_policy="transformer_based_wrap"))``, ``accelerator.prepare(model,
  optimizer)`` (which shards each decoder layer, the embedding, ``[norm, lm_head]`` and the
  root), three AdamW steps with ``accelerator.backward``, eager, and compiled by accelerate's dynamo
  plugin before sharding (``aot_eager``; the whole model, or each layer with
  ``use_regional_compilation``), where ours must also warn about nothing;
- ``transformers.Trainer`` with ``fsdp=True, fsdp_config={"version": 2, ...}``, three steps
  (``max_steps=3``: AdamW, constant learning rate, gradient clipping at 1.0) over a tiny
  in-memory dataset, ``use_cpu=True``, no saving, no reporting.

Both train a tiny ``LlamaForCausalLM`` built from a config with a fixed seed (no download),
on the suite's 2 gloo CPU ranks (world size 2; each rank its own batch). Each stack runs once
with torch's ``fully_shard`` and once with ours; the per-step losses of every rank must be
equal (``==``), the final full parameters ``torch.equal``, the same modules sharded, each an
instance of ``torch.distributed.fsdp.FSDPModule`` (and, with ours, of ``fsdp_compile.FSDPModule``,
so ours did run).

The one shim: accelerate 1.15 turns FSDP on only for accelerator devices. On CPU ranks
``PartialState`` detects ``DistributedType.MULTI_CPU`` (``cpu=True``; without it, with no GPU,
``DistributedType.NO``, one process), and ``AcceleratorState.__init__`` sets
``distributed_type = DistributedType.FSDP`` and keeps ``fsdp_plugin`` only in its branch for
``MULTI_GPU``, ``MULTI_XPU``, ... (``accelerate/state.py``, ``elif self.distributed_type in
[DistributedType.MULTI_GPU, ...]``, which does not list ``MULTI_CPU``), so ``prepare`` would wrap
the model in DDP. While a test builds its ``Accelerator`` (or ``Trainer``, which builds one),
:func:`_fsdp_on_cpu` wraps ``AcceleratorState.__init__`` to do what that branch does for a
``MULTI_CPU`` state given an FSDP plugin; everything after it (``prepare``,
``fsdp2_prepare_model``, ``backward``, ``clip_grad_norm_``, the Trainer's loop) is the stacks' own
code. The ranks' process group is the pool's (accelerate does not initialise another when
one exists). Accelerate's process-global states and the environment variables it sets
(``ACCELERATE_USE_FSDP``, ``LOCAL_WORLD_SIZE``, ...) are reset on each rank before and after.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

STEPS = 3
VOCAB, SEQ, BATCH = 64, 8, 2


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _reset_accelerate_state() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@contextlib.contextmanager
def _clean_process(kind: str):
    """On a rank: accelerate's global states reset and ``os.environ`` restored around the
    block, and ``torch.distributed.fsdp.fully_shard`` switched to ours for ``kind == "ours"``."""
    import torch.distributed.fsdp as torch_fsdp

    import fsdp_compile

    environ = dict(os.environ)
    original = torch_fsdp.fully_shard
    _reset_accelerate_state()
    # What ``torchrun`` sets and accelerate's CPU path reads (else it takes 1 rank per node).
    os.environ["LOCAL_WORLD_SIZE"] = os.environ["WORLD_SIZE"]
    try:
        if kind == "ours":
            torch_fsdp.fully_shard = fsdp_compile.fully_shard
        yield
    finally:
        torch_fsdp.fully_shard = original
        _reset_accelerate_state()
        os.environ.clear()
        os.environ.update(environ)


@contextlib.contextmanager
def _fsdp_on_cpu():
    """The shim of the module docstring: a ``MULTI_CPU`` ``AcceleratorState`` given an FSDP
    plugin becomes an FSDP one, as accelerate makes a ``MULTI_GPU`` one."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = init
    try:
        yield
    finally:
        AcceleratorState.__init__ = original


def _sharding(model) -> dict:
    """Which modules are sharding units (torch's ``FSDPModule``), and which of them ours."""
    from torch.distributed.fsdp import FSDPModule

    import fsdp_compile

    return {
        "fsdp2": sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule)),
        "ours": sorted(n for n, m in model.named_modules() if isinstance(m, fsdp_compile.FSDPModule)),
    }


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


# ---------------------------------------------------------------- on every rank


def train_accelerate(kind: str, compiled: str | None = None, plugin_options: dict | None = None) -> dict:
    """Three AdamW steps of the tiny Llama prepared by accelerate's FSDP2 plugin, with
    torch's ``fully_shard`` (``kind == "fsdp2"``) or ours (``"ours"``); with ``compiled``,
    accelerate's dynamo plugin compiles it (``aot_eager``) before sharding: ``"model"``,
    its default (the whole model), or ``"regional"`` (``use_regional_compilation``: each
    decoder layer, in place). ``plugin_options`` go to the FSDP plugin. Also returns our
    warnings, and what shows the options took effect (:func:`_options_seen`)."""
    import warnings

    import accelerate.utils.fsdp_utils as fsdp_utils
    import torch._dynamo.config as dynamo_config
    import torch.distributed as dist
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import TorchDynamoPlugin

    from fsdp_compile.testing import full_parameters

    torch._dynamo.reset()
    with (
        _clean_process(kind),
        _fsdp_on_cpu(),
        dynamo_config.patch(),  # restores what accelerate's regional path sets
        warnings.catch_warnings(record=True) as caught,
        _counting_calls(fsdp_utils, "fsdp2_load_full_state_dict") as full_state_dict_loads,
    ):
        warnings.simplefilter("always")
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", **(plugin_options or {})
        )
        dynamo = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=compiled == "regional") if compiled else None
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, dynamo_plugin=dynamo)
        assert accelerator.is_fsdp2, accelerator.distributed_type
        model = tiny_llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = accelerator.prepare(model, opt)
        rank = dist.get_rank()
        losses = []
        seen = _options_seen(model, full_state_dict_loads)
        for step in range(STEPS):
            tokens = _batch(step, rank)
            loss = model(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        ours_warnings = [str(w.message) for w in caught if "fsdp_compile" in str(w.message)]
        params = full_parameters(model)
        return {"losses": losses, "params": params, **_sharding(model), "warnings": ours_warnings, "seen": dict(seen)}


@contextlib.contextmanager
def _counting_calls(module, name: str):
    """``module.name`` wrapped to count its calls (a list, appended to per call)."""
    original = getattr(module, name)
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield calls
    finally:
        setattr(module, name, original)


def _options_seen(model, full_state_dict_loads: list) -> dict:
    """Evidence that accelerate applied its options, filled in as the model runs: the
    full-state-dict loads done while preparing, the dtype the first decoder layer's
    ``q_proj`` computes in, whether the layers are ``checkpoint_wrapper``'d, and the
    layers' ``reshard_after_forward`` (recorded by a forward hook)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    seen = {
        "full_state_dict_loads": len(full_state_dict_loads),
        "checkpoint_wrappers": sum(isinstance(m, CheckpointWrapper) for m in model.modules()),
    }
    q_proj = next(m for n, m in model.named_modules() if "layers.0." in n and n.endswith("self_attn.q_proj"))

    def record(module, args, out) -> None:
        seen.setdefault("compute_dtype", str(out.dtype))

    q_proj.register_forward_hook(record)
    return seen


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train_trainer(kind: str, output_dir: str) -> dict:
    """``max_steps=3`` of ``transformers.Trainer`` with FSDP2 on the tiny Llama, with
    torch's ``fully_shard`` or ours; the loss of each step as ``compute_loss`` returned it."""
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments

    from fsdp_compile.testing import full_parameters

    losses: list[float] = []

    class RecordingTrainer(Trainer):
        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            losses.append((loss[0] if isinstance(loss, tuple) else loss).item())
            return loss

    with _clean_process(kind), _fsdp_on_cpu():
        args = TrainingArguments(
            output_dir=os.path.join(output_dir, f"rank{dist.get_rank()}"),
            use_cpu=True,
            fsdp=True,
            fsdp_config={"version": 2, "reshard_after_forward": True, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
            max_steps=STEPS,
            per_device_train_batch_size=BATCH,
            learning_rate=1e-2,
            lr_scheduler_type="constant",
            optim="adamw_torch",
            seed=0,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = RecordingTrainer(model=tiny_llama(), args=args, train_dataset=_Tokens(STEPS * BATCH * dist.get_world_size()))
        assert trainer.is_fsdp_enabled and trainer.accelerator.is_fsdp2
        trainer.train()
        model = trainer.model
        return {"losses": losses, "params": full_parameters(model), **_sharding(model)}


# ---------------------------------------------------------------- tests


def _assert_same_training(expected: list[dict], got: list[dict]) -> None:
    for rank, (e, g) in enumerate(zip(expected, got, strict=True)):
        assert len(e["losses"]) == STEPS, e["losses"]
        assert g["losses"] == e["losses"], f"rank {rank}"
        assert e["fsdp2"] == g["fsdp2"], f"rank {rank}: the stack sharded other modules"
        assert "" in e["fsdp2"] and {"model.layers.0", "_orig_mod.model.layers.0"} & set(e["fsdp2"]), e["fsdp2"]
        assert e["ours"] == [], "torch's run used ours"
        assert g["ours"] == g["fsdp2"], "not every unit of our run is ours"
        assert e["params"].keys() == g["params"].keys()
        differ = [n for n in e["params"] if not torch.equal(e["params"][n], g["params"][n])]
        assert not differ, f"rank {rank}: final parameters differ: {differ}"


def test_accelerate_fsdp2_plugin_trains_as_with_fsdp2(pool2):
    expected = pool2.run(train_accelerate, "fsdp2")
    got = pool2.run(train_accelerate, "ours")
    _assert_same_training(expected, got)


@pytest.mark.parametrize("compiled", ["model", "regional"])
def test_accelerate_dynamo_plugin_compiles_as_with_fsdp2(pool2, compiled):
    """accelerate's dynamo plugin (``aot_eager``: eager's arithmetic) compiling the model
    before its FSDP2 plugin shards it, whole or per decoder layer: ours trains bitwise as
    FSDP2 compiled the same way, and warns about nothing."""
    expected = pool2.run(train_accelerate, "fsdp2", compiled)
    got = pool2.run(train_accelerate, "ours", compiled)
    _assert_same_training(expected, got)
    assert [r["warnings"] for r in got] == [[], []], got[0]["warnings"]


@pytest.mark.parametrize(
    "plugin_options",
    [
        {"cpu_ram_efficient_loading": True},
        {"mixed_precision_policy": "bf16"},
        {"reshard_after_forward": False},
        {"activation_checkpointing": True},
    ],
    ids=["cpu-ram-efficient-loading", "bf16", "no-reshard", "activation-checkpointing"],
)
def test_accelerate_fsdp2_plugin_options_train_as_with_fsdp2(pool2, plugin_options):
    """The plugin's options users set, each on its own: rank 0's weights broadcast into
    a meta-device model (``fsdp2_load_full_state_dict``: ``distribute_tensor`` and
    ``load_state_dict(assign=True)``), torch's ``MixedPrecisionPolicy`` built by accelerate,
    ``reshard_after_forward=False``, and accelerate's ``checkpoint_wrapper`` around each decoder
    layer: bitwise FSDP2's losses and parameters. (``cpu_offload`` is not compared: FSDP2 pins
    the offloaded shards, which needs an accelerator.)"""
    expected = pool2.run(train_accelerate, "fsdp2", None, plugin_options)
    got = pool2.run(train_accelerate, "ours", None, plugin_options)
    _assert_same_training(expected, got)
    seen = [r["seen"] for r in expected + got]
    assert all(s == seen[0] for s in seen), seen
    assert seen[0]["full_state_dict_loads"] == int("cpu_ram_efficient_loading" in plugin_options), seen[0]
    assert seen[0]["compute_dtype"] == ("torch.bfloat16" if "mixed_precision_policy" in plugin_options else "torch.float32")
    assert seen[0]["checkpoint_wrappers"] == (2 if "activation_checkpointing" in plugin_options else 0), seen[0]


def test_transformers_trainer_fsdp2_trains_as_with_fsdp2(pool2, tmp_path):
    expected = pool2.run(train_trainer, "fsdp2", str(tmp_path / "fsdp2"))
    got = pool2.run(train_trainer, "ours", str(tmp_path / "ours"))
    _assert_same_training(expected, got)
