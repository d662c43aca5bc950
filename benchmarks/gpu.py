"""Training steps on one GPU: ours vs torch FSDP2, eager and compiled (CUDA graphs
too), against the unsharded compiled model (the compute-only limit).

    python -m benchmarks.gpu [--worlds nccl1,fake8] [--sizes compute,launch] [--setups ...]
                             [--steps 12] [--budget-s 420] [--layers/--dim/--seq/--batch/--vocab N]
    python -m benchmarks.gpu --device cpu --worlds gloo1,fake8 --layers 2 --dim 64 ...   # smoke run
    python -m benchmarks.gpu --device cpu --worlds gloo1 --sizes launch --layers 8 --dim 64 --seq 16 \
        --batch 1 --vocab 256 --foreach --steps 40   # the CPU side of a launch-bound step, no GPU

A ``transformers`` ``LlamaForCausalLM`` built from a config (bf16 parameters, SDPA,
tied embeddings, its own fp32 loss with labels), AdamW; ``compute``: 8 layers, hidden
2048 (~480M parameters), 4 x 2048 tokens; ``launch``: 8 layers, hidden 1024 (~136M),
4 x 1024 tokens. One table per (world, size): median step, its ratio to the
unsharded compiled one, first step (compile included), peak memory, Dynamo graphs,
first losses. Default setups: all seven in ``nccl1``; ``unsharded-compiled``, ``fsdp2-eager``,
``ours-eager``, ``ours-compiled``, ``ours-compiled-cudagraphs`` in ``fake8``. Meant to fit
in about 7 minutes: setups still to run when ``--budget-s`` (420 s) is spent are skipped.

Notes:

- ``fake8``: the ``fake`` process group at world size 8 (rank 0 of 8, no transfer):
  shard-sized parameters and optimizer, but all-gathers leave their outputs
  unwritten, so the sharded setups' losses are not meaningful (marked ``*``).
- torch 2.11 (the GPU machines'): this script uses nothing newer; fsdp_compile itself
  supports 2.13+, and a setup that raises is a row with the error's first line. Where
  ``fsdp_compile`` is not installed from this checkout, a temporary copy of it is imported.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import importlib
import importlib.util
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
import weakref
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _resolves_to_checkout() -> bool:
    """Whether ``import fsdp_compile`` (and its ``passes`` / ``runtime`` subpackages)
    would load this checkout's files; decided without importing anything."""
    mod = sys.modules.get("fsdp_compile")
    if mod is not None:
        return Path(mod.__file__).resolve() == REPO / "fsdp_compile" / "__init__.py"
    spec = importlib.util.find_spec("fsdp_compile")
    if spec is None or spec.origin is None or Path(spec.origin).resolve() != REPO / "fsdp_compile" / "__init__.py":
        return False
    for sub in ("passes", "runtime"):
        found = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            try:
                found = find(f"fsdp_compile.{sub}", list(spec.submodule_search_locations or []))
            except Exception:  # noqa: BLE001 - a finder that cannot answer
                found = None
            if found is not None:
                break
        if found is None or found.origin is None or Path(found.origin).resolve() != REPO / sub / "__init__.py":
            return False
    return True


def use_this_checkout() -> str:
    """Make ``import fsdp_compile`` load this checkout: as installed (``pip install -e .``),
    or from a temporary copy laid out as the package installs (``passes/`` and
    ``runtime/`` as ``fsdp_compile.passes`` / ``fsdp_compile.runtime``). Returns where from."""
    if _resolves_to_checkout():
        return str(REPO / "fsdp_compile")
    for name in [m for m in sys.modules if m == "fsdp_compile" or m.startswith("fsdp_compile.")]:
        del sys.modules[name]
    tmp = Path(tempfile.mkdtemp(prefix="fsdp_compile_checkout_"))
    atexit.register(shutil.rmtree, tmp, True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "fsdp_compile", tmp / "fsdp_compile", ignore=ignore)
    shutil.copytree(REPO / "passes", tmp / "fsdp_compile" / "passes", ignore=ignore)
    shutil.copytree(REPO / "runtime", tmp / "fsdp_compile" / "runtime", ignore=ignore)
    sys.path.insert(0, str(tmp))
    importlib.invalidate_caches()
    return f"a copy of this checkout in {tmp}"


FSDP_COMPILE_FROM = use_this_checkout()

import argparse  # noqa: E402

from benchmarks._common import benchmark_parser, table_header  # noqa: E402

