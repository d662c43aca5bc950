"""Step time over a shaped link: how much of each setup's communication is hidden.

    sudo python -m benchmarks.shaped_link [--quick] [--rates 1gbit,10gbit] [--delay-us 50] [--reps 5]
                                          [model flags of benchmarks.step_time]

The setups, model and step of ``benchmarks.step_time`` (FSDP2 eager, FSDP2 +
``torch.compile``, ours eager, ours compiled with passes off, ours compiled), but
the 2 ranks talk over a real, rate-limited network link instead of loopback:

- rank 0 and rank 1 each run in their own Linux network namespace
  (``fsdpc-<pid>-0``/``-1``), joined by a veth pair (10.77.0.1 <-> 10.77.0.2)
  whose ends both get a ``tc`` qdisc on egress: ``netem delay 50us rate R``, or,
  where the kernel has no netem (as on the CI machine), ``tbf rate R`` with no
  added delay; the table caption says which. Ranks are started with
  ``ip netns exec <ns> python -m benchmarks.shaped_link --worker``, with
  ``MASTER_ADDR`` = rank 0's veth address and ``GLOO_SOCKET_IFNAME`` = the veth,
  1 thread each (``OMP_NUM_THREADS=1``); a fresh pair of ranks per link rate.
- **step**: median over the timed, interleaved steps (as in step_time, timed on rank 0).
- **compute-only step**: the same setups at world size 1 with the same per-rank
  batch (each rank runs a copy sharded over a 1-rank group of its own: no network,
  collectives are local copies), timed in the same run and round-robin, so under
  the same CPU contention (see ``benchmarks.step_time``).
- **exposed communication** = step - compute-only step.
- **communication alone**: after the timed steps, one more step of each setup
  runs under ``torch.profiler``, which records every collective gloo executed
  (its ``gloo:<op>`` events: op, element count, dtype; FSDP2's, our eager and our
  compiled collectives all end there, bucketed or not; gloo runs a reduce-scatter
  as an all-reduce of the full tensor). The ranks then replay exactly that list,
  back to back, on the same link with nothing else running, ``--reps`` times;
  the median is the time the step's communication takes when nothing overlaps it.
- **overlap** = 1 - exposed / communication alone: 100% = all communication hidden
  behind compute, 0% = none. It goes below 0 when a step costs more than its
  compute plus its collectives run alone: the collectives' CPU work (gloo's
  threads, TCP, copies) slowing the compute beside them on the same 2 cores,
  waits that do not line up across ranks, or noise.
- **link check**: a 32 MiB all-gather (16 MiB from each rank) and a 16 MiB
  all-reduce timed on the link: the bandwidth per direction gloo actually gets.

On the 2-core CI machine gloo over TCP on the veth is CPU-bound at a few Gbit/s
(2-7, depending on load), so at 10 Gbit/s the qdisc is not all that limits the
link; the link check shows what each rate really gave. The kernel's network stack
(veth, TCP, the qdisc) and gloo's copies use the same cores as compute, so even
a hidden collective costs some compute time.

Needs root (``ip netns``, ``tc``); otherwise it prints ``skipped: <why>`` and exits 0.
Every namespace it creates is removed on exit, including Ctrl-C and SIGTERM
(SIGKILL leaves them: the next run removes ``fsdpc-<pid>-*`` namespaces whose
process is gone).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import _netns, step_time
from benchmarks._common import benchmark_parser, table_header

REPO_ROOT = Path(__file__).resolve().parents[1]
PORT = 29500  # inside fresh namespaces: nothing else listens there

_DTYPES = {
    "float": "float32",
    "double": "float64",
    "c10::Half": "float16",
    "c10::BFloat16": "bfloat16",
    "long int": "int64",
    "int": "int32",
}


def parser() -> argparse.ArgumentParser:
    p = benchmark_parser(__doc__, quick_help="tiny model, few steps (smoke run)")
    step_time.add_model_args(p)
    p.add_argument("--rates", default="1gbit,10gbit", help="comma-separated tc rates; 'none' = unshaped veth")
    p.add_argument("--delay-us", type=float, default=50.0, help="netem delay per direction (where netem exists)")
    p.add_argument("--reps", type=int, default=None, help="replays of the communication alone (default 5, 3 with --quick)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per link rate before the ranks are killed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


def resolve(args) -> argparse.Namespace:
    if args is None or isinstance(args, (list, tuple)):
        args = parser().parse_args(list(args or []))
    args = step_time.resolve(args)
    if args.reps is None:
        args.reps = 3 if args.quick else 5
    if isinstance(args.rates, str):
        args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    return args


# -- on each rank, inside its namespace


def _replay(collectives: list, reps: int) -> float:
    """Median time of running ``collectives`` back to back (synchronously)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    buffers = {}

    def tensors(op, numel, dtype):
        key = (op, numel, dtype)
        if key not in buffers:
            dt = getattr(torch, _DTYPES.get(dtype, "float32"))
            inp = torch.ones(numel, dtype=dt)
            out = None
            if op == "all_gather":
                out = torch.empty(numel * world, dtype=dt)
            elif op == "all_to_all":
                out = torch.empty(numel, dtype=dt)
            buffers[key] = (inp, out)
        return buffers[key]

    def run_one(op, numel, dtype):
        inp, out = tensors(op, numel, dtype)
        if op == "all_gather":
            dist.all_gather_into_tensor(out, inp)
        elif op == "all_reduce":
            dist.all_reduce(inp)
        elif op == "broadcast":
            dist.broadcast(inp, 0)
        elif op == "all_to_all":  # our compiled all-gathers and reduce-scatters over gloo (config.gloo_all_to_all)
            dist.all_to_all_single(out, inp)
        else:
            raise ValueError(f"replaying gloo:{op} is not implemented")

    for c in collectives:  # allocate outside the timed region
        tensors(*c)
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        for c in collectives:
            run_one(*c)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _link_check() -> dict:
    """Gbit/s per direction that gloo gets on the link: a 32 MiB all-gather (16 MiB from
    each rank) and a 16 MiB all-reduce (on 2 ranks each rank sends 16 MiB), median of 3."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    inp = torch.ones((16 << 20) // 4)
    out = torch.empty(inp.numel() * world)
    ops = {
        "all_gather": (lambda: dist.all_gather_into_tensor(out, inp), (world - 1) * inp.numel() * 4),
        "all_reduce": (lambda: dist.all_reduce(inp), 2 * (world - 1) / world * inp.numel() * 4),
    }
    gbit = {}
    for name, (fn, sent_bytes) in ops.items():
        fn()
        times = []
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        gbit[name] = sent_bytes * 8 / statistics.median(times) / 1e9
    return gbit


def worker(args) -> None:
    """One rank; the launcher set RANK, WORLD_SIZE, MASTER_ADDR/PORT and GLOO_SOCKET_IFNAME."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    try:
        gbit = _link_check()
        res = step_time.measure(
            step_time.model_kwargs(args), args.seq, args.batch, args.steps, args.setups, cold_compile=False, record_collectives=True
        )
        # Every rank replays rank 0's list, so they issue the same collectives.
        box = [res["collectives"]]
        dist.broadcast_object_list(box, src=0)
        res["communication"] = {name: _replay(box[0][name], args.reps) for name in args.setups}
        res["link_gbit"] = gbit
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps(res))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# -- the launcher, in the root namespace


