"""What the benchmarks share: their command line and their markdown tables."""

from __future__ import annotations

import argparse
import os


def benchmark_parser(doc: str | None, quick_help: str | None = None) -> argparse.ArgumentParser:
    """A parser showing the module docstring, with ``--quick`` (small sizes: the smoke run
    ``python -m benchmarks --quick`` makes) when ``quick_help`` says what it shrinks."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if quick_help is not None:
        p.add_argument("--quick", action="store_true", help=quick_help)
    return p


def table_header(*columns: str) -> str:
    """A markdown table's header row and separator."""
    return "| " + " | ".join(columns) + " |\n" + "|" + "---|" * len(columns)


def one_thread_per_rank(cold_caches: bool = False) -> None:
    """Every rank on one thread (2 cores, 2 ranks); ``cold_caches``: no Inductor or
    AOTAutograd cache hits from earlier runs (they would skip our post-grad passes,
    and compile times would mean nothing)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if cold_caches:
        os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
