"""Parity over several optimizer steps on 2 gloo ranks.

Eager-ours vs compiled-ours (aot_eager) is bitwise: the same ops run. Every
sharded variant matches a single-process unsharded reference on the same
global batch to fp32 rounding (the global mean is computed in a different
order), and so does torch's own FSDP2 where it can run the model.
"""

from __future__ import annotations

import pytest
import torch

from tests import parity_jobs

OURS = ["ours-eager", "ours-aot_eager", "ours-inductor"]
CASES = {
    # model: (variants, train/eval switch)
    "mlp": (["reference", *OURS, "fsdp2"], False),
    "llama": (["reference", *OURS, "fsdp2"], False),
    "llama_tied_across_units": (["reference", "ours-eager", "ours-aot_eager"], False),
    "zoo": (["reference", *OURS], True),
}
STEPS = 3
_cache: dict = {}


@pytest.fixture()
def results(pool2, request):
    name = request.param
    if name not in _cache:
        variants, with_eval = CASES[name]
        per_rank = pool2.run(parity_jobs.train_all, name, variants, STEPS, with_eval)
        # Every rank reports the same full parameters and global losses.
        for variant in variants:
            _assert_records_equal(per_rank[0][variant], per_rank[1][variant], exact=True)
        _cache[name] = per_rank[0]
    return _cache[name]


def _assert_records_equal(a: dict, b: dict, *, exact: bool, rtol=1e-5, atol=1e-6, what="") -> None:
    check = (lambda x, y, m: torch.testing.assert_close(x, y, rtol=0, atol=0, msg=m)) if exact else (
        lambda x, y, m: torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=m)
    )
    assert len(a["loss"]) == len(b["loss"])
    for step, (la, lb) in enumerate(zip(a["loss"], b["loss"])):
        check(torch.tensor(la), torch.tensor(lb), lambda m, s=step: f"{what} loss at step {s}: {m}")
    for step, (pa, pb) in enumerate(zip(a["params"], b["params"])):
        assert pa.keys() == pb.keys()
        for fqn in pa:
            check(pa[fqn], pb[fqn], lambda m, s=step, f=fqn: f"{what} parameter {f} after step {s}: {m}")
    for step, (ba, bb) in enumerate(zip(a["buffers"], b["buffers"])):
        assert ba.keys() == bb.keys()
        for fqn in ba:
            check(ba[fqn], bb[fqn], lambda m, s=step, f=fqn: f"{what} buffer {f} after step {s}: {m}")
    if a["eval_out"] is not None or b["eval_out"] is not None:
        check(a["eval_out"], b["eval_out"], lambda m: f"{what} eval output: {m}")


@pytest.mark.parametrize("results", list(CASES), indirect=True)
def test_compiled_aot_eager_is_bitwise_equal_to_eager(results):
    _assert_records_equal(results["ours-eager"], results["ours-aot_eager"], exact=True, what="aot_eager vs eager")


@pytest.mark.parametrize(
    "results,variant",
    [(name, v) for name, (variants, _) in CASES.items() for v in variants if v != "reference"],
    indirect=["results"],
)
def test_matches_single_process_reference(results, variant):
    _assert_records_equal(results["reference"], results[variant], exact=False, what=f"{variant} vs reference")


@pytest.mark.parametrize("results", ["mlp", "llama"], indirect=True)
def test_ours_compiled_matches_torch_fsdp2(results):
    _assert_records_equal(results["fsdp2"], results["ours-inductor"], exact=False, what="inductor vs FSDP2")


@pytest.mark.parametrize(
    "results,variant",
    [(name, v) for name, (variants, _) in CASES.items() for v in variants if v in ("ours-aot_eager", "ours-inductor")],
    indirect=["results"],
)
def test_one_graph_no_recompiles(results, variant):
    """fullgraph=True already forbids graph breaks; across steps nothing recompiles.
    The train/eval switch of ``zoo`` adds exactly one (eval, no-grad) graph."""
    with_eval = results["reference"]["eval_out"] is not None
    assert results[variant]["frames"] == (2 if with_eval else 1)