def _launch(pair: _netns.VethPair, args, out: Path, logdir: Path) -> dict:
    """Both ranks in their namespaces; rank 0's result."""
    forward = ["--model", args.model, "--layers", args.layers, "--dim", args.dim, "--vocab", args.vocab, "--seq", args.seq]
    forward += ["--batch", args.batch, "--steps", args.steps, "--setups", ",".join(args.setups), "--reps", args.reps]
    forward += ["--timeout", args.timeout]
    procs, logs = [], []
    try:
        for rank in range(2):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_RANK=str(rank),
                MASTER_ADDR=pair.addresses[0],
                MASTER_PORT=str(PORT),
                GLOO_SOCKET_IFNAME=pair.devices[rank],
                OMP_NUM_THREADS="1",
            )
            log = open(logdir / f"rank{rank}.log", "w")
            logs.append(log)
            argv = pair.exec_prefix(rank) + [sys.executable, "-m", "benchmarks.shaped_link", "--worker", "--out", str(out)]
            argv += [str(a) for a in forward]
            # Own session: on failure or interrupt, its whole process group (compile
            # workers included) is ended by its id.
            procs.append(subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + args.timeout + 120
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        bad = {rank: p.returncode for rank, p in enumerate(procs) if p.returncode != 0}
        if bad:
            tails = "\n".join(
                f"--- rank {rank} (exit {code}) ---\n" + (logdir / f"rank{rank}.log").read_text()[-3000:] for rank, code in bad.items()
            )
            raise RuntimeError(f"shaped-link ranks failed or timed out:\n{tails}")
        return json.loads(out.read_text())
    finally:
        with _netns.ignoring_signals():
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, 9)
                    except ProcessLookupError:
                        pass
                    p.wait()
        for log in logs:
            log.close()


