"""FSDP2 features on 2 gloo ranks: meta-device init, gradient clipping, state dicts and DCP."""

from __future__ import annotations

import torch

from tests import feature_jobs


def _equal(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"{k}: {m}", **(tol or {"rtol": 0, "atol": 0}))


def test_meta_device_init_matches_eager_init(pool2):
    for result in pool2.run(feature_jobs.meta_init_matches_eager_init):
        meta_losses, meta_params = result["meta"]
        eager_losses, eager_params = result["eager"]
        assert meta_losses == eager_losses
        _equal(meta_params, eager_params)


def test_clip_grad_norm_matches_unsharded_reference(pool2):
    result = pool2.run(feature_jobs.clip_grad_norm_matches_reference)[0]
    torch.testing.assert_close(result["norm"], result["ref_norm"], rtol=1e-5, atol=1e-7)
    assert result["ref_norm"] > 0.01  # clipping is active (max_norm=0.01)
    _equal(result["ours"], result["ref"], rtol=1e-5, atol=1e-6)


def test_dcp_round_trip_model_and_optimizer_is_bitwise(pool2, tmp_path):
    for result in pool2.run(feature_jobs.dcp_round_trip, str(tmp_path / "ckpt")):
        continued_loss, continued = result["continued"]
        resumed_loss, resumed = result["resumed"]
        assert resumed_loss == continued_loss
        _equal(resumed, continued)


def test_checkpoints_cross_load_with_torch_fsdp2(pool2, tmp_path):
    for writer, reader in (("ours", "fsdp2"), ("fsdp2", "ours")):
        path = str(tmp_path / f"{writer}_to_{reader}")
        saved = pool2.run(feature_jobs.save_checkpoint, path, writer)[0]
        loaded = pool2.run(feature_jobs.load_checkpoint, path, reader)[0]
        _equal(loaded, saved)


def test_gradient_accumulation_matches_torch_fsdp2(pool2):
    """4 micro-batches per step (sync on the last), 2 steps: same parameters as FSDP2."""
    fsdp2 = pool2.run(feature_jobs.gradient_accumulation, "fsdp2", None)[0]
    eager = pool2.run(feature_jobs.gradient_accumulation, "ours", None)[0]
    compiled = pool2.run(feature_jobs.gradient_accumulation, "ours", "aot_eager")[0]
    inductor = pool2.run(feature_jobs.gradient_accumulation, "ours", "inductor")[0]
    _equal(compiled["params"], eager["params"])  # same ops: bitwise
    assert compiled["losses"] == eager["losses"]
    for result in (eager, inductor):
        _equal(result["params"], fsdp2["params"], rtol=1e-5, atol=1e-6)
    # One graph per mode (no sync; sync with accumulated gradients), compiled in the
    # first step only: no recompile in the second.
    for result in (compiled, inductor):
        first, total = result["frames"]
        assert first == total == 2


def test_fsdp_module_methods(pool2):
    for result in pool2.run(feature_jobs.module_methods):
        assert result["unregistered"] != "no error"  # a unit's weight read outside any forward: sharded
        assert result["registered_matches"]
        assert result["held_is_full_plain"] and result["held_forward_matches"]
        assert result["resharded_is_dtensor"]
        assert result["divide_factor_1_sums"]  # divide by 1 = sum over 2 ranks = 2 x average


def test_activation_checkpointing_eager_is_bitwise_equal_to_no_checkpointing(pool2):
    """torch.utils.checkpoint (full, and selective: matmul outputs saved) inside each
    sharded decoder layer, eager: recomputation re-gathers the layer's weights and gives
    exactly the same training, while saving fewer activations."""
    from tests import parity_jobs

    without = pool2.run(parity_jobs.train, "llama", "ours-eager")[0]
    saved_without = pool2.run(feature_jobs.saved_activation_bytes, "llama")[0]
    for name in ("llama_ac", "llama_sac"):
        with_ac = pool2.run(parity_jobs.train, name, "ours-eager")[0]
        assert with_ac["loss"] == without["loss"], name
        _equal(with_ac["params"][-1], without["params"][-1])
        saved = pool2.run(feature_jobs.saved_activation_bytes, name)[0]
        assert saved < saved_without, (name, saved, saved_without)


def test_activation_checkpointing_under_compile(pool2):
    """The same checkpointed model compiled: aot_eager trains bitwise like eager without
    checkpointing, Inductor to fp32 rounding, in one graph; and the compiled forward
    hands the backward fewer bytes (full < selective < none)."""
    from tests import parity_jobs

    without = pool2.run(parity_jobs.train, "llama", "ours-eager")[0]
    for name in ("llama_ac", "llama_sac"):
        compiled = pool2.run(parity_jobs.train, name, "ours-aot_eager")[0]
        assert compiled["loss"] == without["loss"], name
        _equal(compiled["params"][-1], without["params"][-1])
        inductor = pool2.run(parity_jobs.train, name, "ours-inductor")[0]
        _equal(inductor["params"][-1], without["params"][-1], rtol=1e-5, atol=1e-6)
        assert compiled["frames"] == inductor["frames"] == 1
    saved = {name: pool2.run(feature_jobs.compiled_saved_bytes, name)[0] for name in ("llama", "llama_sac", "llama_ac")}
    assert saved["llama_ac"] < saved["llama_sac"] < saved["llama"], saved


def test_checkpoint_saved_at_two_ranks_resumes_at_one_and_four(pool2, rank_pools, tmp_path):
    """DCP resharding: a model + AdamW checkpoint from 2 ranks loads bitwise at world size
    1 and 4, and the next step gives the loss and update of the run that went on at 2
    (to fp32 rounding: the global batch is split differently, so reductions differ)."""
    path = str(tmp_path / "ws2")
    straight = pool2.run(feature_jobs.save_then_continue, path)[0]
    for world_size in (1, 4):
        results = rank_pools(world_size).run(feature_jobs.resume, path)
        for result in results:
            assert result["world_size"] == world_size
            _equal(result["loaded"], straight["saved"])
            torch.testing.assert_close(torch.tensor(result["loss"]), torch.tensor(straight["loss"]), rtol=1e-6, atol=0)
            _equal(result["params"], straight["params"], rtol=1e-5, atol=1e-6)
