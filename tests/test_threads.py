"""Ranks as threads of one process (torch's ``MultiThreadedTestCase`` / ``FSDPTestMultiThread``,
the ``threaded`` process group): each thread-rank trains its own sharded model, and what a
running forward gathers is kept per thread, so the ranks do not see each other's forwards."""

from __future__ import annotations

import copy
import threading
import traceback

import pytest
import torch
import torch.distributed as dist

WORLD_SIZE = 2


def _model() -> torch.nn.Module:
    """Three blocks of two linears with rows that do not divide by the world size."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(8, 7), torch.nn.ReLU(), torch.nn.Linear(7, 8)) for _ in range(3)]
    )


def _train(base: torch.nn.Module, backend: str | None, steps: int = 3) -> float:
    """On this thread-rank: ``base`` sharded per block and unsharded, trained alike with two
    micro-batches a step (the first without gradient sync) on the same batches on every
    rank (so the averaged gradient is the unsharded one); the largest parameter difference."""
    from fsdp_compile import fully_shard
    from fsdp_compile.testing import full_tensor

    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    run = torch.compile(model, backend=backend) if backend else model
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=0.1), torch.optim.AdamW(reference.parameters(), lr=0.1)
    for step in range(steps):
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            # (A generator of its own: the global one is shared by the threads.)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro))
            run(x).sum().backward()
            reference(x).sum().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return max((full_tensor(p) - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters(), strict=True))


def _run_as_threads(fn, *args, world_size: int = WORLD_SIZE) -> list:
    """``fn(*args)`` on ``world_size`` threads, each a rank of a ``threaded`` process group
    (as torch's ``MultiThreadedTestCase`` sets them up); each rank's result, or raises
    with every failing rank's traceback."""
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

    results: dict[int, tuple[str, object]] = {}
    store = dist.HashStore()

    def rank_main(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            results[rank] = ("ok", fn(*args))
        except BaseException:  # noqa: BLE001 - reported below
            results[rank] = ("error", traceback.format_exc())
        finally:
            dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True) for rank in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a thread-rank hung"
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    failures = {rank: value for rank, (status, value) in results.items() if status != "ok"}
    assert not failures, "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items()))
    return [results[rank][1] for rank in range(world_size)]


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_ranks_as_threads_train_like_the_unsharded_model(backend):
    """Eager and compiled (``aot_eager``: bitwise eager), with gradient accumulation and
    uneven shards: every thread-rank's parameters equal its unsharded model's, bitwise."""
    base = _model()  # built once: the threads share the global random generator
    assert _run_as_threads(_train, base, backend) == [0.0] * WORLD_SIZE
    # Nothing the threads traced or ran leaves an annotation behind for later traces
    # (torch's ``fx.traceback.annotate`` keeps it in one process-wide dict).
    assert "custom" not in torch.fx.traceback.current_meta, torch.fx.traceback.current_meta


def _shard_three_ways_in_turn() -> list[bool]:
    """Upstream's ``test_param_registration_after_backward`` (test_fully_shard_training.py),
    multi-unit half: a model sharded with ``reshard_after_forward`` True, False, then 2 (a
    smaller group than the 4 ranks, created by all of them together), then the same again
    with three units; a step each. Whether every parameter is a ``DTensor`` after each."""
    from torch.distributed.tensor import DTensor

    from fsdp_compile import fully_shard

    registered = []
    for units in (1, 3):
        for reshard_after_forward in (True, False, 2):
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
            if units == 3:
                fully_shard(model[0], reshard_after_forward=reshard_after_forward)
                fully_shard(model[2], reshard_after_forward=reshard_after_forward)
            fully_shard(model, reshard_after_forward=reshard_after_forward)
            model(torch.randn(2, 8, generator=torch.Generator().manual_seed(0))).sum().backward()
            registered.append(all(isinstance(p, DTensor) for p in model.parameters()))
    return registered


def test_groups_made_by_all_thread_ranks_are_made_by_each():
    """The groups ``reshard_after_forward=2`` keeps shards over are made by all ranks of the
    world together. Made once per process and kept in a module-level table, the thread-rank
    that found them (made by another thread-rank) skipped making them and the other three
    hung in it, as upstream's test did against ours; now each default process group keeps
    its own groups."""
    assert _run_as_threads(_shard_three_ways_in_turn, world_size=4) == [[True] * 6] * 4


def test_a_forward_on_one_thread_keeps_the_end_of_backward_calls_of_another():
    """A thread-rank's eager forward forgets what a backward of *its own* root that raised
    left queued, and nothing else: another thread-rank's backward still running keeps its
    end-of-backward calls (they finish its last reduce-scatters; a forward on one thread
    used to clear every thread's, and the other rank's step then silently lacked those
    gradients). Deterministic: the other root's forward runs inside this backward."""
    from fsdp_compile._eager import EagerState
    from fsdp_compile._eager_reduce import call_at_end_of_backward

    other_root = EagerState()
    called = []

    def in_backward(grad):
        this_root_end = lambda: called.append("this root")  # noqa: E731
        assert call_at_end_of_backward(this_root_end)
        other = threading.Thread(target=other_root.drop_left_by_a_backward_that_raised)  # its forward's first step
        other.start()
        other.join()
        return grad

    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(in_backward)
    y.sum().backward()
    assert called == ["this root"]
