"""Run every benchmark and print its tables: ``python -m benchmarks [--quick] [--only a,b]``.

Each benchmark runs in its own Python process (they start rank pools or a
``fake`` process group of their own), in this order, and its output is
printed under a heading with the command that reproduces it and its run time:

* ``optimizer_step`` the optimizer step alone, eager and ``torch.compile(opt.step)``;
* ``step_time``    step time, tokens/s, compile time and graphs: FSDP2 eager,
                   FSDP2 + torch.compile, ours eager / compiled (2 CPU ranks, loopback);
* ``breakdown``    where the compiled step's time goes, against the compute-only limit;
* ``shaped_link``  the same over a veth pair shaped with tc (root only; skips otherwise);
* ``memory``       peak memory per rank, reshard_after_forward True and False;
* ``comm_volume``  bytes and collectives per step vs the ideal;
* ``collectives``  gloo's all-gather / reduce-scatter vs ``config.gloo_all_to_all``'s all-to-alls;
* ``graph_count``  graphs, frames and graph breaks per step;
* ``compile_cost``  Dynamo's time per sharded parameter; what a restarted job compiles again;
* ``passes_vs_builtin``  ours vs Inductor's built-in bucketing (modelled);
* ``scale``        Llama-3-8B / 70B shapes at 8-512 ranks (modelled);
* ``dynamic_shapes``  compiles over varying lengths (full mode only: minutes of cold compiles).

``--quick`` gives every benchmark its small sizes (the whole run takes a few
minutes on 2 cores; CI runs it as a smoke test). Without it: the sizes
BENCHMARKS.md reports, which take much longer.

A benchmark that fails is reported with a short "What failed" list first (exception
lines with their innermost frames; for a rank that hung, its Python stack, which
``RankPool`` takes with ``faulthandler``), then the end of its output. With
``--quick`` it is run once more (``--retries``): a smoke run is not lost to one
flaky hang, and the first failure stays in the log.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

from benchmarks._common import benchmark_parser

BENCHMARKS = [
    "step_time",
    "optimizer_step",
    "breakdown",
    "shaped_link",
    "memory",
    "comm_volume",
    "collectives",
    "graph_count",
    "compile_cost",
    "passes_vs_builtin",
    "scale",
    "dynamic_shapes",
]
QUICK_ARGS = {
    "step_time": ["--quick"],
    "optimizer_step": ["--quick"],
    "breakdown": ["--quick", "--model", "hf-llama"],  # step_time --quick covers our Llama
    "shaped_link": ["--quick", "--rates", "1gbit"],
    "memory": ["--quick"],
    "comm_volume": ["--quick"],
    "collectives": ["--quick"],
    "graph_count": ["--layers", "2"],
    "compile_cost": ["--quick"],
    "passes_vs_builtin": ["--layers", "2", "--dim", "128", "--seq", "64"],
    "scale": ["--quick"],
}
FULL_ONLY = {"dynamic_shapes"}


class BenchmarkFailed(RuntimeError):
    pass


_CAUSE = re.compile(r"^(\w+\.)*\w*(Error|Exception|Failure|Timeout)\b.*|.*(did not answer in time|process died).*|^--- rank \d+ ---$")


def failure_causes(text: str, limit: int = 24) -> list[str]:
    """The lines of a failed run's output that say what failed, first seen first,
    without repeats: each exception line with the innermost frames of its traceback,
    each rank's heading in a RankFailure report, a hung rank's innermost frames. A CI
    log that shows only part of a long traceback still shows these."""
    seen, out, frames = set(), [], []
    stack_lines = 0  # a hung rank's stack (faulthandler's "Current thread"): its innermost frames
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Current thread"):
            stack_lines = 5
            continue
        if line.startswith("File "):
            if stack_lines:
                stack_lines -= 1
                out.append("  " + line[:300])
            frames = (frames + [line[:300]])[-3:]
            continue
        stack_lines = 0
        if _CAUSE.match(line) and line not in seen:
            seen.add(line)
            if not line.startswith("---"):
                out += ["  " + f for f in frames]
            frames = []
            out.append(line[:300])
    return out[:limit]


def run_one(name: str, quick: bool, timeout_s: float) -> tuple[str, float]:
    """Run ``python -m benchmarks.<name>``; its standard output and run time.

    It runs in a session of its own: past ``timeout_s`` the whole session (the rank
    processes it started included) gets SIGTERM, then SIGKILL 10 s later, so a hung
    benchmark leaves nothing running beside the next one."""
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *(QUICK_ARGS.get(name, []) if quick else [])]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                stdout, stderr = proc.communicate(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
    elapsed = time.perf_counter() - start
    if timed_out or proc.returncode != 0:
        how = f"did not finish in {timeout_s:.0f} s (stopped)" if timed_out else f"exited with {proc.returncode}"
        causes = "\n".join(f"  {c}" for c in failure_causes(stderr + "\n" + stdout))
        raise BenchmarkFailed(
            f"{' '.join(cmd[1:])} {how} after {elapsed:.0f} s. What failed:\n{causes}\n\n"
            f"Its output's end:\n{stdout[-2000:]}\n{stderr[-6000:]}"
        )
    return stdout.strip(), elapsed


def main(argv=None) -> int:
    p = benchmark_parser(__doc__, quick_help="small sizes: a smoke run of every benchmark")
    p.add_argument("--only", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds allowed per benchmark (default: 900 with --quick, where each takes a few minutes at most; 3600 otherwise)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=None,
        help="runs again a benchmark that failed, up to this many times, printing every failure "
        "(default: 1 with --quick, 0 otherwise; a smoke run should not be lost to one flaky hang)",
    )
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else [b for b in BENCHMARKS if not (args.quick and b in FULL_ONLY)]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; choose from {BENCHMARKS}")

    import torch

    print(f"# fsdp-compile benchmarks{' (quick mode: smoke sizes, not the reported numbers)' if args.quick else ''}\n")
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPU cores, "
          f"{'CUDA' if torch.cuda.is_available() else 'no GPU'}\n")
    retries = args.retries if args.retries is not None else (1 if args.quick else 0)
    timeout_s = args.timeout if args.timeout is not None else (900 if args.quick else 3600)
    total = time.perf_counter()
    failed, flaky = [], []
    for name in names:
        command = " ".join(["python -m benchmarks." + name, *(QUICK_ARGS.get(name, []) if args.quick else [])])
        print(f"## {name} — `{command}`\n", flush=True)
        out = None
        for attempt in range(1 + retries):
            try:
                out, elapsed = run_one(name, args.quick, timeout_s)
                break
            except BenchmarkFailed as e:
                again = "; running it again" if attempt < retries else ""
                print(f"FAILED (attempt {attempt + 1} of {1 + retries}{again}): {e}\n", flush=True)
        if out is None:
            failed.append(name)
            continue
        if attempt:
            flaky.append(name)
        print(out + f"\n\n({elapsed:.0f} s)\n", flush=True)
        has_table = any(line.startswith("|---") for line in out.splitlines())
        if not has_table and "skipped" not in out.lower():
            print(f"FAILED: {name} printed no table\n", flush=True)
            failed.append(name)
    print(
        f"All benchmarks: {time.perf_counter() - total:.0f} s"
        + (f"; failed: {', '.join(failed)}" if failed else "")
        + (f"; failed, then passed when run again (see above): {', '.join(flaky)}" if flaky else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
