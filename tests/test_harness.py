"""fsdp_compile.testing.assert_parity: passes on a correct setup, names the gap otherwise."""

from __future__ import annotations

import pytest

from fsdp_compile.testing import ParityError, assert_parity
from tests import harness_fns


def test_parity_against_reference_and_fsdp2(pool2):
    for reference in ("single_process", "fsdp2"):
        report = assert_parity(
            harness_fns.build_mlp,
            harness_fns.batch,
            harness_fns.mse,
            shard_fn=harness_fns.shard_mlp,
            backends=("eager", "aot_eager"),
            reference=reference,
            pool=pool2,
        )
        assert set(report.max_param_gap) == {"ours:eager", "ours:aot_eager"}


def test_a_gap_is_reported_with_step_and_parameter(pool2):
    """Zero tolerance against the reference: rounding differences must be caught and named."""
    pattern = r"ours:eager: (parameter 'layers\.\d\.(weight|bias)' after step \d differs .* by up to|loss at step \d is .* \(gap )"
    with pytest.raises(ParityError, match=pattern):
        assert_parity(
            harness_fns.build_mlp,
            harness_fns.batch,
            harness_fns.mse,
            shard_fn=harness_fns.shard_mlp,
            backends=("eager",),
            rtol=0,
            atol=0,
            pool=pool2,
        )


def test_pytest_plugin_pools_by_world_size(rank_pools):
    from tests import error_jobs

    assert rank_pools(2).run(error_jobs.rank_and_world) == [(0, 2), (1, 2)]
    assert rank_pools(2) is rank_pools(2)
