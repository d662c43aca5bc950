"""Smoke tests of examples/train.py: it starts its own 2 CPU ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--layers", "1", "--dim", "32", "--vocab", "64", "--seq-len", "16", "--compile-backend", "aot_eager"]


def _train(*args: str) -> dict[int, str]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train.py"), *SMALL, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout[-1500:]}\nstderr:\n{done.stderr[-3000:]}"
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step +(\d+) +loss (\S+) .* ETA", done.stdout, re.M)}


def test_train_save_resume_continues_exactly(tmp_path):
    straight = _train("--steps", "3")
    assert sorted(straight) == [0, 1, 2]
    _train("--steps", "2", "--save", str(tmp_path / "ckpt"))
    resumed = _train("--steps", "1", "--resume", str(tmp_path / "ckpt"))
    assert resumed == {2: straight[2]}  # same loss, to the printed digits


def test_train_with_tensor_parallelism_matches_data_parallel_only():
    """--tp 2: 4 ranks as (dp=2, tp=2) see the same batches as 2 data-parallel ranks
    (dim 48: the feed-forward width, 128, splits evenly over the TP ranks). Eager: the
    compiled FSDP + TP step is tested in test_tensor_parallel.py."""
    args = ("--steps", "2", "--dim", "48", "--compile-backend", "eager")
    plain, tensor_parallel = _train(*args), _train(*args, "--tp", "2")
    assert sorted(tensor_parallel) == [0, 1]
    assert all(abs(float(plain[s]) - float(tensor_parallel[s])) < 2e-4 for s in plain)


def test_train_bf16_with_activation_checkpointing_runs():
    """Both options at once (one run: each start of the example costs its ranks' imports)."""
    assert len(_train("--steps", "2", "--bf16", "--activation-checkpointing", "selective")) == 2


def test_hf_llama_example_trains():
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_llama.py"), "--steps", "2", "--compile-backend", "aot_eager"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout[-1500:]}\nstderr:\n{done.stderr[-3000:]}"
    assert len(re.findall(r"^step \d+  loss \d+\.\d+", done.stdout, re.M)) == 2
