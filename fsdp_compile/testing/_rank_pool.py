"""A persistent group of worker processes, one per rank, that run functions on demand.

Starting processes and a process group costs seconds on a small machine;
a test suite pays it once per pool instead of once per test. Each call sends
the same function (a picklable, module-level callable) to every rank, waits
for all answers, and raises with every failing rank's traceback. A rank that
fails or hangs poisons the group (its peers may be stuck in a collective), so
the pool is then torn down and restarted on the next call.

Ranks are spawned (a fresh interpreter each) unless ``start_method="forkserver"``:
then they are forked from a server that has already imported torch, fsdp_compile
and the compiler's modules (:data:`PRELOADED`), so a rank starts in a fraction of
a second instead of importing them again (several seconds of CPU each: the test
suite starts dozens of ranks; its fixtures use it, see
:func:`fastest_start_method`). Each rank still gets the environment the parent has
when the pool starts, but modules the server preloaded read theirs when it started
(torch's configuration from ``TORCHINDUCTOR_*`` variables, glibc's ``MALLOC_*``):
benchmarks, which set such variables, spawn.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

#: Imported once by the ``forkserver`` the ranks are forked from (a missing optional
#: package is skipped).
PRELOADED = (
    "torch",
    "torch.distributed",
    "fsdp_compile",
    "fsdp_compile.testing",
    "torch._inductor.compile_fx",
    "torch._functorch.partitioners",
    "networkx",
    "transformers",
)


def fastest_start_method() -> str:
    """``forkserver`` where the platform has one (Linux, macOS), else ``spawn``."""
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # e.g. a real-time signal
        return f"signal {number}"


class RankFailure(RuntimeError):
    """One or more ranks raised (or hung) while running a function."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_up_rank_process(rank: int, world_size: int, port: int, backend: str, stack_file: str, environ: dict[str, str]):
    """What a rank process sets before it joins the group: the parent's environment and
    the rendezvous variables, stack dumps on a hang or a crash, and how it compiles.
    Returns the open stack file (kept open for the process's life)."""
    # A forked rank inherits the forkserver's environment, from when it started: take
    # the parent's, as a spawned rank would.
    os.environ.clear()
    os.environ.update(environ)
    # On SIGUSR1 (sent by the parent to a rank that hangs), and on a fatal signal (a
    # native crash: SIGSEGV, or SIGABRT from a heap check), every thread's Python
    # stack goes to ``stack_file``, which the parent puts in its report.
    stacks = open(stack_file, "w")  # noqa: SIM115 - kept open for the process's life
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.enable(file=stacks, all_threads=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    import torch

    from fsdp_compile.testing._torch_internals import compile_in_this_process, skip_side_effect_messages

    torch.set_num_threads(1)
    # By default each rank would compile in a pool of subprocesses of its own; with
    # several ranks on one machine those pools held much of the memory (on a 24 GiB
    # machine a rank died mid-collective). Two threads, not one: the ranks build the
    # same C++ kernels, each behind its file lock, and on one thread each they build
    # one at a time between them (a cold test run: 71 s on one thread, 53 s on two).
    compile_in_this_process(threads=2)
    skip_side_effect_messages()
    from fsdp_compile.testing._backends import register_test_backends

    register_test_backends()
    if backend == "fake":
        from fsdp_compile.testing._torch_internals import register_fake_process_group

        register_fake_process_group()
    return stacks


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    conn: Connection,
    pg_timeout_s: float,
    stack_file: str,
    environ: dict[str, str],
) -> None:
    stacks = _set_up_rank_process(rank, world_size, port, backend, stack_file, environ)  # noqa: F841 - kept open
    import torch.distributed as dist

    from fsdp_compile.testing._torch_internals import reset_dynamo

    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s))
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            reset_dynamo()
            result = fn(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` processes on one ``backend`` process group, reused across calls.

    >>> pool = RankPool(2)
    >>> pool.run(some_module.fn, arg)  # fn(arg) on every rank; list of results by rank
    """

    def __init__(
        self,
        world_size: int = 2,
        backend: str = "gloo",
        *,
        timeout_s: float = 300.0,
        pg_timeout_s: float = 120.0,
        failure_grace_s: float = 10.0,
        start_method: str = "spawn",
    ):
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.pg_timeout_s = pg_timeout_s
        #: Once a rank failed, how long its peers may still answer (with their own error)
        #: before those that did not are reported as hung and the pool is stopped.
        self.failure_grace_s = failure_grace_s
        #: ``multiprocessing`` start method of the ranks: ``spawn`` or ``forkserver``
        #: (see the module docstring).
        self.start_method = start_method
        self._procs: list = []
        self._conns: list[Connection] = []
        self._stack_files: list[str] = []

    # -- lifecycle
    def start(self) -> None:
        if self._procs:
            return
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(list(PRELOADED))  # for the server's first start
        port = _free_port()
        stacks = tempfile.mkdtemp(prefix="fsdpc-rank-stacks-")
        self._stack_files = [os.path.join(stacks, f"rank{rank}.txt") for rank in range(self.world_size)]
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(
                    rank,
                    self.world_size,
                    port,
                    self.backend,
                    child,
                    self.pg_timeout_s,
                    self._stack_files[rank],
                    dict(os.environ),
                ),
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect([None] * self.world_size, deadline=time.monotonic() + 120, expect="ready")

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        self._kill(grace_s=5)

    def _kill(self, grace_s: float = 0) -> None:
        """Stop every worker (after ``grace_s`` seconds to exit by itself) and forget it."""
        for proc in self._procs:
            proc.join(timeout=grace_s)
            if proc.is_alive():
                proc.kill()
            proc.join()
        self._procs, self._conns = [], []
        self._remove_stack_files()

    def _remove_stack_files(self) -> None:
        if self._stack_files:
            shutil.rmtree(os.path.dirname(self._stack_files[0]), ignore_errors=True)
        self._stack_files = []

    def __enter__(self) -> "RankPool":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- work
    def run(self, fn: Callable, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results, indexed by rank."""
        self.start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        return self._collect([None] * self.world_size, deadline=deadline, expect="ok")

    def _collect(self, results: list, *, deadline: float, expect: str) -> list:
        pending = dict(enumerate(self._conns))
        errors: dict[int, str] = {}
        while pending:
            # Once a rank failed, its peers get a short grace period: they are
            # likely blocked in a collective that will never complete.
            limit = min(deadline, self._first_error_at + self.failure_grace_s) if errors else deadline
            remaining = limit - time.monotonic()
            ready = wait(list(pending.values()), timeout=max(0.0, remaining)) if remaining > 0 else []
            if not ready:
                for rank in pending:
                    if self._procs[rank].is_alive():
                        errors[rank] = "did not answer in time (hung in a collective?); where it was:\n" + self._stack_of(rank)
                    else:
                        errors[rank] = self._death_of(rank)
                break
            for conn in ready:
                rank = next(r for r, c in pending.items() if c is conn)
                try:
                    kind, payload = conn.recv()
                except EOFError:
                    kind, payload = "error", self._death_of(rank)
                del pending[rank]
                if kind == expect:
                    results[rank] = payload
                else:
                    if not errors:
                        self._first_error_at = time.monotonic()
                    errors[rank] = payload
        if errors:
            self._kill()
            report = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items()))
            raise RankFailure(f"{len(errors)} of {self.world_size} ranks failed:\n{report}")
        return results

    _first_error_at = 0.0

    def _death_of(self, rank: int) -> str:
        """How a rank that closed its pipe died: its exit code or signal, and the Python
        stacks faulthandler wrote if a fatal signal killed it."""
        proc = self._procs[rank]
        proc.join(timeout=5)  # a crashing process closes its pipe before it is reaped
        code = proc.exitcode
        how = f"killed by {_signal_name(-code)}" if code is not None and code < 0 else f"exit code {code}"
        try:
            text = self._read_stack_file(rank)
        except OSError:
            text = ""
        return f"process died ({how})" + (f"; its Python stacks when it died:\n{text}" if text else "")

    def _read_stack_file(self, rank: int) -> str:
        """The end of what faulthandler wrote for ``rank`` (raises ``OSError`` if unreadable)."""
        if rank >= len(self._stack_files):
            return ""
        with open(self._stack_files[rank]) as f:
            text = f.read()
        # faulthandler ends with one long line of extension module names; it would take
        # the room of the stacks.
        lines = [line for line in text.splitlines() if not line.startswith("Extension modules:")]
        return "\n".join(lines)[-6000:]

    def _stack_of(self, rank: int) -> str:
        """The Python stacks of a live rank's threads, via SIGUSR1 (faulthandler marks the
        thread that took the signal, normally the main one, "Current thread")."""
        if rank >= len(self._stack_files):
            return "(no stack)"
        try:
            os.kill(self._procs[rank].pid, signal.SIGUSR1)
            time.sleep(1.0)
            text = self._read_stack_file(rank)
        except OSError as e:
            return f"(no stack: {e})"
        return text or "(no stack written)"
