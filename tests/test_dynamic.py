"""Dynamic shapes: variable sequence length and batch size without recompiles (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from fsdp_compile.base.compat import c10d_functional
from fsdp_compile.passes.bucketing import apply_buckets, plan_buckets
from fsdp_compile.passes.cost_model import simulate
from fsdp_compile.passes.reordering import reorder_for_overlap
from fsdp_compile.runtime.vocabulary import our_collectives
from tests import dynamic_jobs
from tests.models import shard_blocks


def test_mark_dynamic_recompiles_once(pool2):
    """mark_dynamic on the sequence dimension: after the first compile and the batch-size
    recompile, no further recompiles."""
    for r in pool2.run(dynamic_jobs.variable_lengths, "ours", "aot_eager", mark="mark_dynamic"):
        assert r["frames_by_step"][1] == r["frames"]
        assert r["max_gap"] == 0.0


@pytest.mark.parametrize("backend", ["aot_eager_passes", "inductor_passes"])
def test_ranks_with_different_lengths_in_the_same_step(pool2, backend):
    """dynamic=True: one graph, compiled at the first step, for 8 lengths and 2 batch sizes,
    without a graph break; rank 1 sees 8 tokens fewer than rank 0 every step: collective
    sequences stay identical (the consistency check, one of our post-grad passes, on eager's
    ops and through Inductor's graph pipeline), no hang, parity with eager at each step
    (bitwise on eager's ops)."""
    results = pool2.run(dynamic_jobs.variable_lengths, "ours", backend, per_rank_lengths=True, timeout_s=400)
    for r in results:
        assert r["graphs"] == 1 and r["frames_by_step"][0] == r["frames"]
        assert r["graph_breaks"] == {}
        assert r["max_gap"] <= (0.0 if backend == "aot_eager_passes" else 1e-5)


def test_passes_and_cost_model_on_symbolic_shapes(fake_pg):
    """Bucketing/reordering decide from parameter sizes only; the cost model evaluates
    symbolic activation sizes at their hints and says so."""
    from fsdp_compile import fully_shard
    from fsdp_compile.testing import GraphCapture, collective_nodes
    from fsdp_compile.testing.models import Llama, LlamaConfig

    torch._dynamo.reset()
    model = shard_blocks(Llama(LlamaConfig(n_layers=2)), fully_shard)
    capture = GraphCapture()
    torch.compile(model, backend=capture, dynamic=True)(torch.randint(0, 64, (2, 16))).sum().backward()
    forward = capture.forward_graphs[0]
    assert any(isinstance(s, torch.SymInt) for n in forward.graph.nodes if n.op == "placeholder" for s in getattr(n.meta.get("val"), "shape", ()))
    plan = plan_buckets(our_collectives(forward.graph))
    assert all(isinstance(b.input_bytes, int) for b in plan)  # parameter sizes: static, whatever the tokens
    apply_buckets(forward.graph, plan)
    assert len(collective_nodes(forward, c10d_functional.all_gather_into_tensor)) == 3  # root + 2 layers
    reorder_for_overlap(forward.graph)
    sim = simulate(forward.graph, "h100-nvlink")
    assert sim.step_s > 0
    assert any("symbolic sizes" in note for note in sim.notes)
