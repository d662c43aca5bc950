"""Sharding costs the compiler nothing: with the same ``torch.compile`` call, a model
that graph-breaks by itself (inside a sharded unit's forward, or outside every unit)
or checkpoints around sharded blocks compiles to no more graphs sharded than
unsharded, and still trains like the single-process reference (aot_eager: the same
ops as our eager run; Inductor: to fp32 rounding)."""

from __future__ import annotations

import pytest

from fsdp_compile.testing import assert_parity
from tests import break_models

CASES = ["break_in_block", "break_outside_units", "checkpoint_around_blocks"]


@pytest.mark.parametrize("name", CASES)
def test_no_more_graphs_than_unsharded(pool2, name):
    report = assert_parity(
        getattr(break_models, name),
        break_models.batch,
        break_models.loss,
        shard_fn=break_models.shard,
        backends=("eager", "aot_eager", "inductor"),
        check_graph_count=True,
        pool=pool2,
    )
    assert report.graphs["ours:aot_eager"] == report.graphs["ours:inductor"] <= report.graphs["unsharded"]
    if name == "checkpoint_around_blocks":
        assert report.graphs["unsharded"] == 1
