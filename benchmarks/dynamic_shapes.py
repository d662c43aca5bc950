"""Compiles and compile time over 8 sequence lengths (16..256) and 2 batch sizes.

    python -m benchmarks.dynamic_shapes

Ours vs torch FSDP2 under ``torch.compile`` (Inductor), 2 CPU ranks, a
Llama-style model; ``dynamic=True`` and the default (automatic dynamic:
static first, then one dynamic recompile). Caches are disabled so every
compile is cold. Run from the repository root (reuses ``tests/dynamic_jobs.py``).
"""

from __future__ import annotations

from benchmarks._common import one_thread_per_rank, table_header


def main() -> None:
    one_thread_per_rank(cold_caches=True)  # cold compiles for every setup
    from fsdp_compile.testing import RankPool
    from tests import dynamic_jobs

    rows = []
    with RankPool(2, timeout_s=1800) as pool:
        for mark, label in (("dynamic", "dynamic=True"), ("none", "default (automatic dynamic)")):
            for kind, name in (("fsdp2", "torch FSDP2 + torch.compile"), ("ours", "fsdp_compile")):
                r = pool.run(dynamic_jobs.variable_lengths, kind, "inductor", mark=mark)[0]
                rows.append((label, name, r))
    print("\n8 sequence lengths (16..256), batch 3/2 alternating, 2 ranks, Inductor (rank 0)\n")
    print(table_header('mode', 'setup', 'graphs compiled (non-empty)', 'compile events by step', 'compile time (s)'))
    for label, name, r in rows:
        print(f"| {label} | {name} | {r['graphs']} | {r['frames_by_step']} | {sum(r['compile_seconds']):.1f} |")


if __name__ == "__main__":
    main()
