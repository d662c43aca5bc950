"""The runtime half of the cross-rank consistency check (see ``fsdp_compile.passes.consistency``).

``fsdp_compile::check_collective_sequence`` is inserted at the top of each
compiled graph that holds our collectives, with the graph's collective
fingerprint baked in as a constant. It runs when the graph runs, so the
check happens on every rank alike whether the graph was compiled or came
from Inductor's cache, and only the first time a fingerprint is seen.
"""

from __future__ import annotations

import json

import torch

from fsdp_compile import config
from fsdp_compile._compat import mark_side_effectful
from fsdp_compile.runtime.process_groups import all_gather_json, is_real_multi_rank, side_group

_verified: set[str] = set()


def _describe(entry) -> str:
    if entry is None:
        return "nothing (its sequence is shorter)"
    op, group, reduce_op, shapes = entry
    return f"{op}({shapes}{', ' + reduce_op if reduce_op else ''}) on group {group!r}"


def first_difference(mine: list, theirs: list) -> int | None:
    for i in range(max(len(mine), len(theirs))):
        a = mine[i] if i < len(mine) else None
        b = theirs[i] if i < len(theirs) else None
        if a != b:
            return i
    return None


def verify_across_ranks(graph_name: str, fingerprint: list) -> None:
    """Raise on every rank if any two ranks' fingerprints differ."""
    import torch.distributed as dist

    everyone = all_gather_json(fingerprint, side_group(config.consistency_timeout_s))
    rank = dist.get_rank()
    for other, theirs in enumerate(everyone):
        index = first_difference(fingerprint, theirs)
        if index is None:
            continue
        a = fingerprint[index] if index < len(fingerprint) else None
        b = theirs[index] if index < len(theirs) else None
        raise RuntimeError(
            f"fsdp_compile: ranks compiled different collective sequences for the {graph_name}; "
            f"running it would hang. First difference at collective #{index}: rank {rank} issues "
            f"{_describe(a)}, rank {other} issues {_describe(b)} "
            f"({len(fingerprint)} vs {len(theirs)} collectives). Look for rank-dependent Python in "
            "the model's forward (branches on the rank or on data), or set "
            "fsdp_compile.config.check_collective_consistency = False to skip this check."
        )


@torch.library.custom_op("fsdp_compile::check_collective_sequence", mutates_args=())
def check_collective_sequence(graph_name: str, fingerprint_json: str) -> torch.Tensor:
    """Compare this graph's collective fingerprint across ranks, once per fingerprint."""
    if fingerprint_json not in _verified and is_real_multi_rank():
        verify_across_ranks(graph_name, json.loads(fingerprint_json))
    _verified.add(fingerprint_json)
    return torch.empty(0)


@check_collective_sequence.register_fake
def _(graph_name, fingerprint_json):
    return torch.empty(0)


# Its output is unused: without this, dead-code elimination would drop the check.
mark_side_effectful(torch.ops.fsdp_compile.check_collective_sequence.default)