# id -> (implementation, compiled, torch.compile mode)
SETUPS = {
    "unsharded-compiled": ("unsharded", True, None),
    "unsharded-compiled-cudagraphs": ("unsharded", True, "reduce-overhead"),
    "fsdp2-eager": ("fsdp2", False, None),
    "fsdp2-compiled": ("fsdp2", True, None),
    "ours-eager": ("ours", False, None),
    "ours-compiled": ("ours", True, None),
    "ours-compiled-cudagraphs": ("ours", True, "reduce-overhead"),
}
LIMIT = "unsharded-compiled"
#: Default setups in a ``fake`` world (the compiles that fit the time budget).
FAKE_DEFAULT = ["unsharded-compiled", "fsdp2-eager", "ours-eager", "ours-compiled", "ours-compiled-cudagraphs"]

SIZES = {
    "compute": {"layers": 8, "dim": 2048, "heads": 16, "ffn": 5632, "vocab": 32000, "seq": 2048, "batch": 4},
    "launch": {"layers": 8, "dim": 1024, "heads": 16, "ffn": 2816, "vocab": 32000, "seq": 1024, "batch": 4},
}


def parser() -> argparse.ArgumentParser:
    p = benchmark_parser(__doc__)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run (gloo, no CUDA graphs)")
    p.add_argument(
        "--worlds",
        default=None,
        help="comma-separated: nccl1 (cuda), gloo1 (cpu), fake<N>; default nccl1,fake8 (gloo1,fake8 on cpu)",
    )
    p.add_argument("--sizes", default="compute,launch", help="comma-separated subset of: " + ", ".join(SIZES))
    p.add_argument(
        "--setups",
        default=None,
        help="comma-separated subset of: " + ", ".join(SETUPS) + f" (default: all; in a fake world {', '.join(FAKE_DEFAULT)})",
    )
    p.add_argument(
        "--steps", type=int, default=12, help="steps per setup: the first (compiles), then the timed ones (default 12)"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds after which the remaining setups are skipped (default 420 on cuda, none on cpu)",
    )
    for flag in ("layers", "dim", "heads", "ffn", "vocab", "seq", "batch"):
        p.add_argument(f"--{flag}", type=int, default=None, help=f"override every size's {flag}")
    p.add_argument(
        "--foreach",
        action="store_true",
        default=None,
        help="AdamW's foreach path on any device (its default on CUDA): on CPU, with tiny sizes, "
        "a step's CPU-side costs as a launch-bound GPU step pays them",
    )
    return p


def resolve(args) -> argparse.Namespace:
    cpu = args.device == "cpu"
    args.worlds = [w.strip() for w in (args.worlds or ("gloo1,fake8" if cpu else "nccl1,fake8")).split(",") if w.strip()]
    for w in args.worlds:
        ok = w == ("gloo1" if cpu else "nccl1") or (w.startswith("fake") and w[4:].isdigit() and int(w[4:]) >= 1)
        if not ok:
            raise SystemExit(f"unknown world {w!r}: use {'gloo1' if cpu else 'nccl1'} or fake<N>")
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
    if args.setups is not None:
        args.setups = [s.strip() for s in args.setups.split(",") if s.strip()]
        unknown = [s for s in args.setups if s not in SETUPS]
        if unknown:
            raise SystemExit(f"unknown setup(s) {unknown}; choose from {list(SETUPS)}")
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2 (the first step compiles; the others are timed)")
    if args.budget_s is None:
        args.budget_s = float("inf") if cpu else 420.0
    return args


