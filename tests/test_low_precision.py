"""Low-precision parameter subclasses through FSDP2's all-gather extension (issue 33):
QLoRA's NF4 base weights and float8 training with float8 all-gathers (torchao), eager
and compiled, on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

pytest.importorskip("torchao", reason="torchao not installed (pip install -e '.[torchao]')")

from fsdp_compile.testing import assert_parity  # noqa: E402
from tests import lowp_models as models  # noqa: E402


def _parity(build, batch, backends, pool, **kwargs):
    return assert_parity(build, batch, models.mse, shard_fn=models.shard_layers, backends=backends, pool=pool, **kwargs)


def test_qlora_nf4_trains_like_the_single_process_model(pool2):
    """Frozen NF4 base weights, trainable adapters: eager and compiled (one graph, as the
    unsharded model; through Inductor's graph pipeline and our passes, ``inductor_passes``:
    real Inductor's code for low-precision gathers is the float8 test's) train like the
    single-process model."""
    report = _parity(models.build_qlora, models.batch, ("eager", "aot_eager", "inductor_passes"), pool2, check_graph_count=True)
    assert report.graphs["ours:aot_eager"] == report.graphs["ours:inductor_passes"] == report.graphs["unsharded"] == 1
    assert max(report.max_param_gap.values()) <= 1e-5 and max(report.max_loss_gap.values()) <= 1e-5


def test_qlora_nf4_matches_fsdp2(pool2):
    _parity(models.build_qlora, models.batch, ("eager", "aot_eager"), pool2, reference="fsdp2")


def test_float8_all_gather_trains_like_the_single_process_float8_model(pool2):
    """torchao float8 training with float8 all-gathers (emulated on CPU), eager and compiled
    in one graph; FSDP2 cannot run it on gloo (no float8 all-gather there)."""
    report = _parity(models.build_float8, models.batch_float8, ("eager", "aot_eager", "inductor"), pool2, check_graph_count=True)
    assert report.graphs["ours:aot_eager"] == report.graphs["ours:inductor"] == 1


def test_all_gathers_move_the_low_precision_payload(pool2):
    """The shards keep their subclass; the all-gathers move its payload as bytes: NF4's
    4-bit codes and scales (under 0.3x the float32 bytes of those weights), float8's one
    byte per element (the scale is the amax all-reduce's, one per weight, or none once
    precomputed: one all-reduce for the whole model per step)."""
    nf4 = pool2.run(models.collective_bytes, "nf4")[0]
    assert nf4["local_types"] == ["NF4Tensor"]
    # The root's, then per block one all-gather of both NF4 payloads (FSDP2's: one per
    # unit), one of its frozen norms and one of its adapters.
    assert [dtype for dtype, _ in nf4["gathers"]] == ["float32"] + ["uint8", "float32", "float32"] * 2
    nf4_bytes = sum(b for dtype, b in nf4["gathers"] if dtype == "uint8")
    assert 0 < nf4_bytes <= 0.3 * nf4["fp32_bytes"]
    assert not any(g for n, g in nf4["grads"].items() if "lora" not in n and not n.startswith("head"))

    f8 = pool2.run(models.collective_bytes, "float8")[0]
    assert f8["local_types"] == ["WeightWithDynamicFloat8CastTensor"]
    f8_bytes = sum(b for dtype, b in f8["gathers"] if dtype == "uint8")
    assert f8_bytes == f8["fp32_bytes"] // 4  # one byte per element
    assert f8["all_reduces"] == 4  # dynamic scaling: one amax all-reduce per weight
    assert all(f8["grads"].values())
    precomputed = pool2.run(models.collective_bytes, "float8", True)[0]
    assert precomputed["all_reduces"] == 0  # the scales came from the one precompute all-reduce
    assert precomputed["precompute_all_reduces"] == 1


def test_int8_mixed_precision_weights_use_the_five_argument_pre_hook(pool2):
    """torchao's int8 mixed-precision training weights (FSDP2's five-argument
    ``fsdp_pre_all_gather``), eager and compiled in one graph."""
    report = _parity(
        models.build_int8_mixed_precision, models.batch_float8, ("eager", "aot_eager"), pool2, check_graph_count=True
    )
    assert report.graphs["ours:aot_eager"] == 1


class _Tagged(torch.Tensor):
    """A tensor subclass without FSDP2's all-gather extension."""


class _WithHooks(torch.Tensor):
    def fsdp_pre_all_gather(self, mesh):
        raise AssertionError("not reached")

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        raise AssertionError("not reached")


def _module_with(param: torch.Tensor) -> nn.Module:
    module = nn.Linear(4, 4)
    module.weight = nn.Parameter(param)
    return module


