"""Cost model: formulas, and the simulation on hand-built graphs before/after our passes."""

from __future__ import annotations

import pytest

from fsdp_compile.passes.bucketing import bucket_collectives
from fsdp_compile.passes.cost_model import PROFILES, get_profile, simulate
from fsdp_compile.passes.reordering import reorder_for_overlap
from fsdp_compile.passes.schedule import choose_bucket_cap
from tests.pass_graphs import build_unit_graph


def test_ring_alpha_beta():
    p = PROFILES["h100-ib-400g"]
    assert p.collective_seconds("all_gather", 8 * 2**20, 8) == pytest.approx(p.alpha_s + 7 / 8 * 8 * 2**20 / p.link_bytes_per_s)
    assert p.collective_seconds("all_reduce", 2**20, 2) == pytest.approx(p.alpha_s + 2**20 / p.link_bytes_per_s)


def test_profiles_exist_and_unknown_is_an_error():
    assert {"h100-nvlink", "h100-ib-400g", "cpu-gloo"} <= set(PROFILES)
    with pytest.raises(ValueError, match="unknown hardware profile 'tpu'"):
        get_profile("tpu")


@pytest.mark.parametrize("profile", ["cpu-gloo", "h100-nvlink"])
def test_passes_reduce_simulated_step_time_and_exposure(profile):
    traced, _ = build_unit_graph(2, 0, "0", 4)
    before = simulate(traced.graph, profile)
    # As traced, every wait directly follows its issue: all communication is exposed.
    assert before.exposed_s == pytest.approx(before.communication_s)
    bucket_collectives(traced.graph)
    bucketed = simulate(traced.graph, profile)
    reorder_for_overlap(traced.graph)
    after = simulate(traced.graph, profile)
    assert bucketed.communication_s < before.communication_s  # fewer alphas
    assert after.exposed_s < bucketed.exposed_s
    assert after.step_s < before.step_s
    assert after.compute_s == pytest.approx(bucketed.compute_s)
    assert 0 < after.overlap_fraction <= 1


def test_prefetch_costs_memory():
    traced, _ = build_unit_graph(2, 0, "0", 4)
    bucket_collectives(traced.graph)
    unordered = simulate(traced.graph, "cpu-gloo").peak_bytes
    reorder_for_overlap(traced.graph, prefetch_depth=2)
    assert simulate(traced.graph, "cpu-gloo").peak_bytes >= unordered


def test_auto_bucketing_is_rank_independent():
    """Rank 1 pads (extra copy nodes); the choice must still be the same on both ranks."""
    choices = {choose_bucket_cap(build_unit_graph(2, rank, "0", 4)[0].graph, "cpu-gloo") for rank in (0, 1)}
    assert len(choices) == 1


def test_a_view_keeps_its_buffer_alive():
    """A buffer read later only through a view (a saved activation, a gathered weight after
    its wait) stays live in the memory peak until that last use."""
    import torch
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_compile.passes.graph_utils import emit
    from fsdp_compile.runtime.vocabulary import aten

    graph, mode = fx.Graph(), FakeTensorMode()
    x = graph.placeholder("x")
    with mode:
        x.meta["val"] = torch.empty(256, 256)
    big = emit(graph, aten.mm.default, (x, x))  # 256 KiB
    view = emit(graph, aten.t.default, (big,))
    other = emit(graph, aten.relu.default, (x,))  # another 256 KiB while `big` is still needed
    graph.output((view, other))
    assert simulate(graph, "cpu-gloo").peak_bytes == 2 * 256 * 256 * 4


def test_exposure_by_phase_splits_the_exposed_time():
    """On a unit graph as traced (each wait right after its issue), the gathers before the
    first matmul are 'start', the reduce-scatters after the last matmul 'end', and the
    three parts add up to the exposed time."""
    from fsdp_compile.passes.cost_model import exposure_by_phase

    traced, _ = build_unit_graph(2, 0, "0", 4)
    sim = simulate(traced.graph, "cpu-gloo")
    phases = exposure_by_phase(traced.graph, sim)
    assert phases.start + phases.middle + phases.end == pytest.approx(sim.exposed_s)
    assert phases.start > 0 and phases.end > 0
    starts = [c for c in sim.collectives if c.kind == "all_gather"][:1]
    assert phases.start >= starts[0].exposed_s


def test_steady_state_across_steps_respects_its_bounds():
    """``benchmarks/_across_steps.py`` on a hand-built unit graph (standing in for both the
    forward and the backward): with a free link every schedule's period is exactly the
    compute plus the optimizer; with a slow one no schedule beats the lower bound it reports."""
    from dataclasses import replace

    from benchmarks._across_steps import simulate_across_steps

    traced, _ = build_unit_graph(2, 0, "0", 4)
    free = replace(get_profile("cpu-gloo"), name="free-link", link_bytes_per_s=1e30, alpha_s=0.0)
    out = simulate_across_steps(traced.graph, traced.graph, free)
    for period in (out.in_step, out.optimizer_in_backward, out.across_steps, out.deferred):
        assert period == pytest.approx(out.compute + out.optimizer)
    assert out.optimizer > 0 and out.held_bytes > 0
    slow = simulate_across_steps(traced.graph, traced.graph, "cpu-gloo")
    assert slow.boundary_chain > 0
    for period in (slow.in_step, slow.optimizer_in_backward, slow.across_steps, slow.deferred):
        assert period >= slow.lower_bound * (1 - 1e-9), (period, slow.lower_bound)
