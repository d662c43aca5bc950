"""Where a step's time goes: ours compiled against the compute-only limit.

    python -m benchmarks.breakdown [--quick] [model flags of benchmarks.step_time]
                                   [--setups unsharded-compiled,ours-compiled,...]

The model, ranks and interleaved timing of ``benchmarks.step_time`` (2 gloo ranks
on loopback, 1 thread each, AdamW, fp32), three tables:

**The ladder** (medians of the interleaved timed steps):

- *compute-only limit*: every rank trains an unsharded replica of the model,
  compiled, on its own local batch, with no communication at all: the fastest a
  data-parallel step could be here;
- *1-rank group*: the same setup sharded over a group of one rank per rank: the
  cost of sharding itself (DTensor parameters, bucket copy-in/copy-out, padding,
  collectives reduced to local copies, the optimizer on DTensors) without a network;
- *2 ranks*: the real step; minus the 1-rank step = exposed communication;
- *other threads' CPU*: CPU time per step of the rank's threads other than the
  main one (gloo's, mostly), which competes with compute on 2 cores.

**The profile** (one more step of each setup under ``torch.profiler``, rank 0's
main thread, ms; the profiler adds its own overhead to every op, so these sum to a
slower step than the median):

- *forward graph* / *backward graph*: time inside the compiled forward
  (``CompiledFunction``) and backward (``CompiledFunctionBackward``);
- of which *waits* (``wait_tensor``), *collective issue* (the functional
  collectives' own calls) and *bucket copies* (our ``fsdp_compile::*copy_in``,
  ``all_gather_copy_out`` and ``pad_dim0`` ops);
- *optimizer*: ``step()`` and ``zero_grad()``; of which *DTensor dispatch*
  (``PythonSubclass`` events: the optimizer's foreach ops run per DTensor);
- *outside*: the rest of the step (Python between graphs, Dynamo's guards, the
  autograd engine, the loss);
- *gloo threads*: wall time of gloo's operations on its own threads.

**The calls** (the same profiled step): collective issues, the ops the compiled
graphs call (extern kernels such as ``mm``, our copy ops; Inductor's fused C++
kernels are not profiler events) and the ops run outside any graph (optimizer,
loss, autograd's gradient accumulation): the CPU-side launch count of a step.
"""

from __future__ import annotations

from benchmarks import step_time
from benchmarks._common import benchmark_parser, table_header
from benchmarks._launches import is_wait, launches

DEFAULT_SETUPS = ["unsharded-compiled", "ours-compiled", "ours-compiled-noreshard", "fsdp2-eager", "ours-eager"]
COLUMNS = (
    "forward graph",
    "backward graph",
    "waits",
    "collective issue",
    "bucket copies",
    "optimizer",
    "DTensor dispatch",
    "outside",
    "gloo threads",
)


LAUNCH_COLUMNS = ("collective calls", "ops in graphs", "ops outside graphs")


CATEGORIES = {
    "forward graph": lambda n: n == "CompiledFunction",
    "backward graph": lambda n: n == "CompiledFunctionBackward",
    "waits": is_wait,
    "collective issue": lambda n: n.startswith("_c10d_functional::") and not is_wait(n),
    "bucket copies": lambda n: n.startswith("fsdp_compile::") and ("copy_in" in n or "copy_out" in n or n.endswith("pad_dim0")),
    "optimizer": lambda n: n.startswith(("Optimizer.step#", "Optimizer.zero_grad#")),
    "DTensor dispatch": lambda n: n == "PythonSubclass",
}


def _outermost_total_ms(events, match) -> float:
    """Summed time (ms) of the events ``match`` accepts, not counting one nested
    inside another accepted event (DTensor dispatch re-enters itself)."""
    total = 0.0
    for e in events:
        if not match(e.name):
            continue
        parent = e.cpu_parent
        while parent is not None and not match(parent.name):
            parent = parent.cpu_parent
        if parent is None:
            total += e.cpu_time_total
    return total / 1e3


def categorize(prof, step_s: float) -> dict:
    """The profiled step's time per :data:`COLUMNS` category (ms) on the main thread
    (the one with the most events), plus ``step`` (the profiled step's wall time)."""
    from collections import Counter

    events = list(prof.events())
    main = Counter(e.thread for e in events).most_common(1)[0][0]
    on_main = [e for e in events if e.thread == main]
    out = {name: _outermost_total_ms(on_main, match) for name, match in CATEGORIES.items()}
    out["step"] = step_s * 1e3
    out["outside"] = out["step"] - out["forward graph"] - out["backward graph"] - out["optimizer"]
    out["gloo threads"] = sum(e.cpu_time_total for e in events if e.thread != main and e.name.startswith("gloo:")) / 1e3
    out.update(launches(events))
    return out


def parser():
    p = benchmark_parser(__doc__, quick_help="the small model of step_time --quick (a smoke run)")
    step_time.add_model_args(p, DEFAULT_SETUPS)
    return p


def tables(args=None) -> list[str]:
    """Run the benchmark; its three tables as markdown strings."""
    args = step_time.resolve(parser().parse_args(list(args or [])) if args is None or isinstance(args, (list, tuple)) else args)
    res = step_time.run_on_pool(args, cold_compile=False, breakdown=True)
    limit = res["median"].get(step_time.LIMIT)
    caption = step_time.describe(args, res["n_params"]) + ". 2 CPU ranks (gloo, loopback, 1 thread each)."
    ladder = [
        caption,
        "",
        table_header(
            "setup",
            "step, 2 ranks (ms)",
            "x compute-only limit",
            "step, 1-rank group (ms)",
            "exposed communication (ms)",
            "other threads' CPU (ms)",
        ),
    ]
    for name in args.setups:
        step, local = res["median"][name], res["compute_only"][name]
        ratio = f"{step / limit:.2f}" if limit else "-"
        ladder.append(
            f"| {step_time.SETUPS[name][0]} | {step * 1e3:.0f} | {ratio} | {local * 1e3:.0f} "
            f"| {(step - local) * 1e3:.0f} | {res['other_threads_cpu'][name] * 1e3:.0f} |"
        )
    profile = [
        "One step of each setup under torch.profiler, rank 0's main thread (ms; see the module docstring).",
        "",
        table_header("setup", "profiled step", *COLUMNS),
    ]
    for name in args.setups:
        cats = res["breakdown"][name]
        profile.append(
            f"| {step_time.SETUPS[name][0]} | {cats['step']:.0f} | " + " | ".join(f"{cats[c]:.1f}" for c in COLUMNS) + " |"
        )
    counts = [
        "CPU-side calls in that profiled step, rank 0 (see `launches`).",
        "",
        table_header("setup", *LAUNCH_COLUMNS),
    ]
    for name in args.setups:
        cats = res["breakdown"][name]
        counts.append(f"| {step_time.SETUPS[name][0]} | " + " | ".join(str(cats[c]) for c in LAUNCH_COLUMNS) + " |")
    if args.skipped:
        counts += ["", args.skipped]
    return ["\n".join(ladder), "\n".join(profile), "\n".join(counts)]


def main(argv=None) -> None:
    for text in tables(parser().parse_args(argv)):
        print("\n" + text + "\n")


if __name__ == "__main__":
    main()
