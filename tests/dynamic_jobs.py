"""Rank-side: variable sequence length and batch size under torch.compile.

A module of its own (not merged into tests/test_dynamic.py) because
benchmarks/dynamic_shapes.py runs it too, where pytest need not be installed.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp_compile.testing import full_tensor
from tests.models import compile_counting_graphs, fully_shard_of, shard_blocks

LENGTHS = [16, 24, 40, 64, 96, 128, 200, 256]


def _model(kind: str):
    from fsdp_compile.testing.models import Llama, LlamaConfig

    torch.manual_seed(0)
    return shard_blocks(Llama(LlamaConfig(max_seq_len=256)), fully_shard_of(kind))


def _tokens(step: int, batch: int, length: int, rank_offset: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + rank_offset)
    return torch.randint(0, 64, (batch, length + 1), generator=g)


def variable_lengths(kind: str = "ours", backend: str = "aot_eager", per_rank_lengths: bool = False, mark: str = "dynamic") -> dict:
    """Train on 8 sequence lengths (and two batch sizes) with one compiled and one eager copy
    of the same model; returns compile counts/times and the largest loss gap.

    ``per_rank_lengths``: ranks see different lengths in the same step (rank 1: 8 tokens fewer).
    """
    from torch._dynamo.utils import counters

    counters.clear()  # graph-break counts are process-wide; count this run's only
    compiled_model, eager_model = _model(kind), _model(kind)
    run, counter = compile_counting_graphs(compiled_model, backend, dynamic=True if mark == "dynamic" else None)
    rank = dist.get_rank()
    gaps, compile_seconds, frames_by_step = [], [], []
    for step, length in enumerate(LENGTHS):
        batch = 2 if step % 2 else 3
        length = length - (8 * rank if per_rank_lengths else 0)
        tokens = _tokens(step, batch, length, rank)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if mark == "mark_dynamic":
            torch._dynamo.mark_dynamic(inputs, 1)
        before = counter.frame_count
        start = time.perf_counter()
        loss_c = F.cross_entropy(run(inputs).flatten(0, 1), targets.flatten())
        loss_c.backward()
        if counter.frame_count > before:
            compile_seconds.append(time.perf_counter() - start)
        loss_e = F.cross_entropy(eager_model(inputs).flatten(0, 1), targets.flatten())
        loss_e.backward()
        gaps.append(abs(loss_c.item() - loss_e.item()))
        grads_c = [full_tensor(p.grad) for p in compiled_model.parameters()]
        grads_e = [full_tensor(p.grad) for p in eager_model.parameters()]
        gaps.append(max((a - b).abs().max().item() for a, b in zip(grads_c, grads_e, strict=True)))
        compiled_model.zero_grad()
        eager_model.zero_grad()
        frames_by_step.append(counter.frame_count)
    nonempty = [g for g in counter.graphs if any(n.op == "call_function" for n in g.graph.nodes)]
    return {
        "graphs": len(nonempty),
        "frames": counter.frame_count,
        "frames_by_step": frames_by_step,
        "compile_seconds": compile_seconds,
        "max_gap": max(gaps),
        "graph_breaks": dict(counters["graph_break"]),
    }