def _sent_mib(collectives: list, world: int = 2) -> float:
    """MiB each rank sends for ``collectives`` (ring algorithms: an all-gather sends
    (w-1) inputs, an all-reduce 2(w-1)/w of its tensor; an all-to-all sends (w-1)/w
    of its input, every slice but its own)."""
    size = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4}
    total = 0.0
    for op, numel, dtype in collectives:
        nbytes = numel * size.get(dtype, 4)
        if op == "all_gather":
            total += nbytes * (world - 1)
        elif op == "all_to_all":
            total += nbytes * (world - 1) / world
        else:
            total += nbytes * 2 * (world - 1) / world
    return total / 2**20


def table(args, rate: str, shaping: str, res: dict) -> str:
    lines = [
        f"Link {rate}: {shaping}; gloo gets {res['link_gbit']['all_gather']:.2f} Gbit/s (32 MiB all-gather), "
        f"{res['link_gbit']['all_reduce']:.2f} Gbit/s (16 MiB all-reduce) per direction. "
        + step_time.describe(args, res["n_params"])
        + f"; 2 ranks in separate network namespaces; compute-only = each rank alone (world size 1, same batch), interleaved; "
        f"communication alone = the step's recorded collectives replayed back to back (median of {args.reps}).",
        "",
        table_header(
            "setup",
            "median step (ms)",
            "compute-only step (ms)",
            "exposed communication (ms)",
            "communication alone (ms)",
            "overlap",
            "collectives/step",
            "MiB sent/rank/step",
        ),
    ]
    for name in args.setups:
        step, comp, comm = res["median"][name], res["compute_only"][name], res["communication"][name]
        exposed = step - comp
        overlap = f"{(1 - exposed / comm) * 100:.0f}%" if comm > 0 else "-"
        colls = res["collectives"][name]
        lines.append(
            f"| {step_time.SETUPS[name][0]} | {step * 1e3:.0f} | {comp * 1e3:.0f} | {exposed * 1e3:.0f} | {comm * 1e3:.0f} "
            f"| {overlap} | {len(colls)} | {_sent_mib(colls):.1f} |"
        )
    return "\n".join(lines)


def tables(args=None) -> list[str]:
    """Run the benchmark; one markdown table per link rate, or ``["skipped: <why>"]``.

    ``args``: an ``argparse.Namespace`` from :func:`parser`, a list of CLI strings
    (``["--quick"]``) or ``None`` for the defaults."""
    args = resolve(args)
    why = _netns.unavailable()
    if why:
        return [f"skipped: {why}"]
    with _netns.exit_on_signals():
        removed = _netns.remove_stale()
        if removed:
            print(f"shaped_link: removed stale namespaces {removed}", file=sys.stderr)
        workdir = Path(tempfile.mkdtemp(prefix="fsdpc-shaped-link-"))
        out = []
        pair = _netns.VethPair()
        try:
            try:
                pair.create()
            except _netns.LinkSetupError as e:
                return [f"skipped: could not set up network namespaces: {e}"]
            for rate in args.rates:
                shaping = pair.shape(None if rate == "none" else rate, args.delay_us)
                print(f"shaped_link: {rate}: {shaping}", file=sys.stderr)
                res = _launch(pair, args, workdir / f"result-{rate}.json", workdir)
                out.append(table(args, rate, shaping, res))
        finally:
            with _netns.ignoring_signals():
                pair.destroy()
                shutil.rmtree(workdir, ignore_errors=True)
        return out


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.worker:
        worker(resolve(args))
        return
    for text in tables(resolve(args)):
        print("\n" + text + "\n")


if __name__ == "__main__":
    main()
