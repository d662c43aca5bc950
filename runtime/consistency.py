"""The runtime half of the cross-rank consistency check (see ``fsdp_compile.passes.consistency``).

``fsdp_compile::check_collective_sequence`` is inserted at the top of each
compiled graph that holds our collectives, with the graph's collective
fingerprint baked in as a constant. It runs when the graph runs, so the
check happens on every rank alike whether the graph was compiled or came
from Inductor's cache, and only the first time a fingerprint is seen.
"""

from __future__ import annotations

import itertools
import json

import torch

from fsdp_compile.base import config
from fsdp_compile.base.compat import mark_side_effectful
from fsdp_compile.runtime.process_groups import all_gather_json, is_real_multi_rank, side_group, verified_fingerprints


def _describe(entry) -> str:
    if entry is None:
        return "nothing (its sequence is shorter)"
    op, group, reduce_op, shapes = entry[:4]
    return f"{op}({shapes}{', ' + reduce_op if reduce_op else ''}) on group {group!r}"


def first_difference(mine: list, theirs: list) -> int | None:
    for i in range(max(len(mine), len(theirs))):
        a = mine[i] if i < len(mine) else None
        b = theirs[i] if i < len(theirs) else None
        if a != b:
            return i
    return None


def shared_sequence(fingerprint: list, other_rank: int) -> list:
    """The entries of ``fingerprint`` on groups that ``other_rank`` belongs to too (an
    entry whose group's ranks are unknown counts as shared), without the ranks: what
    this rank and ``other_rank`` must issue alike, in the same order."""
    return [entry[:4] for entry in fingerprint if len(entry) < 5 or entry[4] is None or other_rank in entry[4]]


def first_disagreement(everyone: list) -> tuple | None:
    """``(rank a, rank b, index, a's entry, b's entry)`` for the first pair of ranks whose
    collectives on the groups they share differ (``everyone``: each rank's fingerprint),
    else ``None``."""
    if all(theirs == everyone[0] for theirs in everyone):
        return None  # the common case: every rank compiled the same graph
    for a, b in itertools.combinations(range(len(everyone)), 2):
        seen_by_a, seen_by_b = shared_sequence(everyone[a], b), shared_sequence(everyone[b], a)
        index = first_difference(seen_by_a, seen_by_b)
        if index is not None:
            x = seen_by_a[index] if index < len(seen_by_a) else None
            y = seen_by_b[index] if index < len(seen_by_b) else None
            return a, b, index, x, y
    return None


def verify_across_ranks(graph_name: str, fingerprint: list) -> None:
    """Raise on every rank if two ranks differ in the collectives of a group they share."""
    import torch.distributed as dist

    everyone = all_gather_json(fingerprint, side_group(config.consistency_timeout_s))
    disagreement = first_disagreement(everyone)
    if disagreement is None:
        return
    a, b, index, x, y = disagreement
    count_a, count_b = len(shared_sequence(everyone[a], b)), len(shared_sequence(everyone[b], a))
    raise RuntimeError(
        f"fsdp_compile: ranks compiled different collective sequences for the {graph_name} "
        f"(seen from rank {dist.get_rank()}); running it would hang. First difference at collective "
        f"#{index} of those on groups ranks {a} and {b} share: rank {a} issues {_describe(x)}, "
        f"rank {b} issues {_describe(y)} ({count_a} vs {count_b} collectives). Look for "
        "rank-dependent Python in the model's forward (branches on the rank or on data), or set "
        "fsdp_compile.config.check_collective_consistency = False to skip this check."
    )


@torch.library.custom_op("fsdp_compile::check_collective_sequence", mutates_args=())
def check_collective_sequence(graph_name: str, fingerprint_json: str) -> torch.Tensor:
    """Compare this graph's collective fingerprint across ranks, once per fingerprint (and
    per default process group: a group made again checks again)."""
    verified = verified_fingerprints()
    if fingerprint_json not in verified and is_real_multi_rank():
        verify_across_ranks(graph_name, json.loads(fingerprint_json))
    verified.add(fingerprint_json)
    return torch.empty(0)


@check_collective_sequence.register_fake
def _(graph_name, fingerprint_json):
    return torch.empty(0)


# Its output is unused: without this, dead-code elimination would drop the check.
mark_side_effectful(torch.ops.fsdp_compile.check_collective_sequence.default)