def size_config(args, size: str) -> dict:
    cfg = dict(SIZES[size])
    for key in ("layers", "dim", "vocab", "seq", "batch"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if args.dim is not None:  # heads and SwiGLU width follow an overridden width
        cfg["heads"] = min(16, max(2, cfg["dim"] // 64))
        cfg["ffn"] = cfg["dim"] * 11 // 4 // 8 * 8
    for key in ("heads", "ffn"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    return cfg


def setups_for(args, world: str) -> tuple[list[str], list[str]]:
    """The setups to run in ``world`` and lines about those left out."""
    names = list(args.setups) if args.setups is not None else list(FAKE_DEFAULT if world.startswith("fake") else SETUPS)
    notes = []
    if args.device == "cpu":
        dropped = [n for n in names if SETUPS[n][2] == "reduce-overhead"]
        if dropped and args.setups is not None:
            notes.append(f"{', '.join(dropped)}: CUDA graphs need a GPU; left out with --device cpu")
        names = [n for n in names if n not in dropped]
    return names, notes


# ---------------------------------------------------------------- the model and a step


def build_model(cfg: dict, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["dim"],
        intermediate_size=cfg["ffn"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["heads"],
        max_position_embeddings=cfg["seq"],
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):
        try:
            model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
        except TypeError:  # an older transformers: construct in fp32, then cast
            model = LlamaForCausalLM(config).to(torch.bfloat16)
    if next(model.parameters()).dtype != torch.bfloat16:
        model = model.to(torch.bfloat16)
    return model


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0] if text else ''}".strip()
    return (line[:200] + "...") if len(line) > 200 else line


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def run_setup(name: str, cfg: dict, tokens, device, steps: int, foreach: bool | None = None) -> dict:
    """Build, shard, compile and train ``steps`` steps; the measurements."""
    import torch
    from torch._dynamo.utils import counters

    impl, compiled, mode = SETUPS[name]
    graphs0 = counters["stats"]["unique_graphs"]
    skips0 = counters["inductor"]["cudagraph_skips"]
    model = build_model(cfg, device)
    if impl != "unsharded":
        if impl == "fsdp2":
            from torch.distributed.fsdp import fully_shard
        else:
            from fsdp_compile import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach)  # None: AdamW's default (foreach on CUDA)
    step_fn = torch.compile(model, mode=mode) if compiled else model
    cudagraphs = mode == "reduce-overhead"
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def step(step_fn=step_fn, opt=opt, phases=None):
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        start = time.perf_counter()
        loss = step_fn(input_ids=tokens, labels=tokens, use_cache=False).loss
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if phases is not None:  # CPU time per phase, no synchronization in between
            phases.append((forward - start, backward - forward, time.perf_counter() - backward))
        return loss.detach()

    times, losses, phases = [], [], []
    for i in range(steps):
        sync(device)
        start = time.perf_counter()
        loss = step(phases=phases if i else None)
        sync(device)
        times.append(time.perf_counter() - start)
        if i < 3:
            losses.append(loss.float().item())
        del loss
    calls = count_calls(step, device)
    result = {
        "calls": calls,
        "first": times[0],
        "median": statistics.median(times[1:]),
        "phases": [statistics.median(p) for p in zip(*phases, strict=True)],
        "peak": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "graphs": counters["stats"]["unique_graphs"] - graphs0 if compiled else None,
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips0 if cudagraphs else 0,
        "losses": losses,
        "model_ref": weakref.ref(model),
    }
    del step, step_fn, opt, model
    return result


def count_calls(step, device) -> dict:
    """One more step under ``torch.profiler``: its CPU-side calls (see
    ``benchmarks._launches.launches``; kernel launches need CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks._launches import launches

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync(device)
    return launches(list(prof.events()))


def free(device) -> None:
    import torch

    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- worlds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world(world: str, device) -> None:
    import torch.distributed as dist

    if world.startswith("fake"):
        try:
            from fsdp_compile.testing._torch_internals import register_fake_process_group
        except Exception:  # noqa: BLE001 - fsdp_compile does not import here; torch's module does the same

            def register_fake_process_group():
                import torch.testing._internal.distributed.fake_pg  # noqa: F401

        register_fake_process_group()
        dist.init_process_group("fake", rank=0, world_size=int(world[4:]))
        return
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    if world == "nccl1":
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)


def describe_world(world: str) -> str:
    if world == "nccl1":
        return "NCCL, world size 1"
    if world == "gloo1":
        return "gloo, world size 1"
    return f"fake process group, rank 0 of {world[4:]} (no transfer)"


def millions(n: int) -> str:
    return f"{n / 1e6:.0f}M" if n >= 10e6 else f"{n / 1e6:.2f}M"


def table(world: str, size: str, cfg: dict, n_params: int, args, rows: dict, names: list[str]) -> str:
    fake = world.startswith("fake")
    lines = [
        f"**{world} / {size}**: {describe_world(world)}; transformers Llama, {millions(n_params)} parameters "
        f"({cfg['layers']} layers, hidden {cfg['dim']}, {cfg['heads']} heads, intermediate {cfg['ffn']}, vocab {cfg['vocab']}), "
        f"batch {cfg['batch']} x seq {cfg['seq']}, bf16, SDPA, AdamW; median of {args.steps - 1} steps after the first "
        "(first step: compile included, Inductor's on-disk caches on); CPU-side calls of one more step, profiled "
        "(collective issues, CUDA kernel and graph launches, ops outside the compiled graphs).",
        "",
        table_header(
            "setup",
            "median step (ms)",
            "x limit",
            "first step (s)",
            "peak (GiB)",
            "graphs",
            "losses (first 3)",
            "collectives",
            "kernel launches",
            "ops outside graphs",
        ),
    ]
    limit = rows.get(LIMIT, {}).get("median")
    for name in names:
        row = rows[name]
        if "error" in row or "skipped" in row:
            text = row.get("error") or row["skipped"]
            lines.append(f"| {name} | {text.replace('|', '/')} | - | - | - | - | - | - | - | - |")
            continue
        ratio = f"{row['median'] / limit:.2f}" if limit else "-"
        peak = "n/a" if row["peak"] is None else f"{row['peak']:.2f}"
        graphs = "-" if row["graphs"] is None else str(row["graphs"])
        if row["cudagraph_skips"]:
            graphs += f" (CUDA graphs skipped in {row['cudagraph_skips']})"
        mark = "*" if fake and SETUPS[name][0] != "unsharded" else ""
        losses = ", ".join(f"{v:.4f}{mark}" for v in row["losses"])
        calls = row["calls"]
        launched = calls["kernel launches"] if args.device == "cuda" else "n/a"
        lines.append(
            f"| {name} | {row['median'] * 1e3:.1f} | {ratio} | {row['first']:.1f} | {peak} | {graphs} | {losses} "
            f"| {calls['collective calls']} | {launched} | {calls['ops outside graphs']} |"
        )
    lines += [
        "",
        "CPU time of each phase (median over the timed steps, ms; no synchronization between phases, so a phase "
        "that waits for the GPU shows it): "
        + "; ".join(
            f"{name} {' / '.join(f'{t * 1e3:.1f}' for t in rows[name]['phases'])}" for name in names if "phases" in rows[name]
        )
        + " (forward / backward / optimizer).",
    ]
    if fake:
        lines += [
            "",
            "\\* fake world: all-gathers leave their outputs unwritten, so the sharded setups' losses are not meaningful.",
        ]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = resolve(parser().parse_args(argv))
    import torch
    import torch._inductor.config
    import torch.distributed as dist

    start = time.perf_counter()
    warnings.filterwarnings("ignore", message="fsdp_compile: recompiling")
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device (use --device cpu for a smoke run)")
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # the parameters are bf16; this only silences Inductor's hint
        where = torch.cuda.get_device_name(device)
    else:
        device = torch.device("cpu")
        # No pool of compile workers: on a few cores their start-up slows the first timed steps.
        torch._inductor.config.compile_threads = 1
        where = f"CPU ({os.cpu_count()} cores)"
    print(
        f"torch {torch.__version__}, {where}, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}; "
        f"fsdp_compile from {FSDP_COMPILE_FROM}\n",
        flush=True,
    )

    budget_note = f"skipped: --budget-s {args.budget_s:.0f} spent"
    for world in args.worlds:
        names, notes = setups_for(args, world)
        for note in notes:
            print(f"{world}: {note}", flush=True)
        if time.perf_counter() - start > args.budget_s:
            print(f"{world}: {budget_note} before it started", flush=True)
            continue
        if dist.is_initialized():
            dist.destroy_process_group()
        init_world(world, device)
        try:
            for size in args.sizes:
                cfg = size_config(args, size)
                model = build_model(cfg, "meta")
                n_params = sum(p.numel() for p in model.parameters())
                del model
                tokens = torch.randint(
                    0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=torch.Generator().manual_seed(1234)
                ).to(device)
                rows = {}
                for name in names:
                    if time.perf_counter() - start > args.budget_s:
                        rows[name] = {"skipped": budget_note}
                        print(f"{world}/{size} {name}: {budget_note}", flush=True)
                        continue
                    free(device)
                    try:
                        rows[name] = row = run_setup(name, cfg, tokens, device, args.steps, args.foreach)
                    except Exception as e:  # noqa: BLE001 - reported as a row; the run goes on
                        rows[name] = {"error": first_line(e)}
                        expected = world.startswith("fake") and name.startswith("fsdp2")
                        what = "skipped, it fails in the fake world" if expected else "failed"
                        print(f"{world}/{size} {name}: {what}: {first_line(e)}", flush=True)
                        if not expected:
                            print("".join(traceback.format_exception(e)[-12:]), file=sys.stderr, flush=True)
                        del e
                        free(device)
                        continue
                    free(device)
                    kept = "; its model was not freed" if row.pop("model_ref")() is not None else ""
                    left = f", {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated" if device.type == "cuda" else ""
                    print(
                        f"{world}/{size} {name}: {row['median'] * 1e3:.1f} ms/step, first step {row['first']:.1f} s "
                        f"(at {time.perf_counter() - start:.0f} s{left}){kept}",
                        flush=True,
                    )
                print("\n" + table(world, size, cfg, n_params, args, rows, names) + "\n", flush=True)
        finally:
            free(device)
            dist.destroy_process_group()
    print(f"total {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