def test_parameter_subclasses_fully_shard_cannot_honour_are_refused_by_name(fake_pg):
    from torch.distributed.tensor import Shard
    from torch.testing._internal.two_tensor import TwoTensor

    from fsdp_compile import fully_shard, replicate

    # A subclass without the extension is sharded keeping its subclass, as FSDP2 shards it
    # (its shards may get the hooks after fully_shard: test_fsdp2_extensions.py); gathered
    # without them, it is refused by name, before any collective.
    two = fully_shard(_module_with(TwoTensor(torch.randn(16, 4), torch.randn(16, 4))))
    assert type(two.weight._local_tensor) is TwoTensor
    tagged = fully_shard(_module_with(torch.randn(16, 4).as_subclass(_Tagged)))
    with pytest.raises(
        NotImplementedError,
        match=r"'weight' is a _Tagged, a tensor subclass without FSDP2's all-gather extension .* at its first gather",
    ):
        tagged(torch.randn(2, 4))
    with pytest.raises(NotImplementedError, match=r"'weight' is a _Tagged, a tensor subclass .* only be sharded on dim 0"):
        fully_shard(
            _module_with(torch.randn(16, 8).as_subclass(_Tagged)),
            shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None,
        )
    # (Rows that do not divide evenly are split as FSDP2 splits them, torch.chunk's 2 rows a
    # rank here, not refused: the pre hook pads; see test_fsdp2_extensions.py.)
    uneven = fully_shard(_module_with(torch.randn(12, 4).as_subclass(_WithHooks)))
    assert uneven.weight.to_local().shape == (2, 4)
    with pytest.raises(NotImplementedError, match=r"'weight' is a _WithHooks .* only be sharded on dim 0"):
        fully_shard(
            _module_with(torch.randn(16, 8).as_subclass(_WithHooks)),
            shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None,
        )
    with pytest.raises(NotImplementedError, match=r"'weight' is a _WithHooks .* replicate\(\) does not support it"):
        replicate(_module_with(torch.randn(16, 4).as_subclass(_WithHooks)))


@pytest.mark.parametrize("kind", ["nf4", "float8"])
def test_compiled_step_keeps_no_gathered_low_precision_weight(pool2, kind):
    """reshard_after_forward: the backward re-gathers (hooks included) instead of saving
    what the forward gathered."""
    assert pool2.run(models.saved_gathered_in_compiled_step, kind)[0] == []


def test_compiled_float8_with_precomputed_scales_trains_like_eager(pool2):
    """``precompute_float8_dynamic_scale_for_fsdp`` before each step (the amax of every weight
    in one all-reduce): the compiled step reads the precomputed scales (handed to the
    graph beside the weights, see [Note: side tensors of a traced gather]) and trains like
    eager with dynamic scales, in one graph."""
    eager = pool2.run(models.train_float8, None, False)[0]
    compiled = pool2.run(models.train_float8, "capture", True)[0]
    assert compiled["graphs"] == 1
    assert compiled["all_reduces"] == 0  # the scales are the precomputed ones: no amax all-reduce
    dynamic = pool2.run(models.train_float8, "capture", False, 1)[0]
    assert dynamic["all_reduces"] >= 4  # without: one per weight (again where the backward re-gathers)
    for step in range(len(eager["losses"])):
        assert abs(compiled["losses"][step] - eager["losses"][step]) <= 1e-6
        for name, value in eager["params"][step].items():
            torch.testing.assert_close(compiled["params"][step][name], value, rtol=1e-5, atol=1e-6)


def test_state_dict_full_tensor_and_dcp_see_what_fsdp2_gives(pool2, tmp_path):
    """The sharded parameter is a DTensor over the subclass shard, as FSDP2's: the same
    state-dict types and ``full_tensor()`` (float8; NF4's is not run over gloo, see
    ``state_dict_view``), and a DCP round trip into a fresh model, shard for shard."""
    ours = pool2.run(models.state_dict_view, "ours", str(tmp_path))[0]
    fsdp2 = pool2.run(models.state_dict_view, "fsdp2", str(tmp_path))[0]
    assert ours == fsdp2
    assert ours["nf4"] == ("DTensor", "NF4Tensor", "not gathered over gloo", (256, 256), True)
    assert ours["float8"][:2] == ("DTensor", "WeightWithDynamicFloat8CastTensor") and ours["float8"][-1]


def test_qlora_on_a_transformers_llama(pool2):
    """QLoRA as PEFT and torchtune lay it out on a ``transformers`` Llama (every attention
    and MLP projection a frozen NF4 weight plus an adapter): eager and compiled in the
    unsharded model's one graph, bitwise like FSDP2 (whose parity with the single-process
    model ``test_qlora_nf4_trains_like_the_single_process_model`` checks on our model)."""
    report = assert_parity(
        models.build_hf_qlora,
        models.batch_tokens,
        models.next_token_loss,
        shard_fn=models.shard_hf_layers,
        backends=("eager", "aot_eager"),
        reference="fsdp2",
        check_graph_count=True,
        pool=pool2,
    )
    assert report.graphs["ours:aot_eager"] == report.graphs["unsharded"] == 1
    for variant in ("ours:eager", "ours:aot_eager"):
        assert report.max_param_gap[variant] == 0.0 and report.max_loss_gap[variant] == 0.0, (variant, report)


def test_an_nf4_weight_its_subclass_cannot_split_is_refused_by_name(fake_pg):
    """NF4 keeps its scales in groups of 64 x 256 values: a 128 x 128 weight is one group,
    which 8 ranks cannot share. The subclass's own refusal is reported with the name."""
    from fsdp_compile import fully_shard

    with pytest.raises(ValueError, match=r"'weight' is a NF4Tensor .* cannot split it into 8 shards"):
        fully_shard(models.QLoRALinear(128, 8))
