"""Run an example's ``train(args)`` on every rank: torchrun's ranks when launched by
it (NCCL on GPUs, else gloo), otherwise ``world_size`` CPU ranks (gloo) started here."""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def run_on_ranks(train, args, world_size: int) -> None:
    """``train(args)`` on each rank, between ``init_process_group`` and teardown."""
    if "RANK" in os.environ:  # launched by torchrun: use its ranks
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if use_cuda else "gloo")
        _run(train, args)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"starting {world_size} CPU ranks (gloo)", flush=True)
    torch.multiprocessing.spawn(_spawned_rank, args=(world_size, port, train, args), nprocs=world_size)


def _spawned_rank(rank: int, world_size: int, port: int, train, args) -> None:
    # A native crash (SIGSEGV, SIGABRT) prints every thread's Python stack.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(minutes=5)
    )
    _run(train, args)
    # Done and torn down: leave without interpreter finalization. Objects that outlive
    # destroy_process_group (a mesh held by the model, through reference cycles) would
    # otherwise destroy their gloo groups while the interpreter is half gone, where a
    # thread that needs the GIL aborts the process ("terminate called without an
    # active exception"): the likely cause of a rank-0 SIGABRT seen once in CI, torch 2.15.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(train, args) -> None:
    try:
        train(args)
        dist.barrier()  # no rank tears down the group while a peer is still talking to it
    finally:
        dist.destroy_process_group()
