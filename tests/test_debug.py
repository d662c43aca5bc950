"""Debugging aids: the cross-rank consistency check."""

from __future__ import annotations

from tests import debug_jobs


def test_rank_dependent_graph_raises_on_every_rank_instead_of_hanging(pool2):
    results = pool2.run(debug_jobs.run_rank_dependent_graph, timeout_s=120)
    for rank, (message, seconds) in enumerate(results):
        assert "ranks compiled different collective sequences for the forward graph" in message, message
        assert "First difference at collective #" in message
        # Rank 0 runs one more (10-element) all-gather than rank 1.
        assert "rank 0 issues all_gather_into_tensor(float32[10]) on group" in message
        assert "rank 1 issues nothing (its sequence is shorter)" in message
        assert seconds < 60  # well before any collective timeout


def test_fingerprint_is_rank_independent_despite_padding():
    from fsdp_compile.passes.bucketing import bucket_collectives
    from fsdp_compile.passes.consistency import collective_fingerprint
    from fsdp_compile.passes.reordering import reorder_for_overlap
    from tests.pass_graphs import build_unit_graph

    prints = []
    for rank in (0, 1):
        gm, _ = build_unit_graph(2, rank, "0")
        bucket_collectives(gm.graph)
        reorder_for_overlap(gm.graph)
        prints.append(collective_fingerprint(gm.graph))
    assert prints[0] == prints[1]
    # Unit 0: weight [5, 6] and bias [5] over 2 ranks: padded shards of 3 x 6 + 3 elements.
    assert prints[0][0] == ["all_gather_into_tensor", "0", "", "float32[21]"]
