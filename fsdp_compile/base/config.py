"""How the compiler schedules sharded collectives: one place for every knob.

Patchable like ``torch._inductor.config``::

    import fsdp_compile.config as fsdp_config

    fsdp_config.bucket_mode = "cap"
    with fsdp_config.patch(prefetch_depth=2, reorder=False):
        ...

``fully_shard(...)`` arguments say *what* is sharded (FSDP2's API); these say
*how* the compiled graph communicates. Every rank must use the same values:
they steer graph rewrites, and ranks that rewrite differently would issue
collectives in different orders.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Iterator

#: Joint graph: recompute (re-gather in backward) the all-gathers of units
#: with ``reshard_after_forward=True``. Off keeps every gathered parameter
#: alive from forward to backward (debugging only).
reshard_pass: bool = True

#: Post-grad graphs: merge each unit's collectives into buckets.
bucketing: bool = True

#: ``"unit"``: one all-gather and one reduce-scatter per unit and dtype (FSDP2's
#: behaviour); ``"cap"``: split a unit's bucket at ``bucket_cap_mb``;
#: ``"auto"``: let the cost model choose the number of buckets per unit.
#: Compiled graphs only: eager code always buckets per unit (and group and dtypes), as
#: FSDP2 does, whatever ``bucket_mode`` and ``bucket_cap_mb`` say (tested:
#: ``tests/test_parity.py::test_eager_issues_one_collective_per_unit_like_fsdp2``).
bucket_mode: str = "unit"

#: Upper bound on one bucket, in MiB of one rank's shard (``bucket_mode="cap"``).
bucket_cap_mb: float = 25.0

#: Compiled graphs: a unit whose parameters are used apart (another unit's parameters
#: used in between: a root unit's token embedding first, its output projection last)
#: gets one bucket per run of parameters used together, when each such run gathers at
#: least this many MiB (unsharded bytes); a smaller run stays in its neighbour's bucket.
#: The output projection is then gathered behind the last layers and its gradient
#: reduced behind the backward, not gathered at the step's start and reduced at its
#: end. ``None``: one bucket per unit, as FSDP2. Applies to every ``bucket_mode``.
split_unit_min_mb: float | None = 16.0

#: Post-grad graphs: issue all-gathers early (prefetch) and wait late.
reorder: bool = True

#: How many all-gather buckets may be issued ahead of the one in use.
prefetch_depth: int = 1

#: How many reduce-scatter buckets may be in flight at once in backward.
reduce_scatter_depth: int = 1

#: Upper bound on bytes of gathered (unsharded) buckets in flight, or ``None``
#: for no bound beyond ``prefetch_depth``. A prefetch that would exceed it is
#: issued later instead.
max_inflight_bytes: int | None = None

#: Eager runs overlap communication with compute as FSDP2 does: all-gathers are
#: prefetched one unit ahead (forward and backward) and a unit's reduce-scatter is
#: waited on just before the next one is issued (at most ``reduce_scatter_depth`` in
#: flight) or when the backward ends; its gradient then reaches the sharded parameter. False: every eager
#: collective is waited on at once (gradients flow to the sharded parameters through
#: autograd's graph, e.g. for ``torch.autograd.grad`` with respect to them).
eager_overlap: bool = True

#: Compiled graphs, groups whose backend is gloo: send our all-gathers and
#: reduce-scatters as ``all_to_all_single`` (``fsdp_compile.passes.transport``):
#: the same bytes, sent directly (gloo's own reduce-scatter is an all-reduce of a
#: copy), and no gloo coalesced all-gather, whose worker threads race when two are
#: in flight on one group (README, Limitations); a faster compiled step on CPU
#: (BENCHMARKS.md). The compiled code then shows all-to-alls where profiles and
#: ``TORCH_LOGS=output_code`` readers may expect all-gathers; False keeps gloo's
#: own collectives. Eager runs over a gloo group of 2 ranks send each bucket's
#: reduce-scatter as an all-to-all of its halves, added on arrival (gloo's bits, half
#: the bytes; ``runtime.collectives.sums_reduce_scatter_here``), except where collectives
#: are watched op by op (``CommDebugMode`` or any dispatch mode; a patched
#: ``dist.reduce_scatter_single``), which then see FSDP2's reduce-scatters. Other
#: backends (NCCL) never change.
gloo_all_to_all: bool = True

#: The first time each compiled graph runs, ranks compare their collective
#: sequences and raise (all of them) on a difference instead of hanging.
check_collective_consistency: bool = True

#: Hardware profile the cost model uses for ``bucket_mode="auto"`` and reports
#: (see ``fsdp_compile.passes.cost_model.PROFILES``).
hardware_profile: str = "cpu-gloo"

#: Cost model: the value of a symbolic size (dynamic shapes) that has no hint.
symbolic_size_hint: int = 1024

#: Optimizers: an elementwise ``torch.optim`` optimizer (SGD, Adam, AdamW, ...) of our
#: parameters steps on their local tensors from its second step on, bitwise the same
#: update without ``DTensor`` dispatch (``fsdp_compile.step_on_local_shards``, applied at
#: its first step). Read at each optimizer's first step. Off: every step on ``DTensor``s.
local_shard_optimizer_step: bool = True

#: Seconds a rank waits for its peers in the first-run collective check before it
#: raises alone (a rank running a graph its peers never run).
consistency_timeout_s: float = 120.0

_FIELDS = (
    "reshard_pass",
    "bucketing",
    "bucket_mode",
    "bucket_cap_mb",
    "split_unit_min_mb",
    "reorder",
    "prefetch_depth",
    "reduce_scatter_depth",
    "max_inflight_bytes",
    "eager_overlap",
    "gloo_all_to_all",
    "check_collective_consistency",
    "hardware_profile",
    "symbolic_size_hint",
    "consistency_timeout_s",
    "local_shard_optimizer_step",
)
_BUCKET_MODES = ("unit", "cap", "auto")


def snapshot() -> dict[str, Any]:
    """Current values (part of our Inductor pass's cache key)."""
    module = sys.modules[__name__]
    return {name: getattr(module, name) for name in _FIELDS}


def validate() -> None:
    if bucket_mode not in _BUCKET_MODES:
        raise ValueError(f"fsdp_compile.config.bucket_mode={bucket_mode!r}; expected one of {_BUCKET_MODES}")
    if split_unit_min_mb is not None and split_unit_min_mb < 0:
        raise ValueError(f"fsdp_compile.config.split_unit_min_mb={split_unit_min_mb!r}; expected None or >= 0")
    if prefetch_depth < 0 or reduce_scatter_depth < 1:
        raise ValueError("fsdp_compile.config: prefetch_depth must be >= 0 and reduce_scatter_depth >= 1")


@contextlib.contextmanager
def _patch_context(changes: dict[str, Any]) -> Iterator[None]:
    module = sys.modules[__name__]
    unknown = set(changes) - set(_FIELDS)
    if unknown:
        raise AttributeError(f"fsdp_compile.config has no option(s) {sorted(unknown)}; options: {list(_FIELDS)}")
    saved = {name: getattr(module, name) for name in changes}
    for name, value in changes.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


class patch:
    """Temporarily set options; a context manager or a decorator."""

    def __init__(self, **changes: Any) -> None:
        self._changes = changes
        self._stack: list = []

    def __enter__(self) -> None:
        ctx = _patch_context(self._changes)
        ctx.__enter__()
        self._stack.append(ctx)

    def __exit__(self, *exc) -> None:
        self._stack.pop().__exit__(*exc)

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with _patch_context(self._changes):
                return fn(*args, **kwargs)

        return wrapper
